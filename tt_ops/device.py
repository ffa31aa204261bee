"""The one device entry point: open real P150a cards or the emulated mesh, chosen explicitly.

    from qwen36.tt_ops.device import open_mesh
    with open_mesh("emulated-p150x2", trace_region_size=50_000_000) as ctx:
        ttnn = ctx.ttnn          # the real ttnn module on cards, the emulating namespace here
        mesh = ctx.mesh_device
        ...
        print(ctx.label)         # "emulated-p150x2 (ttnn goldens on CPU)" / "p150a x2 (hardware)"
                                 # / "p150a x2 on ttsim (simulator)"

Device names: ``p150`` / ``p150x2`` / ``p150x4`` (hardware), ``emulated-p150`` / ``emulated-p150x2`` /
``emulated-p150x4`` (emulator). ``device=None`` or ``"auto"`` reads ``MESH_DEVICE`` (P150 / P300 /
P150x4), which names *hardware* only. There is never a fallback from one backend to the other: asking
for hardware on a machine without cards fails fast and names the emulated alternative.

Tenstorrent's simulator (ttsim) is selected the way tt-metal selects it: ``TT_METAL_SIMULATOR`` names the
``libttsim_bh.so`` to load. With it set, the hardware names run the unchanged hardware code path (real ttnn) on
the simulator, and the label says so (``select_backend`` decides, ``backend_label`` words it; nothing else
writes a backend label). ttsim runs slow dispatch only, so ``TT_METAL_SLOW_DISPATCH_MODE=1`` must be set too.

The TT code is written against ttnn ``EXPECTED_TTNN_VERSION``; opening any backend logs a one-line warning when
the installed ttnn differs (cards may carry a source build of tt-metal), and run records carry the version.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from importlib import metadata
from typing import Any

from qwen36.errors import UserError

HARDWARE_DEVICES = {"p150": 1, "p150x2": 2, "p150x4": 4}
EMULATED_DEVICES = {"emulated-p150": 1, "emulated-p150x2": 2, "emulated-p150x4": 4}
MESH_DEVICE_ENV = {"P150": "p150", "P300": "p150x2", "P150X2": "p150x2", "P150X4": "p150x4"}
DEFAULT_TRACE_REGION_SIZE = 0  # same default as ttnn.open_mesh_device; pass a size to trace
DEFAULT_L1_SMALL_SIZE = 0
TT_DEVICE_DIR = pathlib.Path("/dev/tenstorrent")
EXPECTED_TTNN_VERSION = "0.81.1"
SIMULATOR_ENV = "TT_METAL_SIMULATOR"  # tt-metal's own switch: path of libttsim_<arch>.so
SLOW_DISPATCH_ENV = "TT_METAL_SLOW_DISPATCH_MODE"
EMULATED, SIMULATOR, HARDWARE = "emulated", "simulator", "hardware"


class DeviceSelectionError(UserError, RuntimeError):
    """The requested backend is unknown or unavailable (never silently replaced by another)."""


def _emulated_name(n: int) -> str:
    return "emulated-p150" if n == 1 else f"emulated-p150x{n}"


def count_tenstorrent_cards(dev_dir: pathlib.Path | None = None) -> int:
    """Number of Tenstorrent PCIe devices visible (``/dev/tenstorrent/<n>``), without touching ttnn."""
    dev_dir = TT_DEVICE_DIR if dev_dir is None else dev_dir
    if not dev_dir.is_dir():
        return 0
    return sum(1 for p in dev_dir.iterdir() if p.name.isdigit())


def simulator_path() -> pathlib.Path | None:
    """The ttsim library named by ``TT_METAL_SIMULATOR``, or None when the variable is unset/empty."""
    value = os.environ.get(SIMULATOR_ENV, "").strip()
    return pathlib.Path(value).expanduser() if value else None


def select_backend(name: str) -> str:
    """Which backend a (resolved) device name runs on in this process: ``emulated``, ``simulator`` (a hardware
    name with ``TT_METAL_SIMULATOR`` set, the variable tt-metal itself reads) or ``hardware``."""
    if name in EMULATED_DEVICES:
        return EMULATED
    if name not in HARDWARE_DEVICES:
        raise DeviceSelectionError(f"unknown device {name!r}")
    return SIMULATOR if simulator_path() is not None else HARDWARE


def backend_label(name: str, backend: str) -> str:
    """The one place a backend label is worded; callers pass what ``select_backend`` returned."""
    if backend == EMULATED:
        return f"{name} (ttnn goldens on CPU)"
    n = HARDWARE_DEVICES[name]
    if backend == SIMULATOR:
        return f"p150a x{n} on ttsim (simulator)"
    if backend == HARDWARE:
        return f"p150a x{n} (hardware)"
    raise ValueError(f"unknown backend {backend!r}")


def installed_ttnn_version() -> str | None:
    """Version of the installed ttnn distribution (read from its metadata, without importing ttnn), or None."""
    try:
        return metadata.version("ttnn")
    except metadata.PackageNotFoundError:
        return None


def check_ttnn_version(installed: str | None = None) -> str | None:
    """Log one warning line when the installed ttnn is not the version this code is written against."""
    installed = installed_ttnn_version() if installed is None else installed
    if installed != EXPECTED_TTNN_VERSION:
        from loguru import logger

        logger.warning(f"ttnn {installed or 'not installed as a package (source build?)'} is installed; this code "
                       f"is written and tested against ttnn {EXPECTED_TTNN_VERSION}")
    return installed


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
    backend: str = EMULATED  # EMULATED / SIMULATOR / HARDWARE, from select_backend
    ttnn_version: str | None = None
    _closer: Any = None
    _closed: bool = False

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (1, self.num_devices)

    @property
    def is_simulated(self) -> bool:
        return self.backend == SIMULATOR

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
        d = {"backend": self.label, "backend_kind": self.backend, "device": self.device_name,
             "mesh_shape": list(self.mesh_shape), "emulated": self.is_emulated, "ttnn_version": self.ttnn_version}
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
    garbage (docs/emulator_ops.md, "Numerics and tile padding"); ``"exact"`` computes in fp32 on logical shapes, for
    A/B runs.
    ``dispatch_core_config`` (hardware only): passed to ``ttnn.open_mesh_device``; ``None`` lets ttnn pick the
    architecture default.
    """
    name = resolve_device_name(device)
    backend = select_backend(name)
    if backend == EMULATED:
        ctx = _open_emulated(name, trace_region_size, l1_small_size, num_command_queues, alloc_while_trace_live,
                             op_table_policy, numerics)
    else:
        ctx = _open_hardware(name, trace_region_size, l1_small_size, num_command_queues, dispatch_core_config,
                             backend=backend)
    ctx.ttnn_version = check_ttnn_version()
    return ctx


