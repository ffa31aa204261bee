"""What the KDA op modules share: the device ops' common validation (the messages of ``kda_factory_utils.cpp`` in the
installed library), their compute-config resolution, the replicated ``actual_start`` / ``actual_end`` scalars and the
chronology every KDA kernel derives from them (``kda/device/kernels/chronology.hpp``)."""

from __future__ import annotations

from . import numerics
from .errors import EmulatorError
from .tensor import dtype_name
from .ttnn_import import ttnn

TILE = 32


def check_device(op: str, name: str, t) -> None:
    if t is None or not getattr(t, "on_device", False):
        raise EmulatorError(f"{op}: {name} must be an allocated device tensor")


def check_layout(op: str, name: str, t, layout) -> None:
    if t.layout != layout:
        raise EmulatorError(f"{op}: {name} must use {layout.name} layout, got Layout::{t.layout.name}")


def check_dtype(op: str, name: str, t, *accepted: str) -> None:
    if dtype_name(t.dtype) not in accepted:
        raise EmulatorError(f"{op}: {name} must be {' or '.join(accepted)}, got DataType::{dtype_name(t.dtype)}")


def check_interleaved(op: str, name: str, t) -> None:
    if t.is_sharded():
        raise EmulatorError(f"{op}: {name} must use interleaved memory")


def check_output_interleaved(op: str, memory_config, message: str | None = None) -> None:
    if memory_config is not None and memory_config.is_sharded():
        raise EmulatorError(message or f"{op}: output memory layout must be INTERLEAVED, got "
                            f"{memory_config.memory_layout.name}")


def kernel_config(op: str, ckc, default: numerics.KernelConfig, approx_refused: str | None = None):
    """The op's compute config: its own defaults without one; a given config's fidelity ``Invalid`` (a
    default-constructed config) keeps the op's fidelity."""
    if ckc is None:
        return default
    if bool(getattr(ckc, "packer_l1_acc", False)):
        raise EmulatorError(f"{op}: packer_l1_acc=true is unsupported because the compute kernel does not accumulate "
                            "through L1")
    cfg = numerics.kernel_config(ckc)
    if getattr(getattr(ckc, "math_fidelity", None), "name", "") == "Invalid":
        cfg = numerics.KernelConfig(default.phases, cfg.fp32_dest_acc_en, cfg.math_approx_mode, False, True)
    if approx_refused and cfg.math_approx_mode:
        raise EmulatorError(approx_refused)
    return cfg


def scalar(op: str, name: str, t, i: int) -> int:
    """A replicated UINT32 ROW_MAJOR scalar (``actual_start`` / ``actual_end``) as device ``i`` reads it."""
    check_device(op, name, t)
    if t.logical_volume() != 1:
        raise EmulatorError(f"{op}: {name} must be a scalar")
    if dtype_name(t.dtype) != "UINT32" or t.layout != ttnn.ROW_MAJOR_LAYOUT:
        raise EmulatorError(f"{op}: {name} must be a UINT32 ROW_MAJOR scalar, got {dtype_name(t.dtype)} "
                            f"{t.layout.name}")
    return int(t.shards[i].reshape(-1)[0])


def sp_rank(op: str, t, i: int, axis: int) -> tuple[int, int]:
    """(rank, size) of device ``i`` along the sequence-parallel mesh axis (native mesh coordinates, row-major)."""
    shape = [int(d) for d in t.mesh.shape]
    if not 0 <= int(axis) < len(shape):
        raise EmulatorError(f"{op}: invalid sequence_parallel_axis {axis} for a {len(shape)}-D mesh")
    coord = (i // shape[1], i % shape[1])
    return coord[int(axis)], shape[int(axis)]


def chronology(start: int, rank: int, parts: int, rows: int, end: int | None = None) -> dict:
    """``kda_chronology::derive`` / ``derive_interval``: where the chronological sequence starts, whether this rank holds
    both its head and its tail, and (with ``end``) how many of its ``rows`` are valid and which rank owns the last
    segment. ``start`` must be a non-negative multiple of 32 (a caller contract cards do not check)."""
    if start < 0 or start % TILE:
        raise EmulatorError(f"actual_start {start} must be non-negative and 32-aligned (cards do not check it and "
                            "misplace the sequence)")
    first = (start // rows) % parts
    split = parts > 1 and start % rows != 0
    t = {"first_rank": first, "head_rows": rows - start % rows, "local_split": split and rank == first, "rank": rank,
         "final_owner": first if split else (first + parts - 1) % parts, "split": split, "valid_rows": rows}
    if end is None:
        return t
    length = end - start
    if not 0 < length <= parts * rows:
        raise EmulatorError(f"actual_end - actual_start = {length} must be in (0, {parts * rows}] (a non-empty interval "
                            "within physical capacity)")
    if parts == 1:
        return dict(t, valid_rows=length, head_rows=rows)
    step = (rank + parts - first) % parts
    tail_begin = t["head_rows"] + (parts - 1) * rows
    begin = 0 if step == 0 else t["head_rows"] + (step - 1) * rows
    if step == 0:
        valid = min(length, t["head_rows"]) + max(0, length - tail_begin)
    else:
        valid = 0 if length <= begin else min(length - begin, rows)
    last_step = 0 if length <= t["head_rows"] else 1 + (length - t["head_rows"] - 1) // rows
    return dict(t, valid_rows=valid, final_owner=(first + last_step) % parts, split=length > tail_begin)
