"""The emulated Blackhole P150a mesh: a stand-in ``MeshDevice`` plus mesh mappers / composers.

The mesh is (1, N) with N in {1, 2, 4} (P150, P150x2 "P300-like" pair, P150x4). It owns the
emulating ``ttnn`` namespace (``mesh.ttnn``), the device-work counters and the trace state.
"""

from __future__ import annotations

import os
import pathlib

import torch

from .counters import Counters
from .errors import EmulatorError, TraceRuleError
from .ttnn_import import ttnn

MOCK_CLUSTER_DIR = pathlib.Path(__file__).resolve().parent.parent / "mock_clusters"
MOCK_CLUSTER_FILES = {1: "blackhole_p150.yaml", 2: "blackhole_2xp150.yaml", 4: "blackhole_4xp150.yaml"}

# Blackhole P150a facts used for the device queries the model may make.
P150A_WORKER_GRID = (11, 10)  # 110 usable Tensix worker cores (DESIGN section 7)
P150A_DRAM_GRID = (8, 1)  # 8 GDDR6 channels (P150a: 32 GB, 512 GB/s spec)


def ensure_mock_cluster(num_devices: int) -> str:
    """Point ttnn's host runtime at the project's own Blackhole descriptor (host conversions need one).

    The first descriptor set in a process wins for the UMD cluster ttnn opens lazily; host-side tensor
    conversion does not depend on the chip count, so a later mesh of another size is unaffected.
    """
    path = MOCK_CLUSTER_DIR / MOCK_CLUSTER_FILES[num_devices]
    if not path.is_file():
        raise EmulatorError(f"mock cluster descriptor missing: {path}")
    os.environ.setdefault("TT_METAL_MOCK_CLUSTER_DESC_PATH", str(path))
    return os.environ["TT_METAL_MOCK_CLUSTER_DESC_PATH"]


class EmulatedMeshDevice:
    """Stand-in for ``ttnn.MeshDevice`` (1 x N Blackhole P150a chips) backed by torch on the CPU."""

    is_emulated = True

    def __init__(
        self,
        num_devices: int,
        *,
        trace_region_size: int = 0,
        l1_small_size: int = 0,
        num_command_queues: int = 1,
        alloc_while_trace_live: str = "error",
        op_table_policy: str = "layout",
    ):
        if num_devices not in MOCK_CLUSTER_FILES:
            raise EmulatorError(f"emulated mesh supports 1, 2 or 4 P150a chips, got {num_devices}")
        if alloc_while_trace_live not in ("error", "warn"):
            raise EmulatorError("alloc_while_trace_live must be 'error' or 'warn'")
        if op_table_policy not in ("strict", "layout", "warn", "off"):
            raise EmulatorError("op_table_policy must be 'strict', 'layout', 'warn' or 'off'")
        self.op_table_policy = op_table_policy
        if num_command_queues not in (1, 2):
            raise EmulatorError(f"num_command_queues must be 1 or 2, got {num_command_queues}")
        self.mock_cluster_desc = ensure_mock_cluster(num_devices)
        self.num_devices = num_devices
        self.shape = ttnn.MeshShape(1, num_devices)
        self.trace_region_size = int(trace_region_size)
        self.l1_small_size = int(l1_small_size)
        self.num_command_queues = num_command_queues
        self.alloc_while_trace_live = alloc_while_trace_live
        self.counters = Counters()
        self.label_short = f"emulated-p150x{num_devices}" if num_devices > 1 else "emulated-p150"
        self._closed = False
        self._program_cache_enabled = True
        self._program_cache: set = set()
        from .trace import TraceState

        self.trace = TraceState(self)
        from .namespace import EmulatedTTNN

        self.ttnn = EmulatedTTNN(self)

    # ---- MeshDevice-like API -----------------------------------------------------------------
    def get_num_devices(self) -> int:
        return self.num_devices

    def get_device_ids(self) -> list[int]:
        return list(range(self.num_devices))

    def get_devices(self) -> list["EmulatedMeshDevice"]:
        return [self] * self.num_devices

    @property
    def mesh_shape(self):
        return self.shape

    def arch(self):
        return ttnn.Arch.BLACKHOLE

    def compute_with_storage_grid_size(self):
        return ttnn.CoreCoord(*P150A_WORKER_GRID)

    def dram_grid_size(self):
        return ttnn.CoreCoord(*P150A_DRAM_GRID)

    def core_grid(self):
        return ttnn.CoreGrid(y=P150A_WORKER_GRID[1], x=P150A_WORKER_GRID[0])

    def enable_program_cache(self) -> None:
        self._program_cache_enabled = True

    def disable_and_clear_program_cache(self) -> None:
        self._program_cache_enabled = False
        self._program_cache.clear()

    def clear_program_cache(self) -> None:
        self._program_cache.clear()

    def num_program_cache_entries(self) -> int:
        """Distinct device-op keys dispatched while the cache was enabled (see program_cache.py)."""
        return len(self._program_cache)

    def note_program(self, op_name: str, args: tuple, kwargs: dict) -> None:
        if self._program_cache_enabled:
            from .program_cache import program_key

            self._program_cache.add(program_key(op_name, args, kwargs))

    def id(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"EmulatedMeshDevice({self.label_short}, shape=(1, {self.num_devices}), ttnn goldens on CPU)"

    # ---- allocation / lifecycle ----------------------------------------------------------------
    def check_open(self) -> None:
        if self._closed:
            raise EmulatorError(f"{self.label_short} mesh is closed")

    def on_allocate(self, t) -> None:
        """Called for every new device tensor; enforces the allocation rule for live traces."""
        self.check_open()
        if self.trace.replaying:
            return
        self.trace.note_allocation(t)
        if self.trace.capturing is not None:
            t.persistent = False
            t.trace_owner = self.trace.capturing.trace_id
            self.trace.capturing.owned.append(t)
        else:
            live = self.trace.live_trace_ids()
            if live:
                msg = (
                    f"device allocation ({list(t.logical_shape_list)}, {t.dtype.name}) while trace(s) {live} are live: "
                    "on cards, buffers allocated after capture can overlap addresses the trace writes on replay "
                    "(tt-metal warns 'Allocating device buffers is unsafe due to the existence of an active trace'). "
                    "Allocate every buffer before capture, write new inputs with ttnn.copy_host_to_device_tensor "
                    "into the persistent input buffers, or release the trace first."
                )
                if self.alloc_while_trace_live == "error":
                    raise TraceRuleError(msg)
                from loguru import logger

                logger.warning(msg)

    def close(self) -> None:
        self._closed = True


# ------------------------------------------------------------------------------------------------
# Mesh mappers and composers
# ------------------------------------------------------------------------------------------------
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
    if isinstance(mesh_or_shape, EmulatedMeshDevice):
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


__all__ = [
    "EmulatedMeshDevice",
    "EmuMeshMapper",
    "EmuMeshComposer",
    "ShardTensorToMesh",
    "ReplicateTensorToMesh",
    "ShardTensor2dMesh",
    "create_mesh_mapper",
    "ConcatMeshToTensor",
    "ConcatMesh2dToTensor",
    "create_mesh_composer",
    "TraceRuleError",
]
