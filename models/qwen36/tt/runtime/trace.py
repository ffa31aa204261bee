"""The one owner of trace capture and replay for TT code (generator decode, the speculative step, tests, probes).

A trace records the device programs of a step function once and replays them without host dispatch. What makes
that correct on cards (and what the emulator enforces, docs/emulator_traces.md):

  * every tensor the step reads or writes across replays is allocated before capture (weights, state, and the
    step's *persistent input buffers*); the host changes inputs between replays only with
    ``copy_host_to_device_tensor`` into those buffers, never inside a capture;
  * the step's outputs are the tensors the capture produced: the same buffers hold each replay's results;
  * the first run of a step is eager (it compiles every program and does real work), the capture comes after;
  * a live trace blocks allocation on the device (a prefill allocates), so traces are released before one.

    step = TracedStep(ttnn, mesh, lambda: model.decode_forward(inputs, state), name="decode")
    out = step.run_eager()           # compile + real step
    step.capture()                   # recorded, not executed
    ...copy_host_to_device_tensor(new inputs)...; out = step.replay()
    step.release()

:class:`StepTraces` holds several named steps under one policy (eager until a warm-up step completed, then capture
once and replay); the speculative backend uses it for its verify and commit halves, one set per draft depth when
the depth changes between steps (``--spec-k auto``: names carry the depth, each captured on first use).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

TRACE_CQ = 0  # the command queue traces are captured and replayed on (single-queue model)


class TracedStep:
    """A device step function ``fn() -> outputs`` over persistent buffers: captured at most once, replayed."""

    def __init__(self, ttnn, mesh_device, fn: Callable[[], Any], *, name: str = "step"):
        self.ttnn, self.mesh, self.fn, self.name = ttnn, mesh_device, fn, name
        self.trace_id = None
        self.outputs: Any = None  # the tensors the capture produced (filled again by every replay)

    @property
    def captured(self) -> bool:
        return self.trace_id is not None

    def run_eager(self):
        """Dispatch the step op by op (compiles programs on first use). Not allowed while this step is captured:
        the eager run would write the same state the replay writes, outside the trace's bookkeeping."""
        if self.captured:
            raise RuntimeError(f"trace '{self.name}' is captured: replay() it, or release() before running eagerly")
        return self.fn()

    def capture(self):
        """Record ``fn`` (run it eagerly once before: capture records programs, it does not compile or execute)."""
        if self.captured:
            raise RuntimeError(f"trace '{self.name}' is already captured; release() it first")
        ttnn = self.ttnn
        tid = ttnn.begin_trace_capture(self.mesh, cq_id=TRACE_CQ)
        try:
            out = self.fn()
        except BaseException:
            ttnn.end_trace_capture(self.mesh, tid, cq_id=TRACE_CQ)
            ttnn.release_trace(self.mesh, tid)
            raise
        ttnn.end_trace_capture(self.mesh, tid, cq_id=TRACE_CQ)
        self.trace_id, self.outputs = tid, out
        return out

    def replay(self, blocking: bool = False):
        """Execute the captured programs; returns the capture's output tensors (now holding this replay's values)."""
        if not self.captured:
            raise RuntimeError(f"trace '{self.name}' was never captured (capture() after an eager run)")
        self.ttnn.execute_trace(self.mesh, self.trace_id, cq_id=TRACE_CQ, blocking=blocking)
        return self.outputs

    def release(self) -> None:
        if self.trace_id is not None:
            self.ttnn.release_trace(self.mesh, self.trace_id)
        self.trace_id, self.outputs = None, None


class StepTraces:
    """Named :class:`TracedStep` s with one policy: eager until ``warmup_steps`` steps completed (the caller marks
    each with :meth:`step_done`), then each name is captured on its next call and replayed from then on.
    ``run(..., traced=False)`` runs eagerly (the untraced reference path)."""

    def __init__(self, ttnn, mesh_device, *, warmup_steps: int = 1):
        self.ttnn, self.mesh, self.warmup_steps = ttnn, mesh_device, warmup_steps
        self.steps: dict[str, TracedStep] = {}
        self.completed = 0  # steps completed since the last release
        self.captures: Counter[str] = Counter()  # captures per name since construction (a replay is not one)

    def run(self, name: str, fn: Callable[[], Any], *, traced: bool = True):
        if not traced or self.completed < self.warmup_steps:
            return fn()
        step = self.steps.get(name)
        if step is None:
            step = self.steps[name] = TracedStep(self.ttnn, self.mesh, fn, name=name)
            step.capture()
            self.captures[name] += 1
        return step.replay()

    def step_done(self) -> None:
        self.completed += 1

    def release(self) -> None:
        for step in self.steps.values():
            step.release()
        self.steps.clear()
        self.completed = 0

    def __len__(self) -> int:
        """Number of captured traces."""
        return len(self.steps)
