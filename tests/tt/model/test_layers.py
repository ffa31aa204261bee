"""TT layers vs the pure-torch reference on the emulated 1x2 mesh, same inputs (per-layer PCC gates).

Gates (models/qwen36/testing/pcc.py): PCC >= 0.9999 with bf16 weights (accuracy preset), >= 0.99 with bf8
weights (performance preset); GDN recurrent state after prefill + decode steps PCC >= 0.999.
"""
from __future__ import annotations

import pytest
import torch

from qwen36.tt.model.model_config import PrecisionSetting
from qwen36.testing.pcc import PCC_GATES, comp_pcc
from qwen36.testing.tt import LayerHarness, make_bf16_checkpoint

PRESET_GATE = {"accuracy": "layer_bf16", "performance": "layer_bf8"}
PROMPT = 40  # two 32-row GDN chunks, one partial: exercises chunk padding
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def mesh():
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        yield ctx


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-ci-bf16"), "ci", seed=0)


def _inputs(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["accuracy", "performance"])
@pytest.mark.parametrize("layer_id", [0, 3], ids=["gdn", "attention"])
def test_mixer_prefill_then_decode(mesh, bf16_ckpt, preset, layer_id):
    h = LayerHarness(bf16_ckpt, mesh, PrecisionSetting.named(preset), layer_id)
    gate = PCC_GATES[PRESET_GATE[preset]]
    exp, got = h.mixer(_inputs(PROMPT, 1), "prefill")
    ok, msg = comp_pcc(exp, got, gate)
    assert ok, f"layer {layer_id} prefill ({preset}): {msg}"
    for step in range(DECODE_STEPS):
        exp, got = h.mixer(_inputs(1, 10 + step), "decode")
        ok, msg = comp_pcc(exp, got, gate)
        assert ok, f"layer {layer_id} decode step {step} ({preset}): {msg}"
    if not h.is_attention:
        for name, (ref, tt) in h.gdn_states().items():
            ok, msg = comp_pcc(ref, tt, PCC_GATES["gdn_state"])
            assert ok, f"GDN {name} state after prefill + {DECODE_STEPS} decode steps ({preset}): {msg}"


@pytest.mark.parametrize("preset", ["accuracy", "performance"])
def test_mlp(mesh, bf16_ckpt, preset):
    h = LayerHarness(bf16_ckpt, mesh, PrecisionSetting.named(preset), 1)
    exp, got = h.mlp(_inputs(PROMPT, 2))
    ok, msg = comp_pcc(exp, got, PCC_GATES[PRESET_GATE[preset]])
    assert ok, f"MLP ({preset}): {msg}"


def test_mlp_bf4_gate_up_fails_the_bf8_gate_on_ci(mesh, bf16_ckpt):
    """Why the performance preset keeps MLP gate/up in bf8: bfloat4_b misses the 0.99 gate here (measured 0.984)."""
    h = LayerHarness(bf16_ckpt, mesh, PrecisionSetting.named("performance-bf4"), 1)
    exp, got = h.mlp(_inputs(PROMPT, 2))
    ok, msg = comp_pcc(exp, got, PCC_GATES["layer_bf8"])
    assert not ok, f"bf4 gate/up now passes the bf8 gate ({msg}): reconsider the performance preset default"


@pytest.mark.parametrize("layer_id", [2, 3], ids=["gdn", "attention"])
def test_decoder_layer_accuracy(mesh, bf16_ckpt, layer_id):
    """Whole pre-norm block (norms + mixer + residual + MLP), prefill then one decode row, bf16 weights."""
    h = LayerHarness(bf16_ckpt, mesh, PrecisionSetting.accuracy(), layer_id)
    for mode, rows, seed in (("prefill", PROMPT, 3), ("decode", 1, 4)):
        exp, got = h.decoder_layer(_inputs(rows, seed), mode)
        ok, msg = comp_pcc(exp, got, PCC_GATES["layer_bf16"])
        assert ok, f"decoder layer {layer_id} {mode}: {msg}"


