"""Tensor creation, transfer, layout/dtype conversion, in-place copy and mesh mappers (emulated).

Host<->device transfers are host functions (not device programs): they are not counted as programs,
and they are forbidden inside trace capture. Layout/dtype conversions and copies of device tensors are
device ops (counted, traceable).
"""

from __future__ import annotations

import os
import pathlib
import uuid

import torch

from . import mappers
from .errors import EmulatorError, NotEmulatedError, TraceRuleError
from .programs import reshape_is_view
from .registry import device_op, host_fn
from .shard_specs import output_memory_config
from .tensor import (
    EmuMeshBase,
    EmuTensor,
    check_dtype_layout,
    dtype_name,
    is_block_float,
    is_default_tile,
    make_like,
    new_device_tensor,
    view_of,
    quantize_via_ttnn,
    storage_torch_dtype,
    to_torch_dtype,
    ttnn_dtype_from_torch,
    write_inplace,
)
from .ttnn_import import ttnn

# Observable statistics (tests use them to prove a weight-cache reload skips conversion).
STATS = {"as_tensor_conversions": 0, "as_tensor_cache_loads": 0}

CACHE_FORMAT_VERSION = 1


def _resolve_mesh(ns_mesh, device):
    if device is None:
        return None
    if isinstance(device, EmuMeshBase):
        if device is not ns_mesh:
            raise EmulatorError("tensor targeted at a different emulated mesh than this namespace's")
        return device
    raise EmulatorError(
        f"device={type(device).__name__}: the emulating namespace only accepts its emulated mesh "
        "(ctx.mesh_device); real devices and the emulator cannot be mixed"
    )


def _dispatch(mesh, name, impl, args, kwargs):
    real = ttnn
    for part in name.split(".")[1:]:
        real = getattr(real, part)
    return mesh.ttnn._dispatcher.call(name, impl, args, kwargs, real_op=None if not hasattr(real, "function") else real)


# ------------------------------------------------------------------------------------------------
# from_torch / to_torch / as_tensor / to_device / from_device
# ------------------------------------------------------------------------------------------------
def _build_shards(mesh, tensor: torch.Tensor, dtype, mesh_mapper, device_mesh) -> tuple[list, object]:
    if mesh_mapper is not None:
        if isinstance(mesh_mapper, ttnn.ReplicateTensorToMeshWrapper) or type(mesh_mapper).__module__.startswith(
            "ttnn"
        ):
            raise EmulatorError(
                "mesh_mapper is a real ttnn mapper; on the emulated mesh build it through ctx.ttnn "
                "(ttnn.ShardTensorToMesh(mesh, dim), ttnn.ReplicateTensorToMesh(mesh), ttnn.create_mesh_mapper(...))"
            )
        if not isinstance(mesh_mapper, mappers.EmuMeshMapper):
            raise EmulatorError(f"unsupported mesh_mapper {mesh_mapper!r}")
        if device_mesh is not None and mesh_mapper.num_devices != device_mesh.num_devices:
            raise EmulatorError(
                f"mesh_mapper maps onto {mesh_mapper.num_devices} devices but the mesh has {device_mesh.num_devices}"
            )
        pieces = mesh_mapper.map(tensor)
        placements = mesh_mapper.key()
    elif device_mesh is not None:
        # ttnn replicates a tensor with no mapper onto every device of the mesh
        pieces = [tensor] * device_mesh.num_devices
        placements = "replicate(default)"
    else:
        pieces = [tensor]
        placements = None
    if len(pieces) > 1 and all(p is pieces[0] for p in pieces):
        q = quantize_via_ttnn(pieces[0], dtype)
        return [q.clone() for _ in pieces], placements
    out = []
    for p in pieces:
        q = quantize_via_ttnn(p, dtype)
        # never alias the caller's torch tensor: emulated shards are immutable snapshots
        out.append(q.clone() if q.data_ptr() == tensor.data_ptr() and q.numel() else q)
    return out, placements


