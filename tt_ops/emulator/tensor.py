"""Emulated ttnn tensors: one torch tensor per device plus ttnn metadata.

An :class:`EmuTensor` stands in for a (multi-device) ``ttnn.Tensor``. It holds

* ``shards``: one torch tensor per mesh device (row-major over mesh coordinates), stored at the
  *logical* shape (tile padding is metadata, reported through ``padded_shape``),
* ``dtype`` (a real ``ttnn.DataType``), ``layout`` (``ttnn.Layout``), memory config,
* the mesh it lives on (``None`` for a host tensor that was never mapped) and its storage
  (``HOST`` or ``DEVICE``), plus an allocation flag.

Storage dtypes: bfloat16 -> torch.bfloat16, float32 -> torch.float32, bfloat8_b/bfloat4_b ->
torch.bfloat16 holding the *dequantised* values produced by ttnn's own host packer (exact in
bf16), integer dtypes -> the matching torch integer dtype (uint32 -> torch.int64 so indices work
everywhere; ``to_torch`` gives back ``torch.uint32`` like ttnn).

Tile padding: on cards the padding of a TILE tensor (rows/columns up to the next multiple of 32) holds
whatever was last written there. Host tilize (``from_torch``/``as_tensor``/``to_layout`` to TILE) fills it with
zeros; ops leave it undefined ("Padding is undefined by default", ``ttnn.slice`` docstring) unless they document
a fill (``reshape``'s ``pad_value``, ``slice``'s ``pad_value``, ``fill_implicit_tile_padding``). The emulator keeps
that as ``pad_fill`` (a value, or ``None`` = garbage) instead of materialising padded storage; the ops that read
padding on cards consult it (see ``ops_compute`` and docs/emulator_ops.md).

Invariant: shard tensors are never mutated in place. In-place device ops (``copy``, cache updates, ring
writes, ``copy_host_to_device_tensor``, trace write-back) *replace* a tensor's shard list, so op outputs
may safely share storage with their inputs (views from reshape/permute), and ``from_torch`` never aliases
the caller's torch tensor. (Consequence: tensors returned by ``get_device_tensors`` are snapshots of the
shards at that moment, not live aliases as on cards.)

Buffer views: a ``ttnn.reshape`` that is a 0-cost view on cards (the docstring's rule, ``programs.reshape_is_view``)
returns a tensor that shares its base's device buffer, so an in-place write through the view (e.g. the GDN op's
ring mode on a rank-3 view of a rank-4 state) lands in the base, and the view reads the base's current contents.
Here a view keeps a reference to its base (``_base``): reading it reshapes the base's current shards, writing it
replaces the base's shards. A view is no allocation (no allocation rules, never a trace's output buffer).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from . import registry
from .errors import EmulatorError
from .ttnn_import import ttnn

TILE = 32

# Bytes of one 32x32 tile per dtype (ttnn.tile_size gives the same numbers; tested).
TILE_BYTES = {
    "BFLOAT16": 2048,
    "FLOAT32": 4096,
    "BFLOAT8_B": 1088,  # 1024 mantissa bytes + 64 shared-exponent bytes
    "BFLOAT4_B": 576,  # 512 + 64
    "UINT32": 4096,
    "INT32": 4096,
    "UINT16": 2048,
    "UINT8": 1024,
}
ELEMENT_BYTES = {"BFLOAT16": 2, "FLOAT32": 4, "UINT32": 4, "INT32": 4, "UINT16": 2, "UINT8": 1}

BLOCK_FLOAT = ("BFLOAT8_B", "BFLOAT4_B")


def dtype_name(dtype) -> str:
    return dtype.name if hasattr(dtype, "name") else str(dtype)


def storage_torch_dtype(dtype) -> torch.dtype:
    name = dtype_name(dtype)
    return {
        "BFLOAT16": torch.bfloat16,
        "FLOAT32": torch.float32,
        "BFLOAT8_B": torch.bfloat16,
        "BFLOAT4_B": torch.bfloat16,
        "UINT32": torch.int64,
        "INT32": torch.int32,
        "UINT16": torch.int32,
        "UINT8": torch.int32,
    }[name]


def ttnn_dtype_from_torch(tdtype: torch.dtype):
    mapping = {
        torch.bfloat16: ttnn.bfloat16,
        torch.float32: ttnn.float32,
        torch.float16: ttnn.bfloat16,
        torch.float64: ttnn.float32,
        torch.int32: ttnn.int32,
        torch.int64: ttnn.uint32,
        torch.uint8: ttnn.uint8,
        torch.int16: ttnn.uint16,
        torch.bool: ttnn.uint8,
    }
    if hasattr(torch, "uint32"):
        mapping[torch.uint32] = ttnn.uint32
    if hasattr(torch, "uint16"):
        mapping[torch.uint16] = ttnn.uint16
    if tdtype not in mapping:
        raise EmulatorError(f"from_torch: torch dtype {tdtype} has no ttnn equivalent")
    return mapping[tdtype]


def to_torch_dtype(dtype) -> torch.dtype:
    """torch dtype that real ``ttnn.to_torch`` returns for a ttnn dtype (verified on 0.81.1)."""
    name = dtype_name(dtype)
    return {
        "BFLOAT16": torch.bfloat16,
        "FLOAT32": torch.float32,
        "BFLOAT8_B": torch.float32,
        "BFLOAT4_B": torch.float32,
        "UINT32": getattr(torch, "uint32", torch.int64),
        "INT32": torch.int32,
        "UINT16": getattr(torch, "uint16", torch.int32),
        "UINT8": torch.uint8,
    }[name]


def is_block_float(dtype) -> bool:
    return dtype_name(dtype) in BLOCK_FLOAT


def is_tile(layout) -> bool:
    return layout == ttnn.TILE_LAYOUT


def padded_shape_of(shape: Sequence[int], layout) -> list[int]:
    shape = list(shape)
    if not is_tile(layout):
        return shape
    if len(shape) == 0:
        return [TILE, TILE]
    if len(shape) == 1:
        return [TILE, _round_up(shape[0])]
    return shape[:-2] + [_round_up(shape[-2]), _round_up(shape[-1])]


def _round_up(n: int, m: int = TILE) -> int:
    return ((int(n) + m - 1) // m) * m


def shard_bytes(shape: Sequence[int], dtype, layout) -> int:
    """Tile-accurate bytes one device holds for a tensor of this (logical) shape."""
    name = dtype_name(dtype)
    if is_tile(layout):
        padded = padded_shape_of(shape, layout)
        tiles = math.prod(padded[:-2]) * (padded[-2] // TILE) * (padded[-1] // TILE)
        return tiles * TILE_BYTES[name]
    if name in BLOCK_FLOAT:
        raise EmulatorError(f"{name} requires TILE layout")
    return math.prod(shape) * ELEMENT_BYTES[name]


def dram_bytes_of(t) -> int:
    """DRAM one device holds for a device tensor: its tile-accurate shard, or for a DRAM-sharded tensor its whole
    (padded) bank shards."""
    mc = t.memory_config()
    if mc.is_sharded() and mc.shard_spec is not None:
        return mc.shard_spec.grid.num_cores() * shard_bytes(list(mc.shard_spec.shape), t.dtype, t.layout)
    return shard_bytes(t._shards[0].shape, t.dtype, t.layout)


def check_dtype_layout(dtype, layout, where: str) -> None:
    if is_block_float(dtype) and not is_tile(layout):
        raise EmulatorError(
            f"{where}: {dtype_name(dtype)} requires ttnn.TILE_LAYOUT (cards reject block-float dtypes in "
            f"{getattr(layout, 'name', layout)} layout: 'Layout must be Layout::TILE for bfloat8_b or bfloat4_b')"
        )


def quantize_via_ttnn(shard: torch.Tensor, dtype) -> torch.Tensor:
    """Round a torch tensor to ``dtype`` exactly as ttnn's host conversion does; return storage values.

    Block-float dtypes go through the real ttnn host packer (``ttnn.from_torch(..., TILE)`` and back), so
    the quantisation error is the real one. The source dtype is kept (fp32 and bf16 sources give different
    bf8 codes), except dtypes ttnn cannot take (float64/float16), which are cast to float32 first.
    """
    name = dtype_name(dtype)
    if name in BLOCK_FLOAT:
        src = shard
        if src.dtype not in (torch.float32, torch.bfloat16):
            src = src.to(torch.float32)
        if src.numel() == 0:
            return src.to(torch.bfloat16)
        packed = ttnn.from_torch(src.contiguous(), dtype=dtype, layout=ttnn.TILE_LAYOUT)
        return ttnn.to_torch(packed).to(torch.bfloat16).reshape(shard.shape)
    target = storage_torch_dtype(dtype)
    if name == "BFLOAT16":
        return shard.to(torch.bfloat16)
    if name == "FLOAT32":
        return shard.to(torch.float32)
    # integer dtypes
    if shard.is_floating_point():
        shard = shard.to(torch.int64)
    return shard.to(target)


class EmuMeshBase:
    """Marker base class of the emulated mesh device (defined here so that every module below the mesh can
    recognise one without importing ``mesh.py``, which sits at the top of the emulator's import chain)."""

    is_emulated = True


class EmuTensor:
    """Stand-in for a (multi-device) ``ttnn.Tensor`` on the emulated mesh."""

    __slots__ = (
        "_shards",
        "dtype",
        "layout",
        "_memory_config",
        "mesh",
        "on_device",
        "_dealloc",
        "_buffer_release",
        "_freed",
        "placements",
        "persistent",
        "trace_owner",
        "_address",
        "pad_fill",
        "_base",
        "_tile",
        "dist",
        "_spec_memo",
        "__weakref__",
    )

    def __init__(
        self,
        shards: list[torch.Tensor],
        dtype,
        layout,
        *,
        mesh=None,
        on_device: bool = False,
        memory_config=None,
        placements=None,
        pad_fill: float | None = 0.0,
    ):
        if not shards:
            raise EmulatorError("EmuTensor needs at least one shard")
        self._shards = shards
        self.dtype = dtype
        self.layout = layout
        self._memory_config = memory_config if memory_config is not None else ttnn.DRAM_MEMORY_CONFIG
        self.mesh = mesh
        self.on_device = on_device
        self._buffer_release = None  # set by the mesh's DRAM / L1 accounting (mesh.on_allocate); frees the bytes once
        self._dealloc = False
        self._freed = False
        self.placements = placements  # description of how the host tensor was mapped (for to_torch hints)
        self.persistent = True  # cleared for tensors allocated inside a trace capture
        self.trace_owner = None  # trace id whose capture allocated this tensor
        self._address = None  # opaque buffer id handed out by buffer_address()
        # Contents of the tile padding (TILE layout only; see module doc): a known fill value, or None for
        # garbage (whatever the op that wrote the tiles left there).
        self.pad_fill = pad_fill
        self._base = None  # the tensor whose device buffer this one views (see module doc), else None
        # The ttnn.Tile the tensor was created with (None = the default 32x32 tile, faces in order). Ops refuse a
        # non-default tile unless they validate it themselves (namespace.Dispatcher, docs/emulator.md "Tensors").
        self._tile = None
        # How the tensor is distributed over the mesh, where the emulator knows it: (mesh_shape, placements) with
        # one ("shard", dim) or ("replicate",) per mesh axis; set by from_torch/as_tensor/allocate_tensor_on_device
        # and kept by transfers, views and in-place ops; None for other op outputs (tensor_topology() refuses).
        self.dist = None
        self._spec_memo = None  # program_cache.py: (memory config, dtype, layout, their key parts), computed once

    @property
    def _deallocated(self) -> bool:
        return self._dealloc

    @_deallocated.setter
    def _deallocated(self, value: bool) -> None:
        # ttnn.deallocate frees the buffer's DRAM or L1 at once; a tensor never deallocated frees it when it is
        # collected (the weakref finalizer the mesh registered), as a ttnn.Tensor's destructor does
        if value and not self._dealloc and self._buffer_release is not None:
            self._buffer_release()
        self._dealloc = bool(value)

    # ---- data access -------------------------------------------------------------------------
    @property
    def shards(self) -> list[torch.Tensor]:
        if self._deallocated and (self._freed or self.mesh is None or not self.mesh.trace.replaying):
            raise EmulatorError(
                f"use of a deallocated tensor (shape {list(self._shards_shape())}, {dtype_name(self.dtype)}): "
                "ttnn.deallocate() was called on it"
            )
        if self._base is not None:  # a view reads its base's buffer as it is now
            self._shards = [b.reshape(s.shape) for b, s in zip(self._base.shards, self._shards)]
        return self._shards

    def _shards_shape(self):
        return self._shards[0].shape if self._shards else ()

    def set_shards(self, new: list[torch.Tensor]) -> None:
        if len(new) != len(self._shards):
            raise EmulatorError(f"shard count mismatch: tensor has {len(self._shards)}, got {len(new)}")
        if self._base is not None:  # a write through a view lands in its base's buffer
            self._base.set_shards([n.reshape(b.shape) for n, b in zip(new, self._base._shards)])
        self._shards = new

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    # ---- ttnn.Tensor-like metadata -----------------------------------------------------------
    @property
    def shape(self):
        return ttnn.Shape(list(self._shards[0].shape))

    @property
    def logical_shape_list(self) -> list[int]:
        return list(self._shards[0].shape)

    @property
    def padded_shape(self):
        return ttnn.Shape(padded_shape_of(self._shards[0].shape, self.layout))

    def get_dtype(self):
        return self.dtype

    def get_layout(self):
        return self.layout

    @property
    def tile(self):
        return self._tile if self._tile is not None else ttnn.Tile((TILE, TILE))

    def get_tile(self):
        return self.tile

    def tensor_topology(self):
        """A real ``ttnn.TensorTopology`` (distribution shape, placements, mesh coordinates) where the emulator knows
        how the tensor was distributed (see ``dist``); op outputs other than in-place ones are refused by name."""
        if self.dist is None:
            from .errors import NotEmulatedError

            raise NotEmulatedError(
                "Tensor.tensor_topology(): the emulator tracks the topology of tensors built by from_torch/as_tensor/"
                "allocate_tensor_on_device (and in-place op results, transfers, views), not of other op outputs")
        shape, placements = self.dist
        pl = [ttnn.PlacementShard(p[1]) if p[0] == "shard" else ttnn.PlacementReplicate() for p in placements]
        coords = [ttnn.MeshCoordinate(r, c) for r in range(shape[0]) for c in range(shape[1])]
        return ttnn.TensorTopology(ttnn.MeshShape(*shape), pl, coords)

    def memory_config(self):
        return self._memory_config

    def storage_type(self):
        return ttnn.StorageType.DEVICE if self.on_device else ttnn.StorageType.HOST

    def is_allocated(self) -> bool:
        return not self._deallocated

    def device(self):
        return self.mesh if self.on_device else None

    def is_sharded(self) -> bool:
        return bool(self._memory_config.is_sharded())

    def logical_volume(self) -> int:
        return math.prod(self._shards[0].shape)

    def volume(self) -> int:
        return math.prod(padded_shape_of(self._shards[0].shape, self.layout))

    def bytes_per_device(self) -> int:
        return shard_bytes(self._shards[0].shape, self.dtype, self.layout)

    def element_size(self) -> int:
        return ELEMENT_BYTES.get(dtype_name(self.dtype), 1)

    def __len__(self) -> int:
        return int(self._shards[0].shape[0])

    def __repr__(self) -> str:
        where = f"device(mesh {self.mesh.label_short})" if self.on_device and self.mesh else "host"
        state = "" if not self._deallocated else ", deallocated"
        return (
            f"EmuTensor(shape={list(self._shards[0].shape)}, padded={list(self.padded_shape)}, "
            f"dtype={dtype_name(self.dtype)}, layout={self.layout.name}, shards={len(self._shards)}, {where}{state})"
        )

    # ttnn.Tensor has `.to(device, mem_config, cq_id)`, `.to(layout)`, `.cpu()`, `.to_torch()`.
    def _home(self):
        if self.mesh is None:
            raise EmulatorError("this tensor is not attached to an emulated mesh")
        return self.mesh

    # They call the registered host functions directly (the override table sits below this module, so the
    # tensor never imports the op modules that are built on top of it).
    def to(self, *args, **kwargs):
        """The two 0.81.1 overloads (``ttnn.Tensor.to.__doc__``): ``to(device, mem_config=None, cq_id=None)`` and
        ``to(target_layout)``. Anything else raises TypeError as the nanobind overload resolution does."""
        sig = ("Tensor.to(): supported overloads are to(device, mem_config=None, cq_id=None) and "
               "to(target_layout)")
        layout_kw = "target_layout" in kwargs
        first = args[0] if args else kwargs.get("target_layout", kwargs.get("device"))
        if layout_kw or (args and isinstance(first, type(ttnn.TILE_LAYOUT))):
            if len(args) + len(kwargs) != 1:
                raise TypeError(f"{sig}; got {len(args)} positional and keywords {sorted(kwargs)}")
            return registry.host_impl("ttnn.to_layout")(self._home(), self, first)
        names = ("device", "mem_config", "cq_id")
        if len(args) > len(names) or set(kwargs) - set(names):
            raise TypeError(f"{sig}; got {len(args)} positional and keywords {sorted(kwargs)}")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in bound:
                raise TypeError(f"Tensor.to(): {k} given twice")
            bound[k] = v
        if "device" not in bound:
            raise TypeError(f"{sig}; the device is missing")
        return registry.host_impl("ttnn.to_device")(self._home(), self, bound["device"],
                                                     memory_config=bound.get("mem_config"))

    def cpu(self, blocking: bool = True, cq_id=None):
        return registry.host_impl("ttnn.from_device")(self._home(), self)

    def to_torch(self, *args, **kwargs):
        return registry.host_impl("ttnn.to_torch")(self._home(), self, *args, **kwargs)

    # Arithmetic operators route through the emulated namespace like ttnn's do.
    def _ns(self):
        if self.mesh is None:
            raise EmulatorError("arithmetic on a host tensor: move it to the device first")
        return self.mesh.ttnn

    def __add__(self, other):
        return self._ns().add(self, other)

    __radd__ = __add__

    def __sub__(self, other):
        return self._ns().subtract(self, other)

    def __rsub__(self, other):
        return self._ns().subtract(other, self)

    def __mul__(self, other):
        return self._ns().multiply(self, other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._ns().divide(self, other)

    def __neg__(self):
        return self._ns().neg(self)

    def buffer_address(self) -> int:
        """An opaque id, unique per live device buffer (not a card address): equal only for the same buffer."""
        if not self.on_device or self._deallocated:
            raise EmulatorError("buffer_address() of a tensor without a device buffer (host or deallocated)")
        if self._address is None:
            global _NEXT_ADDRESS
            _NEXT_ADDRESS += 1 << 12
            self._address = _NEXT_ADDRESS
        return self._address

    def __getitem__(self, key):
        """Torch-style basic indexing, as ttnn's ``Tensor.__getitem__`` (ttnn.slice, then squeeze of int axes)."""
        from .tensor_index import getitem

        return getitem(self, key)


_NEXT_ADDRESS = 1 << 20


def is_default_tile(tile) -> bool:
    """True for ``None`` or a 32x32 ``ttnn.Tile`` with faces and values in order (``ttnn.Tile.__eq__`` ignores the
    transpose flag in 0.81.1, so the face flags are read directly)."""
    if tile is None:
        return True
    return (list(tile.tile_shape) == [TILE, TILE] and not bool(getattr(tile, "transpose_of_faces", False))
            and not bool(getattr(tile, "transpose_within_face", False)))


def describe_tile(tile) -> str:
    shape = "x".join(str(int(x)) for x in tile.tile_shape)
    return f"{shape}{' transposed' if getattr(tile, 'transpose_of_faces', False) else ''} tile"


def make_like(
    ref: EmuTensor, shards: list[torch.Tensor], *, dtype=None, layout=None, memory_config=None,
    pad_fill: float | None = None,
) -> EmuTensor:
    """New device tensor on ``ref``'s mesh, values rounded to ``dtype`` (default ``ref.dtype``).

    ``pad_fill``: what the op leaves in the tile padding; ``None`` (garbage) unless the op documents a fill."""
    dtype = ref.dtype if dtype is None else dtype
    layout = ref.layout if layout is None else layout
    check_dtype_layout(dtype, layout, "op output")
    return new_device_tensor(
        ref.mesh,
        [quantize_via_ttnn(s, dtype) for s in shards],
        dtype,
        layout,
        memory_config=memory_config if memory_config is not None else ref.memory_config(),
        pad_fill=pad_fill,
    )


def view_of(t: EmuTensor, shape: Sequence[int], memory_config=None) -> EmuTensor:
    """A tensor of ``shape`` sharing ``t``'s device buffer (see the module doc; views of a view share the root)."""
    base = t._base if t._base is not None else t
    shards = [s.reshape([int(x) for x in shape]) for s in t.shards]
    v = EmuTensor(shards, t.dtype, t.layout, mesh=t.mesh, on_device=t.on_device,
                  memory_config=memory_config if memory_config is not None else t.memory_config(),
                  placements=t.placements, pad_fill=t.pad_fill)
    v._base = base
    v.persistent, v.trace_owner = base.persistent, base.trace_owner
    v._tile = t._tile
    v.dist = t.dist if list(shape) == t.logical_shape_list else None  # a reshape may move the sharded dim
    return v


def new_device_tensor(mesh, shards, dtype, layout, memory_config=None, pad_fill: float | None = 0.0) -> EmuTensor:
    t = EmuTensor(list(shards), dtype, layout, mesh=mesh, on_device=True, memory_config=memory_config,
                  pad_fill=pad_fill)
    mesh.on_allocate(t)
    return t


# ------------------------------------------------------------------------------------------------
# Helpers shared by the namespace, the trace machinery and the op modules
# ------------------------------------------------------------------------------------------------
def iter_tensors(obj) -> list:
    """Every EmuTensor inside ``obj`` (nested lists, tuples and dict values), in order. A list, built without
    generators: the dispatcher walks every op's arguments several times, and nested generators were a visible
    share of the emulator's per-op time."""
    out: list = []
    _collect_tensors(obj, out)
    return out


def _collect_tensors(obj, out: list) -> None:
    if isinstance(obj, EmuTensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, EmuTensor):
                out.append(o)
            elif isinstance(o, (list, tuple, dict)):
                _collect_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            if isinstance(o, EmuTensor):
                out.append(o)
            elif isinstance(o, (list, tuple, dict)):
                _collect_tensors(o, out)


def map_shards(obj, i: int, convert=None):
    """Replace every EmuTensor inside ``obj`` by its shard ``i`` (optionally converted)."""
    if isinstance(obj, EmuTensor):
        s = obj.shards[i]
        return convert(s) if convert else s
    if isinstance(obj, list):
        return [map_shards(o, i, convert) for o in obj]
    if isinstance(obj, tuple):
        return tuple(map_shards(o, i, convert) for o in obj)
    if isinstance(obj, dict):
        return {k: map_shards(v, i, convert) for k, v in obj.items()}
    return obj


def write_inplace(t: EmuTensor, new_shards: list[torch.Tensor]) -> None:
    """In-place update of an existing device buffer (suppressed during a capture's dry evaluation)."""
    mesh = t.mesh
    if mesh is not None and mesh.trace.dry:
        return
    t.set_shards([s.contiguous() for s in new_shards])
