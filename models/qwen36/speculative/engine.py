"""The speculative engine: one transaction per step, over a small backend interface.

    step:  draft -> verify -> accept -> commit (publish accepted, discard the rest)    [or abort]

A backend owns all model state (target KV + GDN + conv, MTP KV, the pending token, the sampler) and may
keep it on a device: :meth:`SpecBackend.draft` and :meth:`SpecBackend.verify` return opaque handles the
engine never looks into, and :meth:`SpecBackend.accept` hands back only the emitted tokens and the accepted
count, so a device backend reads back only a few integers per step. The reference backend (``reference_backend.py``) implements the same contract on torch
and also exposes finer primitives for the probes; a TT backend runs the same four calls as device work.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from .depth import DepthController, FixedDepth
from .sampling import SamplingParams, TokenLogprobs
from .thinking import ThinkingBudget


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
    """The contract a backend implements. Batch 1; K >= 1; handles are backend-private.

    label: what actually runs, derived from the live objects (e.g. "reference (torch CPU)").
    first_logprobs: after prefill, the prefill token's TokenLogprobs when the params asked for logprobs, else None.
    mechanism: the backend's commit mechanism object (named in ``mechanisms.MECHANISMS``; ``.name`` is the name),
    fixed at construction. counters: a MechanismCounters, updated in place.
    """

    label: str
    mechanism: Any
    counters: MechanismCounters

    def prefill(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Consume the prompt, seed the sampler from params, pick and return the first new token (pending).
        Penalties (params.penalized) count the prompt and every emitted token, this first one included."""

    def draft(self, k: int) -> Any:
        """MTP: reseed the verified rows, then chain k drafts. Returns a handle (draft ids, draft probs)."""

    def verify(self, draft: Any) -> Any:
        """ONE target forward over the K+1 rows [pending, d_1..d_K] (state per the mechanism). Returns a handle."""

    def accept(self, draft: Any, verify: Any) -> Acceptance:
        """Greedy or rejection sampling (per the prefill params). Only tokens + count cross to the host."""

    def commit(self, acceptance: Acceptance) -> None:
        """Publish the state after row num_accepted; discard later rows; the last token becomes pending."""

    def abort(self) -> None:
        """Discard the step (any time before commit): live state and sampler exactly as before draft().
        A backend that fuses accept + commit on device may refuse abort after accept, saying so."""


def speculative_step(backend: SpecBackend, k: int) -> Acceptance:
    """One transaction: draft, verify (one packed K+1 forward), accept, commit."""
    draft = backend.draft(k)
    verify = backend.verify(draft)
    acceptance = backend.accept(draft, verify)
    backend.commit(acceptance)
    return acceptance


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


def speculative_generate(backend: SpecBackend, prompt: Sequence[int], max_new_tokens: int,
                         k: "int | FixedDepth | DepthController", params: SamplingParams = SamplingParams(),
                         eos_ids: Sequence[int] = (), thinking: ThinkingBudget | None = None) -> GenerationResult:
    """Prefill, then speculative steps until EOS or max_new_tokens. EOS inside an accepted block ends it there.

    ``k``: a fixed draft depth, or a depth policy (``depth.DepthController``) asked for K before every step and
    told the outcome after it. ``thinking``: the thinking budget (``thinking.py``; the backend needs ``inject``).
    The one-user case of :func:`speculative_generate_batch`."""
    return speculative_generate_batch([backend], [prompt], max_new_tokens, [k], [params], eos_ids,
                                      thinking=thinking)[0]