@host_fn("ttnn.from_torch")
def from_torch(
    mesh,
    tensor,
    dtype=None,
    *,
    spec=None,
    tile=None,
    pad_value=None,
    layout=None,
    device=None,
    memory_config=None,
    mesh_mapper=None,
    cq_id=None,
    preserve_nan_values=False,
    col_tilize=False,
    enable_bfloat_opt=False,
):
    if tensor is None:
        return None
    if spec is not None:
        raise NotEmulatedError("ttnn.from_torch(spec=...) is not emulated; pass dtype/layout/memory_config")
    if tile is not None and not is_default_tile(tile) and layout != ttnn.TILE_LAYOUT:
        raise EmulatorError("ttnn.from_torch: a non-default tile needs layout=ttnn.TILE_LAYOUT")
    if col_tilize:
        raise NotEmulatedError("ttnn.from_torch(col_tilize=True) is not emulated")
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(tensor)
    target = _resolve_mesh(mesh, device)
    if target is not None:
        mesh.trace.forbid_in_capture("ttnn.from_torch(..., device=mesh) (a host-to-device write)")
    dtype = dtype if dtype is not None else ttnn_dtype_from_torch(tensor.dtype)
    layout = layout if layout is not None else ttnn.ROW_MAJOR_LAYOUT
    check_dtype_layout(dtype, layout, "ttnn.from_torch")
    shards, placements = _build_shards(mesh, tensor, dtype, mesh_mapper, target)
    if target is not None:
        t = new_device_tensor(target, shards, dtype, layout, memory_config=memory_config)
    else:
        t = EmuTensor(shards, dtype, layout, mesh=mesh, on_device=False, memory_config=memory_config)
    t.placements = placements
    # The tile is recorded, not emulated: values are stored by element either way, and every op refuses a
    # non-default tile unless it validates tiles itself (namespace.Dispatcher.check_inputs).
    t._tile = None if is_default_tile(tile) else tile
    t.dist = _distribution(mesh_mapper, target if target is not None else mesh)
    return t


def _distribution(mesh_mapper, mesh):
    """(mesh_shape, placements) of a from_torch result: the mapper's, or replicated when no mapper is given."""
    if mesh_mapper is not None:
        return tuple(mesh_mapper.mesh_shape), tuple(tuple(p) for p in mesh_mapper.placements)
    if mesh is None:
        return None
    return (1, mesh.num_devices), (("replicate",), ("replicate",))


def _keep_host_metadata(dst: EmuTensor, src: EmuTensor) -> EmuTensor:
    """Transfers move the same buffer contents: mapping, tile and distribution come along."""
    dst.placements, dst._tile, dst.dist = src.placements, src._tile, src.dist
    return dst


@host_fn("ttnn.to_torch")
def to_torch(mesh, tensor, dtype=None, *, torch_rank=None, mesh_composer=None, device=None, cq_id=None):
    if isinstance(tensor, torch.Tensor):
        return tensor.to(dtype) if dtype is not None else tensor
    if not isinstance(tensor, EmuTensor):
        raise EmulatorError(f"ttnn.to_torch: expected an emulated tensor, got {type(tensor).__name__}")
    if tensor.on_device:
        mesh.trace.forbid_in_capture("ttnn.to_torch of a device tensor (a device-to-host read)")
        mesh.trace.check_read(tensor, "ttnn.to_torch")
    shards = tensor.shards
    if mesh_composer is not None:
        if not isinstance(mesh_composer, mappers.EmuMeshComposer):
            raise EmulatorError(
                "mesh_composer must come from the emulating namespace (ttnn.ConcatMeshToTensor(mesh, dim) ...)"
            )
        out = mesh_composer.compose(list(shards))
    else:
        if len(shards) != 1:
            raise EmulatorError(
                f"ttnn.to_torch: can't convert a tensor distributed on MeshShape([1, {len(shards)}]) mesh to a "
                "row-major logical tensor. Supply a mesh composer to concatenate multi-device shards "
                "(same message as ttnn)."
            )
        out = shards[0]
    out = out.to(to_torch_dtype(tensor.dtype)) if out.dtype != to_torch_dtype(tensor.dtype) else out.clone()
    if torch_rank is not None:
        while out.ndim > torch_rank:
            if out.shape[0] != 1:
                raise EmulatorError("ttnn.to_torch: Unable to squeeze to desired rank!")
            out = out.squeeze(0)
    return out.to(dtype) if dtype is not None else out


