"""TTSpecBackend: the speculative engine's ``SpecBackend`` on the TT target, ``slots`` user slots (B; one user is
B = 1). It speaks the engine's one protocol: ``join(slot, prompt, params)``, ``draft({slot: k})``, ``verify``,
``accept(...) -> {slot: Acceptance}``, ``plan_next_depths``, ``commit``, ``abort``, ``leave(slot)``, ``inject``.

One class, two step layouts, chosen once at construction by where the verify's row inputs come from (``rows``) and
each a :class:`~.layout.StepLayout` with the protocol's interface, to which every call goes:

* ``"device"``, :class:`~.device_rows.DeviceRows` (one user, the default at ``slots=1``): position and pending
  token are device state, the commit advances them and makes the next step's drafts inside the commit trace (two
  trace replays a step, no host writes); per-step draft depths with ``depths=``; ``capped_accept`` (the vLLM verify);
* ``"host"``, :class:`~.host_slots.HostRows` (the default above one slot): the host writes every user's row inputs
  before each step over the B slots of the layout's own :class:`~..runtime.batch.TTBatchDecoder`, with the packed
  device MTP chain in a draft trace of its own (three replays and 12 host writes a step); its row inputs in
  tt/spec/host_rows.py. At one slot it is the batched step at B = 1: the same numbers as device rows, other programs
  (tests/tt/spec/test_b1_identity.py, tests/tt/spec/test_program_golden.py).

Why one user keeps device rows: at B = 1 they cost less on cards (docs/tt_spec.md, "One backend, two step layouts":
the modelled, calibrated 27B step of each layout). The step of each layout (its traces, what the host reads and
writes between them, inert rows, drafting, sampling, the commit mechanisms): docs/tt_spec.md; per-step depths:
docs/depth.md.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ...generation.sampling import SamplingParams, TokenLogprobs
from ...speculative.engine import Acceptance
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ..runtime.generator import TTGenerator
from ..runtime.sampler_transform import SamplerStages
from .device_rows import DeviceRows
from .host_rows import BatchSpecError
from .host_slots import HostRows
from .layout import StepLayout
from .mechanisms import TTMechanism, tt_mechanism
from .verify import VerifyOutputs

__all__ = ["BatchSpecError", "TTSpecBackend"]

LAYOUTS = ("device", "host")


class TTSpecBackend:
    """``SpecBackend`` on the TT model: ``slots`` users (module doc). One user (``slots=1``, device rows) picks K at
    its first draft (or steps at ``depths``); B slots (host rows) verify ``k`` drafts per user (every step runs
    B x (k+1) rows) with the backend's ``params``, or each user its own with ``stages``. The layout classes
    are class attributes, so a subclass can run a deliberately broken layout (the probes' self-tests)."""

    one_user_layout: type[DeviceRows] = DeviceRows
    slots_layout: type[HostRows] = HostRows

    def __init__(self, gen: TTGenerator, mechanism: str | TTMechanism = DEFAULT_MECHANISM, drafter: Any = None,
                 use_trace: bool = True, rng: str = "device", depths: Sequence[int] | None = None,
                 prefix_cache=None, *, slots: int = 1, k: int | None = None, params: SamplingParams | None = None,
                 rows: str | None = None, stages: SamplerStages | None = None, pool_blocks: int = 0,
                 capped_accept: bool = False):
        """``depths``: the draft depths steps of one generation may use (``--spec-k auto``, one user); None = one
        depth per generation (the first draft()'s K), the single-depth traces "verify" / "commit".
        ``prefix_cache``: a ``qwen36.prefix_cache.PrefixCache`` (tt/runtime/prefix.py; the MTP prefill is redone
        from the cached hidden rows); with B slots new blocks are cached by joins while no step trace is live, or
        always with ``pool_blocks`` > 0 (host rows: the decoder's ``TTBlockPool`` of that many blocks, allocated
        before any capture; tt/runtime/prefix.py).
        ``rows``: the step layout, "device" (one user; default at one slot) or "host" (B slots; default above one,
        and at one slot the batched step at B = 1); ``k`` and ``params`` are the host rows' verify width and
        sampling params (one user takes its params at join()). ``stages``: host rows only, per-user params (module
        doc): what the traced step contains, e.g. ``SamplerStages.of`` the users' params or ``SamplerStages.every()``;
        None: every user has ``params`` (apart from the seed).
        ``capped_accept``: a caller may hand the step its own drafts (:meth:`cap_drafts`, a server whose scheduler
        holds them): the greedy acceptor then reads a copy of the drafts whose columns past the caller's count hold
        an id no argmax equals (the vocabulary size), so acceptance stops at that count. Greedy users only."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.rows = rows or ("device" if slots == 1 else "host")
        if self.rows not in LAYOUTS:
            raise ValueError(f"rows must be 'device' or 'host', got {rows!r}")
        if self.rows == "host":
            if capped_accept:
                raise NotImplementedError("capped_accept (caller drafts, cap_drafts) is the one-user layout's so far")
            if depths is not None:
                raise BatchSpecError("depths= (per-step depth switching) is the one-user layout's; B slots verify "
                                     "k drafts per user and each user drafts k_b <= k")
            self.layout: StepLayout = self.slots_layout(gen, slots, k, tt_mechanism(mechanism), drafter,
                                               params or SamplingParams(), use_trace, rng, prefix_cache, stages,
                                               pool_blocks)
            return
        if pool_blocks:
            raise ValueError("pool_blocks is the host rows' (B slots): one user resets its state at every join, so "
                             "its joins cache blocks with no trace live")
        if slots != 1:
            raise ValueError(f"device rows hold one user's position; {slots} slots need rows='host'")
        if k is not None or params is not None or stages is not None:
            raise ValueError("k, params and stages are the host rows' (B slots); one user picks K at its first "
                             "draft() and takes its params at join()")
        mechanism = tt_mechanism(mechanism)
        if drafter is None:
            raise ValueError("TTSpecBackend needs a drafter: the device MTP (models/qwen36/tt/spec/mtp_drafter.py) or a "
                             "host callable (history, k) -> k draft ids")
        self.layout = self.one_user_layout(gen, mechanism, drafter, use_trace, rng, depths, prefix_cache,
                                           capped_accept)

    def __getattr__(self, name: str):
        """State views of the layout (``step_state``, ``acceptor``, ``drafter``, ``history``, ``decoder``, ``users``,
        ``traces``, ``counters``, ...): read through to it."""
        if name == "layout":  # not set yet (a failed construction)
            raise AttributeError(name)
        return getattr(self.layout, name)

    # the protocol's data members (real attributes: ``isinstance(be, SpecBackend)`` reads them statically)
    @property
    def label(self) -> str:
        return self.layout.label

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def mechanism(self) -> TTMechanism:
        return self.layout.mechanism

    @property
    def counters(self):
        return self.layout.counters

    use_trace = property(lambda self: self.layout.use_trace,
                         lambda self, value: setattr(self.layout, "use_trace", bool(value)),
                         doc="Whether the steps run as captured traces (the layout's).")

    # ---- the protocol: every call goes to the layout ---------------------------------------------------------
    @torch.no_grad()
    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        return self.layout.join(slot, prompt, params)

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.layout.first_logprobs(slot)

    def leave(self, slot: int) -> None:
        self.layout.leave(slot)

    def draft(self, depths: Mapping[int, int]):
        return self.layout.draft(depths)

    def verify(self, draft) -> VerifyOutputs:
        return self.layout.verify(draft)

    def accept(self, draft, verify) -> dict[int, Acceptance]:
        return self.layout.accept(draft, verify)

    def plan_next_depths(self, depths: Mapping[int, int]) -> None:
        self.layout.plan_next_depths(depths)

    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        self.layout.commit(acceptances)

    @torch.no_grad()
    def inject(self, forced: Mapping[int, Sequence[int]],
               depths: Mapping[int, int] | None = None) -> dict[int, Acceptance]:
        """The thinking budget's forced tokens (``generation/thinking.py``) through the step's own traces, with a
        forced acceptance; the token after each phrase picked on the host with the user's params (each layout's
        ``inject``)."""
        return self.layout.inject(forced, depths)

    def abort(self) -> None:
        self.layout.abort()

    def cap_drafts(self, drafts: Mapping[int, Sequence[int]]) -> None:
        self.layout.cap_drafts(drafts)

    def release(self) -> None:
        self.layout.release()

    def close(self) -> None:
        self.layout.close()
