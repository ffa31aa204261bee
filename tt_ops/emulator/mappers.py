"""Mesh mappers and composers of the emulated mesh (``ShardTensorToMesh``, ``ConcatMeshToTensor``, ...)."""

from __future__ import annotations

import torch

from .errors import EmulatorError
from .tensor import EmuMeshBase
from .ttnn_import import ttnn


class EmuMeshMapper:
    """Maps a torch tensor onto a mesh: one placement per mesh axis (Replicate or Shard(dim))."""

    def __init__(self, mesh_shape: tuple[int, int], placements: list[tuple], label: str):
        self.mesh_shape = tuple(int(x) for x in mesh_shape)
        if len(placements) != len(self.mesh_shape):
            raise EmulatorError(
                f"{label}: {len(placements)} placements for a mesh of rank {len(self.mesh_shape)}"
            )
        self.placements = placements
        self.label = label

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n

    def map(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        rows, cols = self.mesh_shape
        out = []
        for r in range(rows):
            for c in range(cols):
                piece = tensor
                for axis, (coord, size) in enumerate(((r, rows), (c, cols))):
                    pl = self.placements[axis]
                    if pl[0] == "shard":
                        dim = pl[1]
                        if dim >= piece.ndim or dim < -piece.ndim:
                            raise EmulatorError(f"{self.label}: shard dim {dim} out of range for rank {piece.ndim}")
                        extent = tensor.shape[dim]
                        if extent % size != 0:
                            raise EmulatorError(
                                f"{self.label}: dim {dim} of size {extent} does not divide evenly over {size} devices"
                            )
                        piece = torch.chunk(piece, size, dim=dim)[coord]
                out.append(piece.contiguous().clone())
        return out

    def describe(self) -> str:
        parts = [f"Shard({p[1]})" if p[0] == "shard" else "Replicate()" for p in self.placements]
        return f"{self.label}[{', '.join(parts)}] on {self.mesh_shape}"

    def key(self) -> str:
        return self.describe()


class EmuMeshComposer:
    """Concatenates device shards back into one torch tensor: one concat dim per mesh axis."""

    def __init__(self, mesh_shape: tuple[int, int], dims: list[int], label: str):
        self.mesh_shape = tuple(int(x) for x in mesh_shape)
        self.dims = list(dims)
        self.label = label

    def compose(self, shards: list[torch.Tensor]) -> torch.Tensor:
        rows, cols = self.mesh_shape
        if rows * cols != len(shards):
            raise EmulatorError(f"{self.label}: mesh {self.mesh_shape} but tensor has {len(shards)} shards")
        if len(self.dims) == 1:  # 1-D: concat everything in row-major device order
            return torch.cat(shards, dim=self.dims[0])
        row_tensors = [torch.cat(shards[r * cols : (r + 1) * cols], dim=self.dims[1]) for r in range(rows)]
        return torch.cat(row_tensors, dim=self.dims[0])


def _mesh_shape_of(mesh_or_shape) -> tuple[int, int]:
    if isinstance(mesh_or_shape, EmuMeshBase):
        return (1, mesh_or_shape.num_devices)
    if isinstance(mesh_or_shape, ttnn.MeshShape):
        dims = list(mesh_or_shape)
        if len(dims) != 2:
            raise EmulatorError(f"only 2-D mesh shapes are emulated, got {dims}")
        return (int(dims[0]), int(dims[1]))
    if isinstance(mesh_or_shape, (tuple, list)) and len(mesh_or_shape) == 2:
        return (int(mesh_or_shape[0]), int(mesh_or_shape[1]))
    raise EmulatorError(
        f"expected the emulated mesh device or a ttnn.MeshShape, got {type(mesh_or_shape).__name__}: "
        "a real ttnn MeshDevice cannot be mixed with the emulated namespace"
    )


def _placement(p) -> tuple:
    if isinstance(p, ttnn.PlacementShard):
        return ("shard", int(p.dim))
    if isinstance(p, ttnn.PlacementReplicate):
        return ("replicate",)
    raise EmulatorError(f"unknown placement {p!r}")


def ShardTensorToMesh(mesh_device, dim: int) -> EmuMeshMapper:
    rows, cols = _mesh_shape_of(mesh_device)
    # ttnn shards over all devices of the mesh (flattened); on a (1, N) mesh that is the column axis.
    if rows != 1:
        raise EmulatorError("ShardTensorToMesh on a multi-row mesh is not emulated; use ShardTensor2dMesh")
    return EmuMeshMapper((rows, cols), [("replicate",), ("shard", dim)], "ShardTensorToMesh")


def ReplicateTensorToMesh(mesh_device) -> EmuMeshMapper:
    shape = _mesh_shape_of(mesh_device)
    return EmuMeshMapper(shape, [("replicate",), ("replicate",)], "ReplicateTensorToMesh")


def ShardTensor2dMesh(mesh_device, mesh_shape, dims) -> EmuMeshMapper:
    shape = _mesh_shape_of(mesh_shape)
    _check_shape_matches(mesh_device, shape, "ShardTensor2dMesh")
    placements = [("replicate",) if d is None else ("shard", int(d)) for d in dims]
    return EmuMeshMapper(shape, placements, "ShardTensor2dMesh")


def create_mesh_mapper(mesh_device, config) -> EmuMeshMapper:
    shape = _mesh_shape_of(mesh_device)
    placements = [_placement(p) for p in config.placements]
    if len(placements) == 1:  # 1-D placement over the flattened mesh
        placements = [("replicate",), placements[0]]
    return EmuMeshMapper(shape, placements, "create_mesh_mapper")


def ConcatMeshToTensor(mesh_device, dim: int) -> EmuMeshComposer:
    return EmuMeshComposer(_mesh_shape_of(mesh_device), [int(dim)], "ConcatMeshToTensor")


def ConcatMesh2dToTensor(mesh_device, mesh_shape, dims) -> EmuMeshComposer:
    shape = _mesh_shape_of(mesh_shape)
    _check_shape_matches(mesh_device, shape, "ConcatMesh2dToTensor")
    return EmuMeshComposer(shape, [int(dims[0]), int(dims[1])], "ConcatMesh2dToTensor")


def create_mesh_composer(mesh_device, config) -> EmuMeshComposer:
    raise EmulatorError(
        "ttnn.create_mesh_composer: MeshComposerConfig does not expose its dims in ttnn 0.81.1, so the emulator "
        "cannot read it; use ttnn.ConcatMeshToTensor(mesh, dim) or ttnn.ConcatMesh2dToTensor(mesh, shape, dims)"
    )


def _check_shape_matches(mesh_device, shape, label):
    dev_shape = _mesh_shape_of(mesh_device)
    if dev_shape != shape:
        raise EmulatorError(f"{label}: mesh_shape {shape} does not match the mesh {dev_shape}")