def _open_emulated(name, trace_region_size, l1_small_size, num_command_queues, alloc_policy,
                   op_table_policy="layout", numerics="strict") -> MeshContext:
    from .emulator.mesh import EmulatedMeshDevice
    from .ttnn_env import configure_device_logs

    configure_device_logs(emulated=True)  # before the mocked cluster can open (see ttnn_env)
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
    label = backend_label(name, EMULATED)
    from loguru import logger

    logger.info(f"opened {label}: emulated 1x{n} Blackhole P150a mesh, no hardware, numerics={numerics}")
    return MeshContext(ttnn=mesh.ttnn, mesh_device=mesh, num_devices=n, is_emulated=True, label=label,
                       device_name=name, backend=EMULATED, _closer=mesh.close)


def _check_simulator_setup(name: str) -> pathlib.Path:
    """Fail fast, naming the missing piece, when ``TT_METAL_SIMULATOR`` is set but ttsim cannot start."""
    lib = simulator_path()
    if not lib.is_file():
        raise DeviceSelectionError(f"{SIMULATOR_ENV}={lib} (ttsim selected for --device {name}) is not a file; "
                                   "point it at libttsim_bh.so (docs/cards.md), or unset it to use real cards")
    soc = lib.parent / "soc_descriptor.yaml"
    if not soc.is_file():
        raise DeviceSelectionError(f"ttsim needs {soc} beside {lib.name}: copy tt-metal's "
                                   "tt_metal/soc_descriptors/blackhole_140_arch.yaml there (docs/cards.md)")
    if os.environ.get(SLOW_DISPATCH_ENV, "") in ("", "0"):
        raise DeviceSelectionError(f"ttsim runs slow dispatch only: set {SLOW_DISPATCH_ENV}=1 with {SIMULATOR_ENV}")
    return lib


