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

``TTMTPHead(slots=B, packed=True)`` is the same layer packed over the B user slots of the batched backend
(``TTSpecBackend`` with B slots): a B-slot MTP KV cache, the reseed over every user's verify rows in one forward (user b's
rows as virtual users on its own pages) and a chain of B rows per step; its class doc gives the layout.
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
from ..runtime.sampler_tables import DRAFT_UNIFORMS_PER_ROW, UniformTable, draft_uniform_seeds
from ..runtime.sampler_transform import argmax_pick, inverse_cdf_draw
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

    ``slots`` / ``packed``: one user (the default) drafts from device-resident inputs (its position from the verify
    state, its pages in the target's page table layout: :meth:`draft`, :meth:`reseed_select`, :meth:`chain`);
    ``packed`` (the default above one slot) is the same layer packed over the B user slots of the batched backend
    (``TTSpecBackend`` with B slots), its own B-slot MTP KV cache and host-written positions (:meth:`reseed_select_batch`,
    :meth:`chain_batch`, :meth:`join_slot`; the packed layout below). ``packed`` at one slot is the batched step
    at B = 1 (the same numbers as the one-user head, other programs).

    Packed layout, per step (all device ops, traceable; the host only writes the positions below between
    replays, as it writes the verify's row inputs):

        reseed (in the commit)  rows b*R + i (user-major, R = K+1): token = the acceptor's result[b, i]
                                (placeholders -> 0), hidden = verify row b*R + i, position n_b + i. A row past
                                the user's k_b, and every row of a slot not in the step, has position -1: no KV
                                write (``paged_update_cache`` skips it), no attention (the SDPA skips it), so
                                such slots' MTP pages are never touched. KV rows are written in R calls, call i
                                writing row i of every user (B rows, one per update core, each into its own pages).
                                Row a_b of user b -> row b of the persistent :attr:`h_sel` (a slot not in the step
                                keeps its row: the gather reads it back from the old buffer).
        chain (before verify)   step i: row b = user b's draft i at position pos_b + i, written and attended
                                only when user b needs draft i+1 (i + 1 < k_b); the others get -1. The drafts
                                become the next verify's inputs on device: tokens [pending_b, d_1..d_K] per user
                                (rows past k_b zeroed) and the acceptor's drafts (id V past k_b: never accepted).

    A joining user's MTP prefill (:meth:`join_slot`) zeroes and fills only that slot's pages and installs its
    last row into row b of :attr:`h_sel`. Argmax drafts, or (:meth:`enable_sampling`) drafts sampled on device
    from the acceptor's own transform of the MTP logits, each user with its own uniform columns. Name suffixes:
    B users, R rows per user, N = B*R, K drafts, H hidden."""

    def __init__(self, target: TTQwen36Model, weights: MTPWeights, k: int,
                 pick: Callable[[Any], Any] | None = None, slots: int = 1, packed: bool | None = None):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"draft depth k must be an int >= 1, got {k!r}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        packed = slots > 1 if packed is None else bool(packed)
        if not packed and slots != 1:
            raise ValueError(f"{slots} slots need the packed layout (packed=True); the one-user head holds one")
        self.slots, self.packed = slots, packed
        self.sampler_acceptor = None  # packed: the DeviceAcceptor whose transform sampled drafts follow
        self.uniforms = self.draft_probs = None  # packed: enable_sampling's uniform table and draft distributions
        self.rows_used = 0  # packed: host mirror of the draft uniform table's row counter
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
        if self.packed:
            return self._allocate_packed()
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
        if self.packed:
            raise NotImplementedError("the packed MTP head drafts at one depth K (users draft k_b <= K through masks)")
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

    def _require(self, packed: bool | None = None):
        if not self.allocated:
            raise RuntimeError("TTMTPHead.allocate() must be called (before any trace capture) first")
        if packed is not None and packed != self.packed:
            raise RuntimeError("this call is for the " + ("packed B-slot" if packed else "one-user") + " MTP head; "
                               "this head is " + ("packed" if self.packed else "one-user"))

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
        self._require(packed=False)
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

    # ---- packed over B user slots (the batched backend; class doc) ---------------------------------------------
    def _allocate_packed(self) -> "TTMTPHead":
        ttnn, a, b, r, k = self.ttnn, self.args, self.slots, self.rows, self.k
        rm, tile, i32 = ttnn.ROW_MAJOR_LAYOUT, ttnn.TILE_LAYOUT, torch.int32
        hsz, bps = a.cfg.hidden_size, a.blocks_per_seq
        self.kv = new_layer_state(a, ttnn, self.mesh, FULL, slots=b)
        table = torch.arange(b * bps, dtype=i32).reshape(b, bps)
        self.page_table_host = table
        self.page_table = self._dev(table, ttnn.int32, rm)
        self.rows_page_table = self._dev(table.repeat_interleave(r, dim=0), ttnn.int32, rm)  # row b*R + i -> slot b
        self.slot_page_table = self._dev(torch.zeros(1, bps, dtype=i32), ttnn.int32, rm)  # a joining slot's row
        self.kv_zeros = self._dev(torch.zeros(1, a.hkv_d, bps * a.block_size, a.cfg.head_dim),
                                  a.dtype(TensorGroup.KV_CACHE, ttnn), tile)
        steps = max(k - 1, 1)
        # host-written inputs (between replays)
        self.reseed_pos = self._dev(torch.full((b * r,), -1, dtype=i32), ttnn.int32, rm)  # user-major
        self.reseed_row_pos = self._dev(torch.full((r * b,), -1, dtype=i32), ttnn.int32, rm)  # row-major: [i*B + b]
        self.reseed_rope = self._dev(torch.zeros(1, b * r, dtype=i32), ttnn.uint32, rm)
        self.chain_pos = self._dev(torch.full((steps * b,), -1, dtype=i32), ttnn.int32, rm)  # [i*B + b]
        self.chain_rope = self._dev(torch.zeros(1, steps * b, dtype=i32), ttnn.uint32, rm)
        self.pending = self._dev(torch.zeros(1, 1, b, 1), ttnn.float32, tile)
        self.draft_mask = self._dev(torch.zeros(1, 1, b, k), ttnn.float32, tile)
        self.install_idx = self._dev(torch.zeros(1, b, dtype=i32), ttnn.uint32, rm)
        # row select: user b in the step -> reseed row b*R + a_b; otherwise its old h_sel row (table row N + b)
        slots_f = torch.arange(b, dtype=torch.float32).reshape(1, b, 1, 1)
        self.c_sel_keep = self._dev(b * r + slots_f, ttnn.float32, tile)
        self.c_sel_row0 = self._dev(slots_f * r - b * r - slots_f, ttnn.float32, tile)
        # persistent state and outputs
        self.h_sel = self._dev(torch.zeros(1, 1, b, hsz), a.dtype(TensorGroup.RESIDUAL, ttnn), tile)
        self.draft_tokens = self._dev(torch.zeros(1, 1, b, k, dtype=i32), ttnn.uint32, rm)
        self.draft_logits = self._dev(torch.zeros(1, 1, k * b, a.cfg.vocab_size), ttnn.float32, tile)  # [i*B + b]
        self.allocated = True
        return self

    def enable_sampling(self, acceptor, rng_rows: int = 1024) -> None:
        """Sampled drafts (before any capture): draft i of user b drawn by inverse CDF from
        ``acceptor.probs_from_logits`` of its MTP logits (the target's temperature / top-k / top-p / min-p transform,
        so rejection sampling is exact) with uniform column b*32 + i of one table row per chain (a stream of its own,
        seeded from the acceptor's seed like the single-user draft pick's); the K draft distributions of every
        user go to the persistent :attr:`draft_probs` [1, B, K, V] (zero past k_b), what
        ``DeviceAcceptor.stochastic`` takes."""
        self._require(packed=True)
        if self.k > DRAFT_UNIFORMS_PER_ROW:
            raise ValueError(f"sampled drafts take at most {DRAFT_UNIFORMS_PER_ROW} drafts per chain, K = {self.k}")
        ttnn, b = self.ttnn, self.slots
        device_seed, host_seed = draft_uniform_seeds(acceptor.seed)
        self.uniforms = UniformTable(ttnn, self.mesh, rng_rows, b * DRAFT_UNIFORMS_PER_ROW, source=acceptor.rng,
                                     device_seed=device_seed, host_seed=host_seed).allocate()
        self.draft_probs = self._dev(torch.zeros(1, b, self.k, self.args.cfg.vocab_size), ttnn.float32,
                                     ttnn.TILE_LAYOUT)
        self.sampler_acceptor, self.rows_used = acceptor, 0

    def before_chain(self) -> None:
        """Host side, outside any capture, before every chain execution: refill the draft uniforms when used up."""
        if self.uniforms is None:
            return
        if self.rows_used >= self.uniforms.rows:
            self.uniforms.refill()
            self.rows_used = 0
        self.rows_used += 1

    def chain_step_back(self) -> None:
        """Give the last chain's uniform row back (an aborted step)."""
        if self.uniforms is not None and self.rows_used > 0:
            self.uniforms.step_back()
            self.rows_used -= 1

    # ---- host inputs (between replays) -------------------------------------------------------------------------
    def _write(self, host: torch.Tensor, buf) -> None:
        ttnn = self.ttnn
        h = ttnn.from_torch(host.to(torch.float32 if buf.dtype == ttnn.float32 else torch.int32), dtype=buf.dtype,
                            layout=buf.layout, mesh_mapper=self.replicate)
        ttnn.copy_host_to_device_tensor(h, buf)

    def _check_room(self, slot: int, pos: int, kb: int) -> None:
        last = self.args.max_seq_len - 1
        if pos + kb > last:  # the verify's own bound: the reseed writes pos..pos+k_b, the chain stays below it
            raise ValueError(f"slot {slot}: MTP rows up to position {pos + kb} pass max_seq_len {last + 1}")

    def write_reseed_inputs(self, depths: dict[int, int], pos: dict[int, int]) -> None:
        """Positions of the reseed rows of the step about to be verified: user b in ``depths`` (k_b drafts,
        verify row 0 at ``pos[b]``) writes rows 0..k_b at pos_b..pos_b+k_b; every other row -1."""
        b, r = self.slots, self.rows
        p = torch.full((b, r), -1, dtype=torch.int32)
        for s, kb in depths.items():
            self._check_room(s, pos[s], kb)
            p[s, : kb + 1] = torch.arange(pos[s], pos[s] + kb + 1, dtype=torch.int32)
        self._write(p.reshape(-1), self.reseed_pos)
        self._write(p.t().reshape(-1), self.reseed_row_pos)
        self._write(p.clamp(min=0).reshape(1, -1), self.reseed_rope)

    def write_chain_inputs(self, depths: dict[int, int], pos: dict[int, int], pending: dict[int, int]) -> None:
        """The chain's inputs for the users of the next verify: user b's draft 1 predicts the token after
        ``pending[b]`` (at position ``pos[b]``); chain step i writes row pos_b + i while i + 1 < k_b."""
        b, k = self.slots, self.k
        steps = max(k - 1, 1)
        cp = torch.full((steps, b), -1, dtype=torch.int32)
        pend = torch.zeros(1, 1, b, 1)
        mask = torch.zeros(1, 1, b, k)
        for s, kb in depths.items():
            self._check_room(s, pos[s], kb)
            for i in range(kb - 1):
                cp[i, s] = pos[s] + i
            pend[0, 0, s, 0] = float(pending[s])
            mask[0, 0, s, :kb] = 1.0
        self._write(cp.reshape(-1), self.chain_pos)
        self._write(cp.clamp(min=0).reshape(1, -1), self.chain_rope)
        self._write(pend, self.pending)
        self._write(mask, self.draft_mask)

    def read_batch_drafts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft ids [B, K] int64, fp32 draft logits [B, K, V]) of the last chain, every slot (device 0)."""
        b, k = self.slots, self.k
        toks = self.target.to_host(self.draft_tokens).reshape(b, k).to(torch.int64)
        logits = self.target.to_host(self.draft_logits).float().reshape(k, b, -1).transpose(0, 1).contiguous()
        return toks, logits

    # ---- device (traceable) ------------------------------------------------------------------------------------
    def reseed_select_batch(self, result_dev, hidden_dev, count_dev, active_dev) -> None:
        """Reseed over every user's verify rows and row a_b of each user into :attr:`h_sel` (class doc).
        result [1, B, 1, >=R] int32 (the acceptor's), hidden [1, 1, N, H], count / active [1, B, 1, 1] fp32
        (count already 0 for slots outside the step)."""
        self._require(packed=True)
        ttnn, b, r, hsz = self.ttnn, self.slots, self.rows, self.args.cfg.hidden_size
        rm, n = ttnn.ROW_MAJOR_LAYOUT, self.slots * self.rows
        if [int(x) for x in hidden_dev.shape] != [1, 1, n, hsz]:
            raise ValueError(f"hidden: device shape {list(hidden_dev.shape)} != [1, 1, B*(K+1)={n}, H={hsz}]")
        t = result_dev if result_dev.layout == ttnn.TILE_LAYOUT else ttnn.to_layout(result_dev, ttnn.TILE_LAYOUT)
        t = ttnn.relu(ttnn.typecast(ttnn.slice(t, [0, 0, 0, 0], [1, b, 1, r]), ttnn.float32))  # placeholder -1 -> 0
        tokens_1N = ttnn.reshape(ttnn.to_layout(ttnn.typecast(t, ttnn.uint32), rm), [1, n])
        row_pos = [ttnn.slice(self.reseed_row_pos, [i * b], [(i + 1) * b]) for i in range(r)]
        cos, sin = self.target.rope_rows(self.reseed_rope)
        ctx = MTPAttentionContext("decode", cos, sin, self.page_table, pos=self.reseed_pos,
                                  rows_page_table=self.rows_page_table, row_pos=row_pos, users=b)
        h_11NH = self.body(tokens_1N, hidden_dev, ctx)
        idx = ttnn.add(self.c_sel_keep, ttnn.multiply(active_dev, ttnn.add(self.c_sel_row0, count_dev)))
        idx_1B = ttnn.reshape(ttnn.to_layout(ttnn.typecast(idx, ttnn.uint32), rm), [1, b])
        h_sel = self.h_sel
        if h_11NH.dtype != h_sel.dtype:
            raise RuntimeError(f"MTP hidden rows are {h_11NH.dtype}, the persistent row buffer {h_sel.dtype}")
        table = ttnn.concat([ttnn.reshape(h_11NH, [n, hsz]), ttnn.reshape(h_sel, [b, hsz])], dim=0)
        table = ttnn.to_layout(table, rm)
        rows = ttnn.embedding(idx_1B, table, layout=ttnn.TILE_LAYOUT, dtype=h_sel.dtype)
        ttnn.copy(ttnn.reshape(rows, [1, 1, b, hsz]), h_sel)

    def chain_batch(self, verify_tokens, acceptor_drafts) -> None:
        """K argmax drafts per user from :attr:`h_sel` (B rows per step), into :attr:`draft_tokens` /
        :attr:`draft_logits`, the verify's token rows ``verify_tokens`` [1, B*(K+1)] uint32 and the acceptor's
        ``acceptor_drafts`` [1, B, 1, K] uint32 (class doc)."""
        self._require(packed=True)
        ttnn, b, k, rm = self.ttnn, self.slots, self.k, self.ttnn.ROW_MAJOR_LAYOUT
        h, lg = self.h_sel, self.logits(self.h_sel)
        toks, lgs, probs = [], [], []
        acc = self.sampler_acceptor
        u_11B32 = None
        if acc is not None:  # one uniform row per chain: user b's draft i reads column b*32 + i
            u_11B32, _ = self.uniforms.next_row([1, 1, b, DRAFT_UNIFORMS_PER_ROW])
        for i in range(k):
            if acc is None:
                t = ttnn.argmax(lg, dim=3, keepdim=True)  # [1, 1, B, 1] (lowest index on ties)
            else:
                p_11BV = acc.probs_from_logits(lg)
                t = ttnn.typecast(inverse_cdf_draw(ttnn, p_11BV, ttnn.slice(u_11B32, [0, 0, 0, i], [1, 1, b, i + 1])),
                                  ttnn.uint32)
                probs.append(ttnn.reshape(p_11BV, [1, b, 1, self.args.cfg.vocab_size]))
            t = t if t.layout == rm else ttnn.to_layout(t, rm)
            toks.append(t)
            lgs.append(lg)
            if i + 1 < k:
                cur = ttnn.slice(self.chain_pos, [i * b], [(i + 1) * b])
                ridx = ttnn.slice(self.chain_rope, [0, i * b], [1, (i + 1) * b])
                cos, sin = self.target.rope_rows(ridx)
                ctx = MTPAttentionContext("decode", cos, sin, self.page_table, pos=cur, one_row_per_user=True)
                h = self.body(ttnn.reshape(t, [1, b]), h, ctx)
                lg = self.logits(h)
        ttnn.copy(toks[0] if k == 1 else ttnn.concat(toks, dim=3), self.draft_tokens)
        ttnn.copy(lgs[0] if k == 1 else ttnn.concat(lgs, dim=2), self.draft_logits)
        d_f = ttnn.typecast(ttnn.to_layout(self.draft_tokens, ttnn.TILE_LAYOUT), ttnn.float32)  # ids exact below 2**24
        mask = self.draft_mask
        acc = ttnn.add(ttnn.multiply(ttnn.subtract(d_f, float(self.args.cfg.vocab_size)), mask),
                       float(self.args.cfg.vocab_size))  # id V past k_b
        acc = ttnn.reshape(ttnn.to_layout(ttnn.typecast(acc, ttnn.uint32), rm), [1, b, 1, k])
        ttnn.copy(acc, acceptor_drafts)
        rows = ttnn.concat([self.pending, ttnn.multiply(d_f, mask)], dim=3)  # [1, 1, B, K+1]
        rows = ttnn.reshape(ttnn.to_layout(ttnn.typecast(rows, ttnn.uint32), rm), [1, b * (k + 1)])
        ttnn.copy(rows, verify_tokens)
        if probs:  # zero past k_b: a user accepting all its k_b drafts then draws the bonus from p_target alone
            p_1BKV = probs[0] if k == 1 else ttnn.concat(probs, dim=2)
            ttnn.copy(ttnn.multiply(p_1BKV, ttnn.reshape(mask, [1, b, k, 1])), self.draft_probs)

    # ---- a joining user (eager, between replays) -------------------------------------------------------------
    def join_slot(self, slot: int, next_tokens: torch.Tensor, hidden) -> None:
        """MTP prefill of the user joining ``slot`` (rows t = 0..P-1 from x_{t+1} and h_t, as :meth:`prefill`)
        into that slot's pages only (zeroed first: a reseed row reads the last page up to its position, and what
        a previous user left there must not be non-finite), then its last row into row ``slot`` of :attr:`h_sel`.
        Allocates transient buffers: call inside ttnn's corruptible_allocation_scope when traces are live."""
        self._require(packed=True)
        ttnn, b, hsz = self.ttnn, self.slots, self.args.cfg.hidden_size
        if not 0 <= slot < b:
            raise ValueError(f"slot {slot} out of range (the MTP head has {b} slots)")
        row = self.page_table_host[slot: slot + 1].contiguous()
        self._write(row, self.slot_page_table)
        for cache in (self.kv.k, self.kv.v):
            ttnn.experimental.paged_fill_cache(cache, self.kv_zeros, self.slot_page_table, batch_idx=0)
        self.prefill(next_tokens, hidden, page_table=self.slot_page_table, page_table_host=row)
        last = self.last_hidden
        if last.dtype != self.h_sel.dtype:
            last = ttnn.typecast(last, self.h_sel.dtype)
        idx = torch.arange(b, dtype=torch.int32)
        idx[slot] = b
        self._write(idx.reshape(1, b), self.install_idx)
        table = ttnn.to_layout(ttnn.concat([ttnn.reshape(self.h_sel, [b, hsz]), ttnn.reshape(last, [1, hsz])], dim=0),
                               ttnn.ROW_MAJOR_LAYOUT)
        rows = ttnn.embedding(self.install_idx, table, layout=ttnn.TILE_LAYOUT, dtype=self.h_sel.dtype)
        ttnn.copy(ttnn.reshape(rows, [1, 1, b, hsz]), self.h_sel)


def load_tt_mtp(target: TTQwen36Model, reader, k: int, cache_dir=None, pick=None, slots: int = 1,
                packed: bool | None = None) -> TTMTPHead:
    """Convert ``mtp.*`` of ``reader`` for ``target``'s mesh/precision and allocate the head (``slots``/``packed``:
    :class:`TTMTPHead`)."""
    from ..model.weights import WeightLoader, load_mtp_weights

    loader = WeightLoader(reader, target.args, target.ttnn, target.mesh, cache_dir, progress=False)
    return TTMTPHead(target, load_mtp_weights(loader), k, pick=pick, slots=slots, packed=packed).allocate()
