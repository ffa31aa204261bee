"""Batched plain decode on the TT model: B user slots decoded by one traced forward per step.

Slots. The decoder owns one B-slot state (tt/model/state.py): slot b is GDN recurrent blocks b*Hv_d..(b+1)*Hv_d-1, conv
row b, and the KV pages of page-table row b; the persistent decode inputs hold one row per slot (tokens [1, B],
rope rows [1, B], pos [B]). Row b of a step reads and writes slot b only (the GDN ring index, the per-user page
table and cache position); no op mixes rows, so a slot's contents never reach another slot's output.

Buckets. B is fixed per decoder (a bucket: :data:`DEFAULT_BUCKETS`); users join and leave between steps
without a new capture. A free slot's row is padded (token 0, pos -1): its cache write is skipped, its attention
output is zero, its GDN/conv slot is rewritten with values nobody reads (a join starts from zeros), and its
output row is ignored.

    dec = TTBatchDecoder(model, slots=8)
    first = dec.join(slot, prompt_ids)     # prefill on a batch-1 view of the slot -> last-row logits [V]
    logits, ids = dec.step({slot: token})  # one traced forward over all B rows -> [B, V], [B]
    dec.leave(slot)                        # slot reset on device
    dec.slot_remap([...])                  # row i takes over the state of slot remap[i] (vLLM's contract)

Batch 1. ``TTGenerator`` (tt/runtime/generator.py) decodes on ``TTBatchDecoder(model, 1, state=<its state>,
joins=False)``: it prefills its one sequence straight into that state (no scratch, no join buffers are allocated)
and :meth:`TTBatchDecoder.hold` s slot 0 at the sequence's position; its decode steps are this class's at B = 1,
and plain decoding at any B is one driver (``generation.plain.plain_generate`` over tt/runtime/decode.py's
``TTDecoder``), so every plain TT decoder shares one step, one loop and one thinking-budget feed.

Join. The prompt runs through the ordinary batch-1 prefill (chunked GDN, paged fill) on a batch-1 GDN scratch
state and on the slot's own page-table row, so KV pages of no other slot are written; the slot's pages are
zeroed first (a decode reads the last page up to its own position, and whatever a previous user left in the rest
of that page must not be NaN). The scratch is then installed into the slot by one row gather per state tensor.

Row gathers (join, leave, slot_remap) are ``ttnn.embedding`` over the state viewed as a row-major [rows, W] table
(W = Hv_d*Dk*Dv for the recurrent state, (K-1)*Cd for conv): output row i = table row idx[i], the semantics of
``slot_remap``; join and leave append one source row (the scratch, zeroed for a leave) and point the slot at it.

Traces. Join, leave and remap run eagerly between replays and allocate transient buffers while the decode trace
is live; they do so inside ttnn's ``corruptible_allocation_scope`` (buffers a replay may overwrite: every one of
them is dead before the next replay), which is what lets a user join without releasing and recapturing the step.
"""
from __future__ import annotations

import torch

from ...config import FULL
from ..model.model import TTQwen36Model
from ..model.model_config import TensorGroup, state_memory_config
from .prefix import TTBlockPool, TTPrefillResult, prefill as tt_prefix_prefill
from ..model.state import GDNLayerState, KVLayerState, TTModelState, allocate_decode_inputs, allocate_state, new_layer_state
from .trace import StepTraces

DEFAULT_BUCKETS = (1, 8, 32)
FREE = -1  # host position of a free slot (also the pos the device skips)


def bucket_for(users: int, buckets=DEFAULT_BUCKETS) -> int:
    """The smallest bucket holding ``users`` rows."""
    for b in sorted(buckets):
        if users <= b:
            return b
    raise ValueError(f"{users} users exceed the largest decode bucket ({max(buckets)})")