def speculative_generate_batch(backends: "Sequence[SpecBackend] | BatchSpecBackend", prompts: Sequence[Sequence[int]],
                               max_new_tokens: int, depths: "Sequence[int | FixedDepth | DepthController]",
                               params: Sequence[SamplingParams], eos_ids: Sequence[int] = (),
                               arrivals: Sequence[int] | None = None,
                               thinking: ThinkingBudget | None = None) -> list[GenerationResult]:
    """Several users decoded together: user i owns ``backends[i]`` (its own target / MTP state, pending token and
    sampler), ``depths[i]`` (a depth policy is stateful: one object per user) and ``params[i]``.

    Every round prefills or steps each unfinished user once, in user order, so users advance in lockstep and each
    accepts its own number of drafts; a user that reaches EOS or ``max_new_tokens`` stops while the others go on.
    ``arrivals[i]`` (default 0) is the round in which user i joins (its prefill), for users arriving mid-run.
    A user's result depends on its own inputs only: the same as decoding it alone.

    ``backends`` may instead be one batched backend (``batch_backend.BatchSpecBackend``, e.g. the reference's
    ``ReferenceBatchBackend``): then every round's steps run as one packed verify over all users
    (``batch_backend.speculative_generate_slots``), with the same rounds and per-user results."""
    from .batch_backend import BatchSpecBackend, speculative_generate_slots  # it builds on this module

    if isinstance(backends, BatchSpecBackend):
        if thinking is not None and any(p.logprobs is not None for p in params):
            raise ValueError("logprobs with a thinking budget are not supported (forced tokens have no sampled logprob)")
        return speculative_generate_slots(backends, prompts, max_new_tokens, depths, params, eos_ids, arrivals,
                                          thinking=thinking)
    n = len(backends)
    if len({id(b) for b in backends}) != n:
        raise ValueError("each user needs its own backend (a backend holds one user's state)")
    arrivals, ctrls = _per_user_inputs({"backend": n, "prompt": len(prompts)}, depths, params, arrivals)
    if thinking is not None:
        for b in backends:
            if not hasattr(b, "inject"):
                raise ValueError(f"{b.label}: a thinking budget needs the backend's inject() (forced tokens); "
                                 "this backend has none yet")
        if any(p.logprobs is not None for p in params):
            raise ValueError("logprobs with a thinking budget are not supported (forced tokens have no sampled logprob)")
    users = [_UserRun(b, c, p, max_new_tokens, eos_ids, thinking) for b, c, p in zip(backends, ctrls, params)]
    round_ = 0
    while not all(u.done for u in users):
        for i, u in enumerate(users):
            if u.done or arrivals[i] > round_:
                continue
            if arrivals[i] == round_:
                u.prefill(prompts[i])
            else:
                u.step()
        round_ += 1
    return [u.result() for u in users]


def _per_user_inputs(counts: dict[str, int], depths, params, arrivals) -> tuple[list[int], list]:
    """Check one depth, params and arrival per user (and each of ``counts``: name -> how many were given, the first
    being the number of users); returns the arrival rounds (default 0) and one depth policy object per user."""
    n = next(iter(counts.values()))
    arrivals = [0] * n if arrivals is None else list(arrivals)
    given = {**counts, "depth": len(depths), "params": len(params), "arrival": len(arrivals)}
    if n == 0 or any(c != n for c in given.values()):
        names = list(given)
        raise ValueError(f"one {', '.join(names[:-1])} and {names[-1]} per user: got "
                         f"{', '.join(str(c) for c in given.values())}")
    if min(arrivals) < 0:
        raise ValueError(f"arrival rounds must be >= 0, got {arrivals}")
    ctrls = [FixedDepth(k) if isinstance(k, int) else k for k in depths]
    if len({id(c) for c in ctrls}) != n:
        raise ValueError("each user needs its own depth policy object (a policy tracks one user's acceptance)")
    return arrivals, ctrls


