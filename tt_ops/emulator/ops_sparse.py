"""``ttnn.sparse_matmul``: batched matmul over a group (expert) axis that skips or gathers groups.

Semantics follow the ttnn 0.81.1 docstring (modes table and the ``indices`` paragraph):

* dense A / sparse B (``is_input_a_sparse=False``): a ``[A, B, M, K]``, b ``[1, E, K, N]`` -> ``[A, B, 1, E, M, N]``;
  pair (a_i, b_e) is computed where ``sparsity[a, b, 0, e] != 0`` and zero-filled elsewhere;
* both sparse: a ``[1, E, M, K]``, b ``[1, E, K, N]`` -> ``[1, E, M, N]``, group e where ``sparsity[0, 0, 0, e]``;
* sparse A / dense B: a ``[A, E, M, K]``, b ``[1, E, K, N]`` -> ``[A, E, M, N]``, block (a, e) where
  ``sparsity[0, 0, a, e]`` (sparsity ``[1, 1, A, E]``, nnz <= A * E, as the modes table). Tenstorrent's
  ``test_sparse_matmul_inputA_with_nnz`` runs another form (a ``[B, S, M, K]`` with S != E, sparsity ``[1, 1, B, S]``,
  output indexed ``[B, S, 1, E, M, N]``); the table and the test disagree, so that form is refused by name;
* indexed (``indices`` given, B sparse): only groups ``indices[i]`` are computed, the group axis of the output is
  compact (slot i holds group ``indices[i]``); ``sparsity`` is not read. With a sparse A, a is already compact
  (one block per listed group). ``bias`` (indexed mode only): a BFLOAT16 TILE ``[E, <=32, N]`` tensor, row 0 of group
  ``indices[i]``'s tile row added to slot i's Dst value before packing (rounded to the Dst format: "applied at bf16
  precision" without fp32 Dst);
* compact output: with ``nnz`` and an ``optional_output_tensor`` of shape ``[1, nnz, M, N]``, the nnz computed
  blocks are packed in sparsity scan order (row-major over the sparsity tensor), skipped blocks omitted.

Each computed block is one FPU matmul with the same strict numerics as ``ttnn.matmul`` (TF32 operands, fidelity
phases, Dst accumulation, K padding rule P2). Accounting: the op reads a, the sparsity/indices tensors and only the
groups of b it computes (``nnz`` or the non-zero count in scan mode, ``len(indices)`` in indexed mode: on a card the
reader never fetches a skipped group's tiles; in the dense-A mode over several batches every active (batch, group)
pair streams its group's tiles again, as the reader fetches in1 per active pair and an expert's weights do not stay
in L1 from one batch to the next); a trace records that count at capture, like the card's program, which is fixed
at capture too. The dense-A mode computes the active pairs only, one group at a time (its expanded output is
A x B x E blocks, most of them skipped). Tiles other than 32x32 (``output_tile``, or inputs built with another ``tile``) are
refused by name; fused activations too.
"""

from __future__ import annotations

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .registry import device_op
from .shard_specs import output_memory_config
from .tensor import EmuTensor, describe_tile, dtype_name, is_default_tile, make_like, quantize_via_ttnn, write_inplace
from .ttnn_import import ttnn

OP = "ttnn.sparse_matmul"


def bind_sparse_matmul(args, kwargs):
    from .signatures import bind_arguments

    return bind_arguments(OP, ttnn.sparse_matmul, args, kwargs)


def _indices(t: EmuTensor, i: int) -> torch.Tensor:
    return t.shards[i].reshape(-1).to(torch.int64)


def groups_read(b: dict) -> int:
    """How many groups of input_tensor_b the reader fetches (per device)."""
    idx = b.get("indices")
    if idx is not None:
        return int(idx.logical_shape_list[-1])
    nnz = b.get("nnz")
    e = int(b["input_tensor_b"].logical_shape_list[1])
    if nnz is None:
        nnz = int((b["sparsity"].shards[0] != 0).sum())
    a = b["input_tensor_a"].logical_shape_list
    if not b.get("is_input_a_sparse", False) and a[0] * a[1] > 1:
        return int(nnz)  # dense A over several batches: each active (batch, group) pair streams its group again
    return min(e, int(nnz))  # one batch: b is read at most once per group


