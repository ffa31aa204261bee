"""The GDN prefill chunk keeps T on the tile rows (docs/tt_model.md, "GDN prefill layout").

Counted at the "27b-ratios" shapes (27B's per-device GDN heads at TP=2: Cd = 5,120 conv channels, Hk = 8, Hv = 24).
Their prefill runs ttnn's fused GDN ops (tt/model/gdn_prefill.py): q/k/v, g, beta and o keep the chunk's rows on the
tile rows and one head never fills a tile of its own. Before them the chunk took 54 programs and read 50.5 MB per
device (21 of its slices at row offsets that are not tile-aligned). The composite form of the same rows (configs
whose GDN heads are narrower than a tile, and a verify of more than 8 rows) is pinned below it.
"""
from __future__ import annotations

import pytest
import torch

from qwen36.probes.decode_cost import build_bench
from qwen36.tiny import PRESETS

ROWS = 64  # two 32-row tiles
PADDED_ROWS = 40  # a chunk that is not a tile multiple: zero rows up to 64
# one GDN mixer prefill chunk of ROWS rows: programs and bytes read per device (measured: 18 programs, 14.00 MB)
MIXER_PREFILL_MAX = 18
MIXER_PREFILL_BYTES_MAX = 13_997_056
FUSED_OPS = ("ttnn.experimental.kda.qkv_causal_conv1d_silu", "ttnn.transformer.chunk_gated_delta_rule",
             "ttnn.experimental.kda.sigmoid_gated_rms_norm")


@pytest.fixture(scope="module")
def bench():
    b = build_bench("emulated-p150x2", PRESETS["27b-ratios"], "performance", 64)
    yield b
    b.close()


def _prefill(bench, rows: int, name: str):
    ttnn, mesh, mixer = bench.ttnn, bench.mesh, bench.model.layers[0].mixer
    x = ttnn.from_torch(torch.randn(1, 1, rows, bench.cfg.hidden_size, generator=torch.Generator().manual_seed(0)),
                        dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    with bench.ctx.counters.scope(name) as c:
        mixer.forward(x, bench.state.layers[0], "prefill")
    return c, mixer


@pytest.fixture(scope="module")
def fused(bench):
    return _prefill(bench, ROWS, "gdn fused prefill")


def test_prefill_runs_the_fused_ops_once(fused):
    c, mixer = fused
    assert mixer.prefill_path == "fused"
    for op in FUSED_OPS:
        assert c.per_op[op] == 1 and c.programs_per_op[op] == 1, (op, dict(c.programs_per_op))
    for op in ("ttnn.rms_norm", "ttnn.silu", "ttnn.addcmul", "ttnn.transformer.fused_recurrent_gated_delta_rule"):
        assert op not in c.per_op, f"{op} left in the fused prefill: {dict(c.per_op)}"


def test_prefill_rows_stay_on_the_tile_rows(fused):
    """The recurrence reads q/k/v flat [T, width] bf16 with no head padded to a tile (each value head its key
    head's q/k rows and its v rows: 3 x Hv x T x Dv), and the gated norm reads o as [Hv, T, Dv] fp32 (its rows on
    the tile rows) and the gate [T, Vd] bf16, once."""
    c, mixer = fused
    chunk = c.bytes_read_per_op["ttnn.transformer.chunk_gated_delta_rule"]
    assert chunk["BFLOAT16"] == 3 * mixer.hv * ROWS * mixer.dv * 2
    norm = c.bytes_read_per_op["ttnn.experimental.kda.sigmoid_gated_rms_norm"]
    assert norm["FLOAT32"] == ROWS * mixer.vd * 4
    assert norm["BFLOAT16"] == ROWS * mixer.vd * 2 + 32 * mixer.dv * 2  # the gate, and the [Dv] weight's tile


def test_prefill_mixer_upper_bounds(fused):
    c, _ = fused
    assert c.programs <= MIXER_PREFILL_MAX, \
        f"GDN mixer prefill: {c.programs} > {MIXER_PREFILL_MAX}: {dict(c.programs_per_op)}"
    assert c.bytes_read_total <= MIXER_PREFILL_BYTES_MAX, f"GDN mixer prefill reads {c.bytes_read_total} B"


def test_padded_chunk_costs_pad_masks_and_one_slice(bench):
    """A chunk of 40 rows runs as 64: one pad of x, the g/beta row masks, and the slice of the out-projection's
    input back to 40 rows (not tile-aligned: untilize + slice + tilize)."""
    c, _ = _prefill(bench, PADDED_ROWS, "gdn fused prefill, padded")
    assert c.programs == MIXER_PREFILL_MAX + 1 + 2 + 3, dict(c.programs_per_op)
    assert c.per_op["ttnn.pad"] == 1 and c.per_op["ttnn.multiply"] == 4


def test_composite_prefill_conv_output_is_not_row_padded(bench):
    """The composite form (the prefill of configs whose GDN heads are narrower than a tile; the per-tap conv and
    head split of a verify of more than 8 rows): the conv output stays [1, 1, T, Cd] fp32, silu reads it once,
    and the q/k L2 norm reads [T * 2 * Hk, D] unpadded (the gated norm reads o [1, T, Hv, Dv]: 24 heads fill a
    32-row tile)."""
    mixer = bench.model.layers[0].mixer
    fused_prefill, mixer.fused_prefill = mixer.fused_prefill, None
    try:
        c, _ = _prefill(bench, ROWS, "gdn composite prefill")
    finally:
        mixer.fused_prefill = fused_prefill
    assert dict(c.bytes_read_per_op["ttnn.silu"]) == {"FLOAT32": ROWS * mixer.cd * 4}
    assert mixer.hv == 24 and c.per_op["ttnn.rms_norm"] == 2
    assert c.bytes_read_per_op["ttnn.rms_norm"]["FLOAT32"] == ROWS * 2 * mixer.kd * 4 + ROWS * 32 * mixer.dv * 4
    assert c.programs <= 54 and c.bytes_read_total <= 50_496_768
