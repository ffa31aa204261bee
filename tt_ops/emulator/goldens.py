"""Golden-backed ops: ``ttnn.get_golden_function(op)`` run once per device shard, outputs assembled into
EmuTensors with ttnn's dtype/layout rules. Used by the namespace for every registered ttnn op without an
override, and by op modules that fall back to the golden for modes they do not emulate themselves.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import numerics
from .errors import NotEmulatedError
from .shard_specs import output_memory_config
from .tensor import EmuTensor, dtype_name, iter_tensors, make_like, map_shards, quantize_via_ttnn, write_inplace
from .ttnn_import import ttnn


# --------------------------------------------------------------------------------------------------
# Golden-backed ops
# --------------------------------------------------------------------------------------------------
def _out_dtype_for(golden_out: torch.Tensor, args, kwargs, ref: EmuTensor):
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    if golden_out.dtype == torch.bool:
        return ref.dtype
    if not golden_out.is_floating_point():
        for t in iter_tensors((args, kwargs)):
            if dtype_name(t.dtype) in ("UINT32", "INT32", "UINT16", "UINT8"):
                return t.dtype
        return ttnn.uint32
    for t in iter_tensors((args, kwargs)):
        if dtype_name(t.dtype) not in ("UINT32", "INT32", "UINT16", "UINT8"):
            return t.dtype
    return ttnn.bfloat16


# Goldens whose fp32 result is packed out of Dst (rule N4 applies to their FLOAT32 outputs): matmul-like and
# reduction-heavy ops.
FP32_COMPUTE_GOLDENS = {
    "ttnn.rms_norm",
    "ttnn.layer_norm",
    "ttnn.softmax",
    "ttnn.transformer.scaled_dot_product_attention",
    "ttnn.transformer.chunked_scaled_dot_product_attention",
    "ttnn.transformer.joint_scaled_dot_product_attention",
    "ttnn.transformer.chunk_gated_delta_rule",
    "ttnn.transformer.fused_recurrent_gated_delta_rule",
    "ttnn.bmm",
    "ttnn.addmm",
    "ttnn.sum",
    "ttnn.mean",
}

# Goldens that only move, select or compare values: run on the shards as stored (no arithmetic can depend on the
# host, and converting a weight-sized table such as the embedding to fp64 on every call would cost gigabytes at 27B).
# Every other golden computes (rule N8): it runs on fp64 copies of its floating shards and its result is rounded to
# the output dtype once, so no element's value depends on the host's SIMD width, its transcendental kernels, the
# thread count, or how many other rows share the call.
DATA_GOLDENS = {
    "ttnn.embedding",
    "ttnn.slice",
    "ttnn.concat",
    "ttnn.permute",
    "ttnn.transpose",
    "ttnn.pad",
    "ttnn.repeat",
    "ttnn.repeat_interleave",
    "ttnn.gather",
    "ttnn.scatter",
    "ttnn.tilize",
    "ttnn.untilize",
    "ttnn.tilize_with_val_padding",
    "ttnn.untilize_with_unpadding",
    "ttnn.squeeze",
    "ttnn.unsqueeze",
    "ttnn.argmax",
    "ttnn.topk",
    "ttnn.sort",
    "ttnn.eq",
    "ttnn.ne",
    "ttnn.lt",
    "ttnn.le",
    "ttnn.gt",
    "ttnn.ge",
    "ttnn.where",
    "ttnn.logical_and",
    "ttnn.logical_or",
    "ttnn.logical_not",
}


def golden_impl(op_name: str, real_op, golden: Callable | None = None) -> Callable:
    """The op run through ``golden`` (default: ttnn's golden function of ``real_op``) once per device shard."""
    golden = golden if golden is not None else getattr(real_op, "golden_function", None)
    convert = None if op_name in DATA_GOLDENS else numerics.wide

    def impl(*args, **kwargs):
        if golden is None:
            raise NotEmulatedError(
                f"{op_name} exists in ttnn 0.81.1 but has no golden function and no emulation in tt_ops.emulator; "
                "add an emulation (tt_ops/emulator/ops_*.py) with a test against an independent torch formulation"
            )
        inputs = list(iter_tensors((args, kwargs)))
        if not inputs:
            raise NotEmulatedError(f"{op_name}: no device tensor argument; creation ops are not emulated")
        ref = inputs[0]
        out_kw = kwargs.get("output_tensor")
        gkw = {k: v for k, v in kwargs.items() if k not in ("output_tensor", "memory_config", "compute_kernel_config")}
        results = []
        for i in range(ref.num_shards):
            r = golden(*map_shards(args, i, convert), **map_shards(gkw, i, convert))
            results.append(r)
        if op_name in FP32_COMPUTE_GOLDENS and numerics.is_strict(ref):
            results = dst_rule(results, args, kwargs, ref)
        return assemble(op_name, results, args, kwargs, ref, out_kw)

    return impl


def dst_rule(results, args, kwargs, ref):
    """Strict numerics: an fp32 result packed out of a 16-bit Dst (``fp32_dest_acc_en`` off, the default when no
    config is passed) carries bf16 precision only (numerics.dst_output)."""
    if _out_dtype_name(results[0], args, kwargs, ref) != "FLOAT32":
        return results
    cfg = numerics.kernel_config(kwargs.get("compute_kernel_config"))
    return [numerics.dst_output(r, cfg) if isinstance(r, torch.Tensor) and r.is_floating_point() else r
            for r in results]


def _out_dtype_name(first, args, kwargs, ref) -> str:
    if not isinstance(first, torch.Tensor):
        return ""
    return dtype_name(_out_dtype_for(first, args, kwargs, ref))


# What an op leaves in the tile padding of its output when it documents a fill (default: garbage, None).
OUTPUT_PAD_FILL = {
    # ttnn.slice: "pad_value: Fill value for implicit tile padding on tiled tensors. Padding is undefined by
    # default." (0.81.1 docstring)
    "ttnn.slice": lambda args, kwargs: None if kwargs.get("pad_value") is None else float(kwargs["pad_value"]),
}


# Output layout rules where ttnn does not keep the first input's layout.
OUTPUT_LAYOUT = {
    # embedding: "the layout of the output tensor. Defaults to ttnn.ROW_MAJOR_LAYOUT" (op docstring)
    "ttnn.embedding": lambda args, kwargs: kwargs.get("layout") or ttnn.ROW_MAJOR_LAYOUT,
}


def assemble(op_name, results, args, kwargs, ref, out_kw=None):
    first = results[0]
    mem = output_memory_config(op_name, kwargs.get("memory_config"), ref)
    if isinstance(first, torch.Tensor):
        dtype = _out_dtype_for(first, args, kwargs, ref)
        layout = OUTPUT_LAYOUT[op_name](args, kwargs) if op_name in OUTPUT_LAYOUT else ref.layout
        pad = OUTPUT_PAD_FILL[op_name](args, kwargs) if op_name in OUTPUT_PAD_FILL else None
        if out_kw is not None:
            write_inplace(out_kw, [quantize_via_ttnn(r, out_kw.dtype) for r in results])
            if not (out_kw.mesh is not None and out_kw.mesh.trace.dry):
                out_kw.pad_fill = pad
            return out_kw
        return make_like(ref, results, dtype=dtype, layout=layout, memory_config=mem, pad_fill=pad)
    if isinstance(first, (tuple, list)):
        parts = []
        for j in range(len(first)):
            col = [r[j] for r in results]
            if col[0] is None:
                parts.append(None)
            elif isinstance(col[0], torch.Tensor):
                dtype = _out_dtype_for(col[0], args, kwargs, ref)
                parts.append(make_like(ref, col, dtype=dtype, memory_config=mem))
            else:
                parts.append(col[0])
        return type(first)(parts) if isinstance(first, tuple) else parts
    if first is None:
        return None
    return first
