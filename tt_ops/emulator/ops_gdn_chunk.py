"""Chunked Gated-DeltaNet ops of ttnn 0.81.1: ``transformer.chunk_gated_delta_rule`` and
``transformer.gated_delta_attn_seq`` (neither has a golden function that models the card).

``chunk_gated_delta_rule`` (docstring contract in the op below):

* rank 4 (head-split q/k/v): the recurrence in fp64 over all T tokens, the final state rounded to fp32 once (N8), on
  q/k/v cast to bf16 (N6); one program counted (the host relayout programs of that path are not counted).
* rank 3 (flat ``[B, T, heads*dim]``, K == V, chunk 32): under strict numerics the chunk kernel itself
  (``chunk_gdn_math.hpp``: ``prep_chunk`` with the in-kernel qk-norm and the SFPU forward-substitution WY inverse,
  ``scan_step``), :func:`chunk32_kernel`; value head hv reads key head ``hv // (HV / H)`` (``reader_chunk_gdn_prep.cpp``).
  Counted: the bf16 casts of non-bf16 q/k/v, the fused (1) or phased (2: prep, scan, with seven fp32 DRAM
  intermediates) program, a zero state when none is given, and the token-major relayout (untilize + permute).

Kernel numerics (HiFi4, fp32 Dst: the op's only accepted config): every operand of an FPU op sits in a Src register,
so an fp32 value is read as TF32 (10 explicit mantissa bits in SrcB, 9 in SrcA for a product; bf16 values are exact);
matmul products are exact and summed per 32-wide K tile into the fp32 Dst; SFPU ops (exp, rsqrt, the DST-to-DST
products and the forward substitution) are fp32. Copies and transposes are taken as exact.
"""

from __future__ import annotations

import torch

from . import numerics
from .errors import EmulatorError
from .op_accounting import bind_op
from .programs import register_programs
from .registry import device_op
from .tensor import dtype_name, make_like, new_device_tensor, shard_bytes
from .ttnn_import import ttnn

TILE = 32
CHUNK_OP = "ttnn.transformer.chunk_gated_delta_rule"
SEQ_OP = "ttnn.transformer.gated_delta_attn_seq"
L2_EPS = 1e-6  # FLA's l2norm epsilon, inside the root (the golden recurrence uses it too)
_CORES = 11 * 10  # Blackhole P150a worker grid (mesh.P150A_WORKER_GRID)

# the golden's token-by-token recurrence (FLA's naive form), which takes a compute dtype
_recurrence = ttnn.operations.transformer_golden.recurrent_gated_delta_rule


# ---- FPU / SFPU helpers (fp64 values) ------------------------------------------------------------------------------
def _a(x):
    """An fp32 value as the SrcA operand of a product (TF32 without its LSB); bf16 values pass unchanged."""
    return numerics.src_operand(x, "FLOAT32", True)


def _b(x):
    """An fp32 value in SrcB (TF32)."""
    return numerics.src_operand(x, "FLOAT32", False)


_f32 = numerics.round_fp32


def _mm(a, b, acc=None):
    """``acc + a @ b`` with a/b already in their Src formats: exact partial products per 32-wide K tile, each added
    into the fp32 Dst in K order."""
    for k0 in range(0, a.shape[-1], TILE):
        part = torch.matmul(a[..., k0:k0 + TILE], b[..., k0:k0 + TILE, :])
        acc = _f32(part if acc is None else acc + part)
    return acc


def _forward_substitution(neg_n):
    """``(I - negN)^-1`` of strictly lower ``negN`` [..., 32, 32] by the SFPU solve (``triangle_solve_tile``):
    row r = e_r + sum over c < r (in order) of negN[r, c] * row c, one fp32 multiply-add per term."""
    c = neg_n.shape[-1]
    x = torch.eye(c, dtype=neg_n.dtype).expand(neg_n.shape).clone()
    for r in range(1, c):
        row = x[..., r, :]
        for j in range(r):
            row = _f32(row + neg_n[..., r, j:j + 1] * x[..., j, :])
        x[..., r, :] = row
    return x


