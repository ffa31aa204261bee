"""A multi-row GDN step routed by plain data (tt/model/gdn_plan.py), with no speculative-wing object: the layer reads
its GDNRoute, writes only where the route says, and leaves a GDNKept for the commit."""
from __future__ import annotations

import pytest
import torch

from qwen36.tt.model.gdn_plan import GDNRoute, GDNStepPlan
from qwen36.tt.model.model_config import PrecisionSetting
from qwen36.testing.tt import LayerHarness, make_bf16_checkpoint

ROWS = 3  # a K = 2 verify


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from qwen36.tt_ops.device import open_mesh

    ckpt = make_bf16_checkpoint(tmp_path_factory.mktemp("gdn-plan"), "ci", seed=0)
    with open_mesh("emulated-p150x2") as ctx:
        h = LayerHarness(ckpt, ctx, PrecisionSetting.accuracy(), 0)
        h.mixer(torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(1)), "prefill")
        yield h


def _host(h, t):
    return h.ttnn.to_torch(t, mesh_composer=h.ttnn.ConcatMeshToTensor(h.mesh, dim=0)).float()


def test_routed_step_writes_only_where_the_route_says(harness):
    h = harness
    ttnn, st, mixer = h.ttnn, h.state.layers[0], h.layer.mixer
    live_rec, live_conv = _host(h, st.recurrent), _host(h, st.conv)
    scratch = ttnn.clone(st.recurrent)
    plan = GDNStepPlan(1, {id(st): GDNRoute(conv_write=False, initial=scratch, final=scratch)})
    x = torch.randn(1, ROWS, 64, generator=torch.Generator().manual_seed(2))
    out_routed = h.from_device(mixer.forward(h.to_device(x), st, "decode", plan=plan), ROWS)
    # the live state is untouched; the rows' state went to the scratch buffer
    assert torch.equal(_host(h, st.recurrent), live_rec) and torch.equal(_host(h, st.conv), live_conv)
    (kept,) = plan.kept
    assert kept.layer is mixer and kept.state is st
    assert list(kept.window.shape) == [1, 1, mixer.kernel - 1 + ROWS, mixer.cd]
    # the same rows on the live state (no plan): the same output and state bits
    out_live = h.from_device(mixer.forward(h.to_device(x), st, "decode"), ROWS)
    assert torch.equal(out_routed, out_live)
    assert torch.equal(_host(h, scratch), _host(h, st.recurrent))


def test_a_plan_for_another_state_is_refused(harness):
    h = harness
    plan = GDNStepPlan(1, {})
    with pytest.raises(ValueError, match="no route for this GDN layer state"):
        h.layer.mixer.forward(h.to_device(torch.zeros(1, ROWS, 64)), h.state.layers[0], "decode", plan=plan)
