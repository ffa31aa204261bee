"""The speculative engine: one backend protocol, one step, one driver, for any number of users (one user is B = 1).

    step:  draft(depths) -> verify (ONE forward, B x (K+1) rows) -> accept (per user)
           -> the next step's depths -> commit (per user: publish accepted rows, discard the rest)   [or abort]

A :class:`SpecBackend` owns ``slots`` user slots and all model state (target KV + GDN + conv, MTP KV, each user's
pending token and sampler), possibly on a device. A user enters with :meth:`~SpecBackend.join` (its prefill, alone
in its slot) and leaves with :meth:`~SpecBackend.leave`. Each step names the users that take part and the draft
depth of each (``depths``: slot -> k_b >= 1; K = max k_b). The verify runs every slot's K+1 rows in one forward:
user b's rows ``[pending_b, d_1..d_{k_b}]`` are real; its rows past k_b and every row of a slot outside the step
(free, or a user sitting this step out) are inert: no GDN, conv or position change, and their KV rows lie past the
user's position (scratch by design, like rejected rows). Acceptance and commit are per user: greedy or rejection
sampling with the user's own params and sampler, then the state after its own accepted row a_b, through the
backend's commit mechanism object (``mechanisms.MECHANISMS``). Draft and verify return opaque handles the engine
never looks into; accept hands back only per-user counts and tokens, so a device backend reads back a few
integers per step.

The step order lives in one place, :meth:`SpecBatch.step` (one object per batch of running requests; the driver
:func:`speculative_generate` and a server both call it). ``reference_backend.py`` implements the protocol on the
torch reference (the oracle); ``tt/spec/spec_backend.py`` (B slots, one user is B = 1) on the TT model.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from .depth import DepthController, FixedDepth
from ..generation.sampling import SamplingParams, TokenLogprobs
from ..generation.thinking import ThinkingBudget


@dataclass
class Acceptance:
    """What one step publishes, host side: ``tokens`` = accepted drafts then one recovered/bonus token;
    ``logprobs``: one entry per emitted token when the run asked for logprobs, else None."""

    num_accepted: int
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != self.num_accepted + 1:
            raise ValueError(f"an acceptance emits num_accepted + 1 tokens, got {self.num_accepted} and {self.tokens}")


@dataclass
class MechanismCounters:
    """Work done by the speculative state machinery, summed over steps.

    state_copies: copies of one GDN layer's (recurrent + conv) state (save, restore, scratch).
    state_bytes_moved: bytes of those copies. slot_bytes_written: bytes of per-row state slots a verify writes
    (shadow_commit's price instead of copies). recurrence_steps: rows run through a GDN layer's recurrence,
    summed over GDN layers. target_forwards / mtp_forwards: model forward calls (op calls) of each kind.
    """

    steps: int = 0
    aborts: int = 0
    state_copies: int = 0
    state_bytes_moved: int = 0
    slot_bytes_written: int = 0
    recurrence_steps: int = 0
    target_forwards: int = 0
    mtp_forwards: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def add(self, other: "MechanismCounters") -> None:
        for k, v in other.__dict__.items():
            setattr(self, k, getattr(self, k) + v)


@runtime_checkable
class SpecBackend(Protocol):
    """The contract a backend implements. Handles are backend-private; depths map slot -> k_b >= 1.

    label: what actually runs, derived from the live objects (e.g. "reference (torch CPU)"). slots: how many users
    it holds at once (1: a single-user backend). mechanism: the commit mechanism object (``.name`` in
    ``mechanisms.MECHANISMS``), fixed at construction. counters: a MechanismCounters over all slots, updated in
    place (``steps`` counts steps of the whole batch).

    Optional: ``plan_next_depths(depths)`` (a backend that drafts the next step inside this step's commit is told
    the next depths between accept and commit), ``inject(forced, depths)`` (the thinking budget's forced tokens; ``depths``: each user's
    next draft depth, for a backend whose forced rows go through its step at that depth) and ``cap_drafts(drafts)``
    (between draft and verify: each listed user's step verifies the caller's n_b <= k_b drafts instead, its
    acceptance capped at n_b; ``SpecBatch.step(drafts=...)``).
    """

    label: str
    slots: int
    mechanism: Any
    counters: MechanismCounters

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Prefill ``prompt`` into the free ``slot`` (no other slot read or written), seed the user's sampler from
        ``params``, return its first token (pending). Penalties (params.penalized) count the prompt and every
        emitted token, this first one included."""

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        """The joined user's first token's logprobs when its params asked for them, else None."""

    def leave(self, slot: int) -> None:
        """Free ``slot`` (no open step may be running)."""

    def draft(self, depths: Mapping[int, int]) -> Any:
        """Per user in ``depths``: MTP reseed of its verified rows, then a chain of k_b drafts. Returns a handle."""

    def verify(self, draft: Any) -> Any:
        """ONE target forward over B x (K+1) rows, the rows past each user's k_b and every row of the slots not
        in the step inert. Returns a handle."""

    def accept(self, draft: Any, verify: Any) -> dict[int, Acceptance]:
        """Per user in the step: greedy or rejection sampling (its own params) -> slot -> Acceptance."""

    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        """Per user: publish the state after its row a_b; its last emitted token becomes pending. Every user of
        the step must be in ``acceptances``."""

    def abort(self) -> None:
        """Discard the open step (any time before commit): every slot's state and sampler exactly as before
        draft(). A backend that keeps the verified state in place (shadow_commit on device) may refuse after
        verify, saying so."""


def speculative_step(backend: SpecBackend, depths: Mapping[int, int]) -> dict[int, Acceptance]:
    """One transaction, nothing else: draft, verify (one packed forward), accept, commit."""
    draft = backend.draft(depths)
    verify = backend.verify(draft)
    accepted = backend.accept(draft, verify)
    backend.commit(accepted)
    return accepted

@dataclass
class AcceptanceStats:
    """Acceptance counters of a run. ``accepted[i]`` = drafts accepted at step i (before EOS/length cuts)."""

    k: int  # the largest depth a step may use (the fixed K, or the controller's k_max)
    accepted: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # K used at step i

    def record(self, acceptance: Acceptance, k: int | None = None) -> None:
        self.accepted.append(acceptance.num_accepted)
        self.depths.append(self.k if k is None else k)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(1, self.steps)

    @property
    def mean_emitted(self) -> float:
        return self.mean_accepted + 1.0 if self.steps else 0.0

    def per_position(self) -> list[float]:
        """P(draft i accepted), i = 1..K: fraction of the steps that drafted position i (K >= i) with at least i
        accepted. With a fixed K every step drafts every position."""
        out = []
        for i in range(1, self.k + 1):
            drafted = [a for a, k in zip(self.accepted, self.depths) if k >= i]
            out.append(sum(a >= i for a in drafted) / max(1, len(drafted)))
        return out

    @property
    def mean_depth(self) -> float:
        return sum(self.depths) / max(1, self.steps)

    def histogram(self) -> list[int]:
        c = Counter(self.accepted)
        return [c.get(a, 0) for a in range(self.k + 1)]

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "steps": self.steps, "mean_accepted": self.mean_accepted,
                "mean_emitted": self.mean_emitted, "per_position": self.per_position(),
                "histogram": self.histogram(), "mean_depth": self.mean_depth,
                "depth_histogram": [self.depths.count(k) for k in range(1, self.k + 1)]}


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens (first one from prefill), cut after EOS and at max_new_tokens
    stats: AcceptanceStats
    logprobs: list[TokenLogprobs] | None = None  # one per token in ``tokens`` when the params asked for them


