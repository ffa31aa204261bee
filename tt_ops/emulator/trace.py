"""Trace capture and replay on the emulated mesh.

Cards record the commands issued between ``begin_trace_capture`` and ``end_trace_capture`` and do
*not* execute them; ``execute_trace`` replays the recorded programs against whatever the device
buffers hold at that moment. The emulator does the same:

* During capture every device op is *recorded* (op implementation, arguments, outputs). To give the
  caller output tensors with the right shape/dtype, the op is evaluated once in "dry" mode: all
  in-place writes to existing buffers (``copy``, cache updates, GDN ring writes, ``output_tensor=``)
  are suppressed, so capture never changes device state. Outputs allocated during capture are the
  trace's persistent output buffers; at ``end_trace_capture`` their contents are poisoned (NaN for
  floats, -1 / max for integers) because on cards they hold garbage until the first replay.
* ``execute_trace`` re-runs the recorded steps in order; each step's fresh results are written into the
  recorded output buffers *in place*, so tensors the caller holds from capture see the new values, and
  later steps read them.

Rules enforced (each raises :class:`TraceRuleError` with the reason):

1. ``begin_trace_capture`` needs ``trace_region_size > 0`` at mesh open.
2. No host-to-device writes inside capture: ``from_torch``/``as_tensor``/``to_device`` to the mesh,
   ``copy_host_to_device_tensor``; and no device-to-host reads (``to_torch``/``from_device``).
3. Traced inputs are persistent device buffers: an op input inside capture must be a device tensor; new
   values reach a trace only through ``copy_host_to_device_tensor(host, persistent_buffer)`` between
   replays (shard count, shape, dtype and layout must match the buffer).
4. No device allocation while a trace is live (captured and not released), outside capture. Policy is
   set at open (``alloc_while_trace_live="error"`` default, or ``"warn"`` like tt-metal's warning).
5. A buffer owned by a live trace (allocated during its capture) cannot be deallocated eagerly, and a
   trace whose input buffer was deallocated cannot be replayed.
6. No nested capture, no ``execute_trace`` inside a capture, no replay of a released/unknown trace.
7. (ops_ccl.py) Inside a capture, collectives only in their async form with semaphores created beforehand.
8. Buffers allocated while another trace is live (in particular during the capture of a later trace) may share
   addresses that trace's replay writes: tt-metal marks allocations unsafe from ``end_trace_capture`` until the
   trace is released, and ttnn's tracker (``ttnn/tools/trace_allocation_tracker.py``,
   ``TT_METAL_TRACE_ALLOC_TRACKING=1``) fails a replay while such buffers are still alive. The emulator models the
   consequence: replaying trace A marks every live buffer allocated while A was live as *clobbered by A*; reading
   a clobbered buffer (as an op input, by a replayed step, or with ``to_torch``) raises, and a full rewrite (a
   trace replay's output write-back, ``copy_host_to_device_tensor``) clears the mark. Buffers the caller
   declares corruptible (allocated inside ``ttnn.tools.trace_allocation_tracker.corruptible_allocation_scope``)
   are not tracked, as in ttnn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from typing import Any, Callable

import torch

from .counters import Counts
from .errors import TraceRuleError
from .faults import check_fault
from .tensor import EmuTensor, iter_tensors


@dataclasses.dataclass
class TraceStep:
    op_name: str
    impl: Callable
    args: tuple
    kwargs: dict
    outputs: Any
    account: Callable | None = None  # fn(outputs) -> (read, written, collective_bytes, programs, collectives), per replay
    # the capture's accounting, for ops whose counts depend on argument shapes and layouts only (no byte callback
    # reading tensor values, e.g. positions): the same at every replay, so it is summed once per trace (static_counts)
    static: tuple | None = None
    inputs: list | None = None  # the step's input tensors (its arguments are fixed at capture), listed at first replay


@dataclasses.dataclass
class Trace:
    trace_id: int
    cq_id: int
    steps: list = dataclasses.field(default_factory=list)
    counts: Counts = dataclasses.field(default_factory=lambda: Counts("trace"))
    owned: list = dataclasses.field(default_factory=list)  # tensors allocated during capture
    # buffers allocated while this trace was live (outside corruptible scopes): its replay may overwrite them
    unsafe: "weakref.WeakSet" = dataclasses.field(default_factory=weakref.WeakSet)
    complete: bool = False
    released: bool = False
    static_counts: Counts | None = None  # the sum of the steps' ``static`` accounting, built at the first replay


class EmuTraceId:
    """Stand-in for ``ttnn.MeshTraceId``."""

    def __init__(self, value: int):
        self.value = value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"EmuTraceId({self.value})"

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return isinstance(other, EmuTraceId) and other.value == self.value


class TraceState:
    def __init__(self, mesh):
        self.mesh = mesh
        self.traces: dict[int, Trace] = {}
        self.capturing: Trace | None = None
        self.replaying = False
        self.dry = False
        self._next = 0
        self.clobbered: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tensor -> trace id
        self._corruptible_depth = 0

    # ---- queries -------------------------------------------------------------------------------
    def live_trace_ids(self) -> list[int]:
        return [t.trace_id for t in self.traces.values() if t.complete and not t.released]

    def _get(self, trace_id, what: str) -> Trace:
        key = int(trace_id) if isinstance(trace_id, EmuTraceId) else trace_id
        if not isinstance(key, int) or key not in self.traces:
            raise TraceRuleError(f"{what}: unknown trace id {trace_id!r} on {self.mesh.label_short}")
        return self.traces[key]

    # ---- cross-trace allocation tracking (rule 8) ---------------------------------------------------------
    def note_allocation(self, t) -> None:
        if self._corruptible_depth:
            return
        for tr in self.traces.values():
            if tr.complete and not tr.released and tr is not self.capturing:
                tr.unsafe.add(t)

    def in_corruptible_scope(self) -> bool:
        return self._corruptible_depth > 0

    @contextlib.contextmanager
    def corruptible_scope(self):
        self._corruptible_depth += 1
        try:
            yield
        finally:
            self._corruptible_depth -= 1

    def note_full_write(self, t) -> None:
        self.clobbered.pop(t, None)

    def check_read(self, t, what: str) -> None:
        tid = self.clobbered.get(t)
        if tid is not None:
            raise TraceRuleError(
                f"{what} reads a buffer ({t.logical_shape_list}, {t.dtype.name}) allocated while trace {tid} was live, "
                f"after trace {tid} replayed: on cards that replay may have overwritten it (tt-metal marks allocations "
                "unsafe while a trace is live; ttnn's trace allocation tracker, TT_METAL_TRACE_ALLOC_TRACKING=1, fails "
                "the replay while such a buffer is alive). Allocate it before the first capture, rewrite it before "
                "reading, release that trace first, or allocate it inside "
                "ttnn.tools.trace_allocation_tracker.corruptible_allocation_scope(mesh) if it is meant to be scratch."
            )

    def forbid_in_capture(self, what: str) -> None:
        if self.capturing is not None:
            raise TraceRuleError(
                f"{what} inside trace capture (trace {self.capturing.trace_id}): on cards a trace records device "
                "commands only; host<->device transfers cannot be captured. Write inputs with "
                "ttnn.copy_host_to_device_tensor into persistent device buffers *before* execute_trace, and read "
                "outputs with ttnn.to_torch *after* it."
            )

    # ---- API -----------------------------------------------------------------------------------
    def begin(self, cq_id: int = 0) -> EmuTraceId:
        self.mesh.check_open()
        if self.mesh.trace_region_size <= 0:
            raise TraceRuleError(
                "begin_trace_capture: the mesh was opened with trace_region_size=0; cards need a reserved trace "
                "region (open_mesh(..., trace_region_size=<bytes>), e.g. 50_000_000)"
            )
        if self.capturing is not None:
            raise TraceRuleError(f"begin_trace_capture: trace {self.capturing.trace_id} is still being captured")
        tid = self._next
        self._next += 1
        tr = Trace(trace_id=tid, cq_id=int(cq_id or 0))
        self.traces[tid] = tr
        self.capturing = tr
        return EmuTraceId(tid)

    def end(self, trace_id, cq_id: int = 0) -> None:
        tr = self._get(trace_id, "end_trace_capture")
        if self.capturing is not tr:
            raise TraceRuleError(f"end_trace_capture: trace {tr.trace_id} is not being captured")
        self.capturing = None
        tr.complete = True
        for t in tr.owned:
            _poison(t)

    def execute(self, trace_id, cq_id: int = 0, blocking: bool = True) -> None:
        self.mesh.check_open()
        if self.capturing is not None:
            raise TraceRuleError("execute_trace inside a trace capture is not allowed")
        tr = self._get(trace_id, "execute_trace")
        if tr.released:
            raise TraceRuleError(f"execute_trace: trace {tr.trace_id} was released")
        if not tr.complete:
            raise TraceRuleError(f"execute_trace: trace {tr.trace_id} capture was never ended")
        for t in list(tr.unsafe):
            if not getattr(t, "_deallocated", False):
                self.clobbered[t] = tr.trace_id
        self.replaying = True
        counts = Counts(f"trace {tr.trace_id}")
        if tr.static_counts is None:
            tr.static_counts = Counts(f"trace {tr.trace_id} (static)")
            for step in tr.steps:
                if step.static is not None:
                    tr.static_counts.add_op(step.op_name, *step.static)
        try:
            clobbered = self.clobbered
            for step in tr.steps:
                if step.inputs is None:
                    step.inputs = iter_tensors((step.args, step.kwargs))
                _check_inputs_alive(step, tr)
                if clobbered:
                    for t in step.inputs:
                        self.check_read(t, f"replay of trace {tr.trace_id} ({step.op_name})")
                check_fault(self.mesh, step.op_name)  # tests: an op failing inside a replayed trace
                fresh = step.impl(*step.args, **step.kwargs)
                _write_back(step.outputs, fresh, step.op_name)
                if step.account is not None and step.static is None:
                    read, written, cb, n, nc, work = step.account(step.outputs)
                    counts.add_op(step.op_name, read, written, cb, n, nc, work)
        finally:
            self.replaying = False
        counts.add(tr.static_counts)
        self.mesh.counters.record_replay(counts)

    def release(self, trace_id) -> None:
        tr = self._get(trace_id, "release_trace")
        if tr.released:
            raise TraceRuleError(f"release_trace: trace {tr.trace_id} already released")
        if self.capturing is tr:
            raise TraceRuleError("release_trace: the trace is still being captured")
        tr.released = True
        tr.steps.clear()
        # the trace no longer keeps its capture's buffers: those the caller dropped are collected, which frees their
        # DRAM / L1 in the mesh's accounting as a ttnn.Tensor's destructor does
        tr.owned.clear()

    def unreferenced_owned(self) -> list:
        """Buffers allocated during the capture of a live (or capturing) trace that nothing but the trace's own
        records holds any more. On cards such a buffer was freed when the caller dropped its tensor (its address
        reused, the replay writing into it regardless); the emulator keeps the tensor for replay, so the mesh's
        accounting frees these before it refuses an allocation. Counted by reference: a buffer anything else
        references (the caller, a view, an emulator record) counts as held."""
        dead = []
        for tr in self.traces.values():
            if tr.released:
                continue
            held: dict = {}  # id(tensor) -> references from the trace's records (steps, the owned list)
            seen: set = set()

            def walk(o):
                if isinstance(o, EmuTensor):
                    held[id(o)] = held.get(id(o), 0) + 1
                elif isinstance(o, (list, tuple, dict)) and id(o) not in seen:
                    seen.add(id(o))
                    for x in (o.values() if isinstance(o, dict) else o):
                        walk(x)

            for step in tr.steps:
                walk(step.args)
                walk(step.kwargs)
                walk(step.outputs)  # a bare tensor here is the step's own attribute reference
                if step.inputs is not None:
                    walk(step.inputs)  # the replay's list of the step's input tensors
            walk(tr.owned)
            for t in tr.owned:
                # getrefcount: its argument and the loop variable hold two references
                if sys.getrefcount(t) - 2 - held.get(id(t), 0) <= 0:
                    dead.append(t)
        return dead

    def owner_live(self, t) -> bool:
        owner = getattr(t, "trace_owner", None)
        if owner is None or owner not in self.traces:
            return False
        tr = self.traces[owner]
        return not tr.released


def _check_inputs_alive(step: TraceStep, tr: Trace) -> None:
    for t in step.inputs:
        if t._freed:
            raise TraceRuleError(
                f"execute_trace: trace {tr.trace_id} reads a buffer ({t.logical_shape_list}, op {step.op_name}) that "
                "was deallocated after capture; on cards the replay would read freed memory"
            )


def _write_back(recorded, fresh, op_name: str) -> None:
    if recorded is None:
        return
    if isinstance(recorded, EmuTensor):
        if fresh is recorded:
            return
        if not isinstance(fresh, EmuTensor):
            raise TraceRuleError(f"replay of {op_name}: output structure changed")
        if fresh.logical_shape_list != recorded.logical_shape_list:
            raise TraceRuleError(
                f"replay of {op_name}: output shape {fresh.logical_shape_list} != captured "
                f"{recorded.logical_shape_list} (the trace's buffers are fixed at capture)"
            )
        recorded.set_shards(list(fresh._shards))
        if recorded.mesh is not None:
            recorded.mesh.trace.note_full_write(recorded)
        return
    if isinstance(recorded, (list, tuple)):
        for r, f in zip(recorded, fresh):
            _write_back(r, f, op_name)


def _poison(t) -> None:
    if getattr(t, "_freed", False):
        return
    new = []
    for s in t._shards:
        if s.is_floating_point():
            new.append(torch.full_like(s, float("nan")))
        else:
            new.append(torch.full_like(s, -1 if s.dtype != torch.uint8 else 255))
    t._shards = new