@host_fn("ttnn.as_tensor")
def as_tensor(
    mesh,
    tensor,
    dtype=None,
    *,
    layout=ttnn.ROW_MAJOR_LAYOUT,
    device=None,
    memory_config=None,
    cache_file_name=None,
    preprocess=None,
    mesh_mapper=None,
    cache_dump_mode=None,
):
    if device is not None and memory_config is None:
        raise EmulatorError("memory_config must be specified when device is specified (ttnn.as_tensor rule)")
    target = _resolve_mesh(mesh, device)
    if target is not None:
        mesh.trace.forbid_in_capture("ttnn.as_tensor(..., device=mesh) (a host-to-device write)")

    def convert():
        STATS["as_tensor_conversions"] += 1
        src = preprocess(tensor) if preprocess else tensor
        return from_torch(mesh, src, dtype, layout=layout, mesh_mapper=mesh_mapper, memory_config=memory_config)

    if cache_file_name is None:
        host = convert()
    else:
        dname = dtype.name if dtype is not None else "None"
        lname = layout.name if layout is not None else "None"
        path = pathlib.Path(f"{cache_file_name}_dtype_{dname}_layout_{lname}.emutensor.pt")
        mapper_key = mesh_mapper.key() if mesh_mapper is not None else None
        if path.is_file():
            blob = torch.load(path, map_location="cpu", weights_only=True)
            _check_cache_blob(blob, path, dname, lname, mapper_key, tensor)
            STATS["as_tensor_cache_loads"] += 1
            dt = getattr(ttnn, blob["dtype"].lower()) if blob["dtype"] != "None" else None
            host = EmuTensor(
                [s.to(storage_torch_dtype(dt)) for s in blob["shards"]],
                dt,
                layout,
                mesh=mesh,
                on_device=False,
                memory_config=memory_config,
            )
            host.placements = mapper_key
            host.dist = _distribution(mesh_mapper, mesh)
        else:
            host = convert()
            path.parent.mkdir(parents=True, exist_ok=True)
            blob = {
                "version": CACHE_FORMAT_VERSION,
                "writer": "tt_ops.emulator (emulated ttnn cache; not a ttnn .tensorbin)",
                "dtype": host.dtype.name,
                "layout": lname,
                "mapper": mapper_key,
                "source_shape": list(tensor.shape) if tensor is not None else None,
                "shards": [s.contiguous() for s in host.shards],
            }
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
            try:
                torch.save(blob, tmp)
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()
    if target is None:
        return host
    return to_device(mesh, host, target, memory_config=memory_config)


def _check_cache_blob(blob, path, dname, lname, mapper_key, tensor):
    problems = []
    if blob.get("version") != CACHE_FORMAT_VERSION:
        problems.append(f"format version {blob.get('version')} != {CACHE_FORMAT_VERSION}")
    if blob.get("dtype") != dname and dname != "None":
        problems.append(f"dtype {blob.get('dtype')} != {dname}")
    if blob.get("layout") != lname:
        problems.append(f"layout {blob.get('layout')} != {lname}")
    if blob.get("mapper") != mapper_key:
        problems.append(f"mesh mapping {blob.get('mapper')} != {mapper_key}")
    if tensor is not None and blob.get("source_shape") is not None and list(tensor.shape) != blob["source_shape"]:
        problems.append(f"source shape {blob['source_shape']} != {list(tensor.shape)}")
    if problems:
        raise EmulatorError(
            f"weight cache {path} does not match this request ({'; '.join(problems)}); delete it to regenerate"
        )


@host_fn("ttnn.to_device")
def to_device(mesh, tensor, device, memory_config=None, *, queue_id=None):
    target = _resolve_mesh(mesh, device)
    if target is None:
        raise EmulatorError("ttnn.to_device needs the emulated mesh as device")
    mesh.trace.forbid_in_capture("ttnn.to_device (a host-to-device write)")
    if tensor.on_device:
        return tensor
    shards = tensor.shards
    if len(shards) == 1 and target.num_devices > 1:
        shards = [shards[0]] * target.num_devices
    if len(shards) != target.num_devices:
        raise EmulatorError(f"ttnn.to_device: tensor has {len(shards)} shards, mesh has {target.num_devices} devices")
    t = new_device_tensor(
        target, [s.clone() for s in shards], tensor.dtype, tensor.layout, memory_config=memory_config or tensor.memory_config(),
        pad_fill=tensor.pad_fill,
    )
    return _keep_host_metadata(t, tensor)


@host_fn("ttnn.from_device")
def from_device(mesh, tensor, blocking=True, *, queue_id=None):
    if not tensor.on_device:
        return tensor
    mesh.trace.forbid_in_capture("ttnn.from_device (a device-to-host read)")
    t = EmuTensor([s.clone() for s in tensor.shards], tensor.dtype, tensor.layout, mesh=tensor.mesh, on_device=False,
                  pad_fill=tensor.pad_fill)
    return _keep_host_metadata(t, tensor)


