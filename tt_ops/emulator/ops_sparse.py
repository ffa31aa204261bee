"""``ttnn.sparse_matmul``: batched matmul over a group (expert) axis that skips or gathers groups.

Semantics follow the ttnn 0.81.1 docstring (modes table and the ``indices`` paragraph):

* dense A / sparse B (``is_input_a_sparse=False``): a ``[A, B, M, K]``, b ``[1, E, K, N]`` -> ``[A, B, 1, E, M, N]``;
  pair (a_i, b_e) is computed where ``sparsity[a, b, 0, e] != 0`` and zero-filled elsewhere;
* both sparse: a ``[1, E, M, K]``, b ``[1, E, K, N]`` -> ``[1, E, M, N]``, group e where ``sparsity[0, 0, 0, e]``;
* sparse A / dense B: a ``[A, E, M, K]``, b ``[1, E, K, N]`` -> ``[A, E, M, N]``, row a where ``sparsity[0, 0, 0, a]``
  (every expert of that row);
* indexed (``indices`` given, B sparse): only groups ``indices[i]`` are computed, the group axis of the output is
  compact (slot i holds group ``indices[i]``); ``sparsity`` is not read. With a sparse A, a is already compact
  (one block per listed group).

Each computed block is one FPU matmul with the same strict numerics as ``ttnn.matmul`` (TF32 operands, fidelity
phases, Dst accumulation, K padding rule P2). Accounting: the op reads a, the sparsity/indices tensors and only the
groups of b it computes (``nnz`` or the non-zero count in scan mode, ``len(indices)`` in indexed mode: on a card the
reader never fetches a skipped group's tiles); a trace records that count at capture, like the card's program,
which is fixed at capture too. ``bias`` (indexed-mode fused bias) is not emulated.
"""

from __future__ import annotations

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .registry import device_op
from .tensor import EmuTensor, dtype_name, make_like, quantize_via_ttnn, write_inplace
from .ttnn_import import ttnn

OP = "ttnn.sparse_matmul"


def _bind(args, kwargs):
    from .signatures import bind_arguments

    return bind_arguments(OP, ttnn.sparse_matmul, args, kwargs)


def _indices(t: EmuTensor, i: int) -> torch.Tensor:
    return t.shards[i].reshape(-1).to(torch.int64)


def _groups_read(b: dict) -> int:
    """How many groups of input_tensor_b the reader fetches (per device)."""
    idx = b.get("indices")
    if idx is not None:
        return int(idx.logical_shape_list[-1])
    nnz = b.get("nnz")
    a_sparse = bool(b.get("is_input_a_sparse", False))
    b_sparse = bool(b.get("is_input_b_sparse", True))
    e = int(b["input_tensor_b"].logical_shape_list[1])
    if nnz is None:
        nnz = int((b["sparsity"].shards[0] != 0).sum())
    if a_sparse and not b_sparse:
        return min(e, int(nnz) * e)  # every expert of each active row; b is read at most once per group
    return min(e, int(nnz))


def _read(args, kwargs):
    b = _bind(args, kwargs)
    d: dict = {}

    def acc(t, n=None):
        if t is not None:
            d[dtype_name(t.dtype)] = d.get(dtype_name(t.dtype), 0) + (t.bytes_per_device() if n is None else n)

    acc(b["input_tensor_a"])
    acc(b.get("sparsity") if b.get("indices") is None else b["indices"])
    w = b["input_tensor_b"]
    per_group = w.bytes_per_device() // int(w.logical_shape_list[1])
    acc(w, per_group * _groups_read(b))
    return d


def _check(b: dict) -> None:
    a, w = b["input_tensor_a"], b["input_tensor_b"]
    for name, t in (("input_tensor_a", a), ("input_tensor_b", w)):
        if t.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{OP}: {name} must be TILE (got {t.layout.name})")
        if len(t.logical_shape_list) != 4:
            raise EmulatorError(f"{OP}: {name} must have rank 4, got {t.logical_shape_list}")
    sp = b["sparsity"]
    if sp.layout != ttnn.ROW_MAJOR_LAYOUT or dtype_name(sp.dtype) != "BFLOAT16":
        raise EmulatorError(f"{OP}: sparsity must be a ROW_MAJOR bfloat16 tensor")
    pc = b["program_config"]
    if pc is not None and not getattr(pc, "mcast_in0", True):
        raise EmulatorError(f"{OP}: program_config.mcast_in0 must be True")
    if not (b.get("is_input_a_sparse", False) or b.get("is_input_b_sparse", True)):
        raise EmulatorError(f"{OP}: at least one input must be sparse (both-dense is invalid)")
    if b.get("bias") is not None:
        raise NotEmulatedError(f"{OP}(bias=...) is not emulated")
    idx = b.get("indices")
    if idx is not None:
        shape = idx.logical_shape_list
        if idx.layout != ttnn.ROW_MAJOR_LAYOUT or dtype_name(idx.dtype) != "UINT16":
            raise EmulatorError(f"{OP}: indices must be a ROW_MAJOR uint16 tensor")
        if any(s != 1 for s in shape[:-1]):
            raise EmulatorError(f"{OP}: indices must be one ROW_MAJOR stick (all dims but the last 1), got {shape}")
        if not b.get("is_input_b_sparse", True):
            raise EmulatorError(f"{OP}: indices needs is_input_b_sparse=True")
        if b.get("nnz") is not None:
            raise EmulatorError(f"{OP}: nnz must not be given together with indices")
        e = int(w.logical_shape_list[1])
        if shape[-1] > e:
            raise EmulatorError(f"{OP}: {shape[-1]} indices for {e} groups")