class TTBatchDecoder:
    def __init__(self, model: TTQwen36Model, slots: int, *, use_trace: bool = True, prefix_cache=None,
                 pool_blocks: int = 0, state: TTModelState | None = None, joins: bool = True):
        """``state``: decode over this existing state of ``slots`` users instead of allocating one (its owner's);
        ``joins=False``: the owner writes its slots itself (a batch-1 prefill straight into ``state``, then
        :meth:`hold`), so none of the join buffers (batch-1 scratch state, page-table row, gather index, a slot's
        KV zeros) is allocated and :meth:`join` / :meth:`leave` refuse. :class:`.generator.TTGenerator` is
        ``TTBatchDecoder(model, 1, state=its state, joins=False)``: its decode steps are this class's."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots, self.use_trace, self.joins = model, slots, use_trace, joins
        ttnn, mesh, a = model.ttnn, model.mesh, model.args
        self.ttnn, self.mesh = ttnn, mesh
        if state is not None and state.page_table_host.shape[0] != slots:
            raise ValueError(f"state holds {state.page_table_host.shape[0]} user slots, the decoder {slots}")
        self.state = allocate_state(a, ttnn, mesh, slots=slots) if state is None else state
        self.inputs = allocate_decode_inputs(ttnn, mesh, rows=1, batch=slots)
        types = a.cfg.layer_types
        self.scratch = self.slot_page_table = self.gather_idx = self.kv_zeros = None
        if joins:
            # batch-1 GDN state a joining user's prefill runs on (installed into its slot afterwards)
            self.scratch = [new_layer_state(a, ttnn, mesh, t, slots=1) if t != FULL else None for t in types]
            mc, rm = state_memory_config(ttnn), ttnn.ROW_MAJOR_LAYOUT
            self.slot_page_table = ttnn.from_torch(torch.zeros(1, a.blocks_per_seq, dtype=torch.int32),
                                                   dtype=ttnn.int32, layout=rm, device=mesh, memory_config=mc)
            self.gather_idx = ttnn.from_torch(torch.zeros(1, slots, dtype=torch.int32), dtype=ttnn.uint32,
                                              layout=rm, device=mesh, memory_config=mc)
            # zeros of one slot's pages (written over a joining slot's KV through its page-table row)
            kv_shape = (1, a.hkv_d, a.blocks_per_seq * a.block_size, a.cfg.head_dim)
            self.kv_zeros = (ttnn.from_torch(torch.zeros(kv_shape), dtype=a.dtype(TensorGroup.KV_CACHE, ttnn),
                                             layout=ttnn.TILE_LAYOUT, device=mesh, memory_config=mc)
                             if FULL in types else None)
        for layer in model.layers:
            if layer.layer_type != FULL:
                layer.mixer.prepare_batch(slots)
        self.pos = [FREE] * slots  # next cache position per slot (host bookkeeping), FREE when no user holds it
        self.traces = StepTraces(ttnn, mesh, warmup_steps=1)
        self.trace_name = f"decode/B{slots}"
        self.prefix_cache = prefix_cache  # qwen36.prefix_cache.PrefixCache: users sharing a prefix share its blocks
        self.prefills: dict[int, TTPrefillResult] = {}  # slot -> its user's prefill (tokens reused, the lease)
        # ``pool_blocks`` > 0: device buffers for that many cached blocks, allocated now (before any capture), so
        # joins cache new blocks while the step trace is live too (tt/runtime/prefix.py)
        self.pool = None
        if pool_blocks:
            if prefix_cache is None:
                raise ValueError("pool_blocks needs a prefix_cache")
            self._check_joins("a block pool")
            self.pool = TTBlockPool(model, self._scratch_view(self.state.page_table_host[:1]),
                                    prefix_cache.block_size, pool_blocks)

    # ---- host helpers -----------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s, p in enumerate(self.pos) if p == FREE]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range (decoder has {self.slots} slots)")

    def _check_joins(self, what: str) -> None:
        if not self.joins:
            raise ValueError(f"{what} needs a decoder built with joins=True (this one's slots are written by its "
                             f"owner, who calls hold())")

    def write_ids(self, host: torch.Tensor, buf) -> None:
        """Integer ids into one of this decoder's persistent int buffers (host -> device, between steps)."""
        ttnn = self.ttnn
        h = ttnn.from_torch(host.to(torch.int32), dtype=buf.dtype, layout=buf.layout,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        ttnn.copy_host_to_device_tensor(h, buf)

    def zero_scratch(self) -> None:
        """Zero the batch-1 GDN scratch state (a join's starting state, a leave's source row)."""
        ttnn = self.ttnn
        for s in self.scratch:
            if s is None:
                continue
            for buf in (s.recurrent, s.conv):
                h = ttnn.from_torch(torch.zeros(list(buf.shape)), dtype=buf.dtype, layout=buf.layout,
                                    mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
                ttnn.copy_host_to_device_tensor(h, buf)

    def _scratch_view(self, row: torch.Tensor) -> TTModelState:
        """A joining user's batch-1 view: the scratch GDN state, the shared KV caches, its page-table ``row``."""
        return TTModelState([sc if sc is not None else st for st, sc in zip(self.state.layers, self.scratch)],
                            self.slot_page_table, row, 0)

    def scratch_scope(self):
        """ttnn's corruptible-allocation scope: transient buffers a replay may overwrite, dead before the next one."""
        return self.ttnn.tools.trace_allocation_tracker.corruptible_allocation_scope(self.mesh)

    # ---- device row gathers -------------------------------------------------------------------------------
    def _gather(self, idx: list[int], with_scratch: bool) -> None:
        """Every GDN state tensor: row i <- source row idx[i] (source = the B slots, then the scratch when
        ``with_scratch``), on device."""
        ttnn, rm = self.ttnn, self.ttnn.ROW_MAJOR_LAYOUT
        self.write_ids(torch.tensor([idx]), self.gather_idx)
        with self.scratch_scope():
            for st, sc in zip(self.state.layers, self.scratch):
                if not isinstance(st, GDNLayerState):
                    continue
                for buf, extra in ((st.recurrent, sc.recurrent), (st.conv, sc.conv)):
                    src = ttnn.concat([buf, extra], dim=0) if with_scratch else buf
                    if src.layout != rm:
                        src = ttnn.to_layout(src, rm)
                    rows = self.slots + (1 if with_scratch else 0)
                    width = buf.logical_volume() // self.slots  # one slot's values, row-major
                    table = ttnn.reshape(src, [rows, width])
                    out = ttnn.embedding(self.gather_idx, table, layout=rm, dtype=buf.dtype)  # [1, B, W]
                    out = ttnn.reshape(out, list(buf.shape))
                    if buf.layout != rm:
                        out = ttnn.to_layout(out, buf.layout)
                    ttnn.copy(out, buf)

    def _install_scratch(self, slot: int) -> None:
        idx = list(range(self.slots))
        idx[slot] = self.slots
        self._gather(idx, with_scratch=True)

    # ---- users ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, slot: int, prompt, hidden_out: list | None = None, insert: bool | None = None) -> torch.Tensor:
        """Prefill ``prompt`` into free ``slot`` (writes only that slot); returns the last row's fp32 logits [V].
        ``hidden_out`` (a list) receives the prompt's post-final-norm hidden rows per prefill chunk (device
        [1, 1, rows, H]: what the MTP prefill of a speculative user reads). ``insert``: whether new prefix blocks may
        be cached (default: with a block pool always, without one while this decoder's trace is not live; an owner
        with its own traces decides)."""
        self._check_joins("join")
        self._check_slot(slot)
        if self.pos[slot] != FREE:
            raise ValueError(f"slot {slot} is held (position {self.pos[slot]}); leave() it first")
        ids = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("join needs at least one prompt token")
        ttnn, a = self.ttnn, self.model.args
        row = self.state.page_table_host[slot: slot + 1].contiguous()
        self.write_ids(row, self.slot_page_table)
        self.zero_scratch()
        view = self._scratch_view(row)
        with self.scratch_scope():
            for st in self.state.layers:
                if isinstance(st, KVLayerState):
                    for cache in (st.k, st.v):
                        ttnn.experimental.paged_fill_cache(cache, self.kv_zeros, self.slot_page_table, batch_idx=0)
            # with a cache: resume from the longest cached boundary; new blocks are cached into the pool, or without
            # one only while no decode trace is live (a cached block's device buffers outlive this call)
            if insert is None:
                insert = self.pool is not None or len(self.traces) == 0
            res = tt_prefix_prefill(self.model, view, ids.tolist(), self.prefix_cache, hidden_out=hidden_out,
                                    insert=insert, pool=self.pool)
        self._install_scratch(slot)
        self.pos[slot] = ids.numel()
        self.prefills[slot] = res
        return res.logits

    def leave(self, slot: int) -> None:
        """Free ``slot``: its GDN recurrent and conv state are zeroed on device, its position forgotten."""
        self._check_joins("leave")
        self._check_slot(slot)
        self.zero_scratch()
        self._install_scratch(slot)
        self.pos[slot] = FREE
        res = self.prefills.pop(slot, None)
        if res is not None and res.lease is not None:
            res.lease.release()  # its cached blocks may be evicted now (unless another user holds them)

    def hold(self, slot: int, pos: int) -> None:
        """Slot ``slot`` holds a user at position ``pos`` (its next cache position) whose state the owner wrote
        itself: a decoder built with ``joins=False`` over its owner's state (TTGenerator's prefill runs straight on
        it). Between steps."""
        if self.joins:
            raise ValueError("hold() is for a decoder built with joins=False (join() fills a slot of this one)")
        self._check_slot(slot)
        if not 0 <= int(pos):
            raise ValueError(f"slot {slot}: position {pos} must be >= 0")
        self.pos[slot] = int(pos)

    def slot_remap(self, remap) -> None:
        """vLLM-tt's ``slot_remap``: a permutation of all B slots, row i reads (and from now on owns) the state of
        slot ``remap[i]``. The GDN/conv rows are gathered on device; the KV pages stay where they are and the page
        table's rows move with their users (the page table is a per-step input, as vLLM passes it)."""
        remap = [int(r) for r in (remap.tolist() if isinstance(remap, torch.Tensor) else remap)]
        if sorted(remap) != list(range(self.slots)):
            raise ValueError(f"slot_remap must be a permutation of 0..{self.slots - 1}, got {remap}")
        if remap == list(range(self.slots)):
            return
        self._check_joins("a slot remap")
        self._gather(remap, with_scratch=False)
        self.pos = [self.pos[j] for j in remap]
        self.prefills = {i: self.prefills[j] for i, j in enumerate(remap) if j in self.prefills}
        table = self.state.page_table_host[remap].contiguous()
        self.state.page_table_host = table
        self.write_ids(table, self.state.page_table)

    def set_page_table(self, table: torch.Tensor) -> None:
        """Replace the host page table [slots, blocks_per_seq] (a server's block table: vLLM hands every user its
        own blocks of a shared pool) and write it to the device buffer the step reads, if it changed. Between
        steps only (a host -> device copy into a persistent buffer; a captured step keeps reading that buffer)."""
        table = torch.as_tensor(table, dtype=torch.int32)
        if tuple(table.shape) != tuple(self.state.page_table_host.shape):
            raise ValueError(f"page table {tuple(table.shape)}: expected {tuple(self.state.page_table_host.shape)}")
        if torch.equal(table, self.state.page_table_host):
            return
        self.state.page_table_host = table.clone()
        self.write_ids(self.state.page_table_host, self.state.page_table)

    # ---- the step ---------------------------------------------------------------------------------------------
    def _decode_device(self):
        return self.model.decode_forward(self.inputs, self.state)

    @torch.no_grad()
    def step(self, tokens: dict[int, int], read_logits: bool = True):
        """One decode forward: slot s feeds ``tokens[s]`` at its position; every other slot is padded. Returns
        (fp32 logits [B, V] or None, argmax ids [B]); rows of slots not in ``tokens`` are meaningless."""
        m = self.model
        for s in tokens:
            self._check_slot(s)
            if self.pos[s] == FREE:
                raise ValueError(f"slot {s} has no user (join it first)")
            if self.pos[s] >= m.args.max_seq_len:
                raise ValueError(f"slot {s}: position {self.pos[s]} reached max_seq_len {m.args.max_seq_len}")
        toks = [int(tokens.get(s, 0)) for s in range(self.slots)]
        pos = [self.pos[s] if s in tokens else FREE for s in range(self.slots)]
        m.copy_host_to_device(m.prepare_decode_inputs_host(toks, pos), self.inputs)
        out = self.traces.run(self.trace_name, self._decode_device, traced=self.use_trace)
        self.traces.step_done()
        logits = m.to_host(out.logits).float().reshape(self.slots, -1) if read_logits else None
        ids = m.to_host(out.tokens).reshape(-1).to(torch.int64)
        for s in tokens:
            self.pos[s] += 1
        return logits, ids

    @property
    def captures(self) -> int:
        return sum(self.traces.captures.values())

    def release(self) -> None:
        """Release the traces. The block pool's buffers stay while its cache holds blocks in them
        (:meth:`release_pool` frees them once the cache is dropped)."""
        self.traces.release()

    def release_pool(self) -> None:
        if self.pool is not None:
            self.pool.release()
            self.pool = None
