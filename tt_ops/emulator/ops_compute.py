"""linear / matmul.

``numerics="exact"``: products and accumulation in fp64 (rule N8), rounded once to the output dtype (the ttnn
goldens multiply in the input dtype; bf16 matmul on a 2-core CPU is ~100x slower).
``numerics="strict"`` (default): what the FPU does (``numerics.fpu_matmul``: fp32 operands become TF32, math
fidelity phases, bf16 Dst accumulation without ``fp32_dest_acc_en``) plus the tile padding a contraction whose
K is not a multiple of 32 reads (``numerics.padded_k_contribution``: garbage padding on both sides makes the
result garbage, shown as NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .goldens import golden_impl
from .matmul_1d import check_mcast_1d_matmul
from .registry import device_op
from .shard_specs import output_memory_config
from .tensor import EmuTensor, dtype_name, make_like, quantize_via_ttnn, write_inplace
from .ttnn_import import ttnn

_ACTIVATIONS = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "identity": lambda x: x,
}


def _activation_name(act) -> str | None:
    if act is None:
        return None
    if isinstance(act, str):
        return act.lower()
    op_type = getattr(act, "op_type", None)
    if op_type is not None:
        return str(op_type).split(".")[-1].lower()
    return str(act).lower()


def _apply_activation(x: torch.Tensor, act) -> torch.Tensor:
    """A fused activation on the matmul result, in fp64 (rule N8: torch's fp32 transcendentals differ by host and
    by an element's place in the call); the caller rounds to the output dtype."""
    name = _activation_name(act)
    if name is None:
        return x
    if name not in _ACTIVATIONS:
        raise NotEmulatedError(f"fused activation '{name}' is not emulated (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name](numerics.wide(x))


def _mm(a: EmuTensor, b: EmuTensor, i: int, transpose_a: bool, transpose_b: bool, op: str, ckc=None) -> torch.Tensor:
    x = a.shards[i].to(torch.float32)
    w = b.shards[i].to(torch.float32)
    if transpose_a:
        x = x.transpose(-1, -2)
    if transpose_b:
        w = w.transpose(-1, -2)
    if x.shape[-1] != w.shape[-2]:
        raise EmulatorError(
            f"{op}: inner dimensions differ: input_tensor_a {list(x.shape)} x input_tensor_b {list(w.shape)}"
        )
    if not numerics.is_strict(a):
        return numerics.matmul_rows(x, w)
    y = numerics.fpu_matmul(x, w, dtype_name(a.dtype), dtype_name(b.dtype), numerics.kernel_config(ckc))
    extra = numerics.padded_k_contribution(x.shape[-1], a.pad_fill, b.pad_fill)
    if extra is None:
        return numerics.poison_like(y)
    return y + extra if extra else y


def _finish(op, a, outs, dtype, memory_config, optional_output_tensor):
    if optional_output_tensor is not None:
        write_inplace(optional_output_tensor, [quantize_via_ttnn(o, optional_output_tensor.dtype) for o in outs])
        return optional_output_tensor
    return make_like(a, outs, dtype=dtype if dtype is not None else a.dtype, layout=ttnn.TILE_LAYOUT,
                     memory_config=output_memory_config(op, memory_config, a))


def _check_layouts(op, a, b):
    for name, t in (("input_tensor_a", a), ("input_tensor_b", b)):
        if t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{op}: {name} must be in TILE layout (got {t.layout.name})")


def _shard_spec(t_or_mc):
    mc = t_or_mc.memory_config() if isinstance(t_or_mc, EmuTensor) else t_or_mc
    return mc, (mc.shard_spec if mc is not None and mc.is_sharded() else None)


def check_dram_sharded_matmul(op, a, b, program_config, memory_config, transpose_a=False, transpose_b=False):
    """The device op's validation of ``MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig`` (tt-metal's
    matmul device operation), plus the program factory's assumption that in1 lives in DRAM, one shard per bank:

    * in0 WIDTH_SHARDED, ROW_MAJOR shards; the output memory config sharded with in0's layout and buffer type;
    * M (rows in tiles, batch dims not fused) == per_core_M == 1 == in0 shard height in tiles;
    * K tiles and in0's shard width in tiles divisible by in0_block_w;
    * in1 WIDTH_SHARDED in DRAM over at most the device's DRAM banks, its shards covering [K, N];
    * per_core_N x (in0's shard cores) covers N, and in0's shards cover K."""
    if not isinstance(program_config, ttnn.MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig):
        return
    name = "MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig"
    if transpose_a or transpose_b:
        raise EmulatorError(f"{op}: {name} with transpose_a/transpose_b is not emulated")
    WIDTH = ttnn.TensorMemoryLayout.WIDTH_SHARDED
    amc, aspec = _shard_spec(a)
    if aspec is None or amc.memory_layout != WIDTH:
        raise EmulatorError(f"{op}: {name}: input_tensor_a must be WIDTH_SHARDED (got {amc.memory_layout})")
    if aspec.orientation != ttnn.ShardOrientation.ROW_MAJOR:
        raise EmulatorError(f"{op}: {name}: input_tensor_a shard orientation must be ROW_MAJOR")
    if memory_config is None or not memory_config.is_sharded():
        raise EmulatorError(f"{op}: {name}: the output memory config must be sharded")
    if memory_config.memory_layout != amc.memory_layout or memory_config.buffer_type != amc.buffer_type:
        raise EmulatorError(f"{op}: {name}: output memory layout/buffer type ({memory_config.memory_layout}, "
                            f"{memory_config.buffer_type}) must match input_tensor_a's ({amc.memory_layout}, "
                            f"{amc.buffer_type})")
    pa = list(a.padded_shape)
    m_t, k_t = pa[-2] // 32, pa[-1] // 32
    n_t = list(b.padded_shape)[-1] // 32
    pcm, bw = program_config.per_core_M, program_config.in0_block_w
    if m_t != pcm or m_t != 1:
        raise EmulatorError(f"{op}: {name}: M ({m_t} tiles) must equal per_core_M ({pcm}) and be 1 (only one tile "
                            "row of activations is supported)")
    sh, sw = aspec.shape
    if sh // 32 != pcm:
        raise EmulatorError(f"{op}: {name}: per_core_M ({pcm}) must equal shard height {sh} / 32")
    if bw == 0 or k_t % bw or (sw // 32) % bw:
        raise EmulatorError(f"{op}: {name}: K ({k_t} tiles) and the in0 shard width ({sw // 32} tiles) must be "
                            f"divisible by in0_block_w ({bw})")
    cores = aspec.grid.num_cores()
    if cores * (sw // 32) < k_t:
        raise EmulatorError(f"{op}: {name}: in0 shards ({cores} x {sw // 32} tiles) do not cover K ({k_t} tiles)")
    if program_config.per_core_N * cores < n_t:
        raise EmulatorError(f"{op}: {name}: per_core_N ({program_config.per_core_N}) x {cores} cores does not cover "
                            f"N ({n_t} tiles)")
    bmc, bspec = _shard_spec(b)
    if bspec is None or bmc.memory_layout != WIDTH:
        raise EmulatorError(f"{op}: {name}: input_tensor_b must be WIDTH_SHARDED (got {bmc.memory_layout})")
    if bmc.buffer_type != ttnn.BufferType.DRAM:
        raise EmulatorError(f"{op}: {name}: input_tensor_b must be DRAM-sharded (one shard per DRAM bank)")
    banks = bspec.grid.num_cores()
    dram = b.mesh.dram_grid_size() if b.mesh is not None else None
    if dram is not None and banks > dram.x * dram.y:
        raise EmulatorError(f"{op}: {name}: input_tensor_b is sharded over {banks} banks; the device has "
                            f"{dram.x * dram.y}")
    bh, bsw = bspec.shape
    if bh < k_t * 32 or banks * bsw < n_t * 32:
        raise EmulatorError(f"{op}: {name}: input_tensor_b shards {banks} x [{bh}, {bsw}] do not cover "
                            f"[K, N] = [{k_t * 32}, {n_t * 32}]")


@device_op("ttnn.linear")
def linear(
    input_tensor_a,
    input_tensor_b,
    *,
    bias=None,
    transpose_a=False,
    transpose_b=False,
    memory_config=None,
    dtype=None,
    program_config=None,
    activation=None,
    compute_kernel_config=None,
    core_grid=None,
    output_tile=None,
    optional_output_tensor=None,
    global_cb=None,
    sub_device_id=None,
    prefetcher_pipes=(),
    in0_column_offset=None,
):
    _check_layouts("ttnn.linear", input_tensor_a, input_tensor_b)
    check_dram_sharded_matmul("ttnn.linear", input_tensor_a, input_tensor_b, program_config, memory_config,
                              transpose_a, transpose_b)
    check_mcast_1d_matmul("ttnn.linear", input_tensor_a, input_tensor_b, program_config, memory_config,
                          compute_kernel_config, transpose_a, transpose_b)
    if in0_column_offset is not None:
        raise NotEmulatedError("ttnn.linear(in0_column_offset=...) is not emulated")
    fused = getattr(program_config, "fused_activation", None) if program_config is not None else None
    outs = []
    for i in range(input_tensor_a.num_shards):
        y = _mm(input_tensor_a, input_tensor_b, i, transpose_a, transpose_b, "ttnn.linear", compute_kernel_config)
        if bias is not None:
            bvec = bias.shards[i].to(torch.float32)
            n = y.shape[-1]
            if bvec.numel() != n:
                # tile-padded bias rows ([1, 1, 32, N] with one real row) are common on cards
                if bvec.shape[-1] == n:
                    bvec = bvec.reshape(-1, n)[0]
                else:
                    raise EmulatorError(f"ttnn.linear: bias {list(bias.shards[i].shape)} does not match N={n}")
            y = y + bvec.reshape(n)
        if fused is not None:
            y = _apply_activation(y, fused)
        y = _apply_activation(y, activation)
        outs.append(y)
    return _finish("ttnn.linear", input_tensor_a, outs, dtype, memory_config, optional_output_tensor)


@device_op("ttnn.matmul")
def matmul(
    input_tensor_a,
    input_tensor_b,
    *,
    transpose_a=False,
    transpose_b=False,
    memory_config=None,
    dtype=None,
    program_config=None,
    activation=None,
    compute_kernel_config=None,
    core_grid=None,
    output_tile=None,
    optional_output_tensor=None,
    global_cb=None,
    sub_device_id=None,
    prefetcher_pipes=(),
):
    _check_layouts("ttnn.matmul", input_tensor_a, input_tensor_b)
    check_dram_sharded_matmul("ttnn.matmul", input_tensor_a, input_tensor_b, program_config, memory_config,
                              transpose_a, transpose_b)
    check_mcast_1d_matmul("ttnn.matmul", input_tensor_a, input_tensor_b, program_config, memory_config,
                          compute_kernel_config, transpose_a, transpose_b)
    fused = getattr(program_config, "fused_activation", None) if program_config is not None else None
    outs = []
    for i in range(input_tensor_a.num_shards):
        y = _mm(input_tensor_a, input_tensor_b, i, transpose_a, transpose_b, "ttnn.matmul", compute_kernel_config)
        if fused is not None:
            y = _apply_activation(y, fused)
        outs.append(_apply_activation(y, activation))
    return _finish("ttnn.matmul", input_tensor_a, outs, dtype, memory_config, optional_output_tensor)


# ------------------------------------------------------------------------------------------------
# Reductions: sum / mean
# ------------------------------------------------------------------------------------------------
def _reduce(op_name, scale_by_count, input_tensor, dim=None, keepdim=False, **kwargs):
    """``numerics="exact"``: the ttnn golden (fp32 copies of bf16 shards). ``"strict"``: ``numerics.reduce_sum``
    (the FLOAT32 SFPU path only with ``fp32_dest_acc_en=True``, otherwise TF32 inputs on the FPU; bf16 Dst
    accumulation without fp32 dest). The tile padding of the reduced dims is masked, as on cards (Tenstorrent's
    own ``ttnn.mean`` test fills the padding with 42 to check that the op removes it)."""
    real = getattr(ttnn, op_name.split(".")[-1])
    name = dtype_name(input_tensor.dtype)
    if not numerics.is_strict(input_tensor) or name not in ("FLOAT32", "BFLOAT16", "BFLOAT8_B", "BFLOAT4_B"):
        return golden_impl(op_name, real)(input_tensor, dim, keepdim, **kwargs)
    rank = len(input_tensor.logical_shape_list)
    if dim is None:
        dims = list(range(rank))
    elif isinstance(dim, (list, tuple)):
        dims = sorted(int(d) % rank for d in dim)
    else:
        dims = [int(dim) % rank]
    count = 1
    for d in dims:
        count *= input_tensor.logical_shape_list[d]
    scale = float(kwargs.get("scalar", 1.0) if kwargs.get("scalar") is not None else 1.0)
    if scale_by_count:
        scale /= count
    cfg = numerics.kernel_config(kwargs.get("compute_kernel_config"))
    fast = bool(kwargs.get("fast_and_approximate_mode") or False)
    outs = []
    for s in input_tensor.shards:
        y, _path = numerics.reduce_sum(s, dims, name, cfg, fast, scale)
        if not keepdim:
            for d in reversed(dims):
                y = y.squeeze(d)
        outs.append(y)
    return make_like(input_tensor, outs,
                     memory_config=output_memory_config(op_name, kwargs.get("memory_config"), input_tensor))


@device_op("ttnn.sum")
def sum_(input_tensor, dim=None, keepdim=False, **kwargs):
    return _reduce("ttnn.sum", False, input_tensor, dim, keepdim, **kwargs)


@device_op("ttnn.mean")
def mean(input_tensor, dim=None, keepdim=False, **kwargs):
    return _reduce("ttnn.mean", True, input_tensor, dim, keepdim, **kwargs)


@device_op("ttnn.fill_implicit_tile_padding")
def fill_implicit_tile_padding(input_tensor, fill_value, *, memory_config=None):
    """Same values, tile padding set to ``fill_value`` (0.81.1 docstring: "Fills the implicit padding of a tiled
    input tensor with the specified value")."""
    return make_like(input_tensor, list(input_tensor.shards),
                     memory_config=output_memory_config("ttnn.fill_implicit_tile_padding", memory_config, input_tensor),
                     pad_fill=float(fill_value))


# ------------------------------------------------------------------------------------------------
# Norms: the golden, behind the device op's memory-layout validation
# ------------------------------------------------------------------------------------------------
def _check_norm_layout(op: str, input_tensor, memory_config, program_config=None, residual=None):
    """ttnn's layernorm device op (rms_norm included; tt-metal ``layernorm_device_operation.cpp``, read for facts).
    The program factory is chosen by the input alone: a sharded input runs the sharded factory, which reads a
    ``LayerNormShardedMultiCoreProgramConfig``. The validation, restated:

    * a sharded input may not be HEIGHT_SHARDED, and needs a sharded, non-height output (default: the input's);
    * a sharded input needs the sharded program config (newer ttnn derives one from the shard spec when none is
      given; whether 0.81.1 does was not verified, so the emulator asks for it explicitly), with block_h x 32 ==
      the shard height, block_w x 32 == the shard width, subblock_w dividing block_w, the shard grid's bounding box
      inside compute_with_storage_grid_size, and, for one row block (M == block_h x 32), block_w == ceil(K tiles /
      shard cores); the output's memory layout and buffer type equal the input's;
    * the sharded program config with an interleaved input has no shard spec to check against: rejected;
    * a residual_input_tensor of a sharded input is sharded with the same shard spec.

    An interleaved input with a sharded output memory config is accepted (no rule forbids it; the 0.81.1 writer
    kernel of the interleaved factory addresses the output through a TensorAccessor, which resolves sharded pages;
    not yet run on cards)."""
    if not isinstance(input_tensor, EmuTensor):
        return
    sharded_pc = isinstance(program_config, ttnn.LayerNormShardedMultiCoreProgramConfig)
    if not input_tensor.is_sharded():
        if sharded_pc:
            raise EmulatorError(f"{op}: LayerNormShardedMultiCoreProgramConfig needs a sharded input (got an "
                                "interleaved one)")
        return
    mc = input_tensor.memory_config()
    if mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED:
        raise EmulatorError(f"{op}: HEIGHT_SHARDED inputs are not supported by the device op; reshard to "
                            "interleaved (or width/block sharded with a sharded program config) first")
    out = mc if memory_config is None else memory_config
    if not out.is_sharded() or out.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED:
        raise EmulatorError(f"{op}: a sharded input requires a sharded (not height-sharded) output memory_config")
    if residual is not None and isinstance(residual, EmuTensor):
        if not residual.is_sharded() or residual.memory_config().shard_spec != mc.shard_spec:
            raise EmulatorError(f"{op}: residual_input_tensor must be sharded with the input's shard spec")
    if not sharded_pc:
        raise EmulatorError(f"{op}: a sharded input runs the sharded program factory: pass "
                            "program_config=ttnn.LayerNormShardedMultiCoreProgramConfig(...) matching its shards")
    pc, spec = program_config, mc.shard_spec
    if out.memory_layout != mc.memory_layout or out.buffer_type != mc.buffer_type:
        raise EmulatorError(f"{op}: output memory layout/buffer type ({out.memory_layout}, {out.buffer_type}) must "
                            f"match the input's ({mc.memory_layout}, {mc.buffer_type})")
    padded = list(input_tensor.padded_shape)
    k_t = padded[-1] // 32
    m = 1
    for d in padded[:-1]:
        m *= d
    sh, sw = spec.shape
    if pc.subblock_w == 0 or pc.block_w % pc.subblock_w:
        raise EmulatorError(f"{op}: block_w ({pc.block_w}) must be divisible by subblock_w ({pc.subblock_w})")
    if pc.block_h * 32 != sh or pc.block_w * 32 != sw:
        raise EmulatorError(f"{op}: block_h x 32 / block_w x 32 ({pc.block_h * 32}, {pc.block_w * 32}) must equal "
                            f"the shard shape ({sh}, {sw})")
    bbox = spec.grid.bounding_box()
    gx, gy = pc.compute_with_storage_grid_size.x, pc.compute_with_storage_grid_size.y
    if bbox.end.x - bbox.start.x >= gx or bbox.end.y - bbox.start.y >= gy:
        raise EmulatorError(f"{op}: the shard grid's bounding box must fit compute_with_storage_grid_size ({gx}, {gy})")
    if m == pc.block_h * 32 and -(-k_t // spec.grid.num_cores()) != pc.block_w:
        raise EmulatorError(f"{op}: block_w ({pc.block_w}) must equal K ({k_t} tiles) / shard cores "
                            f"({spec.grid.num_cores()})")


def _rms_norm_wide(input_tensor, weight=None, *, epsilon=1e-12, bias=None, residual_input_tensor=None, **_):
    """The math of ttnn's rms_norm golden (residual add, x * rsqrt(mean(x^2) + eps), then the per-channel weight and
    bias sliced to the hidden width) on fp64 shards. The golden itself takes the mean of squares in fp32, whose
    association follows the host's SIMD width (rule N8)."""
    x = input_tensor if residual_input_tensor is None else input_tensor + residual_input_tensor
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + epsilon)
    width = y.shape[-1]
    for p, combine in ((weight, torch.mul), (bias, torch.add)):
        if p is not None:
            y = combine(y, p.reshape(-1)[:width].reshape(*([1] * (y.ndim - 1)), width))
    return y


@device_op("ttnn.rms_norm")
def rms_norm(input_tensor, **kwargs):
    _check_norm_layout("ttnn.rms_norm", input_tensor, kwargs.get("memory_config"), kwargs.get("program_config"),
                       kwargs.get("residual_input_tensor"))
    return golden_impl("ttnn.rms_norm", ttnn.rms_norm, golden=_rms_norm_wide)(input_tensor, **kwargs)


@device_op("ttnn.layer_norm")
def layer_norm(input_tensor, **kwargs):
    _check_norm_layout("ttnn.layer_norm", input_tensor, kwargs.get("memory_config"), kwargs.get("program_config"),
                       kwargs.get("residual_input_tensor"))
    return golden_impl("ttnn.layer_norm", ttnn.layer_norm)(input_tensor, **kwargs)
