"""The batched speculative contract: one backend object for a batch of user slots, one packed verify per step.

    step:  draft(depths) -> verify (ONE forward, B x (K+1) rows) -> accept (per user) -> commit (per user)

A :class:`BatchSpecBackend` owns ``slots`` user slots. A user enters with :meth:`~BatchSpecBackend.join` (its
prefill, alone in its slot) and leaves with :meth:`~BatchSpecBackend.leave`. Each step names the users that take
part and the draft depth of each (``depths``: slot -> k_b >= 1); K = max k_b. The verify runs every slot's K+1
rows in one forward: user b's rows ``[pending_b, d_1..d_{k_b}]`` are real, its rows past k_b and every row of a
slot not in ``depths`` (a free slot, or a user sitting this step out) are inert: they leave no GDN, conv or
position change, and their KV rows lie past the user's position (scratch by design, like rejected rows).
Acceptance is per user (greedy or rejection sampling with the user's own params and sampler), and so is the
commit: each user keeps the state after its own accepted row a_b, through the backend's commit mechanism object
(resolved once from ``mechanisms.MECHANISMS``). Only per-user counts and tokens cross to the host, so a device
backend can accept on device.

:func:`speculative_generate_slots` drives such a backend; ``engine.speculative_generate_batch`` hands it a
``BatchSpecBackend`` when given one instead of a list of per-user backends. ``reference_batch_backend.py``
implements the contract on the torch reference (the oracle).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from .depth import DepthController, FixedDepth
from .engine import Acceptance, GenerationResult, MechanismCounters, _UserBook, _cut, _per_user_inputs
from .sampling import SamplingParams, TokenLogprobs


@runtime_checkable
class BatchSpecBackend(Protocol):
    """The contract a batched backend implements. Handles are backend-private; depths map slot -> k_b >= 1.

    label: what actually runs, derived from the live objects. slots: how many users it holds at once.
    mechanism: the commit mechanism object (``.name`` in ``mechanisms.MECHANISMS``), fixed at construction.
    counters: a MechanismCounters over the whole batch, updated in place (``steps`` counts batched steps).
    """

    label: str
    slots: int
    mechanism: Any
    counters: MechanismCounters

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Prefill ``prompt`` into the free ``slot`` (no other slot read or written), seed the user's sampler from
        ``params``, return its first token (pending)."""

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        """The joined user's first token's logprobs when its params asked for them, else None."""

    def leave(self, slot: int) -> None:
        """Free ``slot`` (no open step may be running)."""

    def draft(self, depths: Mapping[int, int]) -> Any:
        """Per user in ``depths``: MTP reseed of its verified rows, then a chain of k_b drafts. Returns a handle."""

    def verify(self, draft: Any) -> Any:
        """ONE target forward over B x (K+1) rows, the rows past each user's k_b and every row of the slots not
        in the step masked inert. Returns a handle."""

    def accept(self, draft: Any, verify: Any) -> dict[int, Acceptance]:
        """Per user in the step: greedy or rejection sampling (its own params) -> slot -> Acceptance."""

    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        """Per user: publish the state after its row a_b; its last emitted token becomes pending. Every user of
        the step must be in ``acceptances``."""

    def abort(self) -> None:
        """Discard the open step: every slot's state and sampler exactly as before draft()."""