def chunk32_kernel(q, k, v, g, beta, s0, scale: float | None):
    """The chunk-32 kernel for one device: q/k/v [BH, T, D] (bf16 values; q/k already mapped to their value heads),
    g/beta [BH, T] as stored, s0 [BH, D, D] fp32. ``scale`` given: the flat path's in-kernel qk-norm (L2 over D, q
    times ``scale``); None: q/k are used as given (rank 4: normalised and scaled on the host). Returns
    (o [BH, T, D], final state [BH, D, D]) as fp64 holding fp32 values."""
    bh, t_len, d = v.shape
    dk = q.shape[-1]
    nc = t_len // TILE
    q, k, v = (numerics.wide(x.to(torch.float32)).reshape(bh, nc, TILE, x.shape[-1]) for x in (q, k, v))
    g, beta = (numerics.wide(x.to(torch.float32)).reshape(bh, nc, TILE, 1) for x in (g, beta))
    eps = float(torch.tensor(L2_EPS, dtype=torch.float32))

    def inv_rms(x):  # diag(rsqrt(rowsum(x^2) + eps)): the diagonal of x @ x^T, summed per K tile in Dst; SFPU ops
        acc = None
        for k0 in range(0, x.shape[-1], TILE):
            part = (x[..., k0:k0 + TILE] ** 2).sum(-1, keepdim=True)  # bf16 squares: exact in fp64
            acc = _f32(part if acc is None else acc + part)
        return _f32(1.0 / torch.sqrt(_f32(acc + eps)))

    if scale is None:
        qn, kn = q, k
    else:
        scale = float(torch.tensor(scale, dtype=torch.float32))
        qn = _f32(_b(_f32(inv_rms(q) * scale)) * q)  # mm_diag: the diagonal in SrcB, q (bf16) in SrcA
        kn = _f32(_b(inv_rms(k)) * k)
    bb = _b(beta)
    vbeta = _f32(v * bb)
    kbeta = _f32(_a(kn) * bb)
    ga = _a(g)  # tril @ g: g is the SrcA operand
    decay = _f32(torch.cumsum(ga, dim=-2))  # exact in fp64, then the fp32 Dst
    gsum = _f32(ga.sum(dim=-2, keepdim=True))
    dfac = _f32(torch.exp(_f32(gsum - decay)))
    dexp = _f32(torch.exp(decay))
    dl = _f32(dfac * dexp)  # per row: exp(g_sum) as the exact product of the two exps
    tril = torch.tril(torch.ones(TILE, TILE, dtype=numerics.WIDE))
    bd = _b(decay)
    lmask = _f32(torch.exp(_f32(bd - bd.transpose(-1, -2)) * tril)) * tril
    neg_n = -_f32(_mm(_b(kbeta), _a(kn).transpose(-1, -2)) * lmask) * (1.0 - torch.eye(TILE, dtype=numerics.WIDE))
    tinv = _forward_substitution(neg_n)
    nkd = -_f32(_a(kbeta) * _b(dexp))
    intra = _f32(_mm(_b(qn), _a(kn).transpose(-1, -2)) * lmask)
    qdecay = _f32(_a(qn) * _b(dexp))
    kdec_t = _f32(_a(kn) * _b(dfac)).transpose(-1, -2)  # [.., D, 32]
    dl_b = _b(dl)  # dl * I: the identity scaled by the dl column (SrcB)
    s = numerics.wide(s0.to(torch.float32))
    outs = []
    for n in range(nc):
        sa = _a(s)
        diff = _f32(_mm(_b(nkd[:, n]), sa) + _a(vbeta[:, n]))  # nkd @ S, then I @ v_beta into the same Dst
        vnew = _mm(_b(tinv[:, n]), _a(diff))
        outs.append(_mm(_b(intra[:, n]), _a(vnew), acc=_mm(_b(qdecay[:, n]), sa)))
        dl_rows = dl_b[:, n].repeat(1, dk // TILE, 1)  # row r of every state tile scaled by dl_r
        s = _mm(_b(kdec_t[:, n]), _a(vnew), acc=_f32(dl_rows * sa))
    return torch.cat(outs, dim=1).reshape(bh, t_len, d), s


# ---- chunk_gated_delta_rule ------------------------------------------------------------------------------------
def _chunk_bind(args, kwargs):
    return bind_op(CHUNK_OP, args, kwargs)


def _flat_geometry(b):
    q, v, beta = b["q"], b["v"], b["beta"]
    bsz, t_len, qw = q.logical_shape_list
    hv = beta.logical_shape_list[-1]
    d = v.logical_shape_list[-1] // hv
    return bsz, t_len, qw // d, hv, d


def _phased(b, bh: int) -> bool:
    """The path a call runs: the program config's, else fused when a one-producer, one-receiver-per-head geometry
    fits the grid (2 cores per head), else phased (the op's own cost model is not restated)."""
    name = type(b.get("program_config")).__name__
    if name == "ChunkGdnPhasedProgramConfig":
        return True
    if name == "ChunkGdnFusedProgramConfig":
        return False
    return 2 * bh > _CORES


def _chunk_programs(args, kwargs, out) -> int:
    b = _chunk_bind(args, kwargs)
    if len(b["q"].logical_shape_list) != 3:
        return 1  # rank 4: one program counted (its host relayout programs are not)
    bsz, t_len, h, hv, d = _flat_geometry(b)
    n = sum(dtype_name(b[x].dtype) != "BFLOAT16" for x in ("q", "k", "v"))
    n += sum(dtype_name(b[x].dtype) not in ("FLOAT32", "BFLOAT16") for x in ("g", "beta"))
    st = b.get("initial_state")
    n += 1 if st is None or dtype_name(st.dtype) != "FLOAT32" else 0  # a zero state, or its fp32 cast
    n += 2 if _phased(b, bsz * hv) else 1
    return n + (0 if b.get("output_head_major") else 2)  # token-major: untilize + permute


def _add(d, key, n):
    d[key] = d.get(key, 0) + int(n)


def _chunk_bytes(args, kwargs, written: bool):
    b = _chunk_bind(args, kwargs)
    if len(b["q"].logical_shape_list) != 3:
        return None  # rank 4: every input read once, every output written once
    bsz, t_len, h, hv, d = _flat_geometry(b)
    bh, nc = bsz * hv, t_len // TILE
    rd, wr = {}, {}
    for x in ("q", "k", "v"):
        t = b[x]
        if dtype_name(t.dtype) != "BFLOAT16":  # the cast reads it and writes bf16
            _add(rd, dtype_name(t.dtype), t.bytes_per_device())
            _add(wr, "BFLOAT16", t.logical_volume() // bsz * bsz * 2)
    _add(rd, "BFLOAT16", 3 * bh * t_len * d * 2)  # each value head reads its (key head's) q/k and its v
    for x in ("g", "beta"):  # the tile holding the head's column, per head and chunk
        t = b[x]
        dt = dtype_name(t.dtype) if dtype_name(t.dtype) in ("FLOAT32", "BFLOAT16") else "FLOAT32"
        _add(rd, dt, bh * nc * shard_bytes([TILE, TILE], ttnn.float32 if dt == "FLOAT32" else ttnn.bfloat16,
                                           ttnn.TILE_LAYOUT))
    st = b.get("initial_state")
    state = bh * d * d * 4
    if st is None:
        _add(wr, "FLOAT32", state)
    elif dtype_name(st.dtype) != "FLOAT32":
        _add(rd, dtype_name(st.dtype), st.bytes_per_device())
        _add(wr, "FLOAT32", state)
    _add(rd, "FLOAT32", state + 4 * TILE * TILE * 4)  # the state and the constant tiles (eye, tril, ones, masks)
    o = bh * t_len * d * 4
    _add(wr, "FLOAT32", o + (state if b.get("output_final_state") else 0))
    if _phased(b, bh):  # seven fp32 intermediates through DRAM: v_beta, kd, q_decay, intra, k_dec_t, dl, t_inv
        inter = bh * nc * (3 * TILE * d + d * TILE + 3 * TILE * TILE) * 4
        _add(wr, "FLOAT32", inter)
        _add(rd, "FLOAT32", inter)
    if not b.get("output_head_major"):  # untilize and permute each read and write o
        _add(rd, "FLOAT32", 2 * o)
        _add(wr, "FLOAT32", 2 * o)
    return wr if written else rd


register_programs(CHUNK_OP, _chunk_programs)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


@device_op(CHUNK_OP, read_bytes=lambda a, k: _chunk_bytes(a, k, False),
           written_bytes=lambda a, k: _chunk_bytes(a, k, True))
def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64, use_qk_l2norm=False, output_head_major=False, program_config=None,
                           wy_inverse=None, memory_config=None, compute_kernel_config=None, eye=None, tril=None,
                           ones=None, masks=None):
    """Prefill GDN with the contract of the 0.81.1 docstring.

    * ``use_qk_l2norm`` must be False ("use_qk_l2norm not yet supported"); every tensor TILE (the op "never
      relayouts"); ``chunk_size`` 32 or 64; a compute config other than HiFi4 / fp32 Dst / no approx is refused.
    * Rank 4 (head-split, q/k pre-normalised): q scaled on the host then cast to bf16 with k and v (N6), the fp64
      recurrence. Rank 3 (flat, raw q/k): K == V, H = q width / V, HV = beta's last dim, chunk 32, T % 32 == 0, not
      on mono; strict numerics run :func:`chunk32_kernel`, exact numerics the fp64 recurrence on the L2-normalised
      inputs.
    * Output: ``o`` FLOAT32 (BFLOAT16 on mono), token-major ``[B, T, HV, V]`` ROW_MAJOR or ``[B*HV, T, V]`` TILE with
      ``output_head_major``; the final state ``[B, HV, K, V]`` FLOAT32 TILE.
    """
    op = "ttnn.transformer.chunk_gated_delta_rule"
    if use_qk_l2norm:
        raise EmulatorError(f"{op}: use_qk_l2norm not yet supported; pre-normalize q/k on host (or pass rank-3 flat "
                            "q/k/v, which the kernel normalises)")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"chunk_gdn: {name} must be TILE layout (the op casts dtypes but never relayouts)")
    if int(chunk_size) not in (32, 64):
        raise EmulatorError(f"chunk_gdn: chunk_size must be 32 or 64 (got {chunk_size})")
    if compute_kernel_config is not None:
        cfg = numerics.kernel_config(compute_kernel_config)
        fid = getattr(getattr(compute_kernel_config, "math_fidelity", None), "name", "")
        if fid not in ("HiFi4", "Invalid") or not cfg.fp32_dest_acc_en or cfg.math_approx_mode:
            raise EmulatorError(
                f"{op} runs HiFi4 with fp32 destination accumulation and no approx mode on every path; "
                f"compute_kernel_config asked for math_fidelity {fid}, fp32_dest_acc_en {cfg.fp32_dest_acc_en}, "
                f"math_approx_mode {cfg.math_approx_mode}")
    mono = type(program_config).__name__ == "ChunkGdnMonoProgramConfig"
    flat = len(q.logical_shape_list) == 3
    if flat != (len(v.logical_shape_list) == 3) or flat != (len(k.logical_shape_list) == 3):
        raise EmulatorError(f"{op}: pass q, k and v all rank 4 or all rank 3 (flat)")
    if flat and mono:
        raise EmulatorError("chunk_gdn: the mono program takes head-major q/k/v only (no flat inputs, no in-kernel "
                            "qk-norm)")
    if flat and int(chunk_size) != 32:
        raise EmulatorError(f"{op}: the rank-3 flat path needs chunk_size == 32, got {chunk_size}")
    strict = numerics.is_strict(q)
    outs, states = [], []
    for i in range(q.num_shards):
        qi, ki, vi, gi, bi = (t.shards[i].to(torch.float32) for t in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.shards[i].to(torch.float32)
        if flat:
            o, st = _flat(qi, ki, vi, gi, bi, h0, scale, strict)
        else:
            o, st = _rank4(qi, ki, vi, gi, bi, h0, scale, strict, output_final_state, int(chunk_size))
        if output_head_major:
            o = o.permute(0, 2, 1, 3).reshape(-1, o.shape[1], o.shape[-1])
        outs.append(o)
        states.append(st)
    o_t = make_like(v, outs, dtype=ttnn.bfloat16 if mono else ttnn.float32,
                    layout=ttnn.TILE_LAYOUT if output_head_major else ttnn.ROW_MAJOR_LAYOUT,
                    memory_config=memory_config or ttnn.DRAM_MEMORY_CONFIG)
    if output_final_state and states[0] is not None:
        return o_t, new_device_tensor(q.mesh, [s.to(torch.float32).contiguous() for s in states], ttnn.float32,
                                      ttnn.TILE_LAYOUT, memory_config=memory_config)
    return o_t, None


def _rank4(qi, ki, vi, gi, bi, h0, scale, strict, final, chunk):
    op_scale = scale
    if strict:  # the host scales q, then casts q/k/v to bf16
        qi = qi * (float(scale) if scale is not None else qi.shape[-1] ** -0.5)
        op_scale = 1.0
        qi, ki, vi = (x.to(torch.bfloat16).to(torch.float32) for x in (qi, ki, vi))
        if chunk == TILE and qi.shape[-1] % TILE == 0 and vi.shape[-1] % TILE == 0:
            # the host's GQA expand and time padding, then the chunk kernel without qk-norm
            b_sz, t_len, h, d = qi.shape
            hv = vi.shape[2]
            pad = (-t_len) % TILE
            heads = torch.arange(hv) // (hv // h)

            def heads_first(x, idx=None):
                x = x if idx is None else x[:, :, idx]
                x = x.permute(0, 2, 1, *range(3, x.dim())).reshape(b_sz * hv, t_len, *x.shape[3:])
                return torch.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))

            s0 = torch.zeros(b_sz * hv, d, vi.shape[-1]) if h0 is None else h0.reshape(b_sz * hv, d, -1)
            o, st = chunk32_kernel(heads_first(qi, heads), heads_first(ki, heads), heads_first(vi), heads_first(gi),
                                   heads_first(bi), s0, None)
            o = o[:, :t_len].reshape(b_sz, hv, t_len, -1).permute(0, 2, 1, 3)
            return o, (st.reshape(b_sz, hv, d, -1) if final else None)
    q64, k64, v64, g64, b64 = (numerics.wide(x) for x in (qi, ki, vi, gi, bi))
    # the recurrence over all T tokens in fp64, the state rounded to fp32 once at the end (N8; the chunked form's
    # association of the same sums is not modelled on this path)
    return _recurrence(q64, k64, v64, b64, g64, scale=op_scale, initial_state=None if h0 is None else numerics.wide(h0),
                       output_final_state=final, dtype=numerics.WIDE)


