"""One PCC helper (tt-metal ``comp_pcc`` style) and the one table of accuracy gates used by the TT tests.

    ok, msg = comp_pcc(expected, actual, PCC_GATES["layer_bf16"])
    assert ok, msg
"""
from __future__ import annotations

import torch

from ..numerics import pcc  # the one PCC implementation (re-exported here for the TT tests)

# Gate name -> minimum PCC; every TT test reads its threshold from here.
PCC_GATES: dict[str, float] = {
    "layer_bf16": 0.9999,  # one decoder block / mixer / MLP, bf16 weights (accuracy preset), vs fp32 reference
    "layer_bf8": 0.99,  # same with bfloat8_b projections (bfloat4_b MLP gate/up): performance preset
    "gdn_state": 0.999,  # GDN recurrent state after prefill + decode steps
    "model_prefill": 0.98,  # full-model prefill logits on the CI checkpoint
    "model_decode_bf16": 0.999,  # full-model logits at every decode step, accuracy preset (measured min 0.9996)
    "model_decode_bf8": 0.98,  # full-model logits at every decode step, performance preset
}


def comp_pcc(expected: torch.Tensor, actual: torch.Tensor, threshold: float) -> tuple[bool, str]:
    p = pcc(expected, actual)
    diff = (expected.double() - actual.double()).abs()
    rel = float((expected.double() - actual.double()).norm() / expected.double().norm().clamp_min(1e-30))
    msg = f"PCC {p:.6f} (gate {threshold}), max abs {float(diff.max()):.3e}, rel L2 {rel:.3e}"
    return (p == p and p >= threshold), msg