def speculative_generate_slots(backend: BatchSpecBackend, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                               depths: "Sequence[int | FixedDepth | DepthController]",
                               params: Sequence[SamplingParams], eos_ids: Sequence[int] = (),
                               arrivals: Sequence[int] | None = None, thinking=None) -> list[GenerationResult]:
    """Several users decoded as one batch on ``backend``: round r first lets the users with ``arrivals[i] == r``
    join (each takes the lowest free slot), then runs one batched step for every user that joined in an earlier
    round and is not done (users that joined this round sit the step out, their rows inert). A user that reaches
    EOS or ``max_new_tokens`` leaves its slot. Round structure, per-user depths and results are those of the
    per-user scheduler in ``engine.speculative_generate_batch``. ``thinking``: the thinking budget
    (``thinking.py``), each user its own count: a step that crosses a user's budget is cut after its N-th thinking
    token, and the phrases of every user that reached its budget in the step are forced in ONE packed call
    (``backend.inject``)."""
    arrivals, ctrls = _per_user_inputs({"prompt": len(prompts)}, depths, params, arrivals)
    if thinking is not None and not hasattr(backend, "inject"):
        raise ValueError(f"{backend.label}: a thinking budget needs the backend's inject() (forced tokens); this "
                         "backend has none yet")
    users = [_SlotUser(c, p, max_new_tokens, eos_ids) for c, p in zip(ctrls, params)]
    if thinking is not None:
        for u, prompt in zip(users, prompts):
            u.tracker = thinking.tracker(prompt)

    def inject(batch: list[_SlotUser]) -> None:
        forced = {u.slot: u.tracker.forced(len(u.tokens)) for u in batch}
        accs = backend.inject(forced)
        for u in batch:
            u.tokens, u.done = _cut(u.tokens + accs[u.slot].tokens, u.max_new_tokens, u.eos_ids)

    free = list(range(backend.slots))
    plan_next = getattr(backend, "plan_next_depths", None)
    round_ = 0
    while not all(u.done for u in users):
        for i, u in enumerate(users):
            if arrivals[i] == round_:
                if not free:
                    raise ValueError(f"user {i} arrives in round {round_} but no slot is free (the backend has {backend.slots})")
                u.slot = free.pop(0)
                u.join(backend, prompts[i])
                if u.inject_now and not u.done:
                    inject([u])  # the budget is reached at the join's token (budget 1)
                if u.done:
                    backend.leave(u.slot)
                    free = sorted(free + [u.slot])
        stepping = [u for i, u in enumerate(users) if not u.done and arrivals[i] < round_]
        if stepping:
            step = {u.slot: u.step_k for u in stepping}
            draft = backend.draft(step)
            verify = backend.verify(draft)
            accepted = backend.accept(draft, verify)
            for u in stepping:
                if u.tracker is not None:  # cut the user's step right after its budget's last thinking token
                    acc = accepted[u.slot]
                    keep, u.inject_now = u.tracker.cut(acc.tokens, len(u.tokens))
                    if keep < len(acc.tokens):
                        accepted[u.slot] = Acceptance(keep - 1, acc.tokens[:keep])
                u.record(backend.label, accepted[u.slot])
            if plan_next is not None:
                plan_next({u.slot: u.step_k for u in stepping if not u.done})
            backend.commit(accepted)
            forcing = [u for u in stepping if u.inject_now and not u.done]
            if forcing:
                inject(forcing)
            for u in stepping:
                if u.done:
                    backend.leave(u.slot)
                    free = sorted(free + [u.slot])
        round_ += 1
    return [u.result() for u in users]


class _SlotUser(_UserBook):
    """One user of a batched run: its slot and its bookkeeping (``engine._UserBook``); the driver makes the backend
    calls once per batch."""

    def __init__(self, depth, params: SamplingParams, max_new_tokens: int, eos_ids: Sequence[int]):
        super().__init__(depth, params, max_new_tokens, eos_ids)
        self.slot = -1
        self.tracker = None  # thinking budget (thinking.ThinkingTracker) when one is set
        self.inject_now = False

    def join(self, backend: BatchSpecBackend, prompt: Sequence[int]) -> None:
        forced = self.tracker.forced(0) if self.tracker is not None and self.tracker.inject_first() else []
        first = backend.join(self.slot, list(prompt) + forced, self.params)  # budget 0: the phrase in the prefill
        self.start(first, lambda: self._first_logprobs(backend))
        self.tokens, self.done = _cut(forced + self.tokens, self.max_new_tokens, self.eos_ids)
        self.inject_now = self.tracker is not None and self.tracker.cut([first], len(forced))[1]

    def _first_logprobs(self, backend: BatchSpecBackend) -> TokenLogprobs:
        lp = backend.first_logprobs(self.slot)
        if lp is None:
            raise RuntimeError(f"{backend.label}: logprobs were asked for but the join recorded none")
        return lp
