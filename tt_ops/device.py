"""The one device entry point: open real P150a cards or the emulated mesh, chosen explicitly.

    from qwen36.tt_ops.device import open_mesh
    with open_mesh("emulated-p150x2", trace_region_size=50_000_000) as ctx:
        ttnn = ctx.ttnn          # the real ttnn module on cards, the emulating namespace here
        mesh = ctx.mesh_device
        ...
        print(ctx.label)         # "emulated-p150x2 (ttnn goldens on CPU)" / "p150a x2 (hardware)"

Device names: ``p150`` / ``p150x2`` / ``p150x4`` (hardware), ``emulated-p150`` / ``emulated-p150x2`` /
``emulated-p150x4`` (emulator). ``device=None`` or ``"auto"`` reads ``MESH_DEVICE`` (P150 / P300 /
P150x4), which names *hardware* only. There is never a fallback from one backend to the other: asking
for hardware on a machine without cards fails fast and names the emulated alternative.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

HARDWARE_DEVICES = {"p150": 1, "p150x2": 2, "p150x4": 4}
EMULATED_DEVICES = {"emulated-p150": 1, "emulated-p150x2": 2, "emulated-p150x4": 4}
MESH_DEVICE_ENV = {"P150": "p150", "P300": "p150x2", "P150X2": "p150x2", "P150X4": "p150x4"}
DEFAULT_TRACE_REGION_SIZE = 0  # same default as ttnn.open_mesh_device; pass a size to trace
DEFAULT_L1_SMALL_SIZE = 0
TT_DEVICE_DIR = pathlib.Path("/dev/tenstorrent")


class DeviceSelectionError(RuntimeError):
    """The requested backend is unknown or unavailable (never silently replaced by another)."""


def _emulated_name(n: int) -> str:
    return "emulated-p150" if n == 1 else f"emulated-p150x{n}"


def count_tenstorrent_cards(dev_dir: pathlib.Path | None = None) -> int:
    """Number of Tenstorrent PCIe devices visible (``/dev/tenstorrent/<n>``), without touching ttnn."""
    dev_dir = TT_DEVICE_DIR if dev_dir is None else dev_dir
    if not dev_dir.is_dir():
        return 0
    return sum(1 for p in dev_dir.iterdir() if p.name.isdigit())


def resolve_device_name(device: str | None) -> str:
    """Normalise a device name; ``None``/``"auto"`` reads ``MESH_DEVICE`` (hardware names only)."""
    if device is None or device == "auto":
        env = os.environ.get("MESH_DEVICE")
        if not env:
            raise DeviceSelectionError(
                "no device chosen: pass --device p150|p150x2|p150x4 (cards) or "
                "--device emulated-p150|emulated-p150x2|emulated-p150x4 (emulator), or set MESH_DEVICE=P150|P300|P150x4"
            )
        key = env.strip().upper()
        if key not in MESH_DEVICE_ENV:
            raise DeviceSelectionError(f"MESH_DEVICE={env!r} is not one of P150, P300, P150x4")
        return MESH_DEVICE_ENV[key]
    name = device.strip().lower()
    if name not in HARDWARE_DEVICES and name not in EMULATED_DEVICES:
        raise DeviceSelectionError(
            f"unknown device {device!r}; choose one of {sorted(HARDWARE_DEVICES)} (hardware) or "
            f"{sorted(EMULATED_DEVICES)} (emulator)"
        )
    return name


@dataclasses.dataclass
class MeshContext:
    """What ``open_mesh`` returns. ``ttnn`` is the namespace model code must use."""

    ttnn: Any
    mesh_device: Any
    num_devices: int
    is_emulated: bool
    label: str
    device_name: str
    _closer: Any = None
    _closed: bool = False

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (1, self.num_devices)

    @property
    def counters(self):
        """Device-work counters (emulator only; on cards use the profiler)."""
        if not self.is_emulated:
            raise DeviceSelectionError("counters are an emulator feature; on cards use tracy/the device profiler")
        return self.mesh_device.counters

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._closer is not None:
                self._closer()

    def __enter__(self) -> "MeshContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        d = {"backend": self.label, "device": self.device_name, "mesh_shape": list(self.mesh_shape),
             "emulated": self.is_emulated}
        if self.is_emulated:
            d["emulator_numerics"] = self.mesh_device.numerics
        return d


def open_mesh(
    device: str | None,
    *,
    trace_region_size: int = DEFAULT_TRACE_REGION_SIZE,
    l1_small_size: int = DEFAULT_L1_SMALL_SIZE,
    num_command_queues: int = 1,
    alloc_while_trace_live: str = "error",
    op_table_policy: str = "layout",
    dispatch_core_config: Any = None,
    numerics: str = "strict",
) -> MeshContext:
    """Open the chosen backend. See the module docstring.

    ``alloc_while_trace_live`` (emulator only): ``"error"`` (default) raises on a device allocation while a
    captured trace is live, ``"warn"`` logs tt-metal's warning instead.
    ``op_table_policy`` (emulator only): how the ops' documented dtype/layout tables are enforced:
    ``"layout"`` (default: unsupported layout raises, unlisted dtype warns once), ``"strict"``, ``"warn"``, ``"off"``.
    ``numerics`` (emulator only): ``"strict"`` (default) emulates the cards' FPU/SFPU arithmetic and tile-padding
    garbage (docs/emulator.md, "Numerics and tile padding"); ``"exact"`` computes in fp32 on logical shapes, for
    A/B runs.
    ``dispatch_core_config`` (hardware only): passed to ``ttnn.open_mesh_device``; ``None`` lets ttnn pick the
    architecture default.
    """
    name = resolve_device_name(device)
    if name in EMULATED_DEVICES:
        return _open_emulated(name, trace_region_size, l1_small_size, num_command_queues, alloc_while_trace_live,
                              op_table_policy, numerics)
    return _open_hardware(name, trace_region_size, l1_small_size, num_command_queues, dispatch_core_config)


def _open_emulated(name, trace_region_size, l1_small_size, num_command_queues, alloc_policy,
                   op_table_policy="layout", numerics="strict") -> MeshContext:
    from .emulator.mesh import EmulatedMeshDevice

    n = EMULATED_DEVICES[name]
    mesh = EmulatedMeshDevice(
        n,
        trace_region_size=trace_region_size,
        l1_small_size=l1_small_size,
        num_command_queues=num_command_queues,
        alloc_while_trace_live=alloc_policy,
        op_table_policy=op_table_policy,
        numerics=numerics,
    )
    label = f"{name} (ttnn goldens on CPU)"
    from loguru import logger

    logger.info(f"opened {label}: emulated 1x{n} Blackhole P150a mesh, no hardware, numerics={numerics}")
    return MeshContext(ttnn=mesh.ttnn, mesh_device=mesh, num_devices=n, is_emulated=True, label=label,
                       device_name=name, _closer=mesh.close)


def _open_hardware(name, trace_region_size, l1_small_size, num_command_queues,
                   dispatch_core_config=None) -> MeshContext:
    n = HARDWARE_DEVICES[name]
    cards = count_tenstorrent_cards()
    if cards == 0:
        raise DeviceSelectionError(
            f"--device {name} asks for {n} Tenstorrent P150a card(s) but no cards are present on this machine "
            f"({TT_DEVICE_DIR} does not exist or is empty). To run on the emulated mesh instead, pass "
            f"--device {_emulated_name(n)}. There is no automatic fallback."
        )
    if cards < n:
        raise DeviceSelectionError(
            f"--device {name} needs {n} P150a cards but only {cards} are present; use --device "
            f"{'p150' if cards == 1 else 'p150x2'} or --device {_emulated_name(n)}"
        )
    if os.environ.get("TT_METAL_MOCK_CLUSTER_DESC_PATH"):
        raise DeviceSelectionError(
            "TT_METAL_MOCK_CLUSTER_DESC_PATH is set (an emulator/mock setting) but real cards were requested; "
            "unset it in a process that opens hardware"
        )
    import ttnn

    if n > 1:
        ttnn.set_fabric_config(ttnn.FabricConfig.FABRIC_1D)
    mesh = ttnn.open_mesh_device(
        ttnn.MeshShape(1, n),
        trace_region_size=trace_region_size,
        l1_small_size=l1_small_size,
        num_command_queues=num_command_queues,
        dispatch_core_config=dispatch_core_config,
    )
    label = f"p150a x{n} (hardware)"

    def _close():
        ttnn.close_mesh_device(mesh)
        if n > 1:
            ttnn.set_fabric_config(ttnn.FabricConfig.DISABLED)

    return MeshContext(ttnn=ttnn, mesh_device=mesh, num_devices=n, is_emulated=False, label=label,
                       device_name=name, _closer=_close)


__all__ = [
    "open_mesh",
    "MeshContext",
    "DeviceSelectionError",
    "resolve_device_name",
    "count_tenstorrent_cards",
    "HARDWARE_DEVICES",
    "EMULATED_DEVICES",
]