@host_fn("ttnn.copy_host_to_device_tensor")
def copy_host_to_device_tensor(mesh, host_tensor, device_tensor, cq_id=None):
    mesh.trace.forbid_in_capture("ttnn.copy_host_to_device_tensor (a host-to-device write)")
    if not isinstance(host_tensor, EmuTensor) or host_tensor.on_device:
        raise EmulatorError("copy_host_to_device_tensor: the source must be a host tensor (ttnn.from_torch without device)")
    if not isinstance(device_tensor, EmuTensor) or not device_tensor.on_device:
        raise EmulatorError("copy_host_to_device_tensor: the destination must be a device tensor")
    if device_tensor._deallocated:
        raise EmulatorError("copy_host_to_device_tensor: the destination buffer was deallocated")
    if host_tensor.num_shards != device_tensor.num_shards:
        raise TraceRuleError(
            f"copy_host_to_device_tensor: host tensor has {host_tensor.num_shards} shard(s) but the device buffer has "
            f"{device_tensor.num_shards}; build the host tensor with the same mesh_mapper as the persistent buffer"
        )
    if host_tensor.logical_shape_list != device_tensor.logical_shape_list:
        raise EmulatorError(
            f"copy_host_to_device_tensor: shape {host_tensor.logical_shape_list} != buffer "
            f"{device_tensor.logical_shape_list}"
        )
    if host_tensor.dtype != device_tensor.dtype or host_tensor.layout != device_tensor.layout:
        raise EmulatorError(
            f"copy_host_to_device_tensor: {dtype_name(host_tensor.dtype)}/{host_tensor.layout.name} does not match "
            f"buffer {dtype_name(device_tensor.dtype)}/{device_tensor.layout.name}"
        )
    device_tensor.set_shards([s.clone() for s in host_tensor.shards])
    mesh.trace.note_full_write(device_tensor)
    device_tensor.pad_fill = host_tensor.pad_fill


@host_fn("ttnn.copy_device_to_host_tensor")
def copy_device_to_host_tensor(mesh, device_tensor, host_tensor, blocking=True, cq_id=None):
    mesh.trace.forbid_in_capture("ttnn.copy_device_to_host_tensor (a device-to-host read)")
    if host_tensor.num_shards != device_tensor.num_shards:
        raise EmulatorError("copy_device_to_host_tensor: shard count mismatch")
    host_tensor.set_shards([s.clone() for s in device_tensor.shards])


@host_fn("ttnn.deallocate")
def deallocate(mesh, tensor, force=True):
    if not isinstance(tensor, EmuTensor):
        raise EmulatorError(f"ttnn.deallocate: expected an emulated tensor, got {type(tensor).__name__}")
    if tensor._deallocated or not tensor.on_device:
        tensor._deallocated = True
        return
    tr = mesh.trace
    if tr.capturing is not None:
        # Inside capture: the buffer's address may be reused by later captured ops (cards); the replay still
        # computes through it, so the storage is kept for the trace but the caller may not use it any more.
        tensor._deallocated = True
        return
    if tr.owner_live(tensor):
        raise TraceRuleError(
            f"ttnn.deallocate of a buffer ({tensor.logical_shape_list}) owned by live trace {tensor.trace_owner}: "
            "replay writes into it; release the trace first"
        )
    tensor._deallocated = True
    tensor._freed = True
    tensor._shards = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in tensor._shards]


@host_fn("ttnn.get_device_tensors")
def get_device_tensors(mesh, tensor):
    if tensor.on_device:
        mesh.trace.check_read(tensor, "ttnn.get_device_tensors")
    out = []
    for s in tensor.shards:
        t = EmuTensor([s], tensor.dtype, tensor.layout, mesh=tensor.mesh, on_device=tensor.on_device,
                      memory_config=tensor.memory_config(), pad_fill=tensor.pad_fill)
        t._tile = tensor._tile
        out.append(t)
    return out


@host_fn("ttnn.synchronize_device")
def synchronize_device(mesh, device, cq_id=None, sub_device_ids=()):
    _resolve_mesh(mesh, device)
    mesh.trace.forbid_in_capture("ttnn.synchronize_device")


