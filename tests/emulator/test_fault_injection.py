"""The emulator's fault-injection hook (``tt_ops/emulator/faults.py``): the Nth executed call of a named op raises
``InjectedDeviceFault``, so the serving tests (tests/tt/serving/test_vllm_faults.py) can fail a device step on purpose."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator.faults import InjectedDeviceFault, clear_fault, inject_fault  # noqa: E402


def test_fault_plan_counts_eager_calls_and_trace_replays():
    """The hook itself: the Nth executed call fails, captures are not counted, replayed steps are."""
    with open_mesh("emulated-p150x2", trace_region_size=100_000) as ctx:
        _check_plan(ctx.mesh_device)


def _check_plan(mesh):
    ttnn = mesh.ttnn
    x = ttnn.from_torch(torch.ones(32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    plan = inject_fault(mesh, "ttnn.add", nth=3)
    ttnn.add(x, x)  # call 1
    tid = ttnn.begin_trace_capture(mesh, cq_id=0)
    y = ttnn.add(x, x)  # captured: not executed, not counted
    ttnn.end_trace_capture(mesh, tid, cq_id=0)
    ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)  # call 2
    with pytest.raises(InjectedDeviceFault, match="ttnn.add call 3"):
        ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)
    ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)  # call 4 runs again
    assert plan.calls == 4 and plan.fired == [("ttnn.add", 3)]
    clear_fault(mesh)
    ttnn.release_trace(mesh, tid)
    del y