def _flat(qi, ki, vi, gi, bi, h0, scale, strict):
    """Rank 3: o [B, T, HV, V], final state [B, HV, K, V]."""
    b_sz, t_len, qw = qi.shape
    hv = bi.shape[-1]
    op = "ttnn.transformer.chunk_gated_delta_rule"
    if vi.shape[-1] % hv:
        raise EmulatorError(f"{op}: flat v width {vi.shape[-1]} does not split over HV={hv} (beta's last dim)")
    d = vi.shape[-1] // hv
    if qw % d or ki.shape[-1] != qw:
        raise EmulatorError(f"{op}: flat q/k width {qw} is not H*K with K == V == {d}")
    h = qw // d
    if hv % h:
        raise EmulatorError(f"{op}: HV ({hv}) must be divisible by H ({h})")
    if t_len % TILE:
        raise EmulatorError(f"{op}: the rank-3 flat path needs T a multiple of 32, got {t_len}")
    for name, t in (("g", gi), ("beta", bi)):
        if list(t.shape) != [b_sz, t_len, hv]:
            raise EmulatorError(f"chunk_gated_delta_rule: {name} must be [B, T, HV] = [{b_sz}, {t_len}, {hv}], got "
                                f"{list(t.shape)}")
    scale = d ** -0.5 if scale is None else float(scale)
    if not strict or d % TILE:  # exact numerics, or heads narrower than a tile (the kernel's padding not modelled)
        q4 = _l2norm(numerics.wide(qi).reshape(b_sz, t_len, h, d))
        k4 = _l2norm(numerics.wide(ki).reshape(b_sz, t_len, h, d))
        return _recurrence(q4, k4, numerics.wide(vi).reshape(b_sz, t_len, hv, d), numerics.wide(bi),
                           numerics.wide(gi), scale=scale, initial_state=None if h0 is None else numerics.wide(h0),
                           output_final_state=True, dtype=numerics.WIDE)
    heads = torch.arange(hv) // (hv // h)  # value head hv reads key head hv // G

    def per_value_head(x, n):
        return x.to(torch.bfloat16).reshape(b_sz, t_len, n, d)

    qh = per_value_head(qi, h)[:, :, heads].permute(0, 2, 1, 3).reshape(b_sz * hv, t_len, d)
    kh = per_value_head(ki, h)[:, :, heads].permute(0, 2, 1, 3).reshape(b_sz * hv, t_len, d)
    vh = per_value_head(vi, hv).permute(0, 2, 1, 3).reshape(b_sz * hv, t_len, d)
    gh, bh_ = (x.permute(0, 2, 1).reshape(b_sz * hv, t_len) for x in (gi, bi))
    s0 = torch.zeros(b_sz * hv, d, d) if h0 is None else h0.reshape(b_sz * hv, d, d)
    o, s = chunk32_kernel(qh, kh, vh, gh, bh_, s0, scale)
    return o.reshape(b_sz, hv, t_len, d).permute(0, 2, 1, 3), s.reshape(b_sz, hv, d, d)


