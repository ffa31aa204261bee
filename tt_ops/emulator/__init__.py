"""Emulated Blackhole P150a mesh on ttnn 0.81.1's own golden functions (host-side, no cards).

Entry point: :func:`qwen36.tt_ops.device.open_mesh` with ``device="emulated-p150x2"`` (or -p150 / -p150x4).
See docs/emulator.md.

Modules form a one-way import chain (each imports only modules listed before it; tests/emulator/test_import_chain.py
checks it):

    errors, ttnn_import, counters, signatures, registry   leaves
    tensor                                                EmuTensor + shared helpers (write_inplace, iter_tensors)
    numerics, programs, mappers, op_accounting            card arithmetic rules, program counts, mesh mappers,
                                                          the op modules' argument binding / byte accounting
    goldens                                               golden-backed ops
    trace, ops_*                                          trace capture/replay; op implementations (register
                                                          themselves in ``registry``, loaded by it on first use)
    namespace                                             the emulating ``ttnn`` namespace
    mesh                                                  EmulatedMeshDevice (owns namespace, trace, counters)

The names below are resolved lazily so that importing one module of the package does not import the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EmulatedMeshDevice": "mesh",
    "EmuTensor": "tensor",
    "EmulatorError": "errors",
    "NotEmulatedError": "errors",
    "TraceRuleError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
