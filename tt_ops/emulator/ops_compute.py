"""linear / matmul computed in fp32 and rounded to the output dtype (DESIGN 2.1).

The ttnn goldens multiply in the input dtype; bf16 matmul on a 2-core CPU is ~100x slower than fp32
and the result differs from fp32-then-round by at most ~1 bf16 ulp. Cards accumulate in fp32 (or
bf16 dest with fp32_dest_acc_en=False - not modelled, see docs/emulator.md fidelity gaps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import EmulatorError, NotEmulatedError
from .registry import device_op
from .tensor import EmuTensor, make_like, quantize_via_ttnn, write_inplace
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
    name = _activation_name(act)
    if name is None:
        return x
    if name not in _ACTIVATIONS:
        raise NotEmulatedError(f"fused activation '{name}' is not emulated (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name](x)


def _mm(a: EmuTensor, b: EmuTensor, i: int, transpose_a: bool, transpose_b: bool, op: str) -> torch.Tensor:
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
    return torch.matmul(x, w)


def _finish(op, a, outs, dtype, memory_config, optional_output_tensor):
    if optional_output_tensor is not None:
        write_inplace(optional_output_tensor, [quantize_via_ttnn(o, optional_output_tensor.dtype) for o in outs])
        return optional_output_tensor
    return make_like(a, outs, dtype=dtype if dtype is not None else a.dtype, layout=ttnn.TILE_LAYOUT,
                     memory_config=memory_config)


def _check_layouts(op, a, b):
    for name, t in (("input_tensor_a", a), ("input_tensor_b", b)):
        if t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{op}: {name} must be in TILE layout (got {t.layout.name})")


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
    if in0_column_offset is not None:
        raise NotEmulatedError("ttnn.linear(in0_column_offset=...) is not emulated")
    fused = getattr(program_config, "fused_activation", None) if program_config is not None else None
    outs = []
    for i in range(input_tensor_a.num_shards):
        y = _mm(input_tensor_a, input_tensor_b, i, transpose_a, transpose_b, "ttnn.linear")
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
    fused = getattr(program_config, "fused_activation", None) if program_config is not None else None
    outs = []
    for i in range(input_tensor_a.num_shards):
        y = _mm(input_tensor_a, input_tensor_b, i, transpose_a, transpose_b, "ttnn.matmul")
        if fused is not None:
            y = _apply_activation(y, fused)
        outs.append(_apply_activation(y, activation))
    return _finish("ttnn.matmul", input_tensor_a, outs, dtype, memory_config, optional_output_tensor)