def _open_hardware(name, trace_region_size, l1_small_size, num_command_queues,
                   dispatch_core_config=None, *, backend: str = HARDWARE) -> MeshContext:
    n = HARDWARE_DEVICES[name]
    if backend == SIMULATOR:
        _check_simulator_setup(name)
        cards = n  # tt-metal's UMD creates the simulated chips; /dev/tenstorrent plays no part
    else:
        cards = count_tenstorrent_cards()
    if cards == 0:
        raise DeviceSelectionError(
            f"--device {name} asks for {n} Tenstorrent P150a card(s) but no cards are present on this machine "
            f"({TT_DEVICE_DIR} does not exist or is empty). To run on the emulated mesh instead, pass "
            f"--device {_emulated_name(n)}, or set {SIMULATOR_ENV} to run on ttsim. There is no automatic fallback."
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
    from .ttnn_env import import_ttnn

    ttnn = import_ttnn(emulated=False)
    if n == 2:
        # one-cable P150a pair: the project's 2-channel descriptor (tt_ops/mesh_graph/p150x2_one_cable.textproto)
        from .mesh_graph import P150X2_ONE_CABLE

        os.environ.setdefault("TT_MESH_GRAPH_DESC_PATH", str(P150X2_ONE_CABLE))
    if n > 1:
        # what vLLM's TT worker sets on a non-Galaxy mesh: FABRIC_1D, reliability STRICT_INIT
        ttnn.set_fabric_config(ttnn.FabricConfig.FABRIC_1D, ttnn.FabricReliabilityMode.STRICT_INIT)
    mesh = ttnn.open_mesh_device(
        ttnn.MeshShape(1, n),
        trace_region_size=trace_region_size,
        l1_small_size=l1_small_size,
        num_command_queues=num_command_queues,
        dispatch_core_config=dispatch_core_config,
    )
    label = backend_label(name, backend)
    from loguru import logger

    logger.info(f"opened {label}: 1x{n} Blackhole P150a mesh through ttnn")

    def _close():
        ttnn.close_mesh_device(mesh)
        if n > 1:
            ttnn.set_fabric_config(ttnn.FabricConfig.DISABLED)

    return MeshContext(ttnn=ttnn, mesh_device=mesh, num_devices=n, is_emulated=False, label=label,
                       device_name=name, backend=backend, _closer=_close)


def ttnn_for_mesh(mesh_device):
    """The ttnn module that drives ``mesh_device``: an emulated mesh carries its own ttnn facade; a mesh that a
    caller opened itself (vllm-tt opens the cards and hands the model the device) is driven by the real module."""
    emulated = getattr(mesh_device, "ttnn", None)
    if emulated is not None:
        return emulated
    import ttnn

    return ttnn


__all__ = [
    "open_mesh",
    "ttnn_for_mesh",
    "MeshContext",
    "DeviceSelectionError",
    "resolve_device_name",
    "count_tenstorrent_cards",
    "select_backend",
    "backend_label",
    "installed_ttnn_version",
    "check_ttnn_version",
    "EXPECTED_TTNN_VERSION",
    "HARDWARE_DEVICES",
    "EMULATED_DEVICES",
]