class _UserBook:
    """One user's bookkeeping, whatever runs the backend calls: emitted tokens (cut at EOS / ``max_new_tokens``),
    logprobs, acceptance statistics and the depth of its next step. Used by the per-user scheduler
    (:class:`_UserRun`) and the batched driver (``batch_backend._SlotUser``)."""

    def __init__(self, depth, params: SamplingParams, max_new_tokens: int, eos_ids: Sequence[int]):
        self.depth, self.params = depth, params
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.stats = AcceptanceStats(depth.k_max)
        self.tokens: list[int] = []
        self.done = False
        self.want_lp = params.logprobs is not None
        self.logprobs: list[TokenLogprobs] = []
        self.step_k = 0

    def start(self, first: int, first_logprobs) -> None:
        """The prefill's token; ``first_logprobs()`` gives its logprobs (called only when they were asked for)."""
        self.tokens, self.done = _cut([first], self.max_new_tokens, self.eos_ids)
        if self.want_lp:
            self.logprobs.append(first_logprobs())
        self.step_k = 0 if self.done else self.depth.choose()

    def record(self, label: str, acceptance: Acceptance) -> int:
        """One step's outcome at depth ``step_k``; returns (and keeps) the depth of the next step."""
        k = self.step_k
        self.depth.observe(k, acceptance.num_accepted)
        self.stats.record(acceptance, k)
        self.tokens, self.done = _cut(self.tokens + acceptance.tokens, self.max_new_tokens, self.eos_ids)
        if self.want_lp:
            if acceptance.logprobs is None or len(acceptance.logprobs) != len(acceptance.tokens):
                raise RuntimeError(f"{label}: logprobs were asked for but the step returned none per token")
            self.logprobs += acceptance.logprobs
        self.step_k = k if self.done else self.depth.choose()
        return self.step_k

    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.stats,
                                self.logprobs[: len(self.tokens)] if self.want_lp else None)


class _UserRun(_UserBook):
    """One user's speculative decoding: prefill, then one step per call until EOS or ``max_new_tokens``.

    The depth of the next step is chosen between accept and commit: a backend that drafts the next step inside
    this step's commit (the TT backend) is told it then (``plan_next_depth``); the choice uses only the accepted
    count that accept() already brought to the host, and the controller sees the same choose/observe sequence as
    when it is asked before each step."""

    def __init__(self, backend: SpecBackend, depth, params: SamplingParams, max_new_tokens: int,
                 eos_ids: Sequence[int], thinking: ThinkingBudget | None = None):
        super().__init__(depth, params, max_new_tokens, eos_ids)
        self.backend = backend
        self.plan_next = getattr(backend, "plan_next_depth", None)
        self.thinking, self.tracker = thinking, None

    def prefill(self, prompt: Sequence[int]) -> None:
        forced: list[int] = []
        if self.thinking is not None:
            self.tracker = self.thinking.tracker(prompt)
            if self.tracker.inject_first():  # budget 0, block open: the phrase is part of the prefill
                forced = self.tracker.forced(0)
        first = self.backend.prefill(list(prompt) + forced, self.params)
        self.start(first, lambda: _first_logprobs(self.backend))
        self.tokens, self.done = _cut(forced + self.tokens, self.max_new_tokens, self.eos_ids)
        if self.tracker is not None and not self.done and self.tracker.cut([first], len(forced))[1]:
            self._inject()  # the budget is reached at the prefill's token (budget 1)

    def _inject(self) -> None:
        """Force the stop-thinking phrase now (the backend commits it like a prefill continuation and picks the
        token after it); the tracker counts nothing after an injection."""
        acc = self.backend.inject(self.tracker.forced(len(self.tokens)))
        self.tokens, self.done = _cut(self.tokens + acc.tokens, self.max_new_tokens, self.eos_ids)

    def step(self) -> None:
        backend = self.backend
        draft = backend.draft(self.step_k)
        acceptance = backend.accept(draft, backend.verify(draft))
        inject = False
        if self.tracker is not None:  # cut the step right after the budget's last thinking token
            keep, inject = self.tracker.cut(acceptance.tokens, len(self.tokens))
            if keep < len(acceptance.tokens):
                acceptance = Acceptance(keep - 1, acceptance.tokens[:keep])
        next_k = self.record(backend.label, acceptance)
        if self.plan_next is not None:
            self.plan_next(next_k)
        backend.commit(acceptance)
        if inject and not self.done:
            self._inject()


def _first_logprobs(backend) -> TokenLogprobs:
    lp = getattr(backend, "first_logprobs", None)
    if lp is None:
        raise RuntimeError(f"{backend.label}: logprobs were asked for but prefill recorded none")
    return lp
