"""Decode attention, rotary embedding and the decode head split: emulations and vectorised goldens (KV-cache
updates: ``ops_kv_cache``).

Semantics follow the op docstrings of ttnn 0.81.1 and, for ``spec_multi_pos_tiles``, the shipped
flash-decode kernel sources (``ttnn/cpp/.../sdpa_decode/device/kernels``, read for facts):

* ``transformer.paged_scaled_dot_product_attention_decode``: q ``[1, B, nh, dh]``, paged K/V
  ``[P, nkv, bs, dh]``, causal bound ``cur_pos[b]`` (inclusive), ``cur_pos < 0`` skips the user (zeros).
  With ``spec_multi_pos_tiles=T``: q is ``[1, G, T*32, dh]`` (candidate j of group g owns row-tile j,
  rows ``32j..32j+31``), ``cur_pos_tensor`` holds ``G*T`` bounds (group g owns ``[g*T, (g+1)*T)``,
  ascending), candidate j attends to KV positions ``<= cur_pos[g*T + j]``; one KV head (nkv == 1).
  Output has q's shape.
* ``experimental.rotary_embedding_llama(x, cos, sin, trans_mat)``: ``x * cos + (x @ T) * sin`` where the
  32x32 ``trans_mat`` acts on each 32-wide block of the head dim (cards apply it tile by tile).
  Prefill: x ``[1, nh, S, dh]``, cos/sin ``[1, 1 or nh, S, dh]``. Decode (``is_decode_mode=True``): x
  ``[1, B, nh, dh]``, cos/sin ``[1, B, 32 or nh or 1, dh]`` (one row per user, broadcast over heads); the
  decode ``trans_mat`` may be one tile or one tile per user (``[1, 1, B*32, 32]``, Tenstorrent's decode
  tests and tt_transformers repeat the tile per user).
* ``experimental.rotary_embedding_hf(x, cos, sin, is_decode_mode=...)``: ``x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` over the whole head (HF / NeoX form). Validation as the
  device op's ``validate_on_program_cache_miss`` (tt-metal ``rotary_embedding_hf_device_operation.cpp``, read
  for facts): TILE tensors, padded head dim 32 or a multiple of 64, cos and sin of one dtype and shape with
  ``cos[0] == 1`` and ``cos[-1] == D``. Decode: x ``[1, B, nh, D]`` HEIGHT_SHARDED, cos/sin sharded
  ``[1, B, rows <= 32, D]``: the validation checks only ``cos[1] == B`` (its "seq_len must be 1" check reads the
  padded dim 0 in the versions that match 0.81.1's messages), and the sharded kernel
  (``kernels/compute/rotary_embedding_hf_sharded.cpp``, shipped in the wheel) holds one tile row of cos/sin per user
  and multiplies with ``BroadcastDim::Row``: row 0 of the user's tile, broadcast over the heads. So ``[1, B, 1, D]``
  and Tenstorrent's test's zero-padded ``[1, B, 32, D]`` are the same tiles; more than one tile row per user is
  refused by name. Prefill: x ``[1, nh, S, D]`` (any memory layout but width-sharded), cos/sin ``[1, 1, S' >= S,
  D]``, row s of every head takes cos row s. Output: x's dtype; a sharded ``memory_config`` without a shard spec
  takes the input's spec, or the input's tile rows split evenly (``shard_specs.ROTARY_HF``).

Attention math runs in fp64 (rule N8) and is rounded to q's dtype (cards accumulate flash-decode partials in
bf16/fp32 per program config; that reduction-order error is not modelled).
"""

from __future__ import annotations

import math

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .goldens import golden_impl
from .op_accounting import add_bytes, bind_op, shard_ints
from .registry import device_op
from .shard_specs import output_memory_config
from .tensor import EmuTensor, dtype_name, make_like, shard_bytes
from .ttnn_import import ttnn


