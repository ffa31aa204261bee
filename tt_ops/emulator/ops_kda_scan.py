"""The KDA chunk-recurrence pieces of ttnn 0.81.1 (``ttnn.experimental.kda``): ``prepare_chunk_recurrence``,
``recurrent_chunk_scan``, ``summarize_chunk_recurrence``, ``affine_exclusive_scan``, ``chain_affine_transforms``,
``reduce_affine_transforms`` and ``select_final_carry``. No golden function exists for them.

Semantics from their 0.81.1 docstrings and Tenstorrent's oracles for them (the prepared seven-tensor protocol of
``prepare_chunk_recurrence``: per-key cumulative decay G = cumsum(gate_scale * g) within 32-token chunks, q and k
L2-normalised over K (+1e-6), q times K^-0.5, beta = sigmoid(logits) in fp32; v_beta = beta v, kd = beta k e^G,
q_decay = q e^G, intra = tril(q_decay (k e^-G)^T), k_dec_t = (k e^{G_last - G})^T, final_decay = e^{G_last},
t_inv = (I + strictly_lower(kd (k e^-G)^T))^-1; the scan U = t_inv (v_beta - kd S), Y = q_decay S + intra U,
S' = final_decay * S + k_dec_t U; summaries S_after = A S + B with B = F(0), A = F(I) - B).

Numerics: computed in fp64 (N8) and rounded once to each output's dtype; the kernels' own rounding sequence (TF32
operand reads, the anchored gate factors, the nested polynomial inverse) is not modelled for these pieces
(docs/emulator_ops.md). One sequence-parallel rank per sequence (``sequence_parallel_axis`` of mesh size 1, the 1xN
meshes' default): the head/tail split and the fabric collectives of several ranks are refused by name, except in
``chain_affine_transforms``, whose gathered transforms are local.
"""

from __future__ import annotations

import math

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .kda_common import (TILE, check_device, check_dtype, check_interleaved, check_layout, check_output_interleaved,
                         chronology, kernel_config, scalar, sp_rank)
from .registry import device_op
from .tensor import dtype_name, make_like, new_device_tensor
from .ttnn_import import ttnn

PREP = "prepare_chunk_recurrence"
SCAN = "recurrent_chunk_scan"
SUMMARY = "summarize_chunk_recurrence"
EXCL = "affine_exclusive_scan"
CHAIN = "chain_affine_transforms"
REDUCE = "reduce_affine_transforms"
SELECT = "select_final_carry"
_PREP_BF16_BITS = (0, 1, 2, 4, 5)  # v_beta, kd, q_decay, k_dec_t, final_decay
_F32_DEFAULT = numerics.KernelConfig(phases=4, fp32_dest_acc_en=True, math_approx_mode=True, packer_l1_acc=False,
                                     given=False)


def _w(x):
    return numerics.wide(x.to(torch.float32))


def _single_rank(op: str, t, axis) -> None:
    for i in range(t.num_shards):
        _, parts = sp_rank(op, t, i, axis or 0)
        if parts > 1:
            raise NotEmulatedError(f"ttnn.experimental.kda.{op}: {parts} sequence-parallel ranks (head/tail splits and "
                                   "their collectives) are not emulated; use a sequence_parallel_axis of mesh size 1")


def _valid_rows(op, start_t, end_t, i, rows) -> int:
    start = scalar(op, "actual_start", start_t, i) if start_t is not None else 0
    end = None if end_t is None else scalar(op, "actual_end", end_t, i)
    if end is not None and start_t is None:
        raise EmulatorError(f"{op}: actual_end requires actual_start")
    return chronology(start, 0, 1, rows, end)["valid_rows"]


def _tile_device(op, name, t, dtypes=("FLOAT32", "BFLOAT16")):
    check_device(op, name, t)
    check_layout(op, name, t, ttnn.TILE_LAYOUT)
    check_interleaved(op, name, t)
    check_dtype(op, name, t, *dtypes)