def _read(args, kwargs):
    b = bind_sparse_matmul(args, kwargs)
    d: dict = {}

    def acc(t, n=None):
        if t is not None:
            d[dtype_name(t.dtype)] = d.get(dtype_name(t.dtype), 0) + (t.bytes_per_device() if n is None else n)

    acc(b["input_tensor_a"])
    acc(b.get("sparsity") if b.get("indices") is None else b["indices"])
    w = b["input_tensor_b"]
    per_group = w.bytes_per_device() // int(w.logical_shape_list[1])
    acc(w, per_group * groups_read(b))
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
    out_tile = b.get("output_tile")
    if out_tile is not None and not is_default_tile(out_tile):
        raise NotEmulatedError(f"{OP}: output_tile {describe_tile(out_tile)} is not emulated (only 32x32 tiles)")
    a_sparse, b_sparse = bool(b.get("is_input_a_sparse", False)), bool(b.get("is_input_b_sparse", True))
    e = int(w.logical_shape_list[1])
    if w.logical_shape_list[0] != 1:
        raise EmulatorError(f"{OP}: input_tensor_b must be [1, E, K, N], got {w.logical_shape_list}")
    if a.logical_shape_list[-1] != w.logical_shape_list[-2]:
        raise EmulatorError(f"{OP}: inner dimensions differ: a {a.logical_shape_list} x b {w.logical_shape_list}")
    idx = b.get("indices")
    if idx is None:  # the modes table's shapes (indexed mode is checked below)
        sps = sp.logical_shape_list
        if a_sparse and b_sparse:
            want_a, want_sp = f"[1, {e}, M, K]", [1, 1, 1, e]
            ok = a.logical_shape_list[:2] == [1, e]
        elif b_sparse:
            want_a, want_sp = "[A, B, M, K]", [1] + a.logical_shape_list[:2] + [e]
            ok = True
        else:
            want_a, want_sp = f"[A, {e}, M, K]", [1, 1, a.logical_shape_list[0], e]
            ok = a.logical_shape_list[1] == e
        if not ok:
            raise EmulatorError(
                f"{OP}: with is_input_a_sparse={a_sparse}, is_input_b_sparse={b_sparse} input_tensor_a must be "
                f"{want_a} for input_tensor_b {w.logical_shape_list} (the docstring's modes table), got "
                f"{a.logical_shape_list}" + ("" if b_sparse else "; Tenstorrent's test_sparse_matmul_inputA_with_nnz "
                                             "form (a [B, S, M, K], output [B, S, 1, E, M, N]) is not emulated"))
        if list(sps) != list(want_sp):
            raise EmulatorError(f"{OP}: sparsity must be {want_sp} in this mode (the docstring's modes table), got "
                                f"{list(sps)}")
    # the device op's messages below are the strings of 0.81.1's library (Tenstorrent's test matches on them)
    bias = b.get("bias")
    if bias is not None:
        bs = bias.logical_shape_list
        if idx is None:
            raise EmulatorError(f"{OP}: sparse_matmul bias requires indices (indexed/gather mode)")
        if dtype_name(bias.dtype) != "BFLOAT16":
            raise EmulatorError(f"{OP}: bias must be BFLOAT16 (it is added at bias precision, not the weight dtype), "
                                f"got {dtype_name(bias.dtype)}")
        if bias.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{OP}: bias must be TILE layout, got {bias.layout.name}")
        if len(bs) != 3 or bs[0] != e or bs[1] > 32 or bs[2] != w.logical_shape_list[-1]:
            raise EmulatorError(f"{OP}: bias must have padded shape [E, tile_height, N] with E the number of sparse "
                                f"groups ({e}) and N the output width ({w.logical_shape_list[-1]}), got logical {bs}")
    if idx is not None:
        shape = idx.logical_shape_list
        if idx.layout != ttnn.ROW_MAJOR_LAYOUT:
            raise EmulatorError(f"{OP}: indices must be ROW_MAJOR layout, got {idx.layout.name}")
        if dtype_name(idx.dtype) != "UINT16":
            raise EmulatorError(f"{OP}: indices must be UINT16 dtype, got {dtype_name(idx.dtype)}")
        if any(s != 1 for s in shape[:-1]):
            raise EmulatorError(f"{OP}: indices must occupy a single ROW_MAJOR stick (all dimensions except the last "
                                f"must be 1), got shape {shape}")
        if not b.get("is_input_b_sparse", True):
            raise EmulatorError(f"{OP}: Indexed/gather mode requires is_input_b_sparse=true (the indexed operand is "
                                "the expert weight tensor B, laid out as [..., E, K, N]).")
        if b.get("nnz") is not None:
            raise EmulatorError(f"{OP}: nnz ({b['nnz']}) must not be supplied together with indices: the "
                                "indexed/gather loop count is num_active (the length of indices), so nnz would be "
                                "ignored")
        if shape[-1] > e:
            raise EmulatorError(f"{OP}: indices length / num_active ({shape[-1]}) must be <= the number of sparse "
                                f"groups in input B ({e})")


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
        bias = b.get("bias")
        if a_sparse:
            if a.shape[1] != ids.numel():
                raise EmulatorError(f"{OP}: sparse input_tensor_a has {a.shape[1]} blocks for {ids.numel()} indices")
            y = _block(a[0], sel, a_t, w_t, cfg).unsqueeze(0)  # [1, n, M, N]
        else:  # every (a, b) batch pair against every listed group: [A, B, 1, n, M, N]
            y = _block(a[:, :, None, None], sel[None, None, None], a_t, w_t, cfg)
        if bias is not None:  # row 0 of group indices[i]'s tile row, added in Dst before packing
            rows = bias.shards[i][:, 0, :].to(torch.float64)[ids]  # [n, N]
            y = y + rows.reshape(*([1] * (y.dim() - 3)), ids.numel(), 1, -1)
            if numerics.is_strict(a_t):
                y = numerics.dst_output(y, cfg)
        return y
    sp = b["sparsity"].shards[i].to(torch.float32)
    if a_sparse and b_sparse:
        y = _block(a, w, a_t, w_t, cfg)  # [1, E, M, N]
        mask = (sp.reshape(-1) != 0).reshape(1, -1, 1, 1)
    elif b_sparse:
        return _dense_a_pairs(a, w, sp, a_t, w_t, cfg, expanded=True)  # [A, B, 1, E, M, N]
    else:
        y = _block(a, w[0][None], a_t, w_t, cfg)  # [A, E, M, N]: block (a, e) = a[a, e] @ b[0, e]
        mask = (sp.reshape(a.shape[0], -1) != 0).reshape(*y.shape[:2], 1, 1)
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype))


