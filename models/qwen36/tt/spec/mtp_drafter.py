"""The device drafters of the TT speculative step: the MTP head driven inside the step's traces, with argmax or
sampled draft picks (tt/runtime/sampler_transform.py). :class:`TTMTPDrafter` drafts for one user (the one-user step
layout, tt/spec/device_rows.py; tt/spec/mtp.py); :class:`PackedMTPDrafter` for the B user slots of the B-slot layout
(tt/spec/host_slots.py; tt/spec/mtp_packed.py), which builds it from the drafter it is given
(:meth:`TTMTPDrafter.for_slots`)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..model.model_config import TensorGroup
from .mtp import TTMTPHead, load_tt_mtp
from .mtp_packed import PackedMTPHead, load_packed_mtp
from ..runtime.sampler_transform import SampledDraftPick, argmax_pick
from .verify import SpecDeviceState


class TTMTPDrafter:
    """Device drafter: the TT MTP head (models/qwen36/tt/spec/mtp.py). Reseed over the K+1 verify rows (tokens = the
    acceptor's result, hidden = the verify's post-norm rows), select row a, chain K-1 drafts: all inside the
    commit trace, writing the drafts buffer the next verify reads.

    Several draft depths (``--spec-k auto``): one head per depth, all sharing the weights and the one MTP KV cache
    (``TTMTPHead.for_depth``), so the MTP state of the sequence does not depend on the depth each step used. The
    draft is then split in two device halves: :meth:`device_reseed` (reseed over the K+1 rows of the step just
    verified, row a into the persistent :attr:`h_sel` / :attr:`chain_base`) and :meth:`device_chain` at the next
    step's depth K' (reads those two buffers, writes that depth's drafts buffer).

    Draft choice follows the run's SamplingParams: greedy (temperature 0) or ``draft="greedy"`` -> argmax drafts
    (one-hot draft distribution for stochastic acceptance); temperature > 0 with ``draft="sample"`` (the
    default) -> :class:`SampledDraftPick`: each draft drawn on device from the acceptor's own transform of the
    MTP logits, uniforms from a seeded table (seed = the run's seed, an independent stream from the acceptor's),
    and the draft distributions handed to ``DeviceAcceptor.stochastic``. With several depths the picks share one
    uniform table (one stream per run, whatever depth each chain has).

    The B user slots of the B-slot layout draft with :class:`PackedMTPDrafter` (:meth:`for_slots`)."""

    def __init__(self, reader, cache_dir=None):
        self.reader, self.cache_dir = reader, cache_dir
        self.head: TTMTPHead | None = None  # the head of the current depth
        self._base: TTMTPHead | None = None  # owns the weights and the MTP KV cache
        self._heads: dict[int, TTMTPHead] = {}
        self._samplers: dict[int, SampledDraftPick | None] = {}
        self._rng_owner: SampledDraftPick | None = None  # keeps the host mirror of the shared table's row counter
        self._k = None
        self.sampler = None  # SampledDraftPick of the current depth when drafts are sampled
        self.h_sel = self.chain_base = None

    def for_slots(self) -> "PackedMTPDrafter":
        """The drafter of the same MTP head over the B user slots of a B-slot step layout (a new one per layout: it
        holds that layout's packed head)."""
        return PackedMTPDrafter(self.reader, self.cache_dir)

    def _head(self, step_state: SpecDeviceState, k: int) -> TTMTPHead:
        if self._base is None or self._base.target is not step_state.model:
            self._base = load_tt_mtp(step_state.model, self.reader, k, cache_dir=self.cache_dir)
            self._heads = {k: self._base}
        if k not in self._heads:
            self._heads[k] = self._base.for_depth(k)
        return self._heads[k]

    def allocate(self, step_state: SpecDeviceState) -> None:
        """The head for ``step_state``'s depth (before any capture)."""
        self.allocate_depths([step_state])

    def allocate_depths(self, step_states: Sequence[SpecDeviceState]) -> None:
        """Per-depth heads, picks and drafts buffers for every step state (one per depth), before any capture.
        The last one becomes the current depth (:meth:`use`)."""
        self._samplers, self._rng_owner = {}, None
        for st in step_states:
            ttnn, mesh, k = st.ttnn, st.mesh, st.k
            head = self._head(st, k)
            st.drafts = head.draft_tokens  # the verify reads the MTP's persistent draft buffer
            acc = st.acceptor
            if acc is not None and acc.params.sampled_drafts:
                probs_fn = acc.probs_from_logits
                if acc.params.penalized:  # drafts use the committed counts (their own chain is not added)
                    probs_fn = (lambda a: lambda logits: a.probs_from_logits(logits, a.draft_penalties()))(acc)
                sampler = SampledDraftPick(ttnn, mesh, k, acc.vocab, probs_fn, seed=acc.seed, rng=acc.rng)
                if self._rng_owner is None:
                    self._rng_owner = sampler
                else:
                    sampler.uniforms = self._rng_owner.uniforms  # allocate() then keeps the shared, filled table
                head.pick = sampler.allocate()
            else:
                sampler = None
                head.pick = argmax_pick(ttnn)
            self._samplers[k] = sampler
        st = step_states[0]
        ttnn, mesh = st.ttnn, st.mesh
        rep = ttnn.ReplicateTensorToMesh(mesh)
        self.pos = ttnn.from_torch(torch.zeros(1, dtype=torch.int32), dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                                   device=mesh, mesh_mapper=rep)
        if len(step_states) > 1:
            a = st.model.args
            self.h_sel = ttnn.from_torch(torch.zeros(1, 1, 1, a.cfg.hidden_size),
                                         dtype=a.dtype(TensorGroup.RESIDUAL, ttnn), layout=ttnn.TILE_LAYOUT,
                                         device=mesh, mesh_mapper=rep)
            self.chain_base = ttnn.from_torch(torch.zeros(1, 1, 1, 1), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                                              device=mesh, mesh_mapper=rep)
        self.use(step_states[-1].k)

    def use(self, k: int) -> None:
        """Make depth k current (host bookkeeping only)."""
        self.head, self.sampler, self._k = self._heads[k], self._samplers[k], k

    def start(self, step_state: SpecDeviceState, history: list[int], prompt_hidden) -> None:
        """After the prompt: MTP prefill over rows t = 0..P-1 (x_{t+1}, h_t), then the first chain."""
        self.use(step_state.k)
        nxt = torch.tensor(history[1:])
        self.before_device_draft()
        self.head.prefill_draft(nxt, prompt_hidden)

    def step_back(self) -> None:
        """An aborted step: nothing to give back (the aborted step's drafts were made by the previous commit)."""

    def read_drafts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [1, K] int64, fp32 logits [1, K, V]) of the last chain (tests and probes)."""
        ids, logits = self.head.read_drafts()
        return torch.tensor([ids], dtype=torch.int64), logits[None]

    def before_device_draft(self) -> None:
        """Host side, outside any capture, before every chain execution (eager or replayed)."""
        owner = self._rng_owner if self._rng_owner is not None else self.sampler
        if owner is not None and self.sampler is not None:
            owner.before_chain()

    def device_draft(self, step_state: SpecDeviceState, vout) -> None:
        """Reseed + chain at the step's own depth (one depth per generation)."""
        self._set_pos(step_state)
        self._heads[step_state.k].draft(step_state.acceptor.result, vout.out.hidden, self.pos,
                                        step_state.acceptor.count)

    def device_reseed(self, step_state: SpecDeviceState, vout) -> None:
        """Reseed over the verified K+1 rows, row a -> :attr:`h_sel`, n + a + 1 -> :attr:`chain_base`."""
        ttnn = step_state.ttnn
        self._set_pos(step_state)
        h, base = self._heads[step_state.k].reseed_select(step_state.acceptor.result, vout.out.hidden, self.pos,
                                                          step_state.acceptor.count)
        if h.dtype != self.h_sel.dtype:
            raise RuntimeError(f"MTP hidden row is {h.dtype}, the persistent buffer {self.h_sel.dtype}")
        ttnn.copy(h, self.h_sel)
        ttnn.copy(base, self.chain_base)

    def device_chain(self, step_state: SpecDeviceState) -> None:
        """The chain of ``step_state``'s depth K from :attr:`h_sel` at :attr:`chain_base` (writes that depth's drafts)."""
        self._heads[step_state.k].chain(self.h_sel, self.chain_base)

    def _set_pos(self, step_state: SpecDeviceState) -> None:
        ttnn = step_state.ttnn
        pos = ttnn.to_layout(ttnn.reshape(ttnn.typecast(step_state.n, ttnn.int32), [1]), ttnn.ROW_MAJOR_LAYOUT)
        ttnn.copy(pos, self.pos)

    def draft_probs(self, acceptor=None):
        """[1, 1, K, V] fp32 draft distributions (persistent) for sampled drafts of ``acceptor``'s depth (None: the
        current depth); None = one-hot (argmax drafts)."""
        sampler = self.sampler if acceptor is None else self._samplers.get(acceptor.k)
        return sampler.draft_probs if sampler is not None else None

    def restart_rng(self) -> None:
        """Back to the start of the draft-pick stream (after a compile pass that drew from it)."""
        if self._rng_owner is not None:
            self._rng_owner.uniforms.restart()
            self._rng_owner.rows_used = 0


class PackedMTPDrafter:
    """The device drafter of the B-slot layout: one :class:`~.mtp_packed.PackedMTPHead` at the layout's verify depth
    K, every user's reseed and chain in the same device ops (per-user positions, per-slot MTP pages); argmax drafts,
    or sampled ones when the acceptor's params ask for them (each user drawing from its own uniform columns). What
    the layout calls: :meth:`allocate` (construction, before any capture), :meth:`join` (a user's MTP prefill, eager),
    :meth:`write_inputs` (host positions before the draft trace), :meth:`device_chain` (the draft trace: K drafts per
    user into the verify's token rows and the acceptor's drafts) and :meth:`device_reseed` (inside the commit trace:
    the step's verified rows, row a_b of each user kept)."""

    def __init__(self, reader, cache_dir=None):
        self.reader, self.cache_dir = reader, cache_dir
        self.head: PackedMTPHead | None = None

    def allocate(self, step_state: SpecDeviceState) -> None:
        """The packed head over ``step_state``'s users (before any capture); its acceptor's params asking for
        sampled drafts switch them on."""
        if self.head is not None:
            raise RuntimeError("a PackedMTPDrafter serves one B-slot layout (TTMTPDrafter.for_slots makes one each)")
        self.head = load_packed_mtp(step_state.model, self.reader, step_state.k, step_state.users,
                                    cache_dir=self.cache_dir)
        acc = step_state.acceptor
        if acc is not None and acc.params.sampled_drafts:
            self.head.enable_sampling(acc)

    def join(self, slot: int, history: list[int], prompt_hidden) -> None:
        """The MTP prefill of the user joining ``slot``; ``history`` = prompt + first token, ``prompt_hidden`` the
        prefill's post-norm rows [1, 1, P, H]."""
        self.head.join_slot(slot, torch.tensor(history[1:]), prompt_hidden)

    def write_inputs(self, depths: dict[int, int], pos: dict[int, int], pending: dict[int, int]) -> None:
        """The reseed and chain positions of the users of the next verify (between replays)."""
        self.head.write_reseed_inputs(depths, pos)
        self.head.write_chain_inputs(depths, pos, pending)

    def step_back(self) -> None:
        """An aborted step gives its chain's uniform row back (sampled drafts)."""
        self.head.chain_step_back()

    def read_drafts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, K] int64, fp32 logits [B, K, V]) of the last chain (tests and probes)."""
        return self.head.read_batch_drafts()

    def before_device_draft(self) -> None:
        """Host side, outside any capture, before every chain execution (eager or replayed)."""
        self.head.before_chain()

    def device_reseed(self, step_state: SpecDeviceState, vout) -> None:
        """Every stepping user's verified rows, row a_b of each into the head's own ``h_sel``."""
        acc = step_state.acceptor
        self.head.reseed_select_batch(acc.result, vout.out.hidden, acc.count, step_state.active)

    def device_chain(self, step_state: SpecDeviceState) -> None:
        """K drafts per user into the step state's token rows and the acceptor's drafts."""
        self.head.chain_batch(step_state.tokens, step_state.drafts)

    def draft_probs(self, acceptor=None):
        """[1, B, K, V] fp32 draft distributions (zero past each user's depth) for sampled drafts; None when the
        drafts are argmax picks."""
        return self.head.draft_probs
