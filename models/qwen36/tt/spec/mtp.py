"""MTP draft head on the TP mesh, including the MTP reseed over the verified rows.

    u = fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)])       embedding first; fc column-parallel + all_gather
    u = mtp.layers.0(u)                                     the target's TTDecoderLayer (gated attention + MLP),
                                                            own paged KV cache at the target's positions
    h = mtp.norm(u);  logits = h @ lm_head (shared, vocab-parallel, fp32) ; token = argmax (fp32: no bf16 ties)

MTP KV entry for position t = f(h_t, embed(x_{t+1})) (the MTP predicts x_{t+2} from h_t and the next token). One speculative step (all device work,
traceable, nothing read back in between):

    reseed  R = K+1 rows at positions n..n+K from the verify hidden rows 0..K and the acceptor's emitted
            tokens [d_1..d_a, final, placeholders] (placeholders -1 -> token 0). Rows > a write garbage MTP KV
            entries at positions > n+a: attention is causal by position and every such position is rewritten
            (by this step's chain or by the next reseed) before any row at or beyond it attends to it.
    select  row a (device tensor, the acceptor's count) of the post-norm hidden: an exact row gather
            (``ttnn.embedding`` over the [R, H] rows), then the LM head on that one row only (the LM head is
            the largest weight: computing logits for all R rows would cost R x the head stream).
    chain   K-1 more single-row MTP steps at positions n+a+1.., each feeding back its own argmax token
            (embedding of a device token) and its own post-norm hidden.

Multi-row attention (the reseed): the R rows are R *virtual users* of one sequence: every row of a [R, blocks]
page table points at the sequence's pages, ``cur_pos[i] = n + i``, so one ``paged_scaled_dot_product_attention_decode``
call is exactly causal attention over the rows (any number of KV heads per device; ``spec_multi_pos_tiles``
needs one KV head per device, which 27B at TP=2 (2 KV heads) does not have). Costs R scans of the KV instead of
one. The K/V rows are written with one ``paged_update_cache`` per row (never several users writing rows of
the same tile in one call: on cards each core read-modify-writes its user's tile, which would race).

Why fc is column-parallel (each device H/N output columns from the full 2H input, then all_gather): same
weight bytes per device as row-parallel; the collective moves (N-1)/N x T x H per device (all_reduce of
row-parallel partials: 2 (N-1)/N x T x H); and every output element is one fp32-accumulated dot product rounded
once (no bf16 partial sums). The two pre-fc norms are computed replicated (tiny).

Host/device boundary of the traced step (all buffers persistent, allocated by :meth:`TTMTPHead.allocate` /
:meth:`TTMTPHead.allocate_draft_inputs` before any capture):

    tokens  [1, 1, 1, >=R] int32/uint32 (the acceptor's ``result``: columns 0..K are used)
    hidden  [1, 1, R, H]   the target verify's post-final-norm hidden rows (DecodeOutputs.hidden)
    pos     [1] int32 ROW_MAJOR: n = position of verify row 0 (same format as DecodeInputs.pos)
    select  [1, 1, 1, 1] fp32 TILE: a (the acceptor's ``count``)
 -> draft_tokens [1, 1, 1, K] uint32 ROW_MAJOR, draft_logits [1, 1, K, V] fp32 TILE (persistent outputs;
    ``DeviceAcceptor.greedy/stochastic(logits, draft_tokens, probs_from_logits(draft_logits))`` take them).

``PackedMTPHead`` (tt/spec/mtp_packed.py) is the same layer packed over the B user slots of the B-slot step layout
(``TTSpecBackend`` with B slots): a B-slot MTP KV cache, the reseed over every user's verify rows in one forward
(user b's rows as virtual users on its own pages) and a chain of B rows per step; its class doc gives the layout.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...config import FULL
from ..model.attention import AttentionContext, TTGatedAttention
from ..model.ccl import ccl_for
from ..model.model import TTDecoderLayer, TTQwen36Model, lm_head_logits
from ..model.model_config import (TensorGroup, activation_memory_config, compute_config_matmul, compute_config_norm,
                           kv_update_input_memory_config, mtp_head_args, sdpa_decode_program_config,
                           state_memory_config)
from ..runtime.sampler_transform import argmax_pick
from ..model.state import KVLayerState, new_layer_state
from ..model.weights import MTPWeights

PLACEHOLDER_SUBSTITUTE = 0  # token id fed for acceptor placeholders (-1) in reseed rows past a (relu(-1) = 0)


@dataclass
class MTPAttentionContext(AttentionContext):
    """AttentionContext plus what the multi-row (virtual-user) decode needs."""

    rows_page_table: Any = None  # [R, blocks] int32: every row = the sequence's pages
    row_pos: list | None = None  # R tensors [1] int32: position of each row (one KV write per row)
    # packed over B users (the batched drafter): the rows are user-major (user b's row i at b*R + i), row_pos
    # holds R tensors [B] (row i of every user, -1 = no write) and page_table is [B, blocks]
    users: int = 1
    one_row_per_user: bool = False  # a chain step: B rows = B users, the target's own batched decode attention


class TTMTPAttention(TTGatedAttention):
    """The target's gated attention; decode over T > 1 rows of one sequence as T virtual users."""

    def attend_decode(self, q, k, v, kv: KVLayerState, ctx: AttentionContext):
        ttnn = self.ttnn
        rows = q.shape[1]
        if rows == 1 or getattr(ctx, "one_row_per_user", False):
            return super().attend_decode(q, k, v, kv, ctx)
        if not isinstance(ctx, MTPAttentionContext) or ctx.rows_page_table is None or ctx.row_pos is None:
            raise ValueError(f"{rows}-row MTP decode attention needs an MTPAttentionContext with rows_page_table and "
                             "row_pos (one [1] position tensor per row)")
        users = ctx.users
        if rows % users or len(ctx.row_pos) != rows // users or int(ctx.rows_page_table.shape[0]) != rows:
            raise ValueError(f"{rows} rows of {users} user(s) but {len(ctx.row_pos)} row positions / "
                             f"{int(ctx.rows_page_table.shape[0])} page-table rows")
        per_user = rows // users
        shard = kv_update_input_memory_config(ttnn, users, self.d)
        for i in range(per_user):
            for cache, t in ((kv.k, k), (kv.v, v)):
                if users == 1:
                    row = ttnn.slice(t, [0, i, 0, 0], [1, i + 1, self.hkv, self.d])
                else:  # row i of every user (user-major rows: stride R), one user per update core
                    row = ttnn.slice(t, [0, i, 0, 0], [1, rows, self.hkv, self.d], [1, per_user, 1, 1])
                ttnn.experimental.paged_update_cache(cache, ttnn.to_memory_config(row, shard),
                                                     update_idxs_tensor=ctx.row_pos[i], page_table=ctx.page_table)
        o = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, kv.k, kv.v, ctx.rows_page_table, cur_pos_tensor=ctx.pos, scale=self.scale,
            program_config=sdpa_decode_program_config(ttnn), compute_kernel_config=compute_config_norm(ttnn),
            memory_config=activation_memory_config(ttnn))
        return ttnn.reshape(o, [1, 1, rows, self.hq * self.d])


