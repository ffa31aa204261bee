"""The GDN prefill chunk keeps T on the tile rows and one head per row (docs/tt_model.md, "GDN prefill layout").

Counted at the "27b-ratios" shapes (27B's per-device GDN heads at TP=2: Cd = 5,120 conv channels, Hk = 8). The
conv output of a prefill chunk is [1, 1, T, Cd] fp32: T rows on the tile rows, no padding when T is a multiple of 32.
It used to be reshaped to the decode form [1, T, 1, Cd], where every row fills a 32-row tile of its own: silu and
the head-split reshape then read 32x the data (168 MB per 256-row chunk and layer at the 27B instead of 5.2 MB).
"""
from __future__ import annotations

import pytest
import torch

from qwen36.probes.decode_cost import build_bench
from qwen36.tiny import PRESETS

ROWS = 64  # > max_unfold_rows(): the prefill (per-tap) conv path
# one GDN mixer prefill chunk of ROWS rows: programs and bytes read per device, upper bounds (measured: 54 programs,
# 50.5 MB; with the decode-form head split 53 and 62.6 MB; with the [1, T, 1, Cd] conv output as well 54 and 145 MB)
MIXER_PREFILL_MAX = 54
MIXER_PREFILL_BYTES_MAX = 50_496_768


@pytest.fixture(scope="module")
def prefill_counts():
    b = build_bench("emulated-p150x2", PRESETS["27b-ratios"], "performance", 64)
    try:
        ttnn, mesh, mixer = b.ttnn, b.mesh, b.model.layers[0].mixer
        assert ROWS > mixer.max_unfold_rows()
        x = ttnn.from_torch(torch.randn(1, 1, ROWS, b.cfg.hidden_size, generator=torch.Generator().manual_seed(0)),
                            dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
        with b.ctx.counters.scope("gdn prefill") as c:
            mixer.forward(x, b.state.layers[0], "prefill")
        yield c, mixer
    finally:
        b.close()


def test_prefill_conv_output_is_not_row_padded(prefill_counts):
    c, mixer = prefill_counts
    # silu reads the conv output once: T x Cd fp32 with T on the tile rows (no 32-row tile per row)
    assert dict(c.bytes_read_per_op["ttnn.silu"]) == {"FLOAT32": ROWS * mixer.cd * 4}
    assert c.per_op["ttnn.silu"] == 1


def test_prefill_qk_norm_reads_one_head_per_row(prefill_counts):
    """The q/k L2 norm reads [T * 2 * Hk, D] fp32 unpadded; the other fp32 norm is the gated RMSNorm of o
    [1, T, Hv, Dv], whose Hv = 24 heads per device fill a 32-row tile (the recurrence's output form)."""
    c, mixer = prefill_counts
    qk = ROWS * 2 * mixer.kd * 4
    o = ROWS * 32 * mixer.dv * 4
    assert mixer.hv == 24 and c.per_op["ttnn.rms_norm"] == 2
    assert c.bytes_read_per_op["ttnn.rms_norm"]["FLOAT32"] == qk + o


def test_prefill_mixer_upper_bounds(prefill_counts):
    c, _ = prefill_counts
    assert c.programs <= MIXER_PREFILL_MAX, f"GDN mixer prefill: {c.programs} > {MIXER_PREFILL_MAX}: {dict(c.programs_per_op)}"
    assert c.bytes_read_total <= MIXER_PREFILL_BYTES_MAX, f"GDN mixer prefill reads {c.bytes_read_total} B"
