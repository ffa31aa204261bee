"""What the Tensix math units do to the numbers (the emulator's ``numerics="strict"`` mode).

Each rule names its source. Where the exact hardware behaviour is not documented, the rule is the
conservative reading (never more accurate than the card) and says so.

Sources:

* [SRC] tt-isa-documentation, ``WormholeB0/TensixTile/TensixCoprocessor/SrcASrcB.md`` (Blackhole shares the
  layout): SrcA/SrcB hold 19-bit data; FP32 becomes TF32 "throwing away the low 13 bits of mantissa"; BFP8/BFP4
  unpack losslessly to BF16; for SrcA the least significant TF32 mantissa bit is ignored in multiplications;
  the table "Fidelity phases (floating-point)" says which mantissa bits each phase consumes.
* [FP32] tt-metal ``docs/source/tt-metalium/tt_metal/advanced_topics/fp32_accuracy.rst``: ``fp32_dest_acc_en``
  false (the default) makes Dst hold 16-bit data, "FP32 values automatically converted"; ``math_fidelity``
  applies to the matrix engine (FPU) only.
* [CKC] ttnn ``WormholeComputeKernelConfig`` field defaults (installed 0.81.1 and tt-metal
  ``compute_kernel_config.hpp``): LoFi, ``math_approx_mode`` true, ``fp32_dest_acc_en`` false,
  ``packer_l1_acc`` false.
* [SUM] the installed ttnn 0.81.1 docstring of ``ttnn.sum`` / ``ttnn.mean`` (``fast_and_approximate_mode``):
  FLOAT32 input takes the accurate SFPU path (full fp32 accumulation) only with ``fp32_dest_acc_en=True``;
  otherwise it "falls back to the FPU" with "inputs truncated to TF32".

Matmul operand placement: ttnn's matmul kernels compute ``Dst += SrcB @ SrcA`` with input A (``in0``) in SrcB
and input B (``in1``, the weight) in SrcA (tt-metal ``llk_math_matmul`` / ``bmm`` compute kernels).
"""

from __future__ import annotations

import dataclasses

import torch

NUMERICS_MODES = ("strict", "exact")

# Number of FPU fidelity phases per MathFidelity ([SRC]: LoFi = phase 0; HiFi2 = phases 0-1; HiFi3 = 0-2;
# HiFi4 = all four).
_PHASES = {"LoFi": 1, "HiFi2": 2, "HiFi3": 3, "HiFi4": 4}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The fields of a compute-kernel config that change numbers."""

    phases: int
    fp32_dest_acc_en: bool
    math_approx_mode: bool
    packer_l1_acc: bool
    given: bool  # False: the op got no compute_kernel_config (the [CKC] defaults apply)


def is_strict(t) -> bool:
    """Whether the mesh a tensor lives on applies these rules (``numerics="strict"``, the default)."""
    return getattr(getattr(t, "mesh", None), "numerics", "exact") == "strict"


def kernel_config(ckc) -> KernelConfig:
    """Read a ``ttnn.WormholeComputeKernelConfig`` (or ``None``: the struct defaults, [CKC])."""
    if ckc is None:
        return KernelConfig(phases=1, fp32_dest_acc_en=False, math_approx_mode=True, packer_l1_acc=False, given=False)
    fid = getattr(ckc, "math_fidelity", None)
    name = getattr(fid, "name", str(fid)).split(".")[-1]
    # "Invalid" is what a default-constructed config reports; ttnn then uses the op's default (LoFi per [CKC]).
    phases = _PHASES.get(name, 1)
    return KernelConfig(phases=phases, fp32_dest_acc_en=bool(getattr(ckc, "fp32_dest_acc_en", False)),
                        math_approx_mode=bool(getattr(ckc, "math_approx_mode", True)),
                        packer_l1_acc=bool(getattr(ckc, "packer_l1_acc", False)), given=True)


# ---- bit-level helpers ------------------------------------------------------------------------------------
def _keep_mantissa_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncate fp32 values to ``bits`` explicit mantissa bits (toward zero, as the unpacker drops bits)."""
    x = x.to(torch.float32).contiguous()
    drop = 23 - bits
    if drop <= 0:
        return x
    mask = ~((1 << drop) - 1) & 0xFFFFFFFF
    mask = mask - (1 << 32) if mask >= (1 << 31) else mask  # as a signed int32 constant
    return (x.view(torch.int32) & mask).view(torch.float32)


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> TF32 as the unpacker does it: the low 13 mantissa bits are dropped ([SRC], [SUM])."""
    return _keep_mantissa_bits(x, 10)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Dst in 16-bit mode ([FP32]). The rounding mode of that conversion is not documented: round-to-nearest-even
    is assumed (truncation would be up to one bf16 ulp further from the exact value). An fp64 input is rounded to
    fp32 first (the Dst format conversion starts from an fp32 value), then to bf16."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def src_format_bits(dtype_name: str) -> int:
    """Explicit mantissa bits an operand of this ttnn dtype has once unpacked into SrcA/SrcB ([SRC])."""
    return 10 if dtype_name == "FLOAT32" else 7  # TF32; BF16 (BFP8/BFP4 unpack losslessly to BF16)


def _split(x: torch.Tensor, hi_bits: int, total_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) with hi = implicit 1 + ``hi_bits`` mantissa bits and lo = the rest up to ``total_bits``."""
    full = _keep_mantissa_bits(x, total_bits)
    hi = _keep_mantissa_bits(full, hi_bits)
    return hi, full - hi  # exact: both are representable in fp32