@dataclass
class DraftInputs:
    """Persistent input buffers of :meth:`TTMTPHead.draft` (for standalone/test use; the spec step passes the
    verify hidden and the acceptor's result/count buffers directly)."""

    tokens: Any  # [1, 1, 1, R] int32 TILE
    hidden: Any  # [1, 1, R, H] activation dtype TILE
    pos: Any  # [1] int32 ROW_MAJOR
    select: Any  # [1, 1, 1, 1] fp32 TILE


class TTMTPHead:
    """MTP draft head of depth ``k`` sharing the target's embedding, RoPE tables and LM head.

    ``pick(logits [1,1,1,V] fp32) -> token [1,1,1,1] uint32`` (device ops only, traceable) chooses each draft;
    default argmax. Call :meth:`allocate` once before any trace capture.

    One user: it drafts from device-resident inputs (its position from the verify state, its pages in the target's
    page table layout: :meth:`draft`, :meth:`reseed_select`, :meth:`chain`). The same layer over the B user slots
    of the B-slot layout is :class:`~.mtp_packed.PackedMTPHead`."""

    slots = 1

    def __init__(self, target: TTQwen36Model, weights: MTPWeights, k: int, pick: Callable[[Any], Any] | None = None):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"draft depth k must be an int >= 1, got {k!r}")
        self.target, self.w, self.k, self.rows = target, weights, k, k + 1
        # the head's own precision where the preset gives it one (PrecisionSetting.mtp): the same args
        # load_mtp_weights converted its weights with, so its compute configs follow its weights' formats
        self.args, self.ttnn, self.mesh = mtp_head_args(target.args), target.ttnn, target.mesh
        a = self.args
        if self.rows > a.max_seq_len:
            raise ValueError(f"k={k}: {self.rows} reseed rows exceed max_seq_len {a.max_seq_len}")
        self.layer = TTDecoderLayer(a, weights.layer, self.ttnn, self.mesh)
        self.layer.mixer = TTMTPAttention(a, weights.layer.mixer, self.ttnn, self.mesh)
        self.pick = pick or argmax_pick(self.ttnn)
        self.eps = a.cfg.rms_norm_eps
        self.replicate = self.ttnn.ReplicateTensorToMesh(self.mesh)
        self.allocated = False

    # ---- allocation (before any capture) -------------------------------------------------------------
    def _dev(self, x: torch.Tensor, dtype, layout):
        return self.ttnn.from_torch(x, dtype=dtype, layout=layout, device=self.mesh, mesh_mapper=self.replicate,
                                    memory_config=state_memory_config(self.ttnn))

    def allocate(self) -> "TTMTPHead":
        """MTP KV cache (paged, zeroed), page tables, constants, persistent outputs."""
        if self.allocated:
            return self
        ttnn, a = self.ttnn, self.args
        rm = ttnn.ROW_MAJOR_LAYOUT
        self.kv: KVLayerState = new_layer_state(a, ttnn, self.mesh, FULL)
        table = torch.arange(a.blocks_per_seq, dtype=torch.int32)[None]
        self.page_table_host = table
        self.page_table = self._dev(table, ttnn.int32, rm)
        self.chain_pos = self._dev(torch.zeros(1, dtype=torch.int32), ttnn.int32, rm)  # prefill path's chain start
        self._allocate_depth_buffers()
        self.allocated = True
        return self

    def for_depth(self, k: int) -> "TTMTPHead":
        """A head of depth ``k`` sharing this one's weights, layer, MTP KV cache, page table and pick: the MTP state
        of one sequence stays in one place whatever depth each step drafts at. Only the per-depth buffers (reseed
        rows, draft outputs) are its own. Allocates: call before any trace capture."""
        self._require()
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"draft depth k must be an int >= 1, got {k!r}")
        if k + 1 > self.args.max_seq_len:
            raise ValueError(f"k={k}: {k + 1} reseed rows exceed max_seq_len {self.args.max_seq_len}")
        head = copy.copy(self)
        head.k, head.rows = k, k + 1
        head._allocate_depth_buffers()
        return head

    def _allocate_depth_buffers(self) -> None:
        ttnn, a, r = self.ttnn, self.args, self.rows
        rm, tile = ttnn.ROW_MAJOR_LAYOUT, ttnn.TILE_LAYOUT
        table = self.page_table_host
        self.rows_page_table = self._dev(table.expand(r, -1).contiguous(), ttnn.int32, rm)
        self.c_row_offsets = self._dev(torch.arange(r, dtype=torch.float32).reshape(1, 1, 1, r), ttnn.float32, tile)
        self.draft_tokens = self._dev(torch.zeros(1, 1, 1, self.k, dtype=torch.int32), ttnn.uint32, rm)
        self.draft_logits = self._dev(torch.zeros(1, 1, self.k, a.cfg.vocab_size), ttnn.float32, tile)

    def allocate_draft_inputs(self) -> DraftInputs:
        ttnn, r, h = self.ttnn, self.rows, self.args.cfg.hidden_size
        tile, rm = ttnn.TILE_LAYOUT, ttnn.ROW_MAJOR_LAYOUT
        return DraftInputs(self._dev(torch.zeros(1, 1, 1, r, dtype=torch.int32), ttnn.int32, tile),
                           self._dev(torch.zeros(1, 1, r, h), self.args.dtype(TensorGroup.ACTIVATION, ttnn), tile),
                           self._dev(torch.zeros(1, dtype=torch.int32), ttnn.int32, rm),
                           self._dev(torch.zeros(1, 1, 1, 1), ttnn.float32, tile))

    def _require(self):
        if not self.allocated:
            raise RuntimeError(f"{type(self).__name__}.allocate() must be called (before any trace capture) first")

    # ---- host helpers (outside traces) -----------------------------------------------------------------
    def host_draft_inputs(self, tokens: list[int], hidden: torch.Tensor, n: int, a: int) -> dict:
        """Host tensors for :class:`DraftInputs`: tokens (R ids, -1 placeholders allowed), hidden [R, H], n, a."""
        ttnn, r, h = self.ttnn, self.rows, self.args.cfg.hidden_size
        if len(tokens) != r:
            raise ValueError(f"reseed needs {r} tokens (K+1), got {len(tokens)}")
        if not 0 <= a <= self.k:
            raise ValueError(f"accepted count a={a} outside [0, {self.k}]")
        hidden = hidden.reshape(-1, h)
        if hidden.shape[0] != r:
            raise ValueError(f"hidden must have {r} rows, got {hidden.shape[0]}")
        if n < 0 or n + r + self.k > self.args.max_seq_len:
            raise ValueError(f"position n={n}: rows and chain would pass max_seq_len {self.args.max_seq_len}")
        t = torch.tensor(tokens, dtype=torch.int32).reshape(1, 1, 1, r)
        m = self.replicate
        return {"tokens": ttnn.from_torch(t, dtype=ttnn.int32, layout=ttnn.TILE_LAYOUT, mesh_mapper=m),
                "hidden": ttnn.from_torch(hidden.float().reshape(1, 1, r, h),
                                          dtype=self.args.dtype(TensorGroup.ACTIVATION, ttnn), layout=ttnn.TILE_LAYOUT,
                                          mesh_mapper=m),
                "pos": ttnn.from_torch(torch.tensor([n], dtype=torch.int32), dtype=ttnn.int32,
                                       layout=ttnn.ROW_MAJOR_LAYOUT, mesh_mapper=m),
                "select": ttnn.from_torch(torch.tensor([[[[float(a)]]]]), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                                          mesh_mapper=m)}

    def copy_host_to_device(self, host: dict, inputs: DraftInputs) -> None:
        for name, t in host.items():
            self.ttnn.copy_host_to_device_tensor(t, getattr(inputs, name))

    def read_drafts(self) -> tuple[list[int], torch.Tensor]:
        """-> (K draft ids, fp32 draft logits [K, V]) from device 0 (the outputs are replicated)."""
        toks = self.target.to_host(self.draft_tokens).reshape(-1).to(torch.int64).tolist()
        logits = self.target.to_host(self.draft_logits).float().reshape(self.k, -1)
        return toks, logits

    # ---- device pieces (traceable) ---------------------------------------------------------------------
    def body(self, tokens, hidden, ctx: AttentionContext):
        """tokens [1, T] uint32 RM (x_{t+1}), hidden [1, 1, T, H] (h_t) -> MTP post-norm hidden [1, 1, T, H]."""
        ttnn, a = self.ttnn, self.args
        act, res = a.dtype(TensorGroup.ACTIVATION, ttnn), a.dtype(TensorGroup.RESIDUAL, ttnn)
        ncfg = compute_config_norm(ttnn)
        e = ttnn.rms_norm(self.target.embed(tokens), epsilon=self.eps, weight=self.w.norm_embedding,
                          compute_kernel_config=ncfg)
        h = ttnn.rms_norm(hidden, epsilon=self.eps, weight=self.w.norm_hidden, compute_kernel_config=ncfg)
        e = e if e.dtype == act else ttnn.typecast(e, act)
        h = h if h.dtype == act else ttnn.typecast(h, act)
        u = ttnn.linear(ttnn.concat([e, h], dim=3), self.w.fc, dtype=act, memory_config=activation_memory_config(ttnn),
                        compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.ATTN_QKV)))
        if a.num_devices > 1:
            u = ccl_for(ttnn, self.mesh).all_gather(u, dim=3)
        u = u if u.dtype == res else ttnn.typecast(u, res)
        u = self.layer.forward(u, self.kv, ctx)
        return ttnn.rms_norm(u, epsilon=self.eps, weight=self.w.final_norm, compute_kernel_config=ncfg)

    def logits(self, h):
        """Post-norm hidden [1, 1, T, H] -> fp32 logits [1, 1, T, V] (shared vocab-parallel LM head + all_gather)."""
        ttnn, a = self.ttnn, self.args
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        h = h if h.dtype == act else ttnn.typecast(h, act)
        lg = lm_head_logits(ttnn, a, self.target.w.lm_head, h, ttnn.float32)
        if a.num_devices > 1:
            lg = ccl_for(ttnn, self.mesh).all_gather(lg, dim=3)
        return lg

    def _positions(self, pos_f, rows: int):
        """fp32 positions [1, 1, 1, rows] (TILE) -> (cur_pos [rows] int32 RM, rope_idx [1, rows] uint32 RM)."""
        ttnn, rm = self.ttnn, self.ttnn.ROW_MAJOR_LAYOUT
        cur = ttnn.reshape(ttnn.to_layout(ttnn.typecast(pos_f, ttnn.int32), rm), [rows])
        ridx = ttnn.reshape(ttnn.to_layout(ttnn.typecast(pos_f, ttnn.uint32), rm), [1, rows])
        return cur, ridx

    def _pos_f32(self, pos_dev):
        """[1] int32 RM -> [1, 1, 1, 1] fp32 TILE (positions are exact in fp32 below 2**24)."""
        ttnn = self.ttnn
        return ttnn.typecast(ttnn.to_layout(ttnn.reshape(pos_dev, [1, 1, 1, 1]), ttnn.TILE_LAYOUT), ttnn.float32)

    def _reseed_tokens(self, tokens_dev):
        """[1, 1, 1, >=R] int32/uint32 (placeholders < 0) -> [1, R] uint32 RM."""
        ttnn, r = self.ttnn, self.rows
        t = tokens_dev
        if t.layout != ttnn.TILE_LAYOUT:
            t = ttnn.to_layout(t, ttnn.TILE_LAYOUT)
        if int(t.shape[-1]) != r:
            t = ttnn.slice(t, [0, 0, 0, 0], [1, 1, 1, r])
        t = ttnn.relu(ttnn.typecast(t, ttnn.float32))  # placeholder -1 -> 0 (ids exact in fp32 below 2**24)
        return ttnn.reshape(ttnn.to_layout(ttnn.typecast(t, ttnn.uint32), ttnn.ROW_MAJOR_LAYOUT), [1, r])

    def step(self, token, h, pos_f):
        """One chain row: token [1, 1] uint32 RM, h [1, 1, 1, H], position fp32 [1, 1, 1, 1] -> (h', logits)."""
        cur, ridx = self._positions(pos_f, 1)
        cos, sin = self.target.rope_rows(ridx)
        ctx = MTPAttentionContext("decode", cos, sin, self.page_table, pos=cur)
        h = self.body(token, h, ctx)
        return h, self.logits(h)

    def chain(self, h_first, base_f):
        """Drafts from the first row's post-norm hidden; chain step i at position base + i. Writes and returns the
        persistent (draft_tokens, draft_logits)."""
        ttnn, rm = self.ttnn, self.ttnn.ROW_MAJOR_LAYOUT
        lg, h = self.logits(h_first), h_first
        toks, lgs = [], []
        begin, end = getattr(self.pick, "begin_chain", None), getattr(self.pick, "end_chain", None)
        if begin is not None:
            begin()  # stateful picks (SampledDraftPick): gather this chain's uniforms
        for i in range(self.k):
            t = self.pick(lg)
            t = t if t.layout == rm else ttnn.to_layout(t, rm)
            toks.append(t)
            lgs.append(lg)
            if i + 1 < self.k:
                pos_i = base_f if i == 0 else ttnn.add(base_f, float(i))
                h, lg = self.step(ttnn.reshape(t, [1, 1]), h, pos_i)
        ttnn.copy(toks[0] if self.k == 1 else ttnn.concat(toks, dim=3), self.draft_tokens)
        ttnn.copy(lgs[0] if self.k == 1 else ttnn.concat(lgs, dim=2), self.draft_logits)
        if end is not None:
            end()  # SampledDraftPick: the K draft distributions -> its persistent draft_probs
        return self.draft_tokens, self.draft_logits

    def draft(self, tokens_dev, hidden_dev, pos_dev, select_dev):
        """Reseed over the R = K+1 verify rows at n..n+K, select row a, chain K-1 steps (see module docstring).
        Device only, allocates no persistent buffer: safe to capture. Returns the persistent
        (draft_tokens [1,1,1,K] uint32, draft_logits [1,1,K,V] fp32). Name suffixes: R rows, H hidden size."""
        return self.chain(*self.reseed_select(tokens_dev, hidden_dev, pos_dev, select_dev))

    def reseed_select(self, tokens_dev, hidden_dev, pos_dev, select_dev):
        """The first half of :meth:`draft`: reseed over the R = K+1 verify rows, gather row a -> (post-norm hidden of
        row a [1, 1, 1, H], chain start n + a + 1 as fp32 [1, 1, 1, 1]). Device only."""
        self._require()
        ttnn, r, hsz = self.ttnn, self.rows, self.args.cfg.hidden_size
        if [int(s) for s in hidden_dev.shape] != [1, 1, r, hsz]:
            raise ValueError(f"hidden: device shape {list(hidden_dev.shape)} != [1, 1, K+1={r}, H={hsz}]")
        tokens_1R = self._reseed_tokens(tokens_dev)
        n_1111 = self._pos_f32(pos_dev)
        cur_pos_R, rope_idx_1R = self._positions(ttnn.add(n_1111, self.c_row_offsets), r)
        row_pos = [ttnn.slice(cur_pos_R, [i], [i + 1]) for i in range(r)]
        cos_1R1D, sin_1R1D = self.target.rope_rows(rope_idx_1R)
        ctx = MTPAttentionContext("decode", cos_1R1D, sin_1R1D, self.page_table, pos=cur_pos_R,
                                  rows_page_table=self.rows_page_table, row_pos=row_pos)
        h_11RH = self.body(tokens_1R, hidden_dev, ctx)
        # exact row gather of row a (robust to any garbage, incl. non-finite, in the other rows)
        a_idx_11 = ttnn.reshape(ttnn.to_layout(ttnn.typecast(select_dev, ttnn.uint32), ttnn.ROW_MAJOR_LAYOUT), [1, 1])
        h_table_RH = ttnn.to_layout(ttnn.reshape(h_11RH, [r, hsz]), ttnn.ROW_MAJOR_LAYOUT)
        h_sel_111H = ttnn.reshape(ttnn.embedding(a_idx_11, h_table_RH, layout=ttnn.TILE_LAYOUT), [1, 1, 1, hsz])
        base_1111 = ttnn.add(ttnn.add(n_1111, select_dev), 1.0)  # n + a + 1
        return h_sel_111H, base_1111

    # ---- prompt (not traced) -----------------------------------------------------------------------------
    def prefill(self, next_tokens: torch.Tensor, hidden, all_logits: bool = False, page_table=None,
                page_table_host: torch.Tensor | None = None) -> torch.Tensor | None:
        """MTP rows t = 0..P-1 from x_{t+1} = ``next_tokens`` [P] and h_t = ``hidden`` (torch [P, H] or device
        [1, 1, P, H]), chunked like the target prefill (writes MTP KV 0..P-1). Keeps the last row's post-norm
        hidden on device (``self.last_hidden``). Returns fp32 logits [P, V] when ``all_logits``. ``page_table``
        (device [1, blocks]) with its ``page_table_host``: the pages to fill (default: the head's own sequence)."""
        self._require()
        if (page_table is None) != (page_table_host is None):
            raise ValueError("prefill: pass page_table and page_table_host together")
        if page_table is None:
            page_table, page_table_host = self.page_table, self.page_table_host
        ttnn, a = self.ttnn, self.args
        ids = torch.as_tensor(next_tokens).reshape(-1).to(torch.int32)
        p, hsz = ids.numel(), a.cfg.hidden_size
        if p == 0:
            raise ValueError("MTP prefill needs at least one row")
        if p + self.k > a.max_seq_len:
            raise ValueError(f"{p} prompt rows + {self.k} drafts exceed max_seq_len {a.max_seq_len}")
        host_hidden = isinstance(hidden, torch.Tensor)
        if host_hidden and hidden.reshape(-1, hsz).shape[0] != p:
            raise ValueError(f"hidden has {hidden.reshape(-1, hsz).shape[0]} rows, next_tokens {p}")
        rm, mc = ttnn.ROW_MAJOR_LAYOUT, activation_memory_config(ttnn)
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        outs = []
        for start in range(0, p, a.prefill_chunk):
            rows = min(a.prefill_chunk, p - start)
            toks = ttnn.from_torch(ids[start:start + rows][None], dtype=ttnn.uint32, layout=rm, device=self.mesh,
                                   memory_config=mc)
            if host_hidden:
                hid = ttnn.from_torch(hidden.reshape(p, hsz)[start:start + rows].float().reshape(1, 1, rows, hsz),
                                      dtype=act, layout=ttnn.TILE_LAYOUT, device=self.mesh, memory_config=mc)
            else:
                hid = ttnn.slice(hidden, [0, 0, start, 0], [1, 1, start + rows, hsz])
            ctx = self.target.prefill_chunk_context(start, rows, page_table, page_table_host)
            h = self.body(toks, hid, ctx)
            if all_logits:
                outs.append(self.target.to_host(self.logits(h)).float().reshape(rows, -1))
            if start + rows == p:
                self.last_hidden = ttnn.slice(h, [0, 0, rows - 1, 0], [1, 1, rows, hsz])
        return torch.cat(outs, 0) if all_logits else None

    def prefill_draft(self, next_tokens: torch.Tensor, hidden) -> tuple[list[int], torch.Tensor]:
        """First draft after a prompt of P tokens: MTP prefill over the P rows, then the chain from the last row
        at positions P.. . Returns host (K draft ids, fp32 logits [K, V]); the device buffers hold them too."""
        self.prefill(next_tokens, hidden)
        p = torch.as_tensor(next_tokens).numel()
        ttnn = self.ttnn
        ttnn.copy_host_to_device_tensor(
            ttnn.from_torch(torch.tensor([p], dtype=torch.int32), dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                            mesh_mapper=self.replicate), self.chain_pos)
        self.chain(self.last_hidden, self._pos_f32(self.chain_pos))
        return self.read_drafts()

def load_mtp_head(target: TTQwen36Model, reader, cache_dir=None) -> MTPWeights:
    """Convert ``mtp.*`` of ``reader`` for ``target``'s mesh/precision (the weights a head is built on)."""
    from ..model.weights import WeightLoader, load_mtp_weights

    loader = WeightLoader(reader, target.args, target.ttnn, target.mesh, cache_dir, progress=False)
    return load_mtp_weights(loader)


def load_tt_mtp(target: TTQwen36Model, reader, k: int, cache_dir=None, pick=None) -> TTMTPHead:
    """Convert ``mtp.*`` of ``reader`` and allocate the one-user head of depth ``k``."""
    return TTMTPHead(target, load_mtp_head(target, reader, cache_dir), k, pick=pick).allocate()
