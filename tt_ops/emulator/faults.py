"""Fault injection for tests of what the code above the device does when an op fails mid-step.

``inject_fault(mesh, "ttnn.matmul", nth=3)`` makes the 3rd executed call of that op on ``mesh`` (counted from the
injection, eager calls and replayed trace steps alike; trace captures execute nothing and are not counted) raise
:class:`InjectedDeviceFault` instead of running. On cards an op fails as a ``RuntimeError`` from tt-metal (a
``TT_FATAL``/``TT_THROW`` on the host, or a dispatch timeout when a kernel hangs), so the injected error is one too.
Ops earlier in the same step have run and written their outputs (in-place state updates included), as on cards."""
from __future__ import annotations


class InjectedDeviceFault(RuntimeError):
    """The failure :func:`inject_fault` asked for."""


class FaultPlan:
    """Which op fails at which call; ``fired`` records the failures raised (op name, call number)."""

    def __init__(self, op_name: str, nth: int, message: str):
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        self.op_name, self.nth, self.message = op_name, nth, message
        self.calls = 0
        self.fired: list[tuple[str, int]] = []

    def check(self, op_name: str) -> None:
        if op_name != self.op_name:
            return
        self.calls += 1
        if self.calls == self.nth:
            self.fired.append((op_name, self.calls))
            raise InjectedDeviceFault(f"{op_name} call {self.calls}: {self.message}")


def inject_fault(mesh, op_name: str, nth: int = 1, message: str = "injected device fault") -> FaultPlan:
    """Arm one fault on ``mesh`` (replacing any armed one); :func:`clear_fault` disarms it."""
    plan = FaultPlan(op_name, nth, message)
    mesh.fault_plan = plan
    return plan


def clear_fault(mesh) -> None:
    mesh.fault_plan = None


def check_fault(mesh, op_name: str) -> None:
    """Called by the dispatcher before an op executes (eager call or trace replay step)."""
    plan = getattr(mesh, "fault_plan", None)
    if plan is not None:
        plan.check(op_name)
