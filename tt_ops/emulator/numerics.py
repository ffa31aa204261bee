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
    is assumed (truncation would be up to one bf16 ulp further from the exact value)."""
    return x.to(torch.bfloat16).to(torch.float32)


def src_format_bits(dtype_name: str) -> int:
    """Explicit mantissa bits an operand of this ttnn dtype has once unpacked into SrcA/SrcB ([SRC])."""
    return 10 if dtype_name == "FLOAT32" else 7  # TF32; BF16 (BFP8/BFP4 unpack losslessly to BF16)


def _split(x: torch.Tensor, hi_bits: int, total_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) with hi = implicit 1 + ``hi_bits`` mantissa bits and lo = the rest up to ``total_bits``."""
    full = _keep_mantissa_bits(x, total_bits)
    hi = _keep_mantissa_bits(full, hi_bits)
    return hi, full - hi  # exact: both are representable in fp32


# torch's CPU fp32 matmul computes fewer than MIN_ROWS rows with another kernel (a matrix-vector path) whose sums
# round differently; from MIN_ROWS rows up, a row's result does not depend on how many rows share the call
# (tests/test_emulator_numerics_rows.py checks both on this machine's torch). On the card a row's result does not
# depend on the other rows either: every row of a 32-row tile goes through the same FPU sequence. Without this a
# 1-row decode and a (K+1)-row verify round the same row differently, which no card does.
MIN_ROWS = 4


def matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(x, w)`` whose every row is bit-identical whatever the row count of ``x`` (dim -2)."""
    if x.dim() < 2 or x.shape[-2] >= MIN_ROWS:
        return torch.matmul(x, w)
    m = x.shape[-2]
    pad = x.new_zeros(*x.shape[:-2], MIN_ROWS - m, x.shape[-1])
    return torch.matmul(torch.cat([x, pad], dim=-2), w)[..., :m, :]


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
    if cfg.fp32_dest_acc_en:
        out = None
        for x, w in terms:
            y = matmul_rows(x, w)
            out = y if out is None else out + y
        return out
    k = a32.shape[-1]
    out = None
    for k0 in range(0, k, 32):
        part = None
        for x, w in terms:
            y = matmul_rows(x[..., k0:k0 + 32], w[..., k0:k0 + 32, :])
            part = y if part is None else part + y
        out = round_bf16(part if out is None else out + part)
    return out


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
    if dtype_name == "FLOAT32" and cfg.fp32_dest_acc_en and not fast_and_approximate:
        return x.sum(dim=dims, keepdim=True) * scale, "sfpu_fp32"
    if dtype_name == "FLOAT32":
        x = to_tf32(x)
    if cfg.fp32_dest_acc_en:
        return x.sum(dim=dims, keepdim=True) * scale, "fpu_fp32_dest"
    # bf16 Dst: fold the reduced dims into one and accumulate 32 at a time
    keep = [d for d in range(x.ndim) if d not in dims]
    perm = keep + list(dims)
    xt = x.permute(perm)
    lead = list(xt.shape[: len(keep)])
    xt = xt.reshape(lead + [-1])
    acc = None
    for k0 in range(0, xt.shape[-1], 32):
        part = xt[..., k0:k0 + 32].sum(dim=-1)
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
    "KernelConfig",
    "is_strict",
    "kernel_config",
    "to_tf32",
    "round_bf16",
    "fpu_matmul",
    "reduce_sum",
    "dst_output",
    "poison_like",
    "padded_k_contribution",
]
