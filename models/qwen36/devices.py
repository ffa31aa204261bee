"""The names ``--device`` accepts, in one place for the command line and the probes. ``reference`` is the pure-torch
model (CPU, or CUDA with ``reference-cuda``); the others run the TTNN model through tt_ops.device, on the emulated
mesh (``emulated-*``) or on P150a cards. There is no fallback between them: an unavailable backend is an error."""
from __future__ import annotations

from .errors import UserError

REFERENCE_DEVICES = ("reference", "reference-cuda")
TT_DEVICES = ("emulated-p150", "emulated-p150x2", "emulated-p150x4", "p150", "p150x2", "p150x4")


def check_device(name: str) -> str:
    if name not in REFERENCE_DEVICES + TT_DEVICES:
        raise UserError(f"unknown --device {name!r}; choose from {', '.join(REFERENCE_DEVICES + TT_DEVICES)}")
    return name
