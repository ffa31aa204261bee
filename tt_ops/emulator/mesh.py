"""The emulated Blackhole P150a mesh: a stand-in ``MeshDevice`` (mappers / composers live in ``mappers.py``).

The mesh is (1, N) with N in {1, 2, 4} (P150, P150x2 "P300-like" pair, P150x4). It owns the
emulating ``ttnn`` namespace (``mesh.ttnn``), the device-work counters and the trace state.
"""

from __future__ import annotations

import os
import pathlib
import weakref

import torch

from .counters import Counters
from .errors import EmulatorError, TraceRuleError
from .l1 import l1_bank_bytes, l1_footprint
from .shard_specs import require_shard_spec
from .mappers import (  # noqa: F401  (re-exported: the mesh module is where users look for them)
    ConcatMesh2dToTensor,
    ConcatMeshToTensor,
    EmuMeshComposer,
    EmuMeshMapper,
    ReplicateTensorToMesh,
    ShardTensor2dMesh,
    ShardTensorToMesh,
    create_mesh_composer,
    create_mesh_mapper,
)
from .namespace import EmulatedTTNN
from .numerics import NUMERICS_MODES
from .tensor import EmuMeshBase
from .trace import TraceState
from .ttnn_import import ttnn

MOCK_CLUSTER_DIR = pathlib.Path(__file__).resolve().parent.parent / "mock_clusters"
MOCK_CLUSTER_FILES = {1: "blackhole_p150.yaml", 2: "blackhole_2xp150.yaml", 4: "blackhole_4xp150.yaml"}

# Blackhole P150a facts used for the device queries the model may make.
P150A_WORKER_GRID = (11, 10)  # 110 usable Tensix worker cores (Blackhole P150a)
P150A_DRAM_GRID = (8, 1)  # 8 GDDR6 channels (P150a: 32 GB, 512 GB/s spec)
# DRAM the allocator of one chip hands out: 8 banks (one per GDDR6 channel) of 4,273,390,016 B each, the "bank size"
# tt-metal's bank manager reports in its out-of-memory message on a Blackhole P150 card (seen in a public tt-xla
# remediation log on blackhole-p150b: "... across 8 banks, where each bank needs to store ... B, but bank size is
# 4273390016 B"); 34.19 GB of the card's 32 GiB (34.36 GB), the rest reserved by firmware and tt-metal.
P150A_DRAM_BANKS = 8
P150A_DRAM_BANK_BYTES = 4_273_390_016
P150A_DRAM_BYTES = P150A_DRAM_BANKS * P150A_DRAM_BANK_BYTES
# L1: tt-metal's allocator makes one L1 bank per compute core (l1_banking_allocator.cpp), so the emulated chip has as
# many banks as its worker grid has cores; the bank size and the sizing rules are in l1.py
P150A_L1_BANKS = P150A_WORKER_GRID[0] * P150A_WORKER_GRID[1]


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


