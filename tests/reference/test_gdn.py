"""GDN: chunked prefill == recurrent decode (outputs and state); per-row states are the decode states."""
from __future__ import annotations

import torch

from qwen36.reference.gdn import chunk_gated_delta_rule, prepare_qk, recurrent_gated_delta_rule
from qwen36.reference.model import Qwen36Model
from qwen36.tiny import PRESETS

# fp32 chunked (UT transform, triangular solve) vs token loop: different summation order; measured ~1e-6.
ATOL_FP32 = 2e-5


def random_gdn_inputs(b=2, t=100, hk=2, hv=6, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g), hv)
    v = torch.randn(b, hv, t, dv, generator=g)
    decay = -torch.rand(b, hv, t, generator=g) * 0.5
    beta = torch.rand(b, hv, t, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, s0


def test_chunk_equals_recurrent_kernel_level():
    q, k, v, g, beta, s0 = random_gdn_inputs()
    o_r, s_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    for chunk in (16, 64):  # includes a partial last chunk (100 = 64 + 36)
        o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=chunk)
        assert (o_c - o_r).abs().max() <= ATOL_FP32
        assert (s_c - s_r).abs().max() <= ATOL_FP32


def test_chunk_equals_recurrent_in_float64_tightly():
    q, k, v, g, beta, s0 = (x.double() for x in random_gdn_inputs(seed=3))
    o_r, s_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert o_c.dtype == torch.float64
    # same algebra, fp64 arithmetic: agreement to ~1e-12 shows the chunked form is exact, not approximate
    assert (o_c - o_r).abs().max() <= 1e-10
    assert (s_c - s_r).abs().max() <= 1e-10


@torch.no_grad()
def test_model_prefill_chunk_equals_token_by_token_decode(ci_ckpt):
    model = Qwen36Model.from_checkpoint(ci_ckpt)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    s_chunk, s_dec = model.new_state(1, 64), model.new_state(1, 64)
    out_chunk = model(ids, s_chunk, gdn_mode="chunk")
    logits_dec = torch.cat([model(ids[:, i:i + 1], s_dec).logits for i in range(ids.shape[1])], dim=1)
    assert (out_chunk.logits - logits_dec).abs().max() <= 1e-4
    for a, b in zip(s_chunk.gdn_states(), s_dec.gdn_states()):
        assert (a.recurrent - b.recurrent).abs().max() <= ATOL_FP32
        # the window holds the last kernel-1 pre-conv inputs; those come from a 40-row vs 1-row projection
        # matmul, which on CPU may differ in the last bits
        assert (a.conv - b.conv).abs().max() <= 1e-5, "conv window must be the last kernel-1 pre-conv inputs"


@torch.no_grad()
def test_per_token_states_equal_sequential_states(ci_ckpt):
    model = Qwen36Model.from_checkpoint(ci_ckpt)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    base = model.new_state(1, 32)
    model(ids[:, :8], base)
    multi = base.clone()
    out = model(ids[:, 8:], multi, per_token_states=True)
    seq = base.clone()
    for r in range(4):
        model(ids[:, 8 + r:9 + r], seq)
        for li, pt in out.gdn_per_token.items():
            st = seq.layers[li]
            # same per-token recurrence; inputs come from a 4-row vs 1-row matmul (may differ in the last bits)
            assert (pt.recurrent[:, r] - st.recurrent).abs().max() <= 1e-5
            assert (pt.conv[:, r] - st.conv).abs().max() <= 1e-5
    assert PRESETS["ci"].gdn_heads_per_key_head == 3
