"""Programs per GDN layer on the emulated mesh, pinned as upper bounds (docs/tt_model.md, "Programs per step").

Counted at the "27b-ratios" shapes (27B head counts and head dims 128 per device at TP=2, so tile alignment is
that of 27B; hidden 256 keeps it cheap). Before the fused layer the GDN mixer was 58 programs per 1-row decode
(15 slices, most of them not tile-aligned: untilize + slice + tilize each) and the whole decoder layer 69.
"""
from __future__ import annotations

import pytest
import torch

from qwen36.probes.decode_cost import build_bench
from qwen36.tiny import PRESETS

# The async all-reduce counts 2 programs (reduce-scatter + all-gather, as on cards)
MIXER_DECODE_MAX = 27  # 1-row decode, GDN mixer only (in-place state update)
LAYER_DECODE_MAX = 38  # the decoder layer: mixer + 2 norms + 2 residual adds + MLP (its x written in L1 by the norm)
MIXER_MULTI_ROW_MAX = 29  # a 4-row decode (the K=3 verify shape) with the state copied back


@pytest.fixture(scope="module")
def bench():
    b = build_bench("emulated-p150x2", PRESETS["27b-ratios"], "performance", 64)
    yield b
    b.close()


def _mixer_counts(bench, rows: int, name: str):
    ttnn, mesh = bench.ttnn, bench.mesh
    layer = bench.model.layers[0]
    x = ttnn.from_torch(torch.randn(1, 1, rows, bench.cfg.hidden_size), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                        device=mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    with bench.ctx.counters.scope(name) as c:
        layer.mixer.forward(x, bench.state.layers[0], "decode")
    return c


def test_gdn_decode_programs_upper_bound(bench):
    c = _mixer_counts(bench, 1, "gdn mixer decode")
    ops = dict(c.programs_per_op)
    assert c.programs <= MIXER_DECODE_MAX, f"GDN mixer decode: {c.programs} programs > {MIXER_DECODE_MAX}: {ops}"
    # no op pays the untilize/tilize of an unaligned tiled slice or concat, and the state is not copied
    calls = dict(c.per_op)
    for op in ("ttnn.slice", "ttnn.concat"):
        assert ops.get(op, 0) == calls.get(op, 0), f"{op}: {ops.get(op)} programs for {calls.get(op)} calls"
    assert "ttnn.copy" not in ops, f"1-row decode copies the recurrent state: {ops}"


def test_gdn_decoder_layer_programs_upper_bound(bench):
    from qwen36.tt.model.state import allocate_decode_inputs

    model, ttnn = bench.model, bench.ttnn
    inputs = allocate_decode_inputs(ttnn, bench.mesh)
    model.copy_host_to_device(model.prepare_decode_inputs_host([1], 10), inputs)
    bench.regions.clear()
    model.decode_forward(inputs, bench.state)
    layer = bench.regions["layer0"]
    assert layer.programs <= LAYER_DECODE_MAX, f"GDN decoder layer: {layer.programs} > {LAYER_DECODE_MAX}"
    # the only reshard left in the layer is the MLP's down output going back to DRAM for the all-reduce: the
    # post-attention norm writes the MLP's L1 width shards itself
    assert dict(layer.per_op).get("ttnn.to_memory_config") == 1, dict(layer.per_op)


def test_gdn_multi_row_programs_upper_bound(bench):
    c = _mixer_counts(bench, 4, "gdn mixer 4 rows")
    assert c.programs <= MIXER_MULTI_ROW_MAX, \
        f"GDN mixer 4-row decode: {c.programs} > {MIXER_MULTI_ROW_MAX}: {dict(c.programs_per_op)}"