def test_gdn_multi_row_decode_matches_reference(mesh, bf16_ckpt):
    """The K+1-row verify shape of the GDN layer (the speculative verify builds on it): 4 rows through the recurrent kernel
    and the shift-register conv in one forward, vs the reference's recurrent mode."""
    h = LayerHarness(bf16_ckpt, mesh, PrecisionSetting.accuracy(), 0)
    h.mixer(_inputs(PROMPT, 1), "prefill")
    exp, got = h.mixer(_inputs(4, 5), "decode")
    ok, msg = comp_pcc(exp, got, PCC_GATES["layer_bf16"])
    assert ok, f"4-row decode: {msg}"
    for name, (ref, tt) in h.gdn_states().items():
        ok, msg = comp_pcc(ref, tt, PCC_GATES["gdn_state"])
        assert ok, f"GDN {name} after a 4-row step: {msg}"


def test_gdn_bf16_activations_miss_the_bf16_gate(mesh, bf16_ckpt):
    """Why GDN_ACTIVATION is fp32 in every preset: with bf16 GDN activations the per-head gated norm amplifies the
    rounding and layer 0 misses the 0.9999 gate within 8 decode steps (measured 0.99977 at the 4th step; fp32:
    0.99999 at every step). The fused layer (tt/model/gdn.py: conv summed with fp32 accumulation, silu(z) fused into the
    gate multiply) rounds less than the composite one did, which missed the gate within 3 steps (0.99982)."""
    from qwen36.tt.model.model_config import TensorGroup
    from qwen36.testing.pcc import pcc

    prec = PrecisionSetting.accuracy().with_group(TensorGroup.GDN_ACTIVATION, "bfloat16")
    h = LayerHarness(bf16_ckpt, mesh, prec, 0)
    worst = pcc(*h.mixer(_inputs(PROMPT, 1), "prefill"))
    for step in range(8):
        worst = min(worst, pcc(*h.mixer(_inputs(1, 10 + step), "decode")))
    assert worst < PCC_GATES["layer_bf16"], f"bf16 GDN activations now pass ({worst:.6f}): reconsider the fp32 choice"


@pytest.fixture(scope="module")
def gdn32_ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-ci-gdn32-bf16"), "ci-gdn32", seed=0)


@pytest.mark.parametrize("preset", ["accuracy", "performance"])
def test_fused_gdn_prefill_segments_then_decode(mesh, gdn32_ckpt, preset):
    """The prefill on ttnn's fused GDN ops (tt/model/gdn_prefill.py; GDN heads a tile wide) against the reference,
    in segments that take each of its shapes: 2 rows (fewer than the conv history's 3: the new history keeps old
    rows), 38 rows (padded to 64: masked identity rows), 32 rows (whole tiles); then decode rows on the state it
    left (bf16 conv history converted into the fp32 conv state). Measured (min over segments / decode steps): accuracy
    0.999978 / 0.999979, performance 0.999760 / 0.999722; the composite prefill on the same inputs 0.999965 /
    0.999984 and 0.999769 / 0.999741."""
    h = LayerHarness(gdn32_ckpt, mesh, PrecisionSetting.named(preset), 0)
    assert h.layer.mixer.prefill_path == "fused"
    gate = PCC_GATES[PRESET_GATE[preset]]
    for i, rows in enumerate((2, 38, 32)):
        exp, got = h.mixer(_inputs(rows, 20 + i), "prefill")
        ok, msg = comp_pcc(exp, got, gate)
        assert ok, f"fused prefill segment {i} ({rows} rows, {preset}): {msg}"
    for step in range(DECODE_STEPS):
        exp, got = h.mixer(_inputs(1, 30 + step), "decode")
        ok, msg = comp_pcc(exp, got, gate)
        assert ok, f"decode step {step} after the fused prefill ({preset}): {msg}"
    for name, (ref, tt) in h.gdn_states().items():
        ok, msg = comp_pcc(ref, tt, PCC_GATES["gdn_state"])
        assert ok, f"GDN {name} state after the fused prefill + {DECODE_STEPS} decode steps ({preset}): {msg}"