@host_fn("ttnn.is_trace_capture_active")
def is_trace_capture_active(mesh, device):
    return mesh.trace.capturing is not None


@host_fn("ttnn.allocate_tensor_on_device", validate=False)
def allocate_tensor_on_device(mesh, *args, **kwargs):
    names = ["shape", "dtype", "layout", "mesh_device", "memory_config"]
    if args and isinstance(args[0], ttnn.TensorSpec):
        raise NotEmulatedError("allocate_tensor_on_device(TensorSpec, ...) is not emulated; pass shape/dtype/layout")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    shape = [int(x) for x in bound["shape"]]
    dtype, layout = bound["dtype"], bound["layout"]
    target = _resolve_mesh(mesh, bound.get("mesh_device") or bound.get("device"))
    check_dtype_layout(dtype, layout, "ttnn.allocate_tensor_on_device")
    sdt = storage_torch_dtype(dtype)
    # uninitialised device memory: NaN / -1 so reads before a write show up
    fill = float("nan") if sdt.is_floating_point else -1
    shards = [torch.full(shape, fill, dtype=sdt) for _ in range(target.num_devices)]
    t = new_device_tensor(target, shards, dtype, layout, memory_config=bound.get("memory_config"), pad_fill=None)
    t.dist = _distribution(None, target)  # the same allocation on every device
    return t


# ------------------------------------------------------------------------------------------------
# Device-side conversions and copies
# ------------------------------------------------------------------------------------------------
def _to_layout_impl(tensor, layout, dtype=None, memory_config=None, sub_core_grids=None, pad_value=0.0):
    dtype = dtype if dtype is not None else tensor.dtype
    check_dtype_layout(dtype, layout, "ttnn.to_layout")
    if layout == tensor.layout and dtype == tensor.dtype and memory_config is None:
        return tensor
    # tilize fills the padding with pad_value; a TILE -> TILE conversion converts the padding with the data
    pad = pad_value if tensor.layout != ttnn.TILE_LAYOUT else tensor.pad_fill
    return make_like(tensor, list(tensor.shards), dtype=dtype, layout=layout,
                     memory_config=output_memory_config("ttnn.to_layout", memory_config, tensor), pad_fill=pad)


@host_fn("ttnn.to_layout")
def to_layout(mesh, tensor, layout, dtype=None, memory_config=None, sub_core_grids=None, pad_value=0.0):
    if tensor.on_device:
        return _dispatch(tensor.mesh, "ttnn.to_layout", _to_layout_impl, (tensor, layout),
                         {"dtype": dtype, "memory_config": memory_config, "pad_value": pad_value})
    dtype = dtype if dtype is not None else tensor.dtype
    if is_block_float(dtype) and layout == ttnn.ROW_MAJOR_LAYOUT and dtype == tensor.dtype:
        # host bf8/bf4 has no row-major form: 0.81.1 returns the tensor unchanged (still TILE), it does not raise
        t = EmuTensor(list(tensor.shards), tensor.dtype, tensor.layout, mesh=tensor.mesh, on_device=False)
        t.placements = tensor.placements
        return t
    check_dtype_layout(dtype, layout, "ttnn.to_layout")
    t = EmuTensor([quantize_via_ttnn(s, dtype) for s in tensor.shards], dtype, layout, mesh=tensor.mesh, on_device=False)
    t.placements = tensor.placements
    return t


@device_op("ttnn.typecast")
def typecast(input_tensor, *args, dtype=None, memory_config=None, output_tensor=None, sub_core_grids=None,
             input_dtype=None, output_dtype=None):
    tensor = input_tensor
    if input_dtype is not None or output_dtype is not None:
        args = (input_dtype if input_dtype is not None else tensor.dtype, output_dtype)
    if len(args) == 1:
        dtype = args[0]
    elif len(args) == 2:  # (input_dtype, output_dtype) overload
        if args[0] != tensor.dtype:
            raise EmulatorError(f"ttnn.typecast: input_dtype {args[0]} != tensor dtype {tensor.dtype}")
        dtype = args[1]
    if dtype is None:
        raise TypeError("ttnn.typecast() missing the target dtype")
    check_dtype_layout(dtype, tensor.layout, "ttnn.typecast")
    src = [s.to(torch.float32) if s.is_floating_point() else s for s in tensor.shards]
    if output_tensor is not None:
        write_inplace(output_tensor, [quantize_via_ttnn(s, output_tensor.dtype) for s in src])
        return output_tensor
    return make_like(tensor, src, dtype=dtype, pad_fill=tensor.pad_fill,
                     memory_config=output_memory_config("ttnn.typecast", memory_config, tensor))