# ---- prepare_chunk_recurrence ----------------------------------------------------------------------------------------
def prepare_math(q, k, v, g, logits, gate_scale: float, valid: int):
    """One device, one batch: q/k/g [T, H, K], v [T, H, V], beta logits [T, H] -> the seven terms [H, N, ...]."""
    t_len, h, kd_ = q.shape
    q, k, v, g, logits = (_w(x) for x in (q, k, v, g, logits))
    if valid < t_len:  # rows past actual_end: gate, beta-logit, key and value become zeros (identity steps)
        for x in (k, v, g, logits):
            x[valid:] = 0
    n = t_len // TILE
    hf = lambda x: x.reshape(n, TILE, h, -1).permute(2, 0, 1, 3)  # noqa: E731  [H, N, 32, D]
    q, k, v, g = hf(q), hf(k), hf(v), hf(g * float(torch.tensor(gate_scale, dtype=torch.float32)))
    beta = torch.sigmoid(logits.reshape(n, TILE, h).permute(2, 0, 1)).unsqueeze(-1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * kd_ ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    cg = torch.cumsum(g, dim=2)
    decay, inv = torch.exp(cg), torch.exp(-cg)
    last = cg[:, :, -1:]
    kd = beta * k * decay
    q_decay = q * decay
    kr = (k * inv).transpose(-1, -2)
    return (beta * v, kd, q_decay, torch.tril(q_decay @ kr), (k * torch.exp(last - cg)).transpose(-1, -2),
            torch.exp(last).transpose(-1, -2), _unit_lower_inverse(torch.tril(kd @ kr, diagonal=-1)))


def _unit_lower_inverse(strict):
    """(I + strict)^-1 by forward substitution in fp64 (no LAPACK: the same bits on every host)."""
    c = strict.shape[-1]
    x = torch.eye(c, dtype=strict.dtype).expand(strict.shape).clone()
    for r in range(1, c):
        x[..., r, :] = x[..., r, :] - (strict[..., r, :r].unsqueeze(-1) * x[..., :r, :]).sum(-2)
    return x


@device_op("ttnn.experimental.kda.prepare_chunk_recurrence")
def prepare_chunk_recurrence(q, k, v, g, beta, num_heads, *, memory_config=None, compute_kernel_config=None,
                             output_bf16_mask=0, actual_start=None, actual_end=None, sequence_parallel_axis=0,
                             gate_scale=1.0, beta_logits_column_offset=0):
    op = PREP
    if int(num_heads) <= 0:
        raise EmulatorError(f"{op}: num_heads must be positive")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _tile_device(op, name, t, ("BFLOAT16",))
    if any(len(t.logical_shape_list) != 3 for t in (q, k, v, g)):
        raise EmulatorError(f"{op}: q, k, v, and g must be rank 3 production-flat tensors")
    if any(t.logical_shape_list[0] != 1 for t in (q, k, v, g)):
        raise EmulatorError(f"{op}: q, k, v, and g must have leading dimension 1")
    if not (q.logical_shape_list == k.logical_shape_list == g.logical_shape_list):
        raise EmulatorError(f"{op}: q, k, and g must have matching shapes")
    t_len = q.logical_shape_list[1]
    if v.logical_shape_list[1] != t_len:
        raise EmulatorError(f"{op}: q, k, v, and g must have matching sequence lengths")
    if t_len <= 0 or t_len % TILE:
        raise EmulatorError(f"{op}: sequence length must be positive and divisible by 32")
    h = int(num_heads)
    if q.logical_shape_list[2] % h or v.logical_shape_list[2] % h:
        raise EmulatorError(f"{op}: flat widths must be divisible by num_heads")
    kd_, vd = q.logical_shape_list[2] // h, v.logical_shape_list[2] // h
    if kd_ % TILE or vd % TILE:
        raise EmulatorError(f"{op}: K and V must be positive and tile aligned")
    off = int(beta_logits_column_offset)
    bs = beta.logical_shape_list
    if len(bs) != 3 or bs[0] != 1 or bs[1] != t_len or off % TILE or bs[2] < off + h:
        raise EmulatorError(f"{op}: beta logits must be token-major [1, num_chunks * 32, columns] with a tile-aligned "
                            "column offset and num_heads columns after it")
    if not math.isfinite(float(gate_scale)):
        raise EmulatorError(f"{op}: gate_scale must be finite")
    mask = int(output_bf16_mask)
    if mask & ~sum(1 << b for b in _PREP_BF16_BITS):
        raise EmulatorError(f"{op}: unsupported KDA prep BF16 mask 0x{mask:x}")
    if actual_end is not None and actual_start is None:
        raise EmulatorError(f"{op}: actual_end requires actual_start")
    check_output_interleaved(op, memory_config)
    kernel_config(op, compute_kernel_config, _F32_DEFAULT)
    _single_rank(op, q, sequence_parallel_axis)
    outs = [[] for _ in range(7)]
    for i in range(q.num_shards):
        valid = t_len if actual_start is None else _valid_rows(op, actual_start, actual_end, i, t_len)
        terms = prepare_math(*(x.shards[i].reshape(t_len, h, -1) for x in (q, k, v, g)),
                             beta.shards[i].reshape(t_len, -1)[:, off:off + h], float(gate_scale), valid)
        for j, term in enumerate(terms):
            outs[j].append(term.to(torch.float32))
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    return [make_like(q, shards, dtype=ttnn.bfloat16 if mask & (1 << j) else ttnn.float32, layout=ttnn.TILE_LAYOUT,
                      memory_config=mc) for j, shards in enumerate(outs)]


# ---- recurrent_chunk_scan / summarize_chunk_recurrence -----------------------------------------------------------
def scan_math(protocol, state, want_outputs=True):
    """The recurrence over the chunks of each leading row: protocol tensors [L, N, ...] fp64, state [L, K, V]."""
    v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv = protocol
    s = state.clone()
    ys = []
    for n in range(v_beta.shape[1]):
        u = t_inv[:, n] @ (v_beta[:, n] - kd[:, n] @ s)
        if want_outputs:
            ys.append(q_decay[:, n] @ s + intra[:, n] @ u)
        s = final_decay[:, n] * s + k_dec_t[:, n] @ u
    return (torch.stack(ys, 1) if want_outputs else None), s


def _protocol(op, args):
    names = ("v_beta", "kd", "q_decay", "intra", "k_dec_t", "final_decay", "t_inv")
    for name, t in zip(names, args):
        _tile_device(op, name, t, ("FLOAT32",) if name in ("intra", "t_inv") else ("FLOAT32", "BFLOAT16"))
    v_beta, kd = args[0], args[1]
    if len(v_beta.logical_shape_list) != 4 or len(kd.logical_shape_list) != 4:
        raise EmulatorError(f"{op}: v_beta and kd must be rank 4")
    lead, n, c, vd = v_beta.logical_shape_list
    kd_ = kd.logical_shape_list[-1]
    if kd_ <= 0 or vd <= 0 or kd_ % TILE or vd % TILE:
        raise EmulatorError(f"{op}: K and V must be positive and tile aligned")
    shapes = ([lead, n, c, vd], [lead, n, c, kd_], [lead, n, c, kd_], [lead, n, c, c], [lead, n, kd_, c],
              [lead, n, kd_, 1], [lead, n, c, c])
    for name, t, shape in zip(names, args, shapes):
        if t.logical_shape_list != shape:
            raise EmulatorError(f"{op}: {name} shape mismatch")
    return lead, n, kd_, vd


def _groups(op, lead, groups_per_head):
    g = int(groups_per_head)
    if g <= 0:
        raise EmulatorError(f"{op}: groups_per_head must be positive")
    if lead % g:
        raise EmulatorError(f"{op}: groups_per_head {g} must divide the folded leading dimension {lead}")
    return g


def _active_groups(op, start_t, end_t, i, rows_per_group, groups) -> int:
    valid = _valid_rows(op, start_t, end_t, i, rows_per_group * groups)
    return -(-valid // rows_per_group)


@device_op("ttnn.experimental.kda.recurrent_chunk_scan")
def recurrent_chunk_scan(v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv, group_entry_states, *, actual_start,
                         tail_entry_states, groups_per_head=1, memory_config=None, compute_kernel_config=None,
                         sequence_parallel_axis=0, actual_end=None):
    op = SCAN
    args = (v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv)
    lead, n, kd_, vd = _protocol(op, args)
    if group_entry_states is None:
        raise EmulatorError(f"{op}: group_entry_states is required")
    if len(group_entry_states.logical_shape_list) != 3:
        raise EmulatorError(f"{op}: group_entry_states must be rank 3")
    _tile_device(op, "group_entry_states", group_entry_states, ("FLOAT32",))
    if tail_entry_states is None:
        raise EmulatorError(f"{op}: tail_entry_states is required")
    groups = _groups(op, lead, groups_per_head)
    check_output_interleaved(op, memory_config)
    kernel_config(op, compute_kernel_config, _F32_DEFAULT)
    _single_rank(op, v_beta, sequence_parallel_axis)
    ys, ss = [], []
    for i in range(v_beta.num_shards):
        y, s = scan_math([_w(t.shards[i]) for t in args], _w(group_entry_states.shards[i]))
        active = _active_groups(op, actual_start, actual_end, i, n * TILE, groups)
        if active < groups:  # the last valid group's state also goes to group G-1 (fixed-slot carry selection)
            s = s.reshape(-1, groups, kd_, vd).clone()
            s[:, groups - 1] = s[:, active - 1]
            s = s.reshape(lead, kd_, vd)
        ys.append(y.to(torch.float32))
        ss.append(s.to(torch.float32))
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    return [make_like(v_beta, ys, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, memory_config=mc),
            new_device_tensor(v_beta.mesh, ss, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc)]


@device_op("ttnn.experimental.kda.summarize_chunk_recurrence")
def summarize_chunk_recurrence(v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv, *, actual_start,
                               groups_per_head=1, memory_config=None, compute_kernel_config=None,
                               sequence_parallel_axis=0, actual_end=None, packed_head=False):
    op = SUMMARY
    args = (v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv)
    lead, n, kd_, vd = _protocol(op, args)
    if kd_ != vd:
        raise EmulatorError(f"{op}: K must equal V")
    groups = _groups(op, lead, groups_per_head)
    if packed_head and groups != 1:
        raise EmulatorError(f"{op}: packed_head requires a summary with one group per head")
    if packed_head and memory_config is not None and memory_config.is_sharded():
        raise EmulatorError(f"{op}: packed_head requires an interleaved output")
    kernel_config(op, compute_kernel_config, _F32_DEFAULT)
    _single_rank(op, v_beta, sequence_parallel_axis)
    heads_a, heads_b = [], []
    for i in range(v_beta.num_shards):
        proto = [_w(t.shards[i]) for t in args]
        _, b = scan_math(proto, torch.zeros(lead, kd_, vd, dtype=numerics.WIDE), want_outputs=False)
        _, fi = scan_math(proto, torch.eye(kd_, dtype=numerics.WIDE).expand(lead, kd_, kd_).clone(),
                          want_outputs=False)
        heads_a.append((fi - b).to(torch.float32))
        heads_b.append(b.to(torch.float32))
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    if packed_head:
        packed = [torch.cat([a, b], -1).reshape(1, lead, kd_, kd_ + vd) for a, b in zip(heads_a, heads_b)]
        return [make_like(v_beta, packed, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, memory_config=mc)]
    # an unsplit rank defines only the head pair; the tail slots are unspecified (NaN here, as any garbage would be)
    nan = [torch.full_like(a, float("nan")) for a in heads_a]
    nan_b = [torch.full_like(b, float("nan")) for b in heads_b]
    return [make_like(v_beta, x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, memory_config=mc)
            for x in (heads_a, heads_b, nan, nan_b)]


# ---- the affine-transform scans -----------------------------------------------------------------------------------
# "exact HiFi2 math with FP32 destination accumulation" (the affine_exclusive_scan / chain_affine_transforms docstrings)
_HIFI2_FP32 = numerics.KernelConfig(phases=2, fp32_dest_acc_en=True, math_approx_mode=False, packer_l1_acc=False,
                                    given=False)


def _affine_step(a, s, b, a_dtype: str, cfg):
    """``a @ s (+ b)``: the K-sum as the FPU computes it (a in SrcB, the fp32 state in SrcA, ``cfg``'s fidelity, per K
    tile into the Dst), then an fp32 add; an fp32 result."""
    prod = numerics.fpu_matmul(a.to(torch.float32), s.to(torch.float32), a_dtype, "FLOAT32", cfg)
    return prod if b is None else numerics.round_fp32(numerics.wide(prod) + _w(b)).to(torch.float32)


def _affine_pair(op, a, b):
    check_device(op, "a", a)
    check_device(op, "b", b)
    for name, t in (("a", a), ("b", b)):
        check_layout(op, name, t, ttnn.TILE_LAYOUT)
        check_dtype(op, name, t, "FLOAT32", "BFLOAT16")
    if len(a.logical_shape_list) != 3 or len(b.logical_shape_list) != 3:
        raise EmulatorError(f"{op}: inputs must be rank 3")
    (la, ka, ka2), (lb, kb, vb) = a.logical_shape_list, b.logical_shape_list
    if la <= 0:
        raise EmulatorError(f"{op}: leading dimension must be positive")
    if ka != ka2:
        raise EmulatorError(f"{op}: a must contain square KxK matrices")
    if la != lb:
        raise EmulatorError(f"{op}: a and b must have matching leading dimensions" if op == EXCL else
                            f"{op}: inputs must have matching leading dimensions")
    if ka != kb:
        raise EmulatorError(f"{op}: a and b must have matching K dimensions")
    if ka % TILE or vb % TILE:
        raise EmulatorError(f"{op}: K and V must be positive and tile aligned")
    return la, ka, vb


def _local_rows(op, rows, groups):
    if int(rows) <= 0 or int(rows) % TILE:
        raise EmulatorError(f"{op}: local_rows must be positive and 32-aligned")
    if (int(rows) // TILE) % groups:
        raise EmulatorError(f"{op}: local_rows must contain a positive whole number of 32-token chunks per group")


@device_op("ttnn.experimental.kda.affine_exclusive_scan")
def affine_exclusive_scan(a, b, initial_state, groups_per_head, *, actual_start, local_rows, tail_a, tail_b,
                          tail_entry_states, memory_config=None, compute_kernel_config=None, sequence_parallel_axis=0,
                          actual_end=None):
    op = EXCL
    lead, kd_, vd = _affine_pair(op, a, b)
    if int(groups_per_head) <= 0:
        raise EmulatorError(f"{op}: groups_per_head must be positive")
    groups = int(groups_per_head)
    if lead % groups:
        raise EmulatorError(f"{op}: leading dimension must be divisible by groups_per_head")
    check_device(op, "initial_state", initial_state)
    if initial_state.logical_shape_list != [lead // groups, kd_, vd]:
        raise EmulatorError(f"{op}: initial_state shape must be [batch_heads, K, V]")
    check_dtype(op, "initial_state", initial_state, "FLOAT32")
    if tail_a.logical_shape_list != a.logical_shape_list:
        raise EmulatorError(f"{op}: tail_a shape must match a")
    if tail_b.logical_shape_list != b.logical_shape_list:
        raise EmulatorError(f"{op}: tail_b shape must match b")
    if tail_entry_states.logical_shape_list != initial_state.logical_shape_list:
        raise EmulatorError(f"{op}: tail_entry_states shape must match initial_state")
    _local_rows(op, local_rows, groups)
    check_output_interleaved(op, memory_config)
    cfg = kernel_config(op, compute_kernel_config, _HIFI2_FP32)
    _single_rank(op, a, sequence_parallel_axis)
    outs = []
    for i in range(a.num_shards):
        aa, bb = (t.shards[i].reshape(-1, groups, *t.logical_shape_list[1:]) for t in (a, b))
        s = initial_state.shards[i].to(torch.float32)
        entries = []
        for g in range(groups):
            entries.append(s)
            s = _affine_step(aa[:, g], s, bb[:, g], dtype_name(a.dtype), cfg)
        outs.append(torch.stack(entries, 1).reshape(lead, kd_, vd))
    return new_device_tensor(a.mesh, outs, ttnn.float32, ttnn.TILE_LAYOUT,
                             memory_config=memory_config or ttnn.DRAM_MEMORY_CONFIG)


@device_op("ttnn.experimental.kda.reduce_affine_transforms")
def reduce_affine_transforms(a, b, groups_per_head, *, actual_start, local_rows, memory_config=None,
                             compute_kernel_config=None, sequence_parallel_axis=0, actual_end=None):
    op = REDUCE
    lead, kd_, vd = _affine_pair(op, a, b)
    if int(groups_per_head) <= 0:
        raise EmulatorError(f"{op}: groups_per_head must be positive")
    groups = int(groups_per_head)
    if lead % groups:
        raise EmulatorError(f"{op}: leading dimension must be divisible by groups_per_head")
    _local_rows(op, local_rows, groups)
    check_output_interleaved(op, memory_config)
    cfg = kernel_config(op, compute_kernel_config, _HIFI2_FP32)
    _single_rank(op, a, sequence_parallel_axis)
    out_a, out_b = [], []
    dt = dtype_name(a.dtype)
    for i in range(a.num_shards):
        aa, bb = (t.shards[i].reshape(-1, groups, *t.logical_shape_list[1:]) for t in (a, b))
        active = _active_groups(op, actual_start, actual_end, i, int(local_rows) // groups, groups)
        ta, tb = aa[:, 0].to(torch.float32), bb[:, 0].to(torch.float32)
        for g in range(1, active):  # composed in sequence order: A = A_g A, B = A_g B + B_g
            ta, tb = _affine_step(aa[:, g], ta, None, dt, cfg), _affine_step(aa[:, g], tb, bb[:, g], dt, cfg)
        out_a.append(ta)
        out_b.append(tb)
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    return (new_device_tensor(a.mesh, out_a, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc),
            new_device_tensor(a.mesh, out_b, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc))




@device_op("ttnn.experimental.kda.chain_affine_transforms")
def chain_affine_transforms(transforms, initial_state, *, actual_start, local_rows, memory_config=None,
                            compute_kernel_config=None, sequence_parallel_axis=0):
    op = CHAIN
    check_device(op, "transforms", transforms)
    if len(transforms.logical_shape_list) != 4:
        raise EmulatorError(f"{op}: transforms must be rank 4 [P, B*H, K, K + V]")
    check_device(op, "initial_state", initial_state)
    if len(initial_state.logical_shape_list) != 3:
        raise EmulatorError(f"{op}: initial_state must be rank 3 [B*H, K, V]")
    check_layout(op, "transforms", transforms, ttnn.TILE_LAYOUT)
    check_dtype(op, "transforms", transforms, "BFLOAT16")
    check_dtype(op, "initial_state", initial_state, "FLOAT32")
    cfg = kernel_config(op, compute_kernel_config, _HIFI2_FP32)
    if not cfg.fp32_dest_acc_en:
        raise EmulatorError(f"{op}: fp32_dest_acc_en must be enabled; the FP32 product unpacks to DST for the add")
    p_, bh, kd_, kv = transforms.logical_shape_list
    vd = kv - kd_
    if initial_state.logical_shape_list != [bh, kd_, vd] or kd_ % TILE or vd <= 0 or vd % TILE:
        raise EmulatorError(f"{op}: transforms [P, B*H, K, K + V] and initial_state [B*H, K, V] disagree or are not "
                            "tile aligned")
    if int(local_rows) <= 0 or int(local_rows) % TILE:
        raise EmulatorError(f"{op}: local_rows must be positive and 32-aligned")
    entries, finals = [], []
    for i in range(transforms.num_shards):
        rank, parts = sp_rank(op, transforms, i, sequence_parallel_axis)
        if p_ != parts:
            raise EmulatorError(f"{op}: transforms hold {p_} rank transitions, the sequence-parallel axis has {parts}")
        first = chronology(scalar(op, "actual_start", actual_start, i), rank, parts, int(local_rows))["first_rank"]
        tr = transforms.shards[i]
        s = initial_state.shards[i].to(torch.float32)
        states = [s]
        for step in range(parts):  # S_{s+1} = A_rank(s) S_s + B_rank(s): the K-sum in fp32, then an fp32 add
            r = (first + step) % parts
            s = _affine_step(tr[r, :, :, :kd_], s, tr[r, :, :, kd_:], "BFLOAT16", cfg)
            states.append(s)
        entries.append(states[(rank - first) % parts])
        finals.append(s)
    mc = memory_config or ttnn.DRAM_MEMORY_CONFIG
    return (new_device_tensor(transforms.mesh, entries, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc),
            new_device_tensor(transforms.mesh, finals, ttnn.float32, ttnn.TILE_LAYOUT, memory_config=mc))


@device_op("ttnn.experimental.kda.select_final_carry")
def select_final_carry(rank_final, prefix_final, *, actual_start, local_rows, actual_end=None, memory_config=None,
                       sequence_parallel_axis=0, num_links=None):
    op = SELECT
    check_device(op, "rank_final", rank_final)
    check_device(op, "prefix_final", prefix_final)
    for name, t in (("rank_final", rank_final), ("prefix_final", prefix_final)):
        check_layout(op, name, t, ttnn.TILE_LAYOUT)
        check_dtype(op, name, t, "FLOAT32")
    if num_links is not None and int(num_links) <= 0:
        raise EmulatorError(f"{op}: num_links must be positive")
    if int(local_rows) <= 0 or int(local_rows) % TILE:
        raise EmulatorError(f"{op}: local_rows must be positive and 32-aligned")
    cols = int(rank_final.mesh.shape[1])
    axis = int(sequence_parallel_axis or 0)
    coords = [(i // cols, i % cols) for i in range(rank_final.num_shards)]
    out = []
    for i in range(rank_final.num_shards):
        rank, parts = sp_rank(op, rank_final, i, axis)
        end = None if actual_end is None else scalar(op, "actual_end", actual_end, i)
        t = chronology(scalar(op, "actual_start", actual_start, i), rank, parts, int(local_rows), end)
        if t["split"]:  # the owner of the separated tail multicasts its final state along the sequence-parallel line
            owner = next(j for j, c in enumerate(coords)
                         if c[axis] == t["final_owner"] and c[1 - axis] == coords[i][1 - axis])
            src = rank_final.shards[owner]
            out.append((src[:, -1] if src.dim() == 4 else src).to(torch.float32).clone())
        else:  # every rank copies its replicated prefix_final
            out.append(prefix_final.shards[i].to(torch.float32).clone())
    return new_device_tensor(rank_final.mesh, out, ttnn.float32, ttnn.TILE_LAYOUT,
                             memory_config=memory_config or ttnn.DRAM_MEMORY_CONFIG)