# ------------------------------------------------------------------------------------------------
# accounting: what these ops really read per device (not the whole cache they are handed)
# ------------------------------------------------------------------------------------------------
def _sdpa_read(args, kwargs):
    """q, page table, positions, and only the KV blocks up to each user's (group's largest) bound."""
    b = bind_op("ttnn.transformer.paged_scaled_dot_product_attention_decode", args, kwargs)
    q, k, v, pt = b["input_tensor_q"], b["input_tensor_k"], b["input_tensor_v"], b["page_table_tensor"]
    d: dict = {}
    for t in (q, pt, b.get("cur_pos_tensor"), b.get("attn_mask"), b.get("attention_sink")):
        add_bytes(d, t)
    _, nkv, bs, dh = k.logical_shape_list
    per_block = shard_bytes([1, nkv, bs, dh], k.dtype, ttnn.TILE_LAYOUT)
    pos_t = b.get("cur_pos_tensor")
    users = q.logical_shape_list[1]
    nblk_max = pt.logical_shape_list[-1]
    if pos_t is None or not b.get("is_causal", True):
        blocks = users * nblk_max
    else:
        pos = pos_t.shards[0].to(torch.int64).reshape(-1)
        spec_t = int(b.get("spec_multi_pos_tiles") or 0)
        bounds = pos.reshape(users, spec_t)[:, -1] if spec_t else pos[torch.arange(users) % pos.numel()]
        blocks = int(sum(min(nblk_max, (int(p) + bs) // bs) for p in bounds if p >= 0))
    add_bytes(d, k, blocks * per_block)
    add_bytes(d, v, blocks * per_block)
    return d


# ------------------------------------------------------------------------------------------------
# decode attention
# ------------------------------------------------------------------------------------------------
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bound: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, nkv, R, dh], k/v [B, nkv, S, dh], bound [B, R] (inclusive KV bound, <0 = skip) -> [B, nkv, R, dh]."""
    scores = numerics.matmul_rows(q, k.transpose(-1, -2)) * scale  # [B, nkv, R, S]
    pos = torch.arange(k.shape[2])
    mask = pos.view(1, 1, 1, -1) > bound.view(bound.shape[0], 1, bound.shape[1], 1)
    scores = scores.masked_fill(mask, float("-inf"))
    skip = bound < 0  # [B, R]
    scores = scores.masked_fill(skip.view(skip.shape[0], 1, skip.shape[1], 1), 0.0)
    p = torch.softmax(scores, dim=-1)
    out = numerics.matmul_rows(p, v)
    return out.masked_fill(skip.view(skip.shape[0], 1, skip.shape[1], 1), 0.0)


def _paged_to_contiguous(cache: torch.Tensor, pt: torch.Tensor) -> torch.Tensor:
    """[P, nkv, bs, dh] pages + [B, nblk] table -> [B, nkv, nblk*bs, dh]."""
    if bool(((pt < 0) | (pt >= cache.shape[0])).any()):
        raise EmulatorError(f"page table holds a block index outside [0, {cache.shape[0]})")
    g = cache[pt]  # [B, nblk, nkv, bs, dh]
    b, nblk, nkv, bs, dh = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(b, nkv, nblk * bs, dh)


_PLAIN_DECODE_KW = {"attn_mask", "attention_sink", "sliding_window_size", "paged_cache_geometry",
                    "cache_position_modulo"}


def _decode_core(op, q_t, k_all, v_all, positions, scale, is_causal, spec_t):
    """q_t [1, B, R, dh] fp32; k_all/v_all [B or 1, nkv, S, dh] fp32; positions [B] or [B*T]."""
    _, users, rows, dh = q_t.shape
    nkv = k_all.shape[1]
    s_len = k_all.shape[2]
    if k_all.shape[0] == 1 and users > 1:
        k_all = k_all.expand(users, -1, -1, -1)
        v_all = v_all.expand(users, -1, -1, -1)
    scale = (1.0 / math.sqrt(dh)) if scale is None else float(scale)
    if spec_t:
        if nkv != 1:
            raise EmulatorError(
                f"{op}: spec_multi_pos_tiles needs one KV head per device (got {nkv}); the multi-position mode "
                "shares one KV scan per group and has no per-KV-head Q layout"
            )
        if rows != spec_t * 32:
            raise EmulatorError(
                f"{op}: spec_multi_pos_tiles={spec_t} expects q [1, G, {spec_t * 32}, dh] (one 32-row tile per "
                f"candidate), got {list(q_t.shape)}"
            )
        if positions is None or positions.numel() != users * spec_t:
            raise EmulatorError(f"{op}: spec mode needs cur_pos_tensor with G*T = {users * spec_t} bounds")
        bounds = positions.reshape(users, spec_t)
        last = bounds[:, -1]
        for g in range(users):
            if last[g] >= 0 and bool((bounds[g, :-1] > bounds[g, 1:]).any() or (bounds[g] < 0).any()):
                raise EmulatorError(
                    f"{op}: spec bounds of group {g} must ascend ({bounds[g].tolist()}); on device a non-ascending "
                    "group silently drops KV"
                )
        bounds = torch.where(last.view(-1, 1) < 0, torch.full_like(bounds, -1), bounds)
        row_bound = bounds.repeat_interleave(32, dim=1)  # [G, T*32]
        qh = q_t[0].unsqueeze(1)  # [G, 1, R, dh]
        out = _attend(qh, k_all, v_all, row_bound, scale)  # [G, 1, R, dh]
        return out[:, 0].unsqueeze(0)
    if rows % nkv != 0:
        raise EmulatorError(f"{op}: {rows} Q heads do not divide over {nkv} KV heads")
    groups = rows // nkv
    if is_causal:
        if positions is None:
            pos = torch.full((users,), s_len - 1, dtype=torch.int64)
        else:
            pos = positions.reshape(-1)
            pos = pos[torch.arange(users) % pos.numel()]
    else:
        pos = torch.full((users,), s_len - 1, dtype=torch.int64)
    if bool((pos >= s_len).any()):
        raise EmulatorError(f"{op}: cur_pos {pos.max().item()} beyond the KV length {s_len}")
    qh = q_t[0].reshape(users, nkv, groups, dh)
    bound = pos.view(-1, 1).expand(users, groups)
    out = _attend(qh, k_all, v_all, bound, scale)  # [B, nkv, groups, dh]
    return out.reshape(users, rows, dh).unsqueeze(0)


@device_op("ttnn.transformer.paged_scaled_dot_product_attention_decode", read_bytes=_sdpa_read)
def paged_sdpa_decode(input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, **kwargs):
    op = "ttnn.transformer.paged_scaled_dot_product_attention_decode"
    spec_t = int(kwargs.get("spec_multi_pos_tiles", 0) or 0)
    exotic = [k for k in _PLAIN_DECODE_KW if kwargs.get(k) is not None]
    if exotic:
        if spec_t:
            raise NotEmulatedError(f"{op}: spec_multi_pos_tiles combined with {exotic} is not emulated")
        # rarely used features: the (per-user looping) golden, on fp64 shards (N8)
        impl = golden_impl(op, ttnn.transformer.paged_scaled_dot_product_attention_decode)
        return impl(input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, **kwargs)
    if kwargs.get("cur_pos_tensor") is None and kwargs.get("is_causal", True):
        raise EmulatorError(f"{op}: causal paged decode needs cur_pos_tensor")
    outs = []
    for i in range(input_tensor_q.num_shards):
        q = input_tensor_q.shards[i].to(torch.float32)
        pt = page_table_tensor.shards[i].to(torch.int64)
        pos = shard_ints(kwargs.get("cur_pos_tensor"), i)
        if pos is not None and kwargs.get("is_causal", True):  # the pages up to the largest bound (what is read)
            bs = input_tensor_k.shards[i].shape[2]
            pt = pt[:, :max(1, min(pt.shape[1], (int(pos.max()) + bs) // bs))]
        k = _paged_to_contiguous(input_tensor_k.shards[i], pt).to(torch.float32)
        v = _paged_to_contiguous(input_tensor_v.shards[i], pt).to(torch.float32)
        if q.shape[1] != pt.shape[0]:
            raise EmulatorError(f"{op}: q has {q.shape[1]} users/groups but the page table has {pt.shape[0]} rows")
        outs.append(_decode_core(op, q, k, v, pos, kwargs.get("scale"), kwargs.get("is_causal", True), spec_t))
    return make_like(input_tensor_q, outs,
                     memory_config=output_memory_config(op, kwargs.get("memory_config"), input_tensor_q))


@device_op("ttnn.transformer.scaled_dot_product_attention_decode")
def sdpa_decode(input_tensor_q, input_tensor_k, input_tensor_v, **kwargs):
    op = "ttnn.transformer.scaled_dot_product_attention_decode"
    exotic = [k for k in ("attn_mask", "attention_sink", "sliding_window_size") if kwargs.get(k) is not None]
    if exotic or kwargs.get("share_cache"):
        impl = golden_impl(op, ttnn.transformer.scaled_dot_product_attention_decode)
        return impl(input_tensor_q, input_tensor_k, input_tensor_v, **kwargs)
    outs = []
    for i in range(input_tensor_q.num_shards):
        q = input_tensor_q.shards[i].to(torch.float32)
        k = input_tensor_k.shards[i].to(torch.float32)
        v = input_tensor_v.shards[i].to(torch.float32)
        pos = shard_ints(kwargs.get("cur_pos_tensor"), i)
        if pos is None and kwargs.get("cur_pos"):
            pos = torch.tensor(list(kwargs["cur_pos"]), dtype=torch.int64)
        outs.append(_decode_core(op, q, k, v, pos, kwargs.get("scale"), kwargs.get("is_causal", True), 0))
    return make_like(input_tensor_q, outs,
                     memory_config=output_memory_config(op, kwargs.get("memory_config"), input_tensor_q))


# ------------------------------------------------------------------------------------------------
# rotary embedding (llama / interleaved-pair form with a transformation matrix)
# ------------------------------------------------------------------------------------------------
@device_op("ttnn.experimental.rotary_embedding_llama")
def rotary_embedding_llama(input_tensor, cos_cache, sin_cache, trans_mat, *, is_decode_mode=False,
                           memory_config=None, compute_kernel_config=None):
    op = "ttnn.experimental.rotary_embedding_llama"
    for name, t in (("input_tensor", input_tensor), ("cos_cache", cos_cache), ("sin_cache", sin_cache),
                    ("trans_mat", trans_mat)):
        if t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{op}: {name} must be in TILE layout")
    outs = []
    for i in range(input_tensor.num_shards):
        # fp64 (N8); the result is rounded to the input dtype
        x, cos, sin, tm = (numerics.wide(t.shards[i]) for t in (input_tensor, cos_cache, sin_cache, trans_mat))
        dh = x.shape[-1]
        n_tm = tm.numel() // (32 * 32) if tm.shape[-1] == 32 else 0
        if tm.shape[-1] == 32 and tm.numel() == n_tm * 32 * 32 and n_tm >= 1:
            if dh % 32:
                raise EmulatorError(f"{op}: head_dim {dh} is not a multiple of the 32-wide transformation tile")
            blocks = tm.reshape(n_tm, 32, 32)
            xb = x.reshape(*x.shape[:-1], dh // 32, 32)
            if n_tm == 1:
                rot = numerics.matmul_rows(xb, blocks[0]).reshape(x.shape)
            elif is_decode_mode and n_tm == x.shape[1]:
                # decode: one 32x32 tile per user ([1, 1, B*32, 32], height-sharded over the B user cores on cards)
                rot = torch.einsum("obhkc,bcd->obhkd", xb, blocks).reshape(x.shape)
            else:
                raise EmulatorError(f"{op}: trans_mat holds {n_tm} 32x32 tiles; expected 1, or one per user "
                                    f"({x.shape[1]}) in decode mode")
        elif list(tm.shape[-2:]) == [dh, dh] and tm.numel() == dh * dh:
            rot = numerics.matmul_rows(x, tm.reshape(dh, dh))
        else:
            raise EmulatorError(f"{op}: trans_mat must be [.., 32, 32] (decode: [1, 1, B*32, 32]) or "
                                f"[.., {dh}, {dh}], got {list(tm.shape)}")
        if cos.shape[-1] != dh or sin.shape != cos.shape:
            raise EmulatorError(f"{op}: cos/sin {list(cos.shape)} do not match head_dim {dh}")
        if is_decode_mode:
            # x [1, B, nh, dh]; cos/sin [1, B, rows, dh] with identical rows per user
            if cos.shape[1] != x.shape[1]:
                raise EmulatorError(f"{op}: decode cos/sin batch {cos.shape[1]} != input batch {x.shape[1]}")
            if cos.shape[2] != x.shape[2]:
                cos, sin = cos[:, :, :1, :], sin[:, :, :1, :]
        else:
            if cos.shape[-2] != x.shape[-2]:
                raise EmulatorError(f"{op}: cos/sin seq_len {cos.shape[-2]} != input seq_len {x.shape[-2]}")
        outs.append(x * cos + rot * sin)
    return make_like(input_tensor, outs, memory_config=output_memory_config(op, memory_config, input_tensor))


# ------------------------------------------------------------------------------------------------
# rotary embedding (HF rotate_half form, no transformation matrix)
# ------------------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _is_height_sharded(t: EmuTensor) -> bool:
    mc = t.memory_config()
    return bool(mc.is_sharded()) and mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED


@device_op("ttnn.experimental.rotary_embedding_hf")
def rotary_embedding_hf(input_tensor, cos_cache, sin_cache, *, is_decode_mode=False, memory_config=None,
                        compute_kernel_config=None):
    """See the module doc. Numerics: each product is taken in fp32 from the operands as the FPU sees them
    (fp32 cos/sin as TF32 under strict numerics), rounded to the input's format (the kernel packs x*cos and
    rotate_half(x)*sin to intermediate buffers before the add; the conservative reading is that they carry the
    input's format), and the sum is rounded to the output dtype."""
    from . import numerics

    op = "ttnn.experimental.rotary_embedding_hf"
    for name, t in (("input_tensor", input_tensor), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if not isinstance(t, EmuTensor) or not t.on_device:
            raise EmulatorError(f"{op}: {name} must be a device tensor")
        if t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{op}: {name} must be in TILE layout")
    shape = input_tensor.logical_shape_list
    d = shape[-1]
    padded_d = -(-d // 32) * 32
    if not (padded_d == 32 or padded_d % 64 == 0):
        raise EmulatorError(f"{op}: head dim {d} (padded {padded_d}) must be 32 or a multiple of 64 (the rotate_half "
                            "midpoint must fall on a tile boundary)")
    if dtype_name(cos_cache.dtype) != dtype_name(sin_cache.dtype):
        raise EmulatorError(f"{op}: cos and sin dtypes must match")
    cshape = cos_cache.logical_shape_list
    if cshape != sin_cache.logical_shape_list:
        raise EmulatorError(f"{op}: cos {cshape} and sin {sin_cache.logical_shape_list} shapes must match")
    if len(shape) != 4 or len(cshape) != 4 or cshape[0] != 1 or cshape[-1] != d:
        raise EmulatorError(f"{op}: cos {cshape} must be [1, ., ., {d}] for input {shape}")
    if is_decode_mode:
        if not _is_height_sharded(input_tensor):
            raise EmulatorError(f"{op}: decode mode needs a HEIGHT_SHARDED input (the device op's validation)")
        if not (cos_cache.memory_config().is_sharded() and sin_cache.memory_config().is_sharded()):
            raise EmulatorError(f"{op}: decode mode needs sharded cos/sin")
        if shape[0] != 1 or cshape[1] != shape[1]:
            raise EmulatorError(f"{op}: decode mode takes x [1, B, nh, D] and cos/sin [1, B, rows, D]; got x "
                                f"{shape}, cos {cshape}")
        if cshape[2] > 32:
            # the validation lets it through, but the sharded kernel reads one tile row of cos/sin per user
            raise NotEmulatedError(f"{op}: decode cos/sin with {cshape[2]} rows per user: the device op's sharded "
                                   "kernel reads one tile row per user (row 0 broadcast over the heads); pass "
                                   "[1, B, 1, D] or [1, B, <=32, D]")
    else:
        if cshape[1] != 1:
            raise EmulatorError(f"{op}: prefill mode needs cos/sin batch dim 1, got {cshape}")
        if cshape[2] < shape[2]:
            raise EmulatorError(f"{op}: cos seq_len {cshape[2]} < input seq_len {shape[2]}")
        if input_tensor.memory_config().is_sharded() and not _is_height_sharded(input_tensor):
            if input_tensor.memory_config().memory_layout == ttnn.TensorMemoryLayout.WIDTH_SHARDED:
                raise EmulatorError(f"{op}: input cannot be WIDTH_SHARDED")
    if memory_config is not None and memory_config.is_sharded() and \
            memory_config.memory_layout == ttnn.TensorMemoryLayout.WIDTH_SHARDED:
        raise EmulatorError(f"{op}: output cannot be WIDTH_SHARDED")
    strict = numerics.is_strict(input_tensor)
    in_name = dtype_name(input_tensor.dtype)

    def operand(t, i):
        v = t.shards[i].to(torch.float32)
        return numerics.to_tf32(v) if strict and dtype_name(t.dtype) == "FLOAT32" else v

    def packed(v):
        return numerics.round_bf16(v) if strict and in_name != "FLOAT32" else v

    outs = []
    for i in range(input_tensor.num_shards):
        x = operand(input_tensor, i)
        cos, sin = operand(cos_cache, i), operand(sin_cache, i)
        # prefill: the first seq_len rows; decode: row 0 of each user's tile, broadcast over the heads
        rows = shape[2] if not is_decode_mode else 1
        cos, sin = cos[:, :, :rows, :], sin[:, :, :rows, :]
        outs.append(packed(x * cos) + packed(_rotate_half(x) * sin))
    return make_like(input_tensor, outs, memory_config=output_memory_config(op, memory_config, input_tensor))


# ------------------------------------------------------------------------------------------------
# decode head split
# ------------------------------------------------------------------------------------------------
def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _output_shard_config(mc, grid, rows: int, width: int):
    return ttnn.MemoryConfig(mc.memory_layout, mc.buffer_type,
                             ttnn.ShardSpec(grid, [rows, width], ttnn.ShardOrientation.ROW_MAJOR))


@device_op("ttnn.experimental.nlp_create_qkv_heads_decode")
def nlp_create_qkv_heads_decode(input_tensor, *, num_heads, num_kv_heads=None, output_tensors=None,
                                overlap_qk_coregrid=True, batch_offset=None, slice_size=None, memory_config=None):
    """Fused ``[1, 1, B, (nq + 2 nkv) D]`` rows -> q ``[1, B, nq, D]``, k and v ``[1, B, nkv, D]``, each
    HEIGHT_SHARDED one user per core (heads padded to a tile). The 0.81.1 op has no golden; this restates the device
    op (tt-metal ``nlp_create_qkv_heads_decode_device_operation.cpp`` and the host wrapper, read for facts):

    * head_dim = last dim / (nq + 2 nkv) (exact), last dim a tile multiple; input TILE, FLOAT32 or BFLOAT16,
      shape ``[1, 1, B <= 32, .]``;
    * a sharded input must be WIDTH_SHARDED, ROW_MAJOR, one shard row block holding every (padded) row; with
      ``overlap_qk_coregrid=False`` every shard must hold whole heads. For an interleaved input the host wrapper
      (``nlp_create_qkv_heads_decode.cpp``) forces ``overlap_qk_coregrid`` to true: q, k and v share cores;
    * the outputs are always HEIGHT_SHARDED in L1 (the host wrapper builds that config itself): the shard grid is
      ``memory_config``'s when it carries a shard spec, else the device's whole compute grid (``MemoryConfig(
      HEIGHT_SHARDED, L1)`` without a spec, as Tenstorrent's test passes it, or no ``memory_config``); the grid needs
      at least B cores (2 B without overlap); nq <= 32 and nq >= nkv (both rules read in two versions of the host
      wrapper, the QueueId-era one and the current one; not checked against the 0.81.1 binary on cards);
    * output placement: q and v on the first B cores of that grid (row-major from its start core); k on the same
      cores, or, without overlap, on the B cores after the first B + 1. Shards are ``[pad32(nq), D]`` for q and
      (as the device op computes them, from nq) for k and v.
    The copy is exact (no arithmetic); the outputs keep the input's dtype."""
    op = "ttnn.experimental.nlp_create_qkv_heads_decode"
    if output_tensors is not None or batch_offset is not None or slice_size is not None:
        raise NotEmulatedError(f"{op}: output_tensors / batch_offset / slice_size are not emulated")
    if not isinstance(input_tensor, EmuTensor) or not input_tensor.on_device:
        raise EmulatorError(f"{op}: input_tensor must be a device tensor")
    if dtype_name(input_tensor.dtype) not in ("FLOAT32", "BFLOAT16"):
        raise EmulatorError(f"{op}: input must be FLOAT32 or BFLOAT16 (got {dtype_name(input_tensor.dtype)})")
    if input_tensor.layout != ttnn.TILE_LAYOUT:
        raise EmulatorError(f"{op}: only TILE layout is supported for the input")
    shape = input_tensor.logical_shape_list
    nq = int(num_heads)
    nkv = nq if num_kv_heads is None else int(num_kv_heads)
    if len(shape) != 4 or shape[0] != 1 or shape[1] != 1 or shape[2] > 32 or shape[3] % 32:
        raise EmulatorError(f"{op}: input must be [1, 1, B <= 32, W] with W a multiple of 32, got {shape}")
    if shape[3] % (nq + 2 * nkv):
        raise EmulatorError(f"{op}: last dim {shape[3]} is not (num_heads + 2 num_kv_heads) = {nq + 2 * nkv} heads")
    d = shape[3] // (nq + 2 * nkv)
    users = shape[2]
    in_mc = input_tensor.memory_config()
    # the host wrapper: `input.is_sharded() ? overlap_qk_coregrid.value_or(true) : true`
    overlap = (True if overlap_qk_coregrid is None else bool(overlap_qk_coregrid)) if in_mc.is_sharded() else True
    if in_mc.is_sharded():
        spec = in_mc.shard_spec
        if in_mc.memory_layout != ttnn.TensorMemoryLayout.WIDTH_SHARDED:
            raise EmulatorError(f"{op}: a sharded input must be WIDTH_SHARDED (got {in_mc.memory_layout})")
        if spec is None or spec.shape[0] != _pad32(users) or spec.orientation != ttnn.ShardOrientation.ROW_MAJOR:
            raise EmulatorError(f"{op}: the input's shard spec must be ROW_MAJOR with shard height "
                                f"{_pad32(users)} (every row)")
        if not overlap and d % spec.shape[1]:
            raise EmulatorError(f"{op}: without overlap_qk_coregrid every input shard must hold whole heads")
    if memory_config is not None and memory_config.shard_spec is not None:
        grid = memory_config.shard_spec.grid
    else:  # no spec given: the whole compute grid, as the host wrapper derives it
        size = input_tensor.mesh.compute_with_storage_grid_size()
        grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(size.x - 1, size.y - 1))})
    out_mc = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1)
    if nq > 32 or nq < nkv:
        raise EmulatorError(f"{op}: need num_kv_heads {nkv} <= num_heads {nq} <= 32")
    if grid.num_cores() < (users if overlap else 2 * users):
        raise EmulatorError(f"{op}: output grid has {grid.num_cores()} cores; needs "
                            f"{users if overlap else 2 * users} for {users} users")
    start = grid.ranges()[0].start
    q_grid = ttnn.num_cores_to_corerangeset_in_subcoregrids(start, users, grid, True)
    k_grid = q_grid
    if not overlap:
        k_start = ttnn.num_cores_to_corerangeset_in_subcoregrids(start, users + 1, grid, True).ranges()[-1].end
        k_grid = ttnn.num_cores_to_corerangeset_in_subcoregrids(k_start, users, grid, True)
    qs, ks, vs = [], [], []
    for i in range(input_tensor.num_shards):
        x = input_tensor.shards[i].reshape(users, nq + 2 * nkv, d)
        qs.append(x[:, :nq].reshape(1, users, nq, d))
        ks.append(x[:, nq:nq + nkv].reshape(1, users, nkv, d))
        vs.append(x[:, nq + nkv:].reshape(1, users, nkv, d))
    heads_pad = _pad32(nq)
    q = make_like(input_tensor, qs, memory_config=_output_shard_config(out_mc, q_grid, heads_pad, d))
    k = make_like(input_tensor, ks, memory_config=_output_shard_config(out_mc, k_grid, heads_pad, d))
    v = make_like(input_tensor, vs, memory_config=_output_shard_config(out_mc, q_grid, heads_pad, d))
    return q, k, v