def _block(x: torch.Tensor, w: torch.Tensor, a: EmuTensor, b: EmuTensor, cfg) -> torch.Tensor:
    """One FPU matmul x [.., M, K] @ w [.., K, N] with matmul's strict numerics."""
    if x.shape[-1] != w.shape[-2]:
        raise EmulatorError(f"{OP}: inner dimensions differ: {list(x.shape)} x {list(w.shape)}")
    if not numerics.is_strict(a):
        return numerics.matmul_rows(x, w)
    y = numerics.fpu_matmul(x, w, dtype_name(a.dtype), dtype_name(b.dtype), cfg)
    extra = numerics.padded_k_contribution(x.shape[-1], a.pad_fill, b.pad_fill)
    if extra is None:
        return numerics.poison_like(y)
    return y + extra if extra else y


def _shard(b: dict, i: int, cfg) -> torch.Tensor:
    a_t, w_t = b["input_tensor_a"], b["input_tensor_b"]
    a = a_t.shards[i].to(torch.float32)
    w = w_t.shards[i].to(torch.float32)
    a_sparse = bool(b.get("is_input_a_sparse", False))
    b_sparse = bool(b.get("is_input_b_sparse", True))
    idx = b.get("indices")
    if idx is not None:
        ids = _indices(idx, i)
        e = w.shape[1]
        if bool(((ids < 0) | (ids >= e)).any()):
            raise EmulatorError(f"{OP}: an index is outside [0, {e}) (cards assert under watcher, else read garbage)")
        sel = w[0, ids]  # [n, K, N]
        if a_sparse:
            if a.shape[1] != ids.numel():
                raise EmulatorError(f"{OP}: sparse input_tensor_a has {a.shape[1]} blocks for {ids.numel()} indices")
            return _block(a[0], sel, a_t, w_t, cfg).unsqueeze(0)  # [1, n, M, N]
        # every (a, b) batch pair against every listed group: [A, B, 1, n, M, N]
        return _block(a[:, :, None, None], sel[None, None, None], a_t, w_t, cfg)
    sp = b["sparsity"].shards[i].to(torch.float32)
    if a_sparse and b_sparse:
        y = _block(a, w, a_t, w_t, cfg)  # [1, E, M, N]
        mask = (sp.reshape(-1) != 0).reshape(1, -1, 1, 1)
    elif b_sparse:
        y = _block(a[:, :, None, None], w[None, None], a_t, w_t, cfg)  # [A, B, 1, E, M, N]
        mask = (sp != 0).reshape(*y.shape[:-2], 1, 1)
    else:
        y = _block(a, w, a_t, w_t, cfg)  # [A, E, M, N]
        mask = (sp.reshape(-1) != 0).reshape(-1, 1, 1, 1)
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype))


@device_op(OP, read_bytes=_read)
def sparse_matmul(input_tensor_a, input_tensor_b, **kwargs):
    b = _bind((input_tensor_a, input_tensor_b), kwargs)
    _check(b)
    cfg = numerics.kernel_config(b.get("compute_kernel_config"))
    fused = getattr(b["program_config"], "fused_activation", None)
    if fused is not None:
        raise NotEmulatedError(f"{OP}: program_config.fused_activation is not emulated")
    outs = [_shard(b, i, cfg) for i in range(input_tensor_a.num_shards)]
    out_t = b.get("optional_output_tensor")
    if out_t is not None:
        if list(out_t.logical_shape_list) != list(outs[0].shape):
            raise NotEmulatedError(f"{OP}: optional_output_tensor of shape {out_t.logical_shape_list} (the compact "
                                   f"nnz form) is not emulated; expected {list(outs[0].shape)}")
        write_inplace(out_t, [quantize_via_ttnn(o, out_t.dtype) for o in outs])
        return out_t
    dtype = b.get("dtype")
    return make_like(input_tensor_a, outs, dtype=dtype if dtype is not None else input_tensor_a.dtype,
                     layout=ttnn.TILE_LAYOUT, memory_config=b.get("memory_config"))
