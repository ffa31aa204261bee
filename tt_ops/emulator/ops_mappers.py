"""Mesh mappers and composers (emulated): the ``ttnn`` names that build them, each returning the emulator's own
mapper object (mappers.py) for ``from_torch`` / ``to_torch``."""
from __future__ import annotations

from . import mappers
from .registry import host_fn


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