# ---- gated_delta_attn_seq ------------------------------------------------------------------------------------------
_SEQ_DIM = 4 * TILE  # the kernels are written for Ct == Kt == Vt == 4 (gated_delta_attn.cpp)
_SEQ_DEFAULT = numerics.KernelConfig(phases=2, fp32_dest_acc_en=True, math_approx_mode=False, packer_l1_acc=False,
                                     given=False)


def _seq_check(name, t, shape):
    if t is None or not getattr(t, "on_device", False):
        raise EmulatorError(f"{name} must be on device")
    if t.memory_config().buffer_type != ttnn.BufferType.DRAM:
        raise EmulatorError(f"{name} must be in DRAM")
    if t.layout != ttnn.TILE_LAYOUT:
        raise EmulatorError(f"{name} must be tiled")
    if dtype_name(t.dtype) != "FLOAT32":
        raise EmulatorError(f"{name} must be float32, got DataType::{dtype_name(t.dtype)}")
    s = t.logical_shape_list
    if len(s) != len(shape):
        raise EmulatorError(f"{name} rank mismatch: {len(s)} vs {len(shape)}")
    for i, (got, want) in enumerate(zip(s, shape)):
        if got != want:
            raise EmulatorError(f"{name} dim[{i}] expected {want} got {got}")


