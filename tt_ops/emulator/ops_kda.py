"""The KDA convolution and gated norm of ttnn 0.81.1 (``ttnn.experimental.kda``), which have no golden function.

Modelled from each op's 0.81.1 docstring, the validation messages in the installed ``_ttnncpp.so`` and the kernels the
wheel ships under ``ttnn/cpp/ttnn/operations/experimental/kda/`` (docs/emulator_ops.md "KDA and fused GDN ops").

``qkv_causal_conv1d_silu(input, history, tap0..tap3, q_width, k_width, v_width, *, program_config, actual_start,
predecessor_carry, ...)`` and ``..._with_carry(..., exchange_buffer, exchange_semaphores, actual_end=None)``:

* ``input`` ``[1, T, W]`` BFLOAT16, read in place from column ``input_column_offset`` (tile aligned); a ROW_MAJOR
  input is tilized first (one more program). ``history`` (and ``predecessor_carry``) ``[1, 3, C]`` ROW_MAJOR
  BFLOAT16, C = Q+K+V; taps TILE BFLOAT16 of logical volume C. Outputs q/k/v ``[1, T, Q|K|V]`` TILE BFLOAT16.
* Kernel (``qkv_causal_conv1d_silu.cpp``): each tap becomes a diagonal tile (identity x row-broadcast tap, exact) and
  the four shifted activation tiles are matmul'd against them into one Dst, tap 0 (token t-3) first, so Dst holds
  ``((x[t-3] w0 + x[t-2] w1) + x[t-1] w2) + x[t] w3`` rounded to the Dst format after every tap (bf16 Dst by
  default: the op's default config is HiFi4, no approx, fp32_dest_acc_en off); SiLU (precise sigmoid) runs on the
  SFPU in place and the result is packed to BFLOAT16.
* The three rows before the first tile: the caller's ``history`` on the rank holding the chronological start,
  ``predecessor_carry`` on the other sequence-parallel ranks (and at a head/tail split): the chronology derived from
  ``actual_start`` and the mesh coordinate (``kda/device/kernels/chronology.hpp``).
* ``_with_carry`` also returns the next call's history ``[1, 3, C]`` ROW_MAJOR BFLOAT16: the last three rows of
  ``history ++ input[:actual_end - actual_start]`` (one sequence-parallel rank; the fabric exchange over several
  ranks is not emulated).

``sigmoid_gated_rms_norm(input [B*H, T, V], gate [B, T, W], weight [V], num_heads, *, epsilon, output_dtype,
gate_column_offset)`` -> ``[B, T, H*V]`` TILE: per head ``x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate)`` with
the gate read at ``gate_column_offset + h*V``. Kernel order (``sigmoid_gated_rms_norm.cpp``): square, row mean (reduce
with a 1/V scaler), +eps and rsqrt, x * inv, * weight, sigmoid(gate), product; the intermediates live in FLOAT32
buffers unpacked to the Src registers (TF32), Dst fp32 by default (HiFi4, approx on, fp32_dest_acc_en on).
"""

from __future__ import annotations

import math

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .kda_common import (check_device, check_dtype, check_interleaved, check_layout, check_output_interleaved,
                         chronology, kernel_config, scalar, sp_rank)
from .op_accounting import bind_op
from .program_cache import register_key_args
from .programs import register_programs
from .registry import device_op
from .tensor import dtype_name, make_like, new_device_tensor, shard_bytes
from .ttnn_import import ttnn

TILE = 32
HISTORY_ROWS = 3
CONV = "qkv_causal_conv1d_silu"
CONV_OP = "ttnn.experimental.kda.qkv_causal_conv1d_silu"
CARRY_OP = "ttnn.experimental.kda.qkv_causal_conv1d_silu_with_carry"
NORM = "sigmoid_gated_rms_norm"
NORM_OP = "ttnn.experimental.kda.sigmoid_gated_rms_norm"


# ---- qkv_causal_conv1d_silu ----------------------------------------------------------------------------------------
_CONV_DEFAULT = numerics.KernelConfig(phases=4, fp32_dest_acc_en=False, math_approx_mode=False, packer_l1_acc=False,
                                      given=False)


