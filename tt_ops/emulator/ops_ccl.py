"""Collectives emulated directly over the device shards (the ttnn CCL goldens need private kwargs).

Mesh is (1, N). ``cluster_axis`` None or 1 -> the N devices of the row; ``cluster_axis`` 0 -> groups of
one device (identity). Semantics (ttnn):

* ``all_gather(x, dim)``: every device gets ``cat(shards, dim)``.
* ``reduce_scatter(x, dim)``: sum over devices, then device i keeps chunk i of ``dim`` (N equal chunks).
* ``all_reduce(x)``: every device gets the sum.

Trace rule (raises ``TraceRuleError`` during capture): the synchronous ``all_gather`` /
``reduce_scatter`` / ``all_reduce`` cannot be captured. In ttnn 0.81.1 their program factories allocate
global semaphores and synchronise the mesh from the host when the program is built
(``ttnn/cpp/ttnn/operations/ccl/all_gather/device/all_gather_multicast_factory.cpp`` and
``all_gather_factory.cpp``, ``create_mesh_workload``: ``create_global_semaphore`` then ``Synchronize``).
Inside a capture only the ``ttnn.experimental`` async forms are accepted, and only with semaphores
created before the capture (``create_global_semaphore`` inside a capture already raises), the form
Tenstorrent's traced decode uses (``models/tt_transformers/tt/ccl.py`` ``TT_CCL``).

Reductions sum in fp32 and round once to the output dtype (cards reduce pairwise in the packer format;
bf16 partial rounding is not modelled - see docs/emulator_ops.md). Link bytes per device (ring algorithm):
all_gather (N-1) x shard, reduce_scatter (N-1)/N x input, all_reduce 2(N-1)/N x input.
"""

from __future__ import annotations

import torch

from .errors import EmulatorError, TraceRuleError
from .registry import device_op, host_fn
from .shard_specs import output_memory_config
from .signatures import bind_arguments
from .tensor import EmuTensor, make_like, quantize_via_ttnn, write_inplace
from .ttnn_import import ttnn


def _groups(t: EmuTensor, cluster_axis) -> list[list[int]]:
    n = t.num_shards
    if cluster_axis is None or cluster_axis == 1:
        return [list(range(n))]
    if cluster_axis == 0:
        return [[i] for i in range(n)]
    raise EmulatorError(f"cluster_axis must be 0, 1 or None on a (1, {n}) mesh, got {cluster_axis}")


def _norm_dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < ndim:
        raise EmulatorError(f"{op}: dim {dim} out of range for rank {ndim}")
    return dim % ndim


def _all_gather_shards(t: EmuTensor, dim: int, cluster_axis, op: str) -> list[torch.Tensor]:
    d = _norm_dim(dim, t.shards[0].ndim, op)
    out = [None] * t.num_shards
    for g in _groups(t, cluster_axis):
        cat = torch.cat([t.shards[i] for i in g], dim=d)
        for i in g:
            out[i] = cat.clone()
    return out


def _sum_fp32(t: EmuTensor, g: list[int]) -> torch.Tensor:
    acc = t.shards[g[0]].to(torch.float32).clone()
    for i in g[1:]:
        acc += t.shards[i].to(torch.float32)
    return acc


def _reduce_scatter_shards(t: EmuTensor, dim: int, cluster_axis, op: str) -> list[torch.Tensor]:
    d = _norm_dim(dim, t.shards[0].ndim, op)
    out = [None] * t.num_shards
    for g in _groups(t, cluster_axis):
        total = _sum_fp32(t, g)
        if total.shape[d] % len(g) != 0:
            raise EmulatorError(f"{op}: dim {dim} of size {total.shape[d]} does not split over {len(g)} devices")
        chunks = torch.chunk(total, len(g), dim=d)
        for k, i in enumerate(g):
            out[i] = chunks[k].contiguous()
    return out


def _all_reduce_shards(t: EmuTensor, cluster_axis) -> list[torch.Tensor]:
    out = [None] * t.num_shards
    for g in _groups(t, cluster_axis):
        total = _sum_fp32(t, g)
        for i in g:
            out[i] = total.clone()
    return out


