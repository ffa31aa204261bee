"""Gated full attention on a TP mesh: Hq/N query heads and Hkv/N KV heads per device, paged KV cache.

    qkv   = x @ [q_d | k_d | v_d], gate = x @ gate_d           two column-parallel matmuls
    heads = decode: ONE experimental.nlp_create_qkv_heads_decode (q/k/v height-sharded, one row per core);
            prefill: three tile-aligned slices
    q, k  = zero-centred RMSNorm over head_dim (weights stored as 1 + w), then RoPE as ONE
            experimental.rotary_embedding_hf each: the q/k head dims are stored in an order
            (weights.rope_head_permutation) in which partial NeoX RoPE is a full-width rotate_half, with
            cos = 1 / sin = 0 on the pass-through dims. Decode: height-sharded, one row per core (the op's
            decode mode; the sharded K goes into the cache update as is). Prefill: heads-first [1, heads, T, D].
    KV    = prefill: paged_fill_cache (whole pages of the chunk); decode: ONE paged_fused_update_cache (K and V)
            at ``pos``; the K+1-row verify: ONE indexed_fused_update_cache (all rows of K and V)
    o     = prefill: chunked SDPA over the paged cache (causal from chunk_start);
            decode: paged SDPA decode with cur_pos = pos
    out   = all_reduce((o * sigmoid(gate)) @ o_proj_d)   sigmoid fused as the multiply's input activation

Shapes per device: x [1, 1, T, H] -> [1, 1, T, H]. cos/sin come from the model (one table gather per step,
shared by all attention layers): decode [1, T, 1, D] height-sharded, prefill [1, 1, T, D].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .ccl import all_reduce, ccl_for
from .model_config import (TensorGroup, TTModelArgs, activation_memory_config, compute_config_matmul,
                           compute_config_norm, kv_update_input_memory_config, rope_decode_memory_config,
                           sdpa_decode_program_config, sdpa_prefill_program_config)
from .state import KVLayerState
from .weights import AttentionWeights


@dataclass
class AttentionContext:
    """Per-forward inputs shared by every attention layer (all device tensors)."""

    mode: str  # "prefill" | "decode"
    cos: Any  # decode: [1, T, 1, D] height-sharded (model.rope_rows); prefill: [1, 1, T, D]
    sin: Any
    page_table: Any  # [B, blocks_per_seq] int32
    pos: Any = None  # decode: [B] int32 cache position of the row
    chunk_start: int = 0  # prefill: absolute position of row 0 (a multiple of block_size)
    chunk_page_table: Any = None  # prefill: [B, pages of this chunk] int32
    verify_plan: Any = None  # K+1-row verify (models/qwen36/tt/speculative/verify.py VerifyPlan): per-row KV rows and bounds
    gdn_plan: Any = None  # K+1-row verify: the GDN layers' routes and what they keep (gdn_plan.GDNStepPlan)


class TTGatedAttention:
    def __init__(self, args: TTModelArgs, weights: AttentionWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        ccl_for(ttnn, mesh)  # the collectives' persistent semaphores exist before any trace capture
        c = args.cfg
        self.hq, self.hkv, self.d = args.hq_d, args.hkv_d, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self._identity: dict = {}  # (rows, pages) -> identity page table of a block-float cache's verify write

    def rope(self, x, ctx: AttentionContext):
        """RoPE on x [1, T, heads, D] (head dims in the permuted order, see the module doc).

        decode: -> [1, T, heads, D] height-sharded, T rows as the op's batch (each row its own position);
        prefill: -> [1, heads, T, D] (the heads-first layout the cache fill and chunked SDPA take)."""
        ttnn = self.ttnn
        cfg = compute_config_norm(ttnn)
        if ctx.mode == "decode":
            mc = rope_decode_memory_config(ttnn, x.shape[1], x.shape[2], self.d)
            x = x if x.memory_config() == mc else ttnn.to_memory_config(x, mc)  # the q/k norms write it already
            return ttnn.experimental.rotary_embedding_hf(x, ctx.cos, ctx.sin, is_decode_mode=True,
                                                         compute_kernel_config=cfg)
        x = ttnn.permute(x, (0, 2, 1, 3))
        return ttnn.experimental.rotary_embedding_hf(x, ctx.cos, ctx.sin, is_decode_mode=False,
                                                     compute_kernel_config=cfg)

    def project(self, x, mode: str = "prefill"):
        """x [1, 1, T, H] -> q [1, T, Hq_d, D], gate [1, 1, T, Hq_d D], k, v [1, T, Hkv_d, D]; q and k normed.

        [q | k | v] is one matmul and the gate its own (no slice of a fused output). Decode (T <= 32 rows as the
        op's users): ONE experimental.nlp_create_qkv_heads_decode splits the heads, height-sharded one row per core
        on core row 1 (v stays there: the fused cache update wants it on cores apart from the rotated K, which
        :meth:`rope` puts on row 0); q and k go back to interleaved for their RMSNorm (ttnn's layernorm rejects
        height-sharded inputs), and each norm writes its output straight into the decode RoPE's height-sharded
        layout. Prefill: three tile-aligned slices and reshapes."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        qd, kvd = self.hq * self.d, self.hkv * self.d
        mm = dict(dtype=a.dtype(TensorGroup.ACTIVATION, ttnn), memory_config=activation_memory_config(ttnn),
                  compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.ATTN_QKV)))
        qkv = ttnn.linear(x, self.w.qkv, **mm)
        gate = ttnn.linear(x, self.w.gate, **mm)
        if mode == "decode":
            q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
                qkv, num_heads=self.hq, num_kv_heads=self.hkv,
                memory_config=kv_update_input_memory_config(ttnn, rows, self.d, core_row=1))
            q, k = (ttnn.to_memory_config(t, activation_memory_config(ttnn)) for t in (q, k))
        else:
            q = ttnn.reshape(ttnn.slice(qkv, [0, 0, 0, 0], [1, 1, rows, qd]), [1, rows, self.hq, self.d])
            k = ttnn.reshape(ttnn.slice(qkv, [0, 0, 0, qd], [1, 1, rows, qd + kvd]), [1, rows, self.hkv, self.d])
            v = ttnn.reshape(ttnn.slice(qkv, [0, 0, 0, qd + kvd], [1, 1, rows, qd + 2 * kvd]),
                             [1, rows, self.hkv, self.d])
        ncfg = compute_config_norm(ttnn)
        # decode: each norm writes the height-sharded layout the decode RoPE takes (no reshard program between them)
        qmc, kmc = ((rope_decode_memory_config(ttnn, rows, heads, self.d) if mode == "decode" else None)
                    for heads in (self.hq, self.hkv))
        q = ttnn.rms_norm(q, epsilon=self.eps, weight=self.w.q_norm, compute_kernel_config=ncfg, memory_config=qmc)
        k = ttnn.rms_norm(k, epsilon=self.eps, weight=self.w.k_norm, compute_kernel_config=ncfg, memory_config=kmc)
        return q, gate, k, v

    def attend_decode(self, q, k, v, kv: KVLayerState, ctx: AttentionContext):
        """One row per user: q/k/v [1, B, heads, D] (q, k height-sharded by :meth:`rope`) -> o [1, 1, B, Hq_d D].
        User b writes and reads its own pages (page-table row b) at ``ctx.pos[b]``; -1 skips the user (an
        inactive slot of a batched decode: no cache write, its output row is ignored). With a verify plan the
        rows are the K+1 candidates of one user instead."""
        ttnn = self.ttnn
        users = q.shape[1]
        if users != 1 and ctx.verify_plan is not None:
            return self.attend_verify(q, k, v, kv, ctx)
        if ctx.pos.shape[0] != users or ctx.page_table.shape[0] != users:
            raise ValueError(f"decode attention over {users} user rows needs pos [{users}] and a page table of "
                             f"{users} rows (got pos {list(ctx.pos.shape)}, page table {list(ctx.page_table.shape)})")
        # K and V rows in one program: k comes out of the decode RoPE height-sharded on core row 0, v out of the head
        # split on core row 1 (the fused update needs them on disjoint cores)
        ttnn.experimental.paged_fused_update_cache(kv.k, k, kv.v, v, update_idxs_tensor=ctx.pos,
                                                   page_table=ctx.page_table)
        o = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, kv.k, kv.v, ctx.page_table, cur_pos_tensor=ctx.pos, scale=self.scale,
            program_config=sdpa_decode_program_config(ttnn), compute_kernel_config=compute_config_norm(ttnn),
            memory_config=activation_memory_config(ttnn))
        return ttnn.reshape(o, [1, 1, users, self.hq * self.d])

    def attend_verify(self, q, k, v, kv: KVLayerState, ctx: AttentionContext):
        """T = K+1 rows of one user at positions n..n+K; every local KV head's cache is scanned once.

        KV rows: ONE experimental.indexed_fused_update_cache writes the T rows of K and V at their physical cache rows
        (``ctx.verify_plan.phys_rows`` [1, T], page * block_size + row; the op takes interleaved bf16 [1, G, T, D]
        inputs, so k and v leave their height-sharded layouts and go heads-first). Attention: ONE paged SDPA decode
        in multi-position mode (``spec_multi_pos_tiles=T``) whose G = Hkv_d groups are the local KV heads:

        * the kernel takes one KV head per cache, so the caches are viewed per head: ``[P, G, bs, D]`` ->
          ``[P*G, 1, bs, D]`` (the same tile order in DRAM: block p of head h is view block ``p*G + h``; a
          metadata view on cards), and group h reads it through the page table ``pt*G + h``
          (``ctx.verify_plan.head_page_table`` [G, blocks]); each group scans exactly its head's KV blocks once;
        * group h holds that head's g = Hq_d/G query heads (GQA: q heads h*g..h*g+g-1 share KV head h), candidate
          j in row-tile j of q [1, G, T*32, D]; bounds ``ctx.verify_plan.bounds`` [G*T] = n..n+K per group.
        Name suffixes: T rows, G local KV heads, g query heads per KV head (padded to 32), R = T*32, D head dim.
        At G = 1 the view and the table are the plain ones.

        Batched verify (``plan.users`` = B > 1, tt/speculative host rows): the rows are B users x T candidates (user b's at
        b*T..), the groups are the B*G (user, KV head) pairs (group b*G + h: that user's page table ``pt_b*G + h``
        and its own bounds), phys_rows [1, B*T] (a negative row is not written: inert rows) and bounds [B*G*T]."""
        ttnn, plan = self.ttnn, ctx.verify_plan
        users = getattr(plan, "users", 1)
        rows, g, heads = q.shape[1], self.hq // self.hkv, self.hkv
        t = rows // users
        if kv.k.dtype == ttnn.bfloat16:
            k_1GTD, v_1GTD = (ttnn.permute(ttnn.to_memory_config(x, activation_memory_config(ttnn)), (0, 2, 1, 3))
                              for x in (k, v))
            ttnn.experimental.indexed_fused_update_cache(kv.k, k_1GTD, kv.v, v_1GTD, plan.phys_rows)
        else:  # a block-float cache: indexed_fused_update_cache is bf16-only (0.81.1 docstring), so the rows go through
            # the decode's fused update, the T rows as its users, each at its physical row under an identity page table
            ttnn.experimental.paged_fused_update_cache(kv.k, k, kv.v, v, update_idxs_tensor=ttnn.reshape(plan.phys_rows, [rows]),
                                                       page_table=self.identity_pages(rows, kv.k.shape[0]))
        if users == 1:
            q_GTgD = ttnn.permute(ttnn.reshape(q, [rows, heads, g, self.d]), (1, 0, 2, 3))
        else:  # [B, T, G, g D] -> [B, G, T, g D] -> [B*G, T, g, D]: group b*G + h
            q_BGTx = ttnn.permute(ttnn.reshape(q, [users, t, heads, g * self.d]), (0, 2, 1, 3))
            q_GTgD = ttnn.reshape(q_BGTx, [users * heads, t, g, self.d])
        q_GT32D = q_GTgD if g >= 32 else ttnn.pad(q_GTgD, [(0, 0), (0, 0), (0, 32 - g), (0, 0)], 0.0)
        q_1GRD = ttnn.reshape(q_GT32D, [1, users * heads, t * 32, self.d])
        o_1GRD = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q_1GRD, self.head_view(kv.k), self.head_view(kv.v), plan.head_page_table, cur_pos_tensor=plan.bounds,
            scale=self.scale, spec_multi_pos_tiles=t, program_config=sdpa_decode_program_config(ttnn),
            compute_kernel_config=compute_config_norm(ttnn), memory_config=activation_memory_config(ttnn))
        o_GTgD = ttnn.slice(ttnn.reshape(o_1GRD, [users * heads, t, 32, self.d]), [0, 0, 0, 0],
                            [users * heads, t, g, self.d])
        if users == 1:
            o_TGgD = ttnn.permute(o_GTgD, (1, 0, 2, 3))
        else:  # back to [B, T, G, g D]: row b*T + j
            o_TGgD = ttnn.permute(ttnn.reshape(o_GTgD, [users, heads, t, g * self.d]), (0, 2, 1, 3))
        return ttnn.reshape(o_TGgD, [1, 1, rows, self.hq * self.d])

    def identity_pages(self, rows: int, pages: int):
        """[rows, pages] int32: every row the identity page table (logical page p is physical page p), so a cache
        update at a physical row writes that row. Made on the eager verify that precedes any capture."""
        key = (rows, pages)
        if key not in self._identity:
            ttnn = self.ttnn
            self._identity[key] = ttnn.from_torch(
                torch.arange(pages, dtype=torch.int32).expand(rows, pages).contiguous(), dtype=ttnn.int32,
                layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh, memory_config=activation_memory_config(ttnn),
                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        return self._identity[key]

    def head_view(self, cache):
        """Paged cache [P, G, bs, D] viewed as [P*G, 1, bs, D] (one KV head per block; the same buffer)."""
        p, heads, bs, d = cache.shape
        return cache if heads == 1 else self.ttnn.reshape(cache, [p * heads, 1, bs, d])

    def attend_prefill(self, qh, kh, v, kv: KVLayerState, ctx: AttentionContext):
        """T rows at chunk_start..: fill the chunk's pages, then causal chunked SDPA over the paged cache.
        qh [1, Hq_d, T, D] and kh [1, Hkv_d, T, D] heads-first (from :meth:`rope`), v [1, T, Hkv_d, D]."""
        ttnn, a = self.ttnn, self.args
        rows = qh.shape[2]
        kv_dt = a.dtype(TensorGroup.KV_CACHE, ttnn)
        for cache, heads_first in ((kv.k, kh), (kv.v, ttnn.permute(v, (0, 2, 1, 3)))):  # [1, Hkv_d, T, D]
            if heads_first.dtype != kv_dt:  # paged_fill_cache copies tiles: input dtype must equal the cache's
                heads_first = ttnn.typecast(heads_first, kv_dt)
            ttnn.experimental.paged_fill_cache(cache, heads_first, ctx.chunk_page_table, batch_idx=0)
        o = ttnn.transformer.chunked_scaled_dot_product_attention(
            qh, kv.k, kv.v, ctx.page_table, ctx.chunk_start, scale=self.scale,
            program_config=sdpa_prefill_program_config(ttnn, self.mesh, ctx.chunk_start, rows),
            compute_kernel_config=compute_config_norm(ttnn), memory_config=activation_memory_config(ttnn))
        o = ttnn.permute(o, (0, 2, 1, 3))  # [1, T, Hq_d, D]
        return ttnn.reshape(o, [1, 1, rows, self.hq * self.d])

    def forward(self, x, kv: KVLayerState, ctx: AttentionContext):
        ttnn, a = self.ttnn, self.args
        if ctx.mode not in ("prefill", "decode"):
            raise ValueError(f"attention mode must be 'prefill' or 'decode', got {ctx.mode!r}")
        q, gate, k, v = self.project(x, ctx.mode)
        q, k = self.rope(q, ctx), self.rope(k, ctx)
        attend = self.attend_decode if ctx.mode == "decode" else self.attend_prefill
        o = attend(q, k, v, kv, ctx)
        o = ttnn.multiply(o, gate, input_tensor_b_activations=[ttnn.UnaryOpType.SIGMOID])  # sigmoid fused: no program
        out = ttnn.linear(o, self.w.o_proj, dtype=a.dtype(TensorGroup.ACTIVATION, ttnn),
                          memory_config=activation_memory_config(ttnn),
                          compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.ATTN_O)))
        return all_reduce(ttnn, out, a.num_devices)