def _cut(tokens: list[int], max_new_tokens: int, eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Truncate at the first EOS (kept) or at max_new_tokens; returns (tokens, finished)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens



class SpecRequest:
    """One user's request and its bookkeeping: emitted tokens (cut at EOS / ``max_new_tokens``), logprobs,
    acceptance statistics, its depth policy and the depth of its next step (``next_k``), its thinking-budget
    tracker. ``slot``: the backend slot it holds while running (-1 before it joins and after it leaves)."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, depth: "FixedDepth | DepthController",
                 params: SamplingParams, eos_ids: Sequence[int] = (), thinking: ThinkingBudget | None = None):
        self.prompt, self.max_new_tokens, self.eos_ids = list(prompt), max_new_tokens, eos_ids
        self.depth, self.params = depth, params
        self.stats = AcceptanceStats(depth.k_max)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.done = False
        self.slot = -1
        self.next_k = 0
        self.tracker = thinking.tracker(prompt) if thinking is not None else None
        self.inject_now = False  # the thinking budget is reached: force the stop-thinking phrase after this step
        self.last: Acceptance | None = None  # the last step's acceptance, as recorded

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def emit(self, tokens: Sequence[int]) -> None:
        self.tokens, self.done = _cut(self.tokens + list(tokens), self.max_new_tokens, self.eos_ids)

    def joined(self, forced: list[int], first: int, first_logprobs) -> None:
        """The prefill's token (after the ``forced`` tokens a budget of 0 put into the prefill);
        ``first_logprobs()`` gives its logprobs (called only when they were asked for)."""
        self.emit([first])
        if self.want_logprobs:
            self.logprobs.append(first_logprobs())
        self.next_k = 0 if self.done else self.depth.choose()
        self.tokens, self.done = _cut(forced + self.tokens, self.max_new_tokens, self.eos_ids)
        self.inject_now = self.tracker is not None and self.tracker.cut([first], len(forced))[1]

    def record(self, label: str, acceptance: Acceptance, judged: int | None = None) -> Acceptance:
        """One step's outcome at depth ``next_k``: cut it after the thinking budget's last token, tell the depth
        policy, append the tokens, choose the next depth. Returns the acceptance as cut. ``judged``: the drafts the
        step offered when a caller capped them (``SpecBatch.step(drafts=...)``); the policy then learns from those
        (nothing from a step that offered none)."""
        if self.tracker is not None:  # cut the step right after the budget's last thinking token
            keep, self.inject_now = self.tracker.cut(acceptance.tokens, len(self.tokens))
            if keep < len(acceptance.tokens):
                acceptance = Acceptance(keep - 1, acceptance.tokens[:keep])
        k = self.next_k
        judged = k if judged is None else judged
        if judged:
            self.depth.observe(judged, acceptance.num_accepted)
        self.stats.record(acceptance, k)
        self.emit(acceptance.tokens)
        if self.want_logprobs:
            if acceptance.logprobs is None or len(acceptance.logprobs) != len(acceptance.tokens):
                raise RuntimeError(f"{label}: logprobs were asked for but the step returned none per token")
            self.logprobs += acceptance.logprobs
        self.next_k = k if self.done else self.depth.choose()
        self.last = acceptance
        return acceptance

    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.stats, self.logprobs[: len(self.tokens)] if self.want_logprobs
                                else None)


class SpecBatch:
    """The running requests of one backend, and the step order, in one place.

    ``add`` joins a request into the lowest free slot (its prefill); ``step`` runs one speculative step for the
    running requests (every one, or those named), in this order: draft at each request's depth -> verify -> accept
    -> record (each request's next depth is chosen here, between accept and commit: a backend that drafts the next
    step inside the commit is told it through ``plan_next_depths``; the choice uses only the accepted counts
    accept() brought to the host) -> commit -> force the stop-thinking phrase of every request that reached its
    budget, in ONE packed ``backend.inject`` -> leave the slots of finished requests. A caller that hands the
    drafts out between drafting and verifying (a server whose scheduler holds them) opens the step with ``draft``,
    reads them from the backend, and finishes it with ``step`` (or drops it with ``abort``)."""

    def __init__(self, backend: SpecBackend, thinking: ThinkingBudget | None = None):
        if thinking is not None and not hasattr(backend, "inject"):
            raise ValueError(f"{backend.label}: a thinking budget needs the backend's inject() (forced tokens); this "
                             "backend has none yet")
        self.backend, self.thinking = backend, thinking
        self.free = list(range(backend.slots))
        self.running: list[SpecRequest] = []
        self._open: tuple[list[SpecRequest], Any] | None = None  # the step draft() opened: (its requests, handle)
        self._plan = getattr(backend, "plan_next_depths", None)

    def add(self, prompt: Sequence[int], max_new_tokens: int, depth: "int | FixedDepth | DepthController",
            params: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = ()) -> SpecRequest:
        """Join a request now; a budget of 0 with the thinking block open puts the stop phrase into the prefill."""
        if self.thinking is not None and params.logprobs is not None:
            raise ValueError("logprobs with a thinking budget are not supported (forced tokens have no sampled "
                             "logprob)")
        if not self.free:
            raise ValueError(f"no slot is free (the backend has {self.backend.slots})")
        if isinstance(depth, int):
            depth = FixedDepth(depth)
        if any(r.depth is depth for r in self.running):
            raise ValueError("each user needs its own depth policy object (a policy tracks one user's acceptance)")
        self._check_closed("add()")
        req = SpecRequest(prompt, max_new_tokens, depth, params, eos_ids, self.thinking)
        req.slot = self.free.pop(0)
        forced = req.tracker.forced(0) if req.tracker is not None and req.tracker.inject_first() else []
        first = self.backend.join(req.slot, req.prompt + forced, params)
        req.joined(forced, first, lambda: self._first_logprobs(req.slot))
        self.running.append(req)
        if req.inject_now and not req.done:
            self._inject([req])  # the budget is reached at the join's token (budget 1)
        if req.done:
            self.leave(req)
        return req

    @property
    def is_open(self) -> bool:
        """Whether ``draft`` opened a step that ``step`` has not finished (nor ``abort`` dropped)."""
        return self._open is not None

    def draft(self, requests: Sequence[SpecRequest] | None = None) -> list[SpecRequest]:
        """Open a step: draft for ``requests`` (default: every running request) at each one's depth. Returns them."""
        self._check_closed("draft()")
        stepping = list(self.running if requests is None else requests)
        if stepping:
            self._open = (stepping, self.backend.draft({r.slot: r.next_k for r in stepping}))
        return stepping

    def step(self, requests: Sequence[SpecRequest] | None = None,
             drafts: Mapping[int, Sequence[int]] | None = None) -> list[SpecRequest]:
        """One speculative step of ``requests`` (default: every running request), or the rest of the step ``draft``
        opened; returns the requests that stepped. ``drafts``: slot -> the n_b <= k_b drafts the caller holds for
        this step (a server whose scheduler sent back fewer or other drafts than were proposed): the backend
        verifies those and caps each user's acceptance at n_b (its ``cap_drafts``), and the user's depth policy
        learns from its n_b drafts."""
        backend = self.backend
        if self._open is None:
            self.draft(requests)
        elif requests is not None:
            raise ValueError("step(requests=...) finishes the step draft() opened, for the requests it drafted")
        if self._open is None:
            return []
        (stepping, draft), self._open = self._open, None
        if drafts is not None:
            backend.cap_drafts(drafts)
        verify = backend.verify(draft)
        accepted = backend.accept(draft, verify)
        for r in stepping:
            judged = None if drafts is None else len(drafts[r.slot])
            accepted[r.slot] = r.record(backend.label, accepted[r.slot], judged)
        if self._plan is not None:
            self._plan({r.slot: r.next_k for r in stepping if not r.done})
        backend.commit(accepted)
        forcing = [r for r in stepping if r.inject_now and not r.done]
        if forcing:
            self._inject(forcing)
        for r in stepping:
            if r.done:
                self.leave(r)
        return stepping

    def abort(self) -> None:
        """Drop the step ``draft`` opened (the backend's state as before it)."""
        if self._open is None:
            raise RuntimeError("abort() with no open step")
        self._open = None
        self.backend.abort()

    def leave(self, req: SpecRequest) -> None:
        """``req`` is over (finished, or dropped by its caller): its slot is free for the next ``add``."""
        self._check_closed("leave()")
        self.backend.leave(req.slot)
        self.running.remove(req)
        self.free = sorted(self.free + [req.slot])
        req.slot = -1

    def _check_closed(self, what: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"{what} inside the step draft() opened: step() or abort() first")

    def _inject(self, reqs: list[SpecRequest]) -> None:
        accepted = self.backend.inject({r.slot: r.tracker.forced(len(r.tokens)) for r in reqs},
                                       {r.slot: r.next_k for r in reqs})
        for r in reqs:
            r.emit(accepted[r.slot].tokens)

    def _first_logprobs(self, slot: int) -> TokenLogprobs:
        lp = self.backend.first_logprobs(slot)
        if lp is None:
            raise RuntimeError(f"{self.backend.label}: logprobs were asked for but the join recorded none")
        return lp


def speculative_generate(backend: SpecBackend, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                         depths: "Sequence[int | FixedDepth | DepthController]",
                         params: Sequence[SamplingParams] | None = None, eos_ids: Sequence[int] = (),
                         arrivals: Sequence[int] | None = None,
                         thinking: ThinkingBudget | None = None) -> list[GenerationResult]:
    """Decode ``prompts`` on ``backend`` (one prompt: B = 1); user i has its own depth policy ``depths[i]`` (a fixed
    K, or a ``depth.DepthController`` asked for K before every step and told the outcome after it; one object per
    user), ``params[i]`` (default greedy) and arrival round ``arrivals[i]`` (default 0).

    Round r first adds the users arriving in round r (each takes the lowest free slot), then runs one
    :meth:`SpecBatch.step` of the users that arrived before (one that just joined sits the round out: its first
    token came from the prefill). Users advance in lockstep, each accepting its own number of drafts; a user that reaches
    EOS (kept; EOS inside an accepted block ends it there) or ``max_new_tokens`` (one count, or one per user) leaves
    its slot while the others go on. A user's result depends on its own inputs only: the same as decoding it alone. ``thinking``: the thinking
    budget (``thinking.py``), each user its own count (the backend needs ``inject``)."""
    n = len(prompts)
    params = [SamplingParams()] * n if params is None else list(params)
    arrivals = [0] * n if arrivals is None else list(arrivals)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if n == 0 or not len(depths) == len(params) == len(arrivals) == len(limits) == n:
        raise ValueError(f"one prompt, depth, params, arrival and token limit per user: got {n}, {len(depths)}, "
                         f"{len(params)}, {len(arrivals)}, {len(limits)}")
    if min(arrivals) < 0:
        raise ValueError(f"arrival rounds must be >= 0, got {arrivals}")
    ctrls = [FixedDepth(k) if isinstance(k, int) else k for k in depths]
    if len({id(c) for c in ctrls}) != n:
        raise ValueError("each user needs its own depth policy object (a policy tracks one user's acceptance)")
    batch = SpecBatch(backend, thinking)
    reqs: list[SpecRequest | None] = [None] * n
    round_ = 0
    while not all(r is not None and r.done for r in reqs):
        new = []
        for i in range(n):
            if arrivals[i] == round_:
                if not batch.free:
                    raise ValueError(f"user {i} arrives in round {round_} but no slot is free (the backend has "
                                     f"{backend.slots})")
                reqs[i] = batch.add(prompts[i], limits[i], ctrls[i], params[i], eos_ids)
                new.append(reqs[i])
        batch.step([r for r in batch.running if r not in new])
        round_ += 1
    return [r.result() for r in reqs]