def _fwd_sub(l_unit, l_inv, rhs, ph, d):
    """Blocked forward substitution ``L_unit^-1 @ rhs`` as ``fwd_sub_row`` does it, four 32-row blocks: block i =
    L_inv_i @ (rhs_i - sum_{j<i} L_ij @ out_j), each matmul an fp32 Dst result, each subtraction an FPU eltwise op on
    TF32 operands."""
    outs = []
    for i in range(4):
        fwd = rhs[..., i * TILE:(i + 1) * TILE, :]
        for j in range(i):
            corr = _mm_ph(l_unit[..., i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE], outs[j], ph, d)
            fwd = numerics.round_dst(_b(fwd) - _b(corr), d)
        outs.append(_mm_ph(l_inv[..., i * TILE:(i + 1) * TILE, :], fwd, ph, d))
    return torch.cat(outs, dim=-2)


def _mm_ph(a, b, ph, d, acc=None):
    """``acc + a @ b`` (in0 = a in SrcB, in1 = b in SrcA) with ``ph`` fidelity phases, per K tile into Dst."""
    sa, sb = _a(b), _b(a)
    for k0 in range(0, a.shape[-1], TILE):
        part = _phase_matmul(sb[..., k0:k0 + TILE], sa[..., k0:k0 + TILE, :], ph)
        acc = numerics.round_dst(part if acc is None else acc + part, d)
    return acc