def _conv_validate(op, b, carry: bool) -> tuple[int, int, int, int]:
    x, hist = b["input"], b["history"]
    check_device(op if not carry else CONV, "input", x)
    if len(x.logical_shape_list) != 3:
        raise EmulatorError(f"{CONV}: input must be an allocated device tensor of rank 3")
    widths = [int(b[k]) for k in ("q_width", "k_width", "v_width")]
    if min(widths) <= 0:
        raise EmulatorError(f"{CONV}: Q/K/V widths must be positive")
    if any(w % TILE for w in widths):
        raise EmulatorError(f"{CONV}: Q/K/V widths must be tile aligned")
    c = sum(widths)
    ccs = int(b["program_config"].channel_chunk_size)
    if ccs <= 0:
        raise EmulatorError(f"{CONV}: channel_chunk_size must be positive")
    if ccs % TILE:
        raise EmulatorError(f"{CONV}: channel_chunk_size must be tile aligned")
    if ccs > c:
        raise EmulatorError(f"{CONV}: channel_chunk_size must not exceed Q+K+V width")
    if c % ccs:
        raise EmulatorError(f"{CONV}: channel_chunk_size must divide Q+K+V width exactly")
    off = int(b.get("input_column_offset") or 0)
    if off % TILE:
        raise EmulatorError(f"{CONV}: input_column_offset must be tile aligned")
    one, t_len, w = x.logical_shape_list
    if one != 1 or w < off + c:
        raise EmulatorError(f"{CONV}: input must be [1,T,W] holding the convolution channels from "
                            f"input_column_offset (got {x.logical_shape_list}, offset {off}, Q+K+V {c})")
    if t_len <= 0 or t_len % TILE:
        raise EmulatorError(f"{CONV}: sequence must be positive and tile aligned")
    check_dtype(CONV, "input", x, "BFLOAT16")
    check_interleaved(CONV, "input", x)
    check_device(CONV, "history", hist)
    check_layout(CONV, "history", hist, ttnn.ROW_MAJOR_LAYOUT)
    check_dtype(CONV, "history", hist, "BFLOAT16")
    check_interleaved(CONV, "history", hist)
    if hist.logical_shape_list != [1, HISTORY_ROWS, c]:
        raise EmulatorError(f"{CONV}: history must be [1,{HISTORY_ROWS},Q+K+V]")
    for i in range(4):
        tap = b[f"tap{i}"]
        check_device(CONV, f"tap{i}", tap)
        check_layout(CONV, f"tap{i}", tap, ttnn.TILE_LAYOUT)
        check_dtype(CONV, f"tap{i}", tap, "BFLOAT16")
        check_interleaved(CONV, f"tap{i}", tap)
        if tap.logical_volume() != c:
            raise EmulatorError(f"{CONV}: tap{i} logical volume must equal Q+K+V")
        if tap.logical_shape_list[-1] != c:
            raise EmulatorError(f"{CONV}: tap{i} last dimension must equal Q+K+V")
    check_output_interleaved(CONV, b.get("memory_config"))
    return t_len, c, off, ccs