def _forbid_sync_in_capture(op: str, t: EmuTensor) -> None:
    tr = t.mesh.trace if t.mesh is not None else None
    if tr is not None and tr.capturing is not None:
        raise TraceRuleError(
            f"{op} inside trace capture (trace {tr.capturing.trace_id}): the synchronous collective allocates its "
            "global semaphores and synchronises the mesh from the host when its program is built "
            "(ccl/all_gather/device/all_gather_multicast_factory.cpp), which a trace cannot record. Use the async "
            "form (ttnn.experimental.all_gather_async / reduce_scatter_minimal_async / all_reduce_async) with "
            "semaphores created by ttnn.create_global_semaphore before the capture (tt_transformers TT_CCL)."
        )


def _require_semaphores(op: str, t: EmuTensor, **sems) -> None:
    """Inside a capture every semaphore argument must be a persistent one created before the capture."""
    tr = t.mesh.trace if t.mesh is not None else None
    if tr is None or tr.capturing is None:
        return
    for name, v in sems.items():
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        if not items or any(not isinstance(x, EmuGlobalSemaphore) for x in items):
            raise TraceRuleError(
                f"{op} inside trace capture needs persistent semaphores: {name}={v!r}. Without them the op creates "
                "its own when its program is built, which a trace cannot record; create them with "
                "ttnn.create_global_semaphore before the capture and pass them in."
            )


def _group_size(t: EmuTensor, cluster_axis) -> int:
    return len(_groups(t, cluster_axis)[0])


def _input_of(args, kwargs) -> EmuTensor:
    return args[0] if args else kwargs["input_tensor"]


def _bytes(t: EmuTensor) -> int:
    return t.bytes_per_device()


def _ag_bytes(args, kwargs, out):
    t = _input_of(args, kwargs)
    n = _group_size(t, kwargs.get("cluster_axis"))
    return (n - 1) * _bytes(t)


def _rs_bytes(args, kwargs, out):
    t = _input_of(args, kwargs)
    n = _group_size(t, kwargs.get("cluster_axis"))
    return (n - 1) * _bytes(t) // n


def _ar_bytes(args, kwargs, out):
    t = _input_of(args, kwargs)
    n = _group_size(t, kwargs.get("cluster_axis"))
    return 2 * (n - 1) * _bytes(t) // n


def _emit(op: str, t: EmuTensor, shards, memory_config, output_tensor=None, dtype=None):
    if output_tensor is not None:
        if list(output_tensor.shards[0].shape) != list(shards[0].shape):
            raise EmulatorError(
                f"output_tensor shape {output_tensor.logical_shape_list} != result {list(shards[0].shape)}"
            )
        write_inplace(output_tensor, [quantize_via_ttnn(s, output_tensor.dtype) for s in shards])
        return output_tensor
    return make_like(t, shards, dtype=dtype, memory_config=output_memory_config(op, memory_config, t))


@device_op("ttnn.all_gather", collective_bytes=_ag_bytes)
def all_gather(input_tensor, dim, *, cluster_axis=None, memory_config=None, output_tensor=None, **_ignored):
    _forbid_sync_in_capture("ttnn.all_gather", input_tensor)
    shards = _all_gather_shards(input_tensor, dim, cluster_axis, "ttnn.all_gather")
    return _emit("ttnn.all_gather", input_tensor, shards, memory_config, output_tensor)


@device_op("ttnn.reduce_scatter", collective_bytes=_rs_bytes)
def reduce_scatter(input_tensor, dim, *, cluster_axis=None, memory_config=None, output_tensor=None, **_ignored):
    _forbid_sync_in_capture("ttnn.reduce_scatter", input_tensor)
    shards = _reduce_scatter_shards(input_tensor, dim, cluster_axis, "ttnn.reduce_scatter")
    return _emit("ttnn.reduce_scatter", input_tensor, shards, memory_config, output_tensor)