def _phase_matmul(srcb, srca, ph):
    if ph >= 4:
        return torch.matmul(srcb, srca)
    b_hi, a_hi = numerics.fidelity_hi(srcb, srca)
    if ph == 1:
        return torch.matmul(b_hi, a_hi)
    if ph == 2:
        return torch.matmul(b_hi, srca)
    return torch.matmul(b_hi, srca) + torch.matmul(srcb - b_hi, a_hi)


def gated_delta_attn_seq_math(l_unit, v_beta_sc, k_bd_sc, intra, q_decay, k_decay_t, dl_exp, l_inv, s0, cfg):
    """``gated_delta_attn.cpp`` for one device (fp64 values): per chunk v_cor / k_cum by forward substitution, then
    v_new = v_cor - k_cum @ S, out = q_decay @ S + intra @ v_new, S = S * dl + k_decay_t @ v_new."""
    ph, d = cfg.phases, cfg.fp32_dest_acc_en
    wide = lambda x: numerics.wide(x.to(torch.float32))  # noqa: E731
    l_unit, v_beta_sc, k_bd_sc, intra, q_decay, k_decay_t, dl_exp, l_inv = (
        wide(x) for x in (l_unit, v_beta_sc, k_bd_sc, intra, q_decay, k_decay_t, dl_exp, l_inv))
    s = wide(s0)
    outs = []
    for n in range(l_unit.shape[1]):
        v_cor = _fwd_sub(l_unit[:, n], l_inv[:, n], v_beta_sc[:, n], ph, d)
        k_cum = _fwd_sub(l_unit[:, n], l_inv[:, n], k_bd_sc[:, n], ph, d)
        v_prime = _mm_ph(k_cum, s, ph, d)
        v_new = numerics.round_dst(_b(v_cor) - _b(v_prime), d)
        o_inter = _mm_ph(q_decay[:, n], s, ph, d)
        intra_v = _mm_ph(intra[:, n], v_new, ph, d)
        outs.append(numerics.round_dst(_b(o_inter) + _b(intra_v), d))
        s_upd = _mm_ph(k_decay_t[:, n], v_new, ph, d)
        # mul_tiles_bcast_scalar(S, dl): S in SrcA, dl in SrcB
        s_tmp = numerics.round_dst(numerics.fpu_product(_b(dl_exp[:, n, :1, :1]), _a(s), ph), d)
        s = numerics.round_dst(_b(s_tmp) + _b(s_upd), d)
    return torch.stack(outs, dim=1), s