# Host independence (rule N8). torch's CPU kernels are not row-invariant or host-invariant: an fp32 sum's
# association follows the SIMD width (AVX2 vs AVX-512) and the thread split, BLAS picks kernels by ISA, row count and
# CPU vendor, and transcendentals run through Sleef in the vector loop but through libm for the loop's scalar tail
# (so a value's last bit depends on where it sits in the call). A card computes every element of a tile alike,
# whatever the row count. The emulator therefore does its arithmetic in fp64 and rounds to the card's format (fp32,
# bf16, ...) only where the card rounds. fp32/bf16/TF32 operands are exact in fp64, their products too (at most 48
# significant bits), and what a host's kernel choice changes in an fp64 result is about one fp64 ulp, 2^29 times
# finer than the fp32 rounding that follows: a rounded result can differ between hosts only when its exact value
# lies within ~2^-53 (relative) of a rounding boundary of the output format. K-tile sums of bf16/TF32 products are
# exact in fp64 whenever the tile's 32 products span less than ~2^30 in magnitude, and then no host can differ.
WIDE = torch.float64


def wide(x: torch.Tensor) -> torch.Tensor:
    """fp64 copy of a floating tensor (integers and booleans unchanged)."""
    return x.to(WIDE) if x.is_floating_point() and x.dtype != WIDE else x


# torch's CPU matmul also takes another kernel (a matrix-vector path) below MIN_ROWS rows. In fp64 that changes an
# fp64 ulp at most (N8), but the padding keeps even that off the row count (rule N7).
MIN_ROWS = 4


def matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` in fp64 (returns fp64) whose every row is the same whatever the row count of ``x`` (dim -2) and the
    host (N7, N8); callers round the result to the card's format."""
    x, w = wide(x), wide(w)
    if x.dim() < 2 or x.shape[-2] >= MIN_ROWS:
        return torch.matmul(x, w)
    m = x.shape[-2]
    pad = x.new_zeros(*x.shape[:-2], MIN_ROWS - m, x.shape[-1])
    return torch.matmul(torch.cat([x, pad], dim=-2), w)[..., :m, :]


# Elements (fp64) one chunk of K-tile partial products may hold: bounds the memory of a matmul as wide as the 27B LM
# head (the partials are [tiles, rows, N]).
_PARTIAL_ELEMENTS = 1 << 23


def _k_tile_partials(x: torch.Tensor, w: torch.Tensor):
    """Yield the fp64 partial product of every 32-wide K tile of ``x @ w``, in K order: [..., M, N] each.

    ``x`` [..., M, K], ``w`` [..., K, N] (broadcastable batch dims; widened to fp64 a chunk of tiles at a time, so a
    weight is never copied whole). K is zero-padded to whole tiles (the padding's own contribution is the caller's
    business, rule P2)."""
    k = x.shape[-1]
    kp = (-k) % 32
    if kp:
        x = torch.nn.functional.pad(x, (0, kp))
        w = torch.nn.functional.pad(w, (0, 0, 0, kp))
    tiles = x.shape[-1] // 32
    rank = max(x.dim(), w.dim())  # align the batch dims before the tile axis goes in front
    x = x.reshape(*([1] * (rank - x.dim())), *x.shape)
    w = w.reshape(*([1] * (rank - w.dim())), *w.shape)
    xt = x.reshape(*x.shape[:-1], tiles, 32).movedim(-2, 0)  # [T, ..., M, 32]
    wt = w.reshape(*w.shape[:-2], tiles, 32, w.shape[-1]).movedim(-3, 0)  # [T, ..., 32, N]
    lead = torch.broadcast_shapes(xt.shape[1:-2], wt.shape[1:-2])
    per_tile = max(1, int(torch.Size(lead).numel()) * x.shape[-2] * w.shape[-1])
    step = max(1, _PARTIAL_ELEMENTS // per_tile)
    for t0 in range(0, tiles, step):
        yield from torch.matmul(wide(xt[t0:t0 + step]), wide(wt[t0:t0 + step]))


def fpu_matmul(a: torch.Tensor, b: torch.Tensor, a_dtype: str, b_dtype: str, cfg: KernelConfig) -> torch.Tensor:
    """``a @ b`` as the FPU computes it: operand formats, fidelity phases and Dst accumulation.

    ``a`` (in0) sits in SrcB, ``b`` (in1) in SrcA. Phase products ([SRC] table; SrcA hi = implicit + 4 bits,
    SrcB hi = implicit + 6 bits): phase 0 = Bhi*Ahi, 1 = Bhi*Alo, 2 = Blo*Ahi, 3 = Blo*Alo, here written with
    A = in0 (SrcB) and B = in1 (SrcA): p0 = a_hi@b_hi, p1 = a_hi@b_lo, p2 = a_lo@b_hi, p3 = a_lo@b_lo.
    Every phase product is exact in fp32 (at most 11 x 11 significant bits).

    Accumulation: fp32 Dst with ``fp32_dest_acc_en``; otherwise Dst holds bf16 ([FP32]) and the running sum is
    rounded to bf16 after every 32-wide K tile (the granularity at which partial sums leave the multiplier is
    not documented; per K tile is the conservative reading).
    """
    a_bits = src_format_bits(a_dtype)
    b_bits = src_format_bits(b_dtype) - (1 if b_dtype == "FLOAT32" else 0)  # SrcA ignores the TF32 LSB
    # bf16-family operands already fit their Src format: skip the (weight-sized) masking copy
    a32 = _keep_mantissa_bits(a, a_bits) if a_dtype == "FLOAT32" else a.to(torch.float32)
    b32 = _keep_mantissa_bits(b, b_bits) if b_dtype == "FLOAT32" else b.to(torch.float32)
    p = cfg.phases
    if p >= 4:
        terms = [(a32, b32)]
    else:
        a_hi, a_lo = _split(a32, 6, a_bits)
        b_hi, b_lo = _split(b32, 4, b_bits)
        if p == 1:
            terms = [(a_hi, b_hi)]
        elif p == 2:
            terms = [(a_hi, b32)]  # phases 0 + 1 = a_hi @ (b_hi + b_lo)
        else:
            terms = [(a_hi, b32), (a_lo, b_hi)]
    # Every K tile's partial sum in fp64 (exact: N8), then Dst accumulation tile by tile in K order, rounded to the
    # Dst format after each tile: fp32 with fp32_dest_acc_en, else bf16. Nothing here depends on the host's kernels.
    rnd = (lambda v: v.to(torch.float32)) if cfg.fp32_dest_acc_en else round_bf16
    streams = [_k_tile_partials(x, w) for x, w in terms]
    out = None
    for parts in zip(*streams):
        part = parts[0]
        for extra in parts[1:]:
            part = part + extra
        out = rnd(part if out is None else out + part)
    return out


def src_operand(x: torch.Tensor, dtype_name: str, srca: bool) -> torch.Tensor:
    """An operand as it sits in a Src register, as fp64 ([SRC]): FLOAT32 becomes TF32 (SrcA also ignores the TF32
    LSB in multiplications); BF16 and the block floats unpack losslessly. For the eltwise FPU ops ``in0`` is SrcA and
    ``in1`` SrcB; for matmuls ``in0`` is SrcB and ``in1`` SrcA (module doc)."""
    if dtype_name == "FLOAT32":
        return wide(_keep_mantissa_bits(x, 9 if srca else 10))
    return wide(x.to(torch.float32))


def fidelity_hi(srcb: torch.Tensor, srca: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high parts the first fidelity phase multiplies ([SRC]): SrcB implicit + 6 bits, SrcA implicit + 4 bits."""
    return wide(_keep_mantissa_bits(srcb, 6)), wide(_keep_mantissa_bits(srca, 4))


def fpu_product(srcb: torch.Tensor, srca: torch.Tensor, phases: int) -> torch.Tensor:
    """Elementwise product of Src operands (fp64 values already in their Src formats) under ``phases`` fidelity
    phases ([SRC] table, as in :func:`fpu_matmul`: SrcB hi = implicit + 6 bits, SrcA hi = implicit + 4 bits); exact
    in fp64."""
    if phases >= 4:
        return srcb * srca
    b_hi, a_hi = fidelity_hi(srcb, srca)
    if phases == 1:
        return b_hi * a_hi
    if phases == 2:
        return b_hi * srca
    return b_hi * srca + (srcb - b_hi) * a_hi


def round_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 Dst / an FLOAT32 circular buffer (round to nearest even), returned as fp64."""
    return wide(x.to(torch.float32))


def round_dst(x: torch.Tensor, fp32_dest_acc_en: bool) -> torch.Tensor:
    """A value written to Dst (and packed out of it): fp32 with ``fp32_dest_acc_en``, else bf16 ([FP32]); as fp64."""
    return round_fp32(x) if fp32_dest_acc_en else wide(round_bf16(x))


def reduce_sum(x: torch.Tensor, dims: list[int], dtype_name: str, cfg: KernelConfig, fast_and_approximate: bool,
               scale: float = 1.0) -> tuple[torch.Tensor, str]:
    """``ttnn.sum`` over ``dims`` (keepdim) as the card computes it; returns (fp32 result, path name).

    FLOAT32: the SFPU path (exact fp32 accumulation) needs ``fp32_dest_acc_en=True`` and
    ``fast_and_approximate_mode=False`` ([SUM]); otherwise the FPU path with TF32 inputs. FPU accumulation is
    fp32 with ``fp32_dest_acc_en`` and bf16 (rounded after every 32 reduced elements, conservative) without.
    The reduce scaler (1.0, or 1/N for mean) is exact in BF16 for the powers of two; fidelity effects on the
    data operand of the FPU reduce are not modelled (which Src register carries the data is not documented).
    """
    x = x.to(torch.float32)
    # fp64 sums (N8): the result is rounded to fp32 once, whatever the host's summation order
    if dtype_name == "FLOAT32" and cfg.fp32_dest_acc_en and not fast_and_approximate:
        return (wide(x).sum(dim=dims, keepdim=True) * scale).to(torch.float32), "sfpu_fp32"
    if dtype_name == "FLOAT32":
        x = to_tf32(x)
    if cfg.fp32_dest_acc_en:
        return (wide(x).sum(dim=dims, keepdim=True) * scale).to(torch.float32), "fpu_fp32_dest"
    # bf16 Dst: fold the reduced dims into one and accumulate 32 at a time
    keep = [d for d in range(x.ndim) if d not in dims]
    perm = keep + list(dims)
    xt = x.permute(perm)
    lead = list(xt.shape[: len(keep)])
    xt = xt.reshape(lead + [-1])
    acc = None
    for k0 in range(0, xt.shape[-1], 32):
        part = wide(xt[..., k0:k0 + 32]).sum(dim=-1)  # exact in fp64 (N8)
        acc = round_bf16(part if acc is None else acc + part)
    out_shape = [1 if d in dims else x.shape[d] for d in range(x.ndim)]
    # acc is laid out as the kept dims in order; reshape back with size-1 reduced dims
    return round_bf16(acc * scale).reshape(out_shape), "fpu_bf16_dest"


def dst_output(x: torch.Tensor, cfg: KernelConfig) -> torch.Tensor:
    """Values packed out of a 16-bit Dst carry bf16 precision at most ([FP32]); fp32 Dst keeps fp32."""
    return x if cfg.fp32_dest_acc_en else round_bf16(x)


def poison_like(x: torch.Tensor) -> torch.Tensor:
    """What a result that read garbage tile padding looks like here: NaN (deterministic, impossible to miss)."""
    return torch.full_like(x, float("nan"))


def padded_k_contribution(k: int, pad_a, pad_b) -> float | None:
    """What the tile padding of a contraction of length ``k`` adds to every output element.

    A matmul multiplies whole 32x32 tiles: when ``k`` is not a multiple of 32 the padding columns of A meet the
    padding rows of B. ``pad_a``/``pad_b`` are the operands' padding fills (``None`` = garbage). Zero times
    garbage is taken as zero (cards' garbage is usually finite; inf/NaN garbage would poison it too);
    garbage times garbage (or times a non-zero fill) returns ``None``: the result is garbage.
    """
    kp = (-k) % 32
    if kp == 0:
        return 0.0
    if pad_a == 0.0 or pad_b == 0.0:
        return 0.0
    if pad_a is None or pad_b is None:
        return None
    return kp * float(pad_a) * float(pad_b)


__all__ = [
    "NUMERICS_MODES",
    "WIDE",
    "wide",
    "matmul_rows",
    "KernelConfig",
    "is_strict",
    "kernel_config",
    "to_tf32",
    "round_bf16",
    "fpu_matmul",
    "src_operand",
    "fpu_product",
    "fidelity_hi",
    "round_fp32",
    "round_dst",
    "reduce_sum",
    "dst_output",
    "poison_like",
    "padded_k_contribution",
]
