"""The gate for bfloat4_b MLP gate/up weights in the performance preset, on weights with the statistics of real
checkpoints rather than i.i.d. Gaussians: heavy-tailed entries (Student-t, 4 degrees of freedom) times log-normal
per-output-channel and per-input-channel scales (trained projections have rows and columns whose norms differ by
several x, and outlier input channels).

bfloat4_b shares one exponent per 16 consecutive values of a tile row; the weights are stored [in, out], so one block
spans 16 output channels, and channels with different scales then share an exponent: the small ones lose their
mantissa. Measured here (emulated, strict numerics): MLP PCC 0.9820 with bf4 gate/up against the 0.99 gate (bf8:
0.99984; a second draw of the same statistics gave 0.9616 / 0.99977), so the performance
preset keeps bf8 and ``performance-bf4`` stays an opt-in preset with that accuracy cost stated.

``performance-bf4`` is the mixed MLP precision of tt_transformers' performance mode: bfloat4_b gate/up (ff1/ff3,
LoFi) and bfloat8_b down (ff2, HiFi2). Its whole-model figure on a checkpoint whose every MLP has these statistics:
prefill logits PCC 0.99884 (bf8: 0.99941) against the 0.98 model gate, which it passes; the per-layer gate is the
one that fails, and it binds (a 64-layer 27B stacks the per-layer error that a 4-layer CI model hides)."""
from __future__ import annotations

import pytest
import torch

from qwen36.tiny import PRESETS, random_weights, write_checkpoint
from qwen36.tt.model.model_config import PrecisionSetting, TensorGroup
from qwen36.numerics import PCC_GATES, comp_pcc
from support.tt import LayerHarness

LAYER = 1  # a CI-config layer; only its MLP is run


def realistic_matrix(shape, gen: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """[out, in]: Student-t(4) entries x log-normal(0, 0.6) row scales x log-normal(0, 0.6) column scales."""
    o, i = shape
    base = _student_t(o, i, gen)
    s_out = torch.exp(0.6 * torch.randn(o, generator=gen))
    s_in = torch.exp(0.6 * torch.randn(i, generator=gen))
    return base * s_out[:, None] * s_in[None, :] * scale


def _student_t(o: int, i: int, gen: torch.Generator, dof: float = 4.0) -> torch.Tensor:
    """Student-t draws from one generator: z / sqrt(chi2_dof / dof), chi2 as a sum of dof squared normals."""
    z = torch.randn(o, i, generator=gen)
    chi2 = (torch.randn(int(dof), o, i, generator=gen) ** 2).sum(0)
    return z / torch.sqrt(chi2 / dof)


def _realistic_checkpoint(out_dir, prefix: str):
    """The CI checkpoint with every MLP matrix whose name contains ``prefix`` redrawn with realistic statistics."""
    cfg = PRESETS["ci"]
    w = random_weights(cfg, 0, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    for name in sorted(w):
        if prefix in name:
            w[name] = realistic_matrix(tuple(w[name].shape), gen).to(torch.bfloat16)
    return write_checkpoint(out_dir, cfg, w)


@pytest.fixture(scope="module")
def realistic_ckpt(tmp_path_factory):
    return _realistic_checkpoint(tmp_path_factory.mktemp("tt-bf4-realistic"), f"layers.{LAYER}.mlp.")


@pytest.fixture(scope="module")
def realistic_model_ckpt(tmp_path_factory):
    """Every decoder layer's MLP with realistic statistics (the whole-model gate)."""
    return _realistic_checkpoint(tmp_path_factory.mktemp("tt-bf4-realistic-model"), ".mlp.")


@pytest.fixture(scope="module")
def mesh():
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        yield ctx


def _mlp_pcc(ckpt, mesh, preset: str):
    h = LayerHarness(ckpt, mesh, PrecisionSetting.named(preset), LAYER)
    x = torch.randn(1, 40, h.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    exp, got = h.mlp(x)
    return comp_pcc(exp, got, PCC_GATES["layer_bf8"])


def test_realistic_weights_pass_the_gate_in_bf8(realistic_ckpt, mesh):
    ok, msg = _mlp_pcc(realistic_ckpt, mesh, "performance")
    assert ok, f"bf8 MLP on realistic weight statistics: {msg}"


def test_realistic_weights_fail_the_gate_in_bf4(realistic_ckpt, mesh):
    """Why the performance preset keeps bf8 gate/up (module doc). If this starts passing, reconsider the default."""
    ok, msg = _mlp_pcc(realistic_ckpt, mesh, "performance-bf4")
    assert not ok, f"bf4 gate/up now passes the gate on realistic weights ({msg}): reconsider the performance preset"
    assert PrecisionSetting.named("performance").dtypes[next(g for g in PrecisionSetting.named("performance").dtypes
                                                              if g.value == "mlp_gate_up")] == "bfloat8_b"


def test_bf4_preset_is_the_mixed_mlp_precision(mesh):
    """bf4 only where tt_transformers' performance mode puts it (gate/up, LoFi); down stays bf8 (HiFi2)."""
    from qwen36.tt.model.model_config import compute_config_matmul

    ttnn = mesh.ttnn
    d = PrecisionSetting.named("performance-bf4").dtypes
    assert d[TensorGroup.MLP_GATE_UP] == "bfloat4_b" and d[TensorGroup.MLP_DOWN] == "bfloat8_b"
    assert compute_config_matmul(ttnn, d[TensorGroup.MLP_GATE_UP]).math_fidelity == ttnn.MathFidelity.LoFi
    assert compute_config_matmul(ttnn, d[TensorGroup.MLP_DOWN]).math_fidelity == ttnn.MathFidelity.HiFi2


@pytest.mark.parametrize("preset", ["performance", "performance-bf4"])
def test_realistic_weights_whole_model_prefill_gate(realistic_model_ckpt, preset):
    """Whole-model prefill logits with realistic statistics in every MLP: both presets pass the 0.98 model gate
    (the layer gate above is the binding one for bf4), and bf4 costs accuracy against bf8 on the same weights."""
    from qwen36.reference.model import Qwen36Model
    from qwen36.tt.runtime.generator import TTGenerator

    ref = Qwen36Model.from_checkpoint(realistic_model_ckpt, dtype=torch.float32)
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(7))
    exp = ref(ids[None], ref.new_state(1, 128)).logits[0]
    gen = TTGenerator.from_checkpoint(realistic_model_ckpt, "emulated-p150x2", precision=preset, max_seq_len=256,
                                      progress=False, block_size=32, prefill_chunk=64)
    try:
        got = gen.teacher_forced_logits(ids)
    finally:
        gen.close()
    ok, msg = comp_pcc(exp, got, PCC_GATES["model_prefill"])
    assert ok, f"{preset} whole model on realistic MLP statistics: {msg}"