@device_op("ttnn.all_reduce", collective_bytes=_ar_bytes)
def all_reduce(input_tensor, *, cluster_axis=None, memory_config=None, **_ignored):
    _forbid_sync_in_capture("ttnn.all_reduce", input_tensor)
    return _emit("ttnn.all_reduce", input_tensor, _all_reduce_shards(input_tensor, cluster_axis), memory_config)


# ---- experimental async forms ------------------------------------------------------------------
def _ag_async_bytes(args, kwargs, out):
    b = bind_arguments("ttnn.experimental.all_gather_async", ttnn.experimental.all_gather_async, args, kwargs)
    t = b["input_tensor"]
    return (_group_size(t, b.get("cluster_axis")) - 1) * _bytes(t)


@device_op("ttnn.experimental.all_gather_async", collective_bytes=_ag_async_bytes)
def all_gather_async(*args, **kwargs):
    b = bind_arguments("ttnn.experimental.all_gather_async", ttnn.experimental.all_gather_async, args, kwargs)
    t = b["input_tensor"]
    _require_semaphores("ttnn.experimental.all_gather_async", t,
                        multi_device_global_semaphore=b.get("multi_device_global_semaphore"))
    shards = _all_gather_shards(t, b["dim"], b.get("cluster_axis"), "ttnn.experimental.all_gather_async")
    return _emit("ttnn.experimental.all_gather_async", t, shards, b.get("memory_config"),
                 b.get("persistent_output_buffer"))


def _rs_async_bytes(args, kwargs, out):
    b = bind_arguments(
        "ttnn.experimental.reduce_scatter_minimal_async", ttnn.experimental.reduce_scatter_minimal_async, args, kwargs
    )
    t = b["input_tensor"]
    n = _group_size(t, b.get("cluster_axis"))
    return (n - 1) * _bytes(t) // n


@device_op("ttnn.experimental.reduce_scatter_minimal_async", collective_bytes=_rs_async_bytes)
def reduce_scatter_minimal_async(*args, **kwargs):
    name = "ttnn.experimental.reduce_scatter_minimal_async"
    b = bind_arguments(name, ttnn.experimental.reduce_scatter_minimal_async, args, kwargs)
    t = b["input_tensor"]
    _require_semaphores(name, t, multi_device_global_semaphore=b.get("multi_device_global_semaphore"))
    shards = _reduce_scatter_shards(t, b["dim"], b.get("cluster_axis"), name)
    bufs = b.get("persistent_output_buffers")
    # persistent_output_buffers = [intermediate, output] on cards; the output is the last one
    out_buf = bufs[-1] if bufs else None
    return _emit(name, t, shards, b.get("memory_config"), out_buf)


def _ar_async_bytes(args, kwargs, out):
    b = bind_arguments("ttnn.experimental.all_reduce_async", ttnn.experimental.all_reduce_async, args, kwargs)
    t = b["input_tensor"]
    n = _group_size(t, b.get("cluster_axis"))
    if b.get("multi_device_global_semaphore") is not None:
        return (n - 1) * _bytes(t)  # the single-op form sends the whole input to every other device
    return 2 * (n - 1) * _bytes(t) // n