def _conv_rows(b, i: int, t_len: int, c: int, off: int, cfg, carry_hist: bool):
    """Device ``i``: (q|k|v fp64 [T, C] rounded as the kernel rounds, the window's input rows [T, C] fp64)."""
    x = b["input"].shards[i].reshape(t_len, -1)[:, off:off + c]
    hist = b["history"].shards[i].reshape(HISTORY_ROWS, c)
    pred = hist if carry_hist else b["predecessor_carry"].shards[i].reshape(HISTORY_ROWS, c)
    rank, parts = sp_rank(CONV, b["input"], i, b.get("sequence_parallel_axis") or 0)
    topo = chronology(scalar(CONV, "actual_start", b["actual_start"], i), rank, parts, t_len)
    # the three rows before every 32-row tile: the previous tile's last rows, or a carry at a segment start
    x64 = numerics.wide(x.to(torch.float32))
    tiles = t_len // TILE
    before = torch.stack([numerics.wide(hist.to(torch.float32))]
                         + [x64[m * TILE - HISTORY_ROWS:m * TILE] for m in range(1, tiles)])  # [tiles, 3, C]
    p64 = numerics.wide(pred.to(torch.float32))
    if topo["rank"] != topo["first_rank"]:
        before[0] = p64
    if topo["local_split"]:
        before[topo["head_rows"] // TILE] = p64
    window = torch.cat([before, x64.reshape(tiles, TILE, c)], 1)  # [tiles, 35, C]
    acc = None
    for tap in range(4):
        w = numerics.wide(b[f"tap{tap}"].shards[i].reshape(-1).to(torch.float32))
        part = numerics.fpu_product(window[:, tap:tap + TILE], w, cfg.phases)  # act in SrcB, diagonal in SrcA
        acc = numerics.round_dst(part if acc is None else acc + part, cfg.fp32_dest_acc_en)
    out = numerics.round_dst(acc * torch.sigmoid(acc), cfg.fp32_dest_acc_en)  # SFPU SiLU, written back to Dst
    return out.reshape(t_len, c), x64


def _conv_outputs(b, cfg, t_len, c, off, carry_hist=False):
    widths = [int(b[k]) for k in ("q_width", "k_width", "v_width")]
    per = [[], [], []]
    rows = []
    for i in range(b["input"].num_shards):
        out, x64 = _conv_rows(b, i, t_len, c, off, cfg, carry_hist)
        rows.append(x64)
        for j, part in enumerate(torch.split(out, widths, dim=1)):
            per[j].append(part.to(torch.float32).reshape(1, t_len, widths[j]))
    mc = b.get("memory_config") or ttnn.DRAM_MEMORY_CONFIG
    outs = tuple(make_like(b["input"], shards, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, memory_config=mc,
                           pad_fill=0.0) for shards in per)
    return outs, rows


def _conv_bind(op, args, kwargs):
    return bind_op(op, args, kwargs)


def _conv_read(op):
    def read(args, kwargs):
        b = bind_op(op, args, kwargs)
        x = b["input"]
        t_len = x.logical_shape_list[1]
        c = sum(int(b[k]) for k in ("q_width", "k_width", "v_width"))
        out = {"BFLOAT16": t_len * c * 2 + HISTORY_ROWS * c * 2 + 4 * (c // TILE) * 1024}
        if x.layout != ttnn.TILE_LAYOUT:  # the tilize program reads the whole row-major input
            out["BFLOAT16"] += x.bytes_per_device()
        return out
    return read


def _conv_written(op):
    def written(args, kwargs):
        b = bind_op(op, args, kwargs)
        x = b["input"]
        t_len = x.logical_shape_list[1]
        c = sum(int(b[k]) for k in ("q_width", "k_width", "v_width"))
        n = t_len * c * 2
        if x.layout != ttnn.TILE_LAYOUT:
            n += shard_bytes(x.logical_shape_list, x.dtype, ttnn.TILE_LAYOUT)
        if op == CARRY_OP:
            n += 2 * HISTORY_ROWS * c * 2  # the carry, and the rows staged in the exchange buffer
        return {"BFLOAT16": n}
    return written


def _conv_programs(args, kwargs, out) -> int:
    """One program; a ROW_MAJOR input is tilized first (docstring: "A ROW_MAJOR input is tilized first")."""
    x = args[0] if args else kwargs.get("input")
    return 1 + int(getattr(x, "layout", ttnn.TILE_LAYOUT) != ttnn.TILE_LAYOUT)


def _tilized(b):
    x = b["input"]
    if x.layout == ttnn.TILE_LAYOUT:
        return b
    return dict(b, input=make_like(x, list(x.shards), layout=ttnn.TILE_LAYOUT, pad_fill=0.0))


@device_op(CONV_OP, read_bytes=_conv_read(CONV_OP), written_bytes=_conv_written(CONV_OP))
def qkv_causal_conv1d_silu(input, history, tap0, tap1, tap2, tap3, q_width, k_width, v_width, *, program_config,
                           actual_start, predecessor_carry, memory_config=None, compute_kernel_config=None,
                           sequence_parallel_axis=0, input_column_offset=0):
    b = _conv_bind(CONV_OP, (input, history, tap0, tap1, tap2, tap3, q_width, k_width, v_width),
                   dict(program_config=program_config, actual_start=actual_start, predecessor_carry=predecessor_carry,
                        memory_config=memory_config, compute_kernel_config=compute_kernel_config,
                        sequence_parallel_axis=sequence_parallel_axis, input_column_offset=input_column_offset))
    t_len, c, off, _ = _conv_validate(CONV, b, carry=False)
    check_device(CONV, "predecessor_carry", predecessor_carry)
    if (predecessor_carry.logical_shape_list != history.logical_shape_list or predecessor_carry.dtype != history.dtype
            or predecessor_carry.layout != history.layout
            or repr(predecessor_carry.memory_config()) != repr(history.memory_config())):
        raise EmulatorError(f"{CONV}: predecessor_carry must have history's tensor spec (shape, dtype, layout, "
                            "memory config); pass history itself for local execution")
    cfg = kernel_config(CONV, compute_kernel_config, _CONV_DEFAULT, approx_refused=(
        f"{CONV}: math_approx_mode=true is unsupported because the fused SiLU uses the precise sigmoid"))
    outs, _ = _conv_outputs(_tilized(b), cfg, t_len, c, off)
    return outs


@device_op(CARRY_OP, read_bytes=_conv_read(CARRY_OP), written_bytes=_conv_written(CARRY_OP))
def qkv_causal_conv1d_silu_with_carry(input, history, tap0, tap1, tap2, tap3, q_width, k_width, v_width, *,
                                      program_config, actual_start, exchange_buffer, exchange_semaphores,
                                      actual_end=None, memory_config=None, compute_kernel_config=None,
                                      sequence_parallel_axis=0, input_column_offset=0):
    b = _conv_bind(CARRY_OP, (input, history, tap0, tap1, tap2, tap3, q_width, k_width, v_width),
                   dict(program_config=program_config, actual_start=actual_start, exchange_buffer=exchange_buffer,
                        exchange_semaphores=exchange_semaphores, actual_end=actual_end, memory_config=memory_config,
                        compute_kernel_config=compute_kernel_config, sequence_parallel_axis=sequence_parallel_axis,
                        input_column_offset=input_column_offset))
    t_len, c, off, _ = _conv_validate(CARRY_OP, b, carry=True)
    check_device(CONV, "exchange_buffer", exchange_buffer)
    if exchange_buffer.logical_shape_list != [1, 4 * HISTORY_ROWS, c]:
        raise EmulatorError(f"{CONV}: exchange_buffer must be [1,{4 * HISTORY_ROWS},Q+K+V], got "
                            f"{exchange_buffer.logical_shape_list}")
    if exchange_buffer.memory_config().buffer_type != ttnn.BufferType.DRAM:
        raise EmulatorError(f"{CONV}: exchange_buffer must be in DRAM")
    check_layout(CONV, "exchange_buffer", exchange_buffer, ttnn.ROW_MAJOR_LAYOUT)
    check_dtype(CONV, "exchange_buffer", exchange_buffer, "BFLOAT16")
    sems = list(exchange_semaphores or [])
    if not sems:
        raise EmulatorError(f"{CONV}: exchange_buffer needs its exchange semaphores")
    if len(sems) != 3:
        raise EmulatorError(f"{CONV}_with_carry: pass 3 exchange_semaphores")
    cfg = kernel_config(CONV, compute_kernel_config, _CONV_DEFAULT, approx_refused=(
        f"{CONV}: math_approx_mode=true is unsupported because the fused SiLU uses the precise sigmoid"))
    carries = []
    for i in range(input.num_shards):
        _, parts = sp_rank(CONV, input, i, sequence_parallel_axis)
        if parts > 1:
            raise NotEmulatedError(f"{CARRY_OP}: the fabric history exchange over {parts} sequence-parallel ranks is "
                                   "not emulated (one rank per sequence: sequence_parallel_axis of mesh size 1)")
    outs, rows = _conv_outputs(_tilized(b), cfg, t_len, c, off, carry_hist=True)
    for i, x64 in enumerate(rows):
        start = scalar(CONV, "actual_start", actual_start, i)
        valid = t_len if actual_end is None else scalar(CONV, "actual_end", actual_end, i) - start
        if not 0 < valid <= t_len:
            raise EmulatorError(f"{CONV}: actual_end - actual_start = {valid} must be in (0, T = {t_len}]")
        joined = torch.cat([numerics.wide(history.shards[i].reshape(HISTORY_ROWS, c).to(torch.float32)), x64[:valid]])
        carries.append(joined[-HISTORY_ROWS:].to(torch.bfloat16).reshape(1, HISTORY_ROWS, c))
    carry = new_device_tensor(input.mesh, carries, ttnn.bfloat16, ttnn.ROW_MAJOR_LAYOUT,
                              memory_config=memory_config or ttnn.DRAM_MEMORY_CONFIG)
    return (*outs, carry)


register_programs(CONV_OP, _conv_programs)
register_programs(CARRY_OP, _conv_programs)


# ---- sigmoid_gated_rms_norm --------------------------------------------------------------------------------------
_NORM_DEFAULT = numerics.KernelConfig(phases=4, fp32_dest_acc_en=True, math_approx_mode=True, packer_l1_acc=False,
                                      given=False)


def _norm_check(name, t, dtypes):
    check_device(NORM, name, t)
    if t.layout != ttnn.TILE_LAYOUT:
        raise EmulatorError(f"{NORM}: {name} must use TILE layout")
    if t.is_sharded():
        raise EmulatorError(f"{NORM}: {name} must use interleaved memory")
    if dtype_name(t.dtype) not in dtypes:
        raise EmulatorError(f"{NORM}: {name} has unsupported dtype DataType::{dtype_name(t.dtype)}")


def _norm_validate(x, gate, weight, num_heads, epsilon, output_dtype, memory_config, off):
    if len(x.logical_shape_list) != 3:
        raise EmulatorError(f"{NORM}: input must be [B*H,T,V]")
    if int(num_heads) <= 0:
        raise EmulatorError(f"{NORM}: num_heads must be positive")
    bh, t_len, v = x.logical_shape_list
    if bh % int(num_heads):
        raise EmulatorError(f"{NORM}: leading dimension must be divisible by num_heads")
    _norm_check("input", x, ("FLOAT32", "BFLOAT16"))
    _norm_check("gate", gate, ("BFLOAT16",))
    _norm_check("weight", weight, ("BFLOAT16",))
    if dtype_name(output_dtype) not in ("FLOAT32", "BFLOAT16"):
        raise EmulatorError(f"{NORM}: output_dtype must be FLOAT32 or BFLOAT16")
    check_output_interleaved(NORM, memory_config, f"{NORM}: output memory configuration must be interleaved")
    if not (math.isfinite(float(epsilon)) and float(epsilon) > 0.0):
        raise EmulatorError(f"{NORM}: epsilon must be finite and positive")
    if int(off) % TILE:
        raise EmulatorError(f"{NORM}: gate_column_offset must be tile aligned")
    if len(gate.logical_shape_list) != 3:
        raise EmulatorError(f"{NORM}: gate must be rank 3 [B,T,W]")
    if len(weight.logical_shape_list) != 1:
        raise EmulatorError(f"{NORM}: weight must be [V]")
    batch, h = bh // int(num_heads), int(num_heads)
    g = gate.logical_shape_list
    if g[0] != batch or g[1] != t_len or g[2] < int(off) + h * v:
        raise EmulatorError(f"{NORM}: gate {g} must be [B, T, W] and hold H*V = {h * v} columns at "
                            f"gate_column_offset {off}")
    if weight.logical_volume() != v:
        raise EmulatorError(f"{NORM}: weight volume must equal V")
    if t_len <= 0 or t_len % TILE:
        raise EmulatorError(f"{NORM}: sequence must be positive and tile aligned")
    if v <= 0 or v % TILE:
        raise EmulatorError(f"{NORM}: value_dim must be positive and tile aligned")
    return batch, h, t_len, v


def norm_math(x, gate, weight, x_dtype: str, eps: float, cfg) -> torch.Tensor:
    """The kernel's sequence on one head's rows: ``x`` [..., T, V] fp32/bf16 values, ``gate`` [..., T, V] bf16,
    ``weight`` [V]; returns fp64 values as packed out of Dst (before the output dtype's rounding).

    Every FLOAT32 intermediate buffer is unpacked to the Src registers (TF32; the program factory's UnpackToSrc), an
    fp32 input too; a BFLOAT16 input, the gate and the weight unpack exactly. Eltwise products put in0 in SrcA."""
    d = cfg.fp32_dest_acc_en
    src = numerics.src_operand
    xa, xb = src(x, x_dtype, True), src(x, x_dtype, False)
    sq = numerics.round_dst(numerics.fpu_product(xb, xa, cfg.phases), d)  # mul_tiles(x, x) -> tmp (FLOAT32)
    v = x.shape[-1]
    scaler = src(torch.tensor(1.0 / v, dtype=torch.float32), "FLOAT32", False)  # AVG scaler, a FLOAT32 tile
    # the row reduce: each 32-column tile's products summed, accumulated tile by tile in Dst (fp32 by default)
    terms = src(sq, "FLOAT32", True) * scaler
    acc = None
    for k0 in range(0, v, TILE):
        part = terms[..., k0:k0 + TILE].sum(-1, keepdim=True)
        acc = numerics.round_dst(part if acc is None else acc + part, d)
    eps_bf16 = numerics.wide(torch.tensor(eps, dtype=torch.float32).to(torch.bfloat16).to(torch.float32))
    # add_tiles(stats, eps) -> Dst, rsqrt on the SFPU in place (approximation not modelled) -> inv (FLOAT32)
    inv = numerics.round_dst(1.0 / torch.sqrt(numerics.round_dst(src(acc, "FLOAT32", True) + eps_bf16, d)), d)
    norm = numerics.round_dst(numerics.fpu_product(src(inv, "FLOAT32", False), xa, cfg.phases), d)
    w = src(weight, "BFLOAT16", False)
    tmp = numerics.round_dst(numerics.fpu_product(w, src(norm, "FLOAT32", True), cfg.phases), d)
    sig = numerics.round_dst(torch.sigmoid(numerics.wide(gate.to(torch.float32))), d)  # copy_tile + SFPU sigmoid
    return numerics.round_dst(numerics.fpu_product(src(sig, "FLOAT32", False), src(tmp, "FLOAT32", True),
                                                   cfg.phases), d)


def _norm_read(args, kwargs):
    b = bind_op(NORM_OP, args, kwargs)
    x, gate, weight = b["input"], b["gate"], b["weight"]
    bh, t_len, v = x.logical_shape_list
    return {dtype_name(x.dtype): x.bytes_per_device(),
            "BFLOAT16": bh * t_len * v * 2 + shard_bytes(weight.logical_shape_list, weight.dtype, weight.layout)}


@device_op(NORM_OP, read_bytes=_norm_read)
def sigmoid_gated_rms_norm(input, gate, weight, num_heads, *, epsilon=1e-5, memory_config=None,
                           compute_kernel_config=None, output_dtype=None, gate_column_offset=0):
    output_dtype = ttnn.float32 if output_dtype is None else output_dtype
    check_device(NORM, "input", input)
    batch, h, t_len, v = _norm_validate(input, gate, weight, num_heads, epsilon, output_dtype, memory_config,
                                        gate_column_offset)
    cfg = kernel_config(NORM, compute_kernel_config, _NORM_DEFAULT)
    eps = float(torch.tensor(float(epsilon), dtype=torch.float32))  # the attribute is a C++ float
    off = int(gate_column_offset)
    outs = []
    for i in range(input.num_shards):
        x = input.shards[i].reshape(batch, h, t_len, v)
        g = gate.shards[i][:, :, off:off + h * v].reshape(batch, t_len, h, v).permute(0, 2, 1, 3)
        y = norm_math(x, g, weight.shards[i].reshape(v), dtype_name(input.dtype), eps, cfg)
        outs.append(y.permute(0, 2, 1, 3).reshape(batch, t_len, h * v).to(torch.float32))
    return make_like(input, outs, dtype=output_dtype, layout=ttnn.TILE_LAYOUT,
                     memory_config=memory_config or ttnn.DRAM_MEMORY_CONFIG, pad_fill=0.0)


def _key_with_config(op: str, default: numerics.KernelConfig):
    """ttnn hashes the resolved compute config: the op's default and the same config passed explicitly share one
    program (Tenstorrent's tests assert it)."""
    def fn(args, kwargs):
        try:
            cfg = kernel_config(op, kwargs.get("compute_kernel_config"), default)
        except EmulatorError:
            return args, kwargs
        return args, dict(kwargs, compute_kernel_config=(cfg.phases, cfg.fp32_dest_acc_en, cfg.math_approx_mode))
    return fn


register_key_args(CONV_OP, _key_with_config(CONV, _CONV_DEFAULT))
register_key_args(CARRY_OP, _key_with_config(CONV, _CONV_DEFAULT))
register_key_args(NORM_OP, _key_with_config(NORM, _NORM_DEFAULT))