def _dense_a_pairs(a: torch.Tensor, w: torch.Tensor, sp: torch.Tensor, a_t, w_t, cfg, expanded: bool) -> torch.Tensor:
    """Dense A [A, B, M, K] x sparse B [1, E, K, N]: the active pairs (sparsity [1, A, B, E] != 0) only, computed one
    group at a time over the row blocks that use it (a row's result does not depend on the other rows: rules N7/N8),
    so memory follows the active pairs, not A x B x E. ``expanded``: the [A, B, 1, E, M, N] output with skipped
    pairs zero-filled; else the compact [1, nnz, M, N] in sparsity scan order."""
    n_a, n_b, m, _ = a.shape
    e, n = w.shape[1], w.shape[-1]
    flags = (sp.reshape(n_a * n_b, e) != 0)
    pairs = flags.nonzero()  # (batch, group) in scan order
    blocks = a.reshape(n_a * n_b, m, -1)
    out = torch.zeros(pairs.shape[0], m, n, dtype=torch.float64)
    for g in pairs[:, 1].unique().tolist():
        sel = (pairs[:, 1] == g).nonzero().reshape(-1)
        rows = blocks[pairs[sel, 0]].reshape(-1, blocks.shape[-1])  # every block of group g, stacked
        out[sel] = _block(rows, w[0, g], a_t, w_t, cfg).to(torch.float64).reshape(sel.numel(), m, n)
    if not expanded:
        return out.unsqueeze(0)
    full = torch.zeros(n_a * n_b, e, m, n, dtype=torch.float64)
    full[pairs[:, 0], pairs[:, 1]] = out
    return full.reshape(n_a, n_b, 1, e, m, n)