@device_op("ttnn.to_memory_config")
def to_memory_config(tensor, memory_config, dtype=None, output_tensor=None):
    dtype = dtype if dtype is not None else tensor.dtype
    return make_like(tensor, list(tensor.shards), dtype=dtype,
                     memory_config=output_memory_config("ttnn.to_memory_config", memory_config, tensor),
                     pad_fill=tensor.pad_fill)


def _sharded_config(op, args, kwargs):
    """The target MemoryConfig of ``interleaved_to_sharded``'s two overloads (0.81.1 signature): a sharded
    MemoryConfig, or (grid, shard_shape, shard_scheme, shard_orientation) with the grid a CoreRangeSet or a grid size
    (CoreCoord, cores (0, 0) .. (x-1, y-1)); the grid form shards into L1, as ttnn's host wrapper builds it."""
    names_cfg = ("sharded_memory_config", "output_dtype")
    names_grid = ("grid", "shard_shape", "shard_scheme", "shard_orientation", "output_dtype")
    if (args and isinstance(args[0], ttnn.MemoryConfig)) or "sharded_memory_config" in kwargs:
        b = dict(zip(names_cfg, args), **kwargs)
        mc = b["sharded_memory_config"]
    else:
        b = dict(zip(names_grid, args), **kwargs)
        grid = b["grid"]
        if isinstance(grid, ttnn.CoreCoord):
            grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(grid.x - 1, grid.y - 1))})
        mc = ttnn.MemoryConfig(b["shard_scheme"], ttnn.BufferType.L1,
                               ttnn.ShardSpec(grid, list(b["shard_shape"]), b["shard_orientation"]))
    if not mc.is_sharded():
        raise EmulatorError(f"{op}: the target memory config must be sharded (got {mc.memory_layout})")
    return mc, b.get("output_dtype"), b.get("preallocated_output")


@device_op("ttnn.interleaved_to_sharded")
def interleaved_to_sharded(input_tensor, *args, **kwargs):
    """Same values in a sharded buffer, with the target memory config recorded on the output (the golden runs the
    copy, but the golden path would keep the input's INTERLEAVED config: every later sharding check then saw an
    interleaved tensor)."""
    op = "ttnn.interleaved_to_sharded"
    mc, out_dtype, prealloc = _sharded_config(op, args, kwargs)
    dtype = out_dtype if out_dtype is not None else input_tensor.dtype
    if prealloc is not None:
        write_inplace(prealloc, [quantize_via_ttnn(s, prealloc.dtype) for s in input_tensor.shards])
        return prealloc
    return make_like(input_tensor, list(input_tensor.shards), dtype=dtype, memory_config=mc,
                     pad_fill=input_tensor.pad_fill)


@device_op("ttnn.sharded_to_interleaved")
def sharded_to_interleaved(input_tensor, memory_config=None, output_dtype=None):
    """A sharded tensor copied to an interleaved buffer (``memory_config`` must be interleaved; None = DRAM, the
    binding's ``operation::DEFAULT_OUTPUT_MEMORY_CONFIG``). As ttnn's host wrapper: an input without a shard spec comes
    back unchanged."""
    op = "ttnn.sharded_to_interleaved"
    mc = ttnn.DRAM_MEMORY_CONFIG if memory_config is None else memory_config
    if mc.is_sharded():
        raise EmulatorError(f"{op}: memory_config must be interleaved (got {mc.memory_layout})")
    if input_tensor.memory_config().shard_spec is None:
        return input_tensor
    dtype = output_dtype if output_dtype is not None else input_tensor.dtype
    return make_like(input_tensor, list(input_tensor.shards), dtype=dtype, memory_config=mc,
                     pad_fill=input_tensor.pad_fill)