@device_op(SEQ_OP)
def gated_delta_attn_seq(L_unit, v_beta_sc, k_bd_sc, intra_attn, q_decay, k_decay_t, dl_exp, L_inv, *,
                         initial_state=None, memory_config=None, compute_kernel_config=None):
    """Path A of the Gated-DeltaNet chunk scan (0.81.1 docstring): all inputs FLOAT32 TILE in DRAM, chunk, key and
    value dims exactly 128 (the kernels' four 32-row blocks); outputs FLOAT32 TILE ``[BH, NC, C, Dv]`` and
    ``[BH, Dk, Dv]``. Validation as the device op (``gated_delta_attn_device_operation.cpp``); default compute config
    HiFi2 with fp32 Dst (the op's host wrapper)."""
    for name, t in (("L_unit", L_unit), ("k_bd_sc", k_bd_sc), ("dl_exp", dl_exp), ("L_inv", L_inv),
                    ("v_beta_sc", v_beta_sc), ("intra_attn", intra_attn), ("q_decay", q_decay),
                    ("k_decay_t", k_decay_t)):
        if t is None or not getattr(t, "on_device", False):
            raise EmulatorError(f"{name} must be on device")
    bh, nc, c, _ = L_unit.logical_shape_list
    dk, dv = k_bd_sc.logical_shape_list[-1], v_beta_sc.logical_shape_list[-1]
    for name, val in (("chunk_size", c), ("key_dim", dk), ("val_dim", dv)):
        if val != _SEQ_DIM:
            raise EmulatorError(f"{name} must be exactly {_SEQ_DIM}, got {val}")
    for name, t, shape in (("L_unit", L_unit, [bh, nc, c, c]), ("k_bd_sc", k_bd_sc, [bh, nc, c, dk]),
                           ("dl_exp", dl_exp, [bh, nc, 1, 1]), ("L_inv", L_inv, [bh, nc, c, TILE]),
                           ("v_beta_sc", v_beta_sc, [bh, nc, c, dv]), ("intra_attn", intra_attn, [bh, nc, c, c]),
                           ("q_decay", q_decay, [bh, nc, c, dk]), ("k_decay_t", k_decay_t, [bh, nc, dk, c])):
        _seq_check(name, t, shape)
    if initial_state is not None:
        _seq_check("initial_state", initial_state, [bh, dk, dv])
    cfg = _SEQ_DEFAULT if compute_kernel_config is None else numerics.kernel_config(compute_kernel_config)
    if compute_kernel_config is not None and getattr(compute_kernel_config.math_fidelity, "name", "") == "Invalid":
        cfg = numerics.KernelConfig(2, cfg.fp32_dest_acc_en, cfg.math_approx_mode, cfg.packer_l1_acc, True)
    outs, states = [], []
    for i in range(L_unit.num_shards):
        s0 = torch.zeros(bh, dk, dv) if initial_state is None else initial_state.shards[i]
        o, s = gated_delta_attn_seq_math(*(t.shards[i] for t in (L_unit, v_beta_sc, k_bd_sc, intra_attn, q_decay,
                                                                   k_decay_t, dl_exp, L_inv)), s0, cfg)
        outs.append(o.to(torch.float32))
        states.append(s.to(torch.float32))
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    return (make_like(L_unit, outs, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, memory_config=mc),
            new_device_tensor(L_unit.mesh, states, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc))