def _compact(b: dict, i: int, y: torch.Tensor) -> torch.Tensor:
    """The ``[1, nnz, M, N]`` form: the computed blocks in sparsity scan order (row-major), skipped ones omitted."""
    flags = (b["sparsity"].shards[i].reshape(-1) != 0)
    blocks = y.reshape(-1, *y.shape[-2:])
    if blocks.shape[0] != flags.numel():
        raise EmulatorError(f"{OP}: the compact output needs one sparsity flag per block ({blocks.shape[0]}), "
                            f"sparsity has {flags.numel()}")
    return blocks[flags].unsqueeze(0)


@device_op(OP, read_bytes=_read)
def sparse_matmul(input_tensor_a, input_tensor_b, **kwargs):
    b = bind_sparse_matmul((input_tensor_a, input_tensor_b), kwargs)
    _check(b)
    cfg = numerics.kernel_config(b.get("compute_kernel_config"))
    fused = getattr(b["program_config"], "fused_activation", None)
    if fused is not None:
        raise NotEmulatedError(f"{OP}: program_config.fused_activation is not emulated")
    out_t = b.get("optional_output_tensor")
    nnz = b.get("nnz")
    dense_a = b.get("indices") is None and not b.get("is_input_a_sparse", False) and b.get("is_input_b_sparse", True)
    a_shape, w_shape = input_tensor_a.logical_shape_list, input_tensor_b.logical_shape_list
    if (out_t is not None and dense_a and nnz is not None
            and list(out_t.logical_shape_list) == [1, int(nnz), a_shape[2], w_shape[3]]):
        # the compact form of the dense-A mode: computed pair by pair (the expanded [A, B, 1, E, M, N] never exists)
        counts = [int((b["sparsity"].shards[i] != 0).sum()) for i in range(input_tensor_a.num_shards)]
        if any(c != int(nnz) for c in counts):
            raise EmulatorError(f"{OP}: nnz={nnz} but the sparsity has {counts} non-zero entries per device "
                                "(a card hangs on this mismatch; the docstring makes exactness the caller's duty)")
        outs = [_dense_a_pairs(input_tensor_a.shards[i].to(torch.float32), input_tensor_b.shards[i].to(torch.float32),
                               b["sparsity"].shards[i].to(torch.float32), input_tensor_a, input_tensor_b, cfg,
                               expanded=False) for i in range(input_tensor_a.num_shards)]
        write_inplace(out_t, [quantize_via_ttnn(o, out_t.dtype) for o in outs])
        return out_t
    outs = [_shard(b, i, cfg) for i in range(input_tensor_a.num_shards)]
    if out_t is not None:
        compact = None if nnz is None or b.get("indices") is not None else [1, int(nnz)] + list(outs[0].shape[-2:])
        if compact is not None and list(out_t.logical_shape_list) == compact:
            counts = [int((b["sparsity"].shards[i] != 0).sum()) for i in range(input_tensor_a.num_shards)]
            if any(c != int(nnz) for c in counts):
                raise EmulatorError(f"{OP}: nnz={nnz} but the sparsity has {counts} non-zero entries per device "
                                    "(a card hangs on this mismatch; the docstring makes exactness the caller's duty)")
            outs = [_compact(b, i, o) for i, o in enumerate(outs)]
        elif list(out_t.logical_shape_list) != list(outs[0].shape):
            if b.get("indices") is not None:  # the device op's message
                raise EmulatorError(f"{OP}: Optional output tensor shape {out_t.logical_shape_list} must match the "
                                    f"indexed output shape {list(outs[0].shape)} when indices are provided "
                                    f"(num_active={b['indices'].logical_shape_list[-1]})")
            raise EmulatorError(f"{OP}: optional_output_tensor has shape {out_t.logical_shape_list}; expected the "
                                f"expanded {list(outs[0].shape)}" + (f" or the compact {compact}" if compact else ""))
        write_inplace(out_t, [quantize_via_ttnn(o, out_t.dtype) for o in outs])
        return out_t
    dtype = b.get("dtype")
    return make_like(input_tensor_a, outs, dtype=dtype if dtype is not None else input_tensor_a.dtype,
                     layout=ttnn.TILE_LAYOUT,
                     memory_config=output_memory_config(OP, b.get("memory_config"), input_tensor_a))