@device_op("ttnn.reshape")
def reshape(input_tensor, shape=None, *rest, memory_config=None, pad_value=None, reshape_tile_mode=None,
            sub_core_grids=None, skip_padding_fill=False, logical_shape=None, padded_shape=None):
    tensor = input_tensor
    if shape is None:
        shape = logical_shape
    if shape is None:
        raise TypeError("ttnn.reshape() missing the target shape")
    target = [int(x) for x in shape]  # ttnn.Shape or sequence; the golden rejects ttnn.Shape
    if rest:  # (logical_shape, padded_shape) overload: padded shape is metadata only here
        if len(rest) != 1:
            raise TypeError("ttnn.reshape(): too many positional arguments")
    numel = tensor.shards[0].numel()
    prod = 1
    for d in target:
        prod *= d if d != -1 else 1
    if -1 not in target and prod != numel:
        raise EmulatorError(f"ttnn.reshape: cannot reshape {tensor.logical_shape_list} to {target}")
    if reshape_is_view(tensor.logical_shape_list, target, tensor.layout):
        if tensor.on_device and tensor.mesh is not None and (
                memory_config is None or memory_config == tensor.memory_config()):
            if -1 in target:
                target = list(tensor.shards[0].reshape(target).shape)
            return view_of(tensor, target)  # the same device buffer (module doc of tensor.py)
        pad = tensor.pad_fill  # a view moves no data
    else:  # "pad_value ... applied to tile padding lanes" unless skip_padding_fill (ttnn.reshape docstring)
        pad = None if skip_padding_fill else float(pad_value if pad_value is not None else 0.0)
    return make_like(tensor, [s.reshape(target) for s in tensor.shards],
                     memory_config=output_memory_config("ttnn.reshape", memory_config, tensor), pad_fill=pad)


def _copy_read(args, kwargs):
    a = args[0] if args else kwargs["input_a"]
    return {dtype_name(a.dtype): a.bytes_per_device()}


@device_op("ttnn.copy", read_bytes=_copy_read)
def copy(input_a, input_b):
    """In place: writes input_a (cast to input_b's dtype) into input_b; returns input_b (ttnn semantics)."""
    if input_a.logical_shape_list != input_b.logical_shape_list:
        raise EmulatorError(f"ttnn.copy: shape {input_a.logical_shape_list} != {input_b.logical_shape_list}")
    if input_a.layout != input_b.layout:
        raise EmulatorError("ttnn.copy: input layouts differ")
    write_inplace(input_b, [quantize_via_ttnn(s, input_b.dtype) for s in input_a.shards])
    if not (input_b.mesh is not None and input_b.mesh.trace.dry):
        input_b.pad_fill = input_a.pad_fill  # whole tiles are copied, padding included
    return input_b


@device_op("ttnn.clone")
def clone(input, *, dtype=None, memory_config=None, compute_kernel_config=None):
    return make_like(input, [s.clone() for s in input.shards], dtype=dtype,
                     memory_config=output_memory_config("ttnn.clone", memory_config, input), pad_fill=input.pad_fill)


# ------------------------------------------------------------------------------------------------
# Mesh mappers / composers
# ------------------------------------------------------------------------------------------------
@host_fn("ttnn.ShardTensorToMesh")
@host_fn("ttnn.shard_tensor_to_mesh_mapper", validate=False)  # functional alias, same mapper
def _shard(mesh, mesh_device, dim):
    return mappers.ShardTensorToMesh(mesh_device, dim)


@host_fn("ttnn.ReplicateTensorToMesh")
@host_fn("ttnn.replicate_tensor_to_mesh_mapper", validate=False)  # functional alias
def _replicate(mesh, mesh_device):
    return mappers.ReplicateTensorToMesh(mesh_device)


@host_fn("ttnn.ShardTensor2dMesh")
def _shard2d(mesh, mesh_device, mesh_shape, dims):
    return mappers.ShardTensor2dMesh(mesh_device, mesh_shape, dims)


@host_fn("ttnn.create_mesh_mapper", validate=False)
def _create_mapper(mesh, mesh_device, config):
    return mappers.create_mesh_mapper(mesh_device, config)


@host_fn("ttnn.ConcatMeshToTensor")
@host_fn("ttnn.concat_mesh_to_tensor_composer", validate=False)  # functional alias
def _concat(mesh, mesh_device, dim):
    return mappers.ConcatMeshToTensor(mesh_device, dim)


@host_fn("ttnn.ConcatMesh2dToTensor")
def _concat2d(mesh, mesh_device, mesh_shape, dims):
    return mappers.ConcatMesh2dToTensor(mesh_device, mesh_shape, dims)


@host_fn("ttnn.create_mesh_composer", validate=False)
def _create_composer(mesh, mesh_device, config):
    return mappers.create_mesh_composer(mesh_device, config)
