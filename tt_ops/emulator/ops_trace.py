"""Trace API of the emulating namespace (see trace.py for semantics and rules)."""

from __future__ import annotations

from .errors import EmulatorError
from .registry import host_fn


def _check_mesh(mesh, mesh_device, what):
    if mesh_device is not mesh:
        raise EmulatorError(f"{what}: mesh_device must be the emulated mesh of this namespace")


@host_fn("ttnn.begin_trace_capture")
def begin_trace_capture(mesh, mesh_device, *, cq_id=None):
    _check_mesh(mesh, mesh_device, "begin_trace_capture")
    return mesh.trace.begin(cq_id or 0)


@host_fn("ttnn.end_trace_capture")
def end_trace_capture(mesh, mesh_device, trace_id, *, cq_id=None):
    _check_mesh(mesh, mesh_device, "end_trace_capture")
    mesh.trace.end(trace_id, cq_id or 0)


@host_fn("ttnn.execute_trace")
def execute_trace(mesh, mesh_device, trace_id, *, cq_id=None, blocking=True):
    _check_mesh(mesh, mesh_device, "execute_trace")
    mesh.trace.execute(trace_id, cq_id or 0, blocking)


@host_fn("ttnn.tools.trace_allocation_tracker.corruptible_allocation_scope", validate=False)
def corruptible_allocation_scope(mesh, mesh_device):
    """Allocations in this scope are declared corruptible by trace replays and not tracked (ttnn's API)."""
    _check_mesh(mesh, mesh_device, "corruptible_allocation_scope")
    return mesh.trace.corruptible_scope()


@host_fn("ttnn.release_trace")
def release_trace(mesh, mesh_device, trace_id):
    _check_mesh(mesh, mesh_device, "release_trace")
    mesh.trace.release(trace_id)