def _check_single_op_all_reduce(name: str, t: EmuTensor, buf, out_mc, ring_size: int) -> None:
    """The 0.81.1 device op's validation of the single-op form (``buffer_tensor`` + one
    ``multi_device_global_semaphore``; ``AllReduceAsyncDeviceOperation::validate_on_program_cache_miss``, its
    messages present in the wheel's ``_ttnncpp.so``): on Blackhole the input may not be in DRAM (its kernel takes
    NoC addresses without a tensor accessor); input, buffer and output WIDTH_SHARDED; the output's shard grid inside
    the buffer's; the buffer's shard at least ring_size x the output's (it holds every device's copy of the output
    shard for the reduction); an even ring size."""
    width = ttnn.TensorMemoryLayout.WIDTH_SHARDED
    mc = t.memory_config()
    arch = t.mesh.arch() if t.mesh is not None else None
    if arch == ttnn.Arch.BLACKHOLE and mc.buffer_type == ttnn.BufferType.DRAM:
        raise EmulatorError(f"{name}: This kernel does not support blackhole dram as it does not use an accessor to "
                            "get the noc address as needed by the fabric api (the input must be in L1)")
    if mc.memory_layout != width:
        raise EmulatorError(f"{name}: Unsupported memory layout for input tensor {mc.memory_layout} (WIDTH_SHARDED)")
    if not isinstance(buf, EmuTensor):
        raise EmulatorError(f"{name}: the single-op form needs buffer_tensor (a persistent device tensor)")
    bmc = buf.memory_config()
    if bmc.memory_layout != width:
        raise EmulatorError(f"{name}: Unsupported memory layout for buffer tensor {bmc.memory_layout} (WIDTH_SHARDED)")
    if out_mc.memory_layout != width:
        raise EmulatorError(f"{name}: Unsupported memory layout for output tensor {out_mc.memory_layout} "
                            "(WIDTH_SHARDED)")
    bspec, ospec = bmc.shard_spec, out_mc.shard_spec
    if not bspec.grid.contains(ospec.grid):
        raise EmulatorError(f"{name}: The output tensor must reside on a subset of the cores of the buffer tensor")
    need = int(ospec.shape[0]) * int(ospec.shape[1]) * ring_size
    have = int(bspec.shape[0]) * int(bspec.shape[1])
    if need > have:
        raise EmulatorError(f"{name}: The shard size for the buffer must be large enough to hold the intermediate "
                            f"tensor. Require at least {need} but has {have}")
    if ring_size % 2:
        raise EmulatorError(f"{name}: AllReduceAsync currently only supports even number of blocks in the reduction "
                            f"kernel. ring_size={ring_size}")


@device_op("ttnn.experimental.all_reduce_async", collective_bytes=_ar_async_bytes)
def all_reduce_async(*args, **kwargs):
    name = "ttnn.experimental.all_reduce_async"
    b = bind_arguments(name, ttnn.experimental.all_reduce_async, args, kwargs)
    t = b["input_tensor"]
    single = b.get("multi_device_global_semaphore") is not None
    if single:
        _require_semaphores(name, t, multi_device_global_semaphore=b["multi_device_global_semaphore"])
        out_mc = b.get("memory_config") or t.memory_config()  # the op's default: the input's memory config
        _check_single_op_all_reduce(name, t, b.get("buffer_tensor"), out_mc, _group_size(t, b.get("cluster_axis")))
        return _emit(name, t, _all_reduce_shards(t, b.get("cluster_axis")), out_mc, dtype=b.get("dtype"))
    else:
        _require_semaphores(name, t, barrier_semaphores=b.get("barrier_semaphores"),
                            rs_global_semaphores=b.get("rs_global_semaphores"),
                            ag_global_semaphores=b.get("ag_global_semaphores"))
    math_op = b.get("math_op")
    if math_op is not None and str(math_op).split(".")[-1].lower() != "sum":
        raise EmulatorError(f"{name}: only math_op=ReduceType.Sum is emulated, got {math_op}")
    return _emit(name, t, _all_reduce_shards(t, b.get("cluster_axis")), b.get("memory_config"))


class EmuGlobalSemaphore:
    """Stand-in for a ttnn global semaphore (collectives on the emulator synchronise trivially)."""

    def __init__(self, initial_value: int = 0):
        self.value = initial_value

    def __repr__(self):
        return f"EmuGlobalSemaphore({self.value})"


@host_fn("ttnn.create_global_semaphore", validate=True)
def create_global_semaphore(mesh, mesh_device, cores, initial_value, buffer_type=None):
    mesh.trace.forbid_in_capture("ttnn.create_global_semaphore (a device allocation)")
    return EmuGlobalSemaphore(int(initial_value))


@host_fn("ttnn.reset_global_semaphore_value", validate=False)
def reset_global_semaphore_value(mesh, semaphore, value):
    semaphore.value = int(value)