class EmulatedMeshDevice(EmuMeshBase):
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
        numerics: str = "strict",
    ):
        if num_devices not in MOCK_CLUSTER_FILES:
            raise EmulatorError(f"emulated mesh supports 1, 2 or 4 P150a chips, got {num_devices}")
        if alloc_while_trace_live not in ("error", "warn"):
            raise EmulatorError("alloc_while_trace_live must be 'error' or 'warn'")
        if op_table_policy not in ("strict", "layout", "warn", "off"):
            raise EmulatorError("op_table_policy must be 'strict', 'layout', 'warn' or 'off'")
        self.op_table_policy = op_table_policy
        if numerics not in NUMERICS_MODES:
            raise EmulatorError(f"numerics must be one of {NUMERICS_MODES}, got {numerics!r}")
        # "strict": FPU/SFPU numerics and tile-padding garbage as cards have them (numerics.py); "exact": fp32
        # math on logical shapes (for A/B runs that separate card arithmetic from model bugs)
        self.numerics = numerics
        if num_command_queues not in (1, 2):
            raise EmulatorError(f"num_command_queues must be 1 or 2, got {num_command_queues}")
        self.mock_cluster_desc = ensure_mock_cluster(num_devices)
        self.num_devices = num_devices
        self.shape = ttnn.MeshShape(1, num_devices)
        self.trace_region_size = int(trace_region_size)
        # DRAM accounting per device (docs/emulator_traces.md "DRAM capacity"): the trace region is reserved at open, as
        # open_mesh_device(trace_region_size=...) carves it out of each chip's DRAM
        if self.trace_region_size > P150A_DRAM_BYTES:
            raise EmulatorError(f"trace_region_size {self.trace_region_size} B exceeds a P150a's DRAM "
                                f"({P150A_DRAM_BYTES} B)")
        self.dram_used = [self.trace_region_size] * num_devices
        self.l1_small_size = int(l1_small_size)
        # L1 accounting per device (docs/emulator_traces.md "L1 capacity"): bytes each core's L1 bank has handed out to
        # live buffers (the same on every core: the allocator gives a buffer one address range in all banks), and the
        # most it has held since open
        self.l1_bank_bytes = l1_bank_bytes(self.l1_small_size)
        if self.l1_bank_bytes <= 0:
            raise EmulatorError(f"l1_small_size {self.l1_small_size} B leaves no L1 for buffers (a Blackhole core has "
                                f"{l1_bank_bytes(0)} B above the reserved base)")
        self.l1_used = [0] * num_devices
        self.l1_peak = [0] * num_devices
        self.num_command_queues = num_command_queues
        self.alloc_while_trace_live = alloc_while_trace_live
        self.counters = Counters()
        self.label_short = f"emulated-p150x{num_devices}" if num_devices > 1 else "emulated-p150"
        self._closed = False
        self._program_cache_enabled = True
        self._program_cache: set = set()
        self.trace = TraceState(self)
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
        return (f"EmulatedMeshDevice({self.label_short}, shape=(1, {self.num_devices}), ttnn goldens on CPU, "
                f"numerics={self.numerics})")

    # ---- allocation / lifecycle ----------------------------------------------------------------
    def check_open(self) -> None:
        if self._closed:
            raise EmulatorError(f"{self.label_short} mesh is closed")

    def on_allocate(self, t) -> None:
        """Called for every new device tensor; enforces the allocation rule for live traces and the DRAM capacity."""
        self.check_open()
        if self.trace.replaying:
            return
        require_shard_spec(t)  # the tensor layer refuses a sharded buffer without a shard spec (shard_specs.py)
        self._account_dram(t)
        self._account_l1(t)
        self.trace.note_allocation(t)
        if self.trace.capturing is not None:
            t.persistent = False
            t.trace_owner = self.trace.capturing.trace_id
            self.trace.capturing.owned.append(t)
        else:
            # an allocation the caller declared scratch (ttnn's corruptible_allocation_scope) is tt-metal's warning
            # case taken knowingly: a replay may overwrite it, so it must be dead before the next replay (a join's
            # prefill between decode replays). Rule 8 does not track it either.
            live = [] if self.trace.in_corruptible_scope() else self.trace.live_trace_ids()
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

    def _account_dram(self, t) -> None:
        """Charge a DRAM buffer's bytes to every device it lives on; refuse it where a chip's DRAM would overflow."""
        from .tensor import dram_bytes_of

        if t.memory_config().buffer_type != ttnn.BufferType.DRAM:
            return  # L1 buffers live in the cores' SRAM (_account_l1)
        need = dram_bytes_of(t)
        if max(self.dram_used) + need > P150A_DRAM_BYTES:
            self._free_dropped_capture_buffers()
        for i, used in enumerate(self.dram_used):
            if used + need > P150A_DRAM_BYTES:
                per_bank, used_bank = -(-need // P150A_DRAM_BANKS), -(-used // P150A_DRAM_BANKS)
                # the card allocator's message (tt-metal bank_manager.cpp), then what the emulator knows of the buffer
                raise EmulatorError(
                    f"device {i}: Out of Memory: Not enough space to allocate {need} B DRAM buffer across "
                    f"{P150A_DRAM_BANKS} banks, where each bank needs to store {per_bank} B, but bank size is "
                    f"{P150A_DRAM_BANK_BYTES} B (allocated: {used_bank} B, free: {P150A_DRAM_BANK_BYTES - used_bank} B)"
                    f"; tensor {list(t.logical_shape_list)} {t.dtype.name}, {used} B of {P150A_DRAM_BYTES} B in use on "
                    f"the device (trace region {self.trace_region_size} B)")
        self.dram_used = [u + need for u in self.dram_used]
        t._buffer_release = weakref.finalize(t, EmulatedMeshDevice._release, weakref.ref(self), "dram_used", need)

    def _free_dropped_capture_buffers(self) -> None:
        """Free the bytes of capture buffers the caller has dropped (trace.py ``unreferenced_owned``): a card freed
        them when their tensors were destroyed; the emulator only still holds them for replay."""
        for t in self.trace.unreferenced_owned():
            if t._buffer_release is not None:
                t._buffer_release()  # a weakref.finalize: frees once, later calls do nothing

    @staticmethod
    def _release(mesh_ref, pool: str, nbytes: int) -> None:
        """A freed buffer's bytes go back to ``pool`` (``dram_used`` or ``l1_used``) on every device; nothing if the
        mesh itself is gone."""
        mesh = mesh_ref()
        if mesh is not None:
            setattr(mesh, pool, [u - nbytes for u in getattr(mesh, pool)])

    def dram_in_use(self) -> list[int]:
        """Bytes of DRAM allocated per device: the trace region plus every live DRAM buffer."""
        return list(self.dram_used)

    def _account_l1(self, t) -> None:
        """Charge an L1 buffer's bytes per bank to every core of every device it lives on (l1.py: one address range in
        all banks); refuse it where a core's L1 would overflow, with the card allocator's message."""
        if t.memory_config().buffer_type != ttnn.BufferType.L1:
            return
        size, banks, per_bank = l1_footprint(t, P150A_L1_BANKS)
        if max(self.l1_used) + per_bank > self.l1_bank_bytes:
            self._free_dropped_capture_buffers()
        for i, used in enumerate(self.l1_used):
            if used + per_bank > self.l1_bank_bytes:
                # the card allocator's message (tt-metal bank_manager.cpp), then what the emulator knows of the buffer
                raise EmulatorError(
                    f"device {i}: Out of Memory: Not enough space to allocate {size} B L1 buffer across {banks} banks, "
                    f"where each bank needs to store {per_bank} B, but bank size is {self.l1_bank_bytes} B "
                    f"(allocated: {used} B, free: {self.l1_bank_bytes - used} B); tensor {list(t.logical_shape_list)} "
                    f"{t.dtype.name} {t.memory_config().memory_layout.name} in L1 (l1_small_size {self.l1_small_size} B)")
        self.l1_used = [u + per_bank for u in self.l1_used]
        self.l1_peak = [max(p, u) for p, u in zip(self.l1_peak, self.l1_used)]
        t._buffer_release = weakref.finalize(t, EmulatedMeshDevice._release, weakref.ref(self), "l1_used", per_bank)

    def l1_in_use(self) -> list[int]:
        """Bytes of each core's L1 bank held by live L1 buffers, per device (circular buffers not included)."""
        return list(self.l1_used)

    def l1_peak_per_core(self) -> list[int]:
        """Most bytes of a core's L1 bank the live L1 buffers held at once since open (or the last reset), per
        device."""
        return list(self.l1_peak)

    def reset_l1_peak(self) -> None:
        """Start the peak over from what the live L1 buffers hold now (to measure one phase, e.g. a decode step)."""
        self.l1_peak = list(self.l1_used)

    def close(self) -> None:
        self._closed = True


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
