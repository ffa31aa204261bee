"""Emulated Blackhole P150a mesh on ttnn 0.81.1's own golden functions (host-side, no cards).

Entry point: :func:`tt_ops.device.open_mesh` with ``device="emulated-p150x2"`` (or -p150 / -p150x4).
See docs/emulator.md.
"""

from .errors import EmulatorError, NotEmulatedError, TraceRuleError
from .mesh import EmulatedMeshDevice
from .tensor import EmuTensor

__all__ = ["EmulatedMeshDevice", "EmuTensor", "EmulatorError", "NotEmulatedError", "TraceRuleError"]
