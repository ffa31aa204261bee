"""MTP head equals a hand evaluation of its formula (fc over the normed embedding and hidden, one decoder layer, shared norm + LM head); K-step chain drafting feeds back its own token and hidden."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen36.checkpoint import load_checkpoint
from qwen36.reference.model import Qwen36Model


def rms_zc(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def hand_mtp_single_position(r, cfg, tok_next, h):
    """One MTP row at position 0 with an empty cache, written out from the formula (no model code)."""
    g = lambda n: r.get(n)
    eps = cfg.rms_norm_eps
    e = g("embed_tokens.weight")[tok_next]
    u = torch.cat([rms_zc(e, g("mtp.pre_fc_norm_embedding.weight"), eps),
                   rms_zc(h, g("mtp.pre_fc_norm_hidden.weight"), eps)]) @ g("mtp.fc.weight").t()
    p = "mtp.layers.0."
    x = rms_zc(u, g(p + "input_layernorm.weight"), eps)
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qg = (x @ g(p + "self_attn.q_proj.weight").t()).view(hq, 2 * d)
    gate = qg[:, d:].reshape(-1)
    v = (x @ g(p + "self_attn.v_proj.weight").t()).view(hkv, d)
    # single position 0 attending only to itself: softmax weight 1, RoPE at position 0 is the identity
    attn = v.repeat_interleave(hq // hkv, 0).reshape(-1)
    a = (attn * torch.sigmoid(gate)) @ g(p + "self_attn.o_proj.weight").t()
    y = u + a
    m = rms_zc(y, g(p + "post_attention_layernorm.weight"), eps)
    y = y + (F.silu(m @ g(p + "mlp.gate_proj.weight").t()) * (m @ g(p + "mlp.up_proj.weight").t())) @ g(p + "mlp.down_proj.weight").t()
    hid = rms_zc(y, g("mtp.norm.weight"), eps)
    lm = g("lm_head.weight")
    return hid @ lm.t(), hid


@torch.no_grad()
def test_mtp_matches_hand_formula(ci_ckpt):
    reader = load_checkpoint(ci_ckpt, require_mtp=True)
    model = Qwen36Model.from_reader(reader)
    h = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tok = 17
    logits, hid = model.mtp_forward(torch.tensor([[tok]]), h.view(1, 1, -1), 0, model.new_mtp_state(1, 8))
    ref_logits, ref_hid = hand_mtp_single_position(reader, model.config, tok, h)
    assert (hid[0, 0] - ref_hid).abs().max() <= 1e-5
    assert (logits[0, 0] - ref_logits).abs().max() <= 1e-4


@torch.no_grad()
def test_chain_drafting_feeds_back_own_token_and_post_norm_hidden(ci_ckpt):
    model = Qwen36Model.from_checkpoint(ci_ckpt, require_mtp=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    state = model.new_state(1, 32)
    out = model(ids, state)
    x_n = out.logits[:, -1:].argmax(-1)
    next_tokens = torch.cat([ids[:, 1:], x_n], dim=1)  # x_{t+1} for t = 0..n-1
    mtp_state = model.new_mtp_state(1, 32)
    draft = model.mtp_draft(mtp_state, next_tokens, out.hidden, 0, k=3)

    # manual chain: first pass over the verified rows, then feed back (own token, own post-norm hidden)
    ms = model.new_mtp_state(1, 32)
    lg, h = model.mtp_forward(next_tokens, out.hidden, 0, ms)
    d1 = lg[:, -1].argmax(-1)
    lg2, h2 = model.mtp_forward(d1[:, None], h[:, -1:], 10, ms)
    d2 = lg2[:, -1].argmax(-1)
    lg3, _ = model.mtp_forward(d2[:, None], h2[:, -1:], 11, ms)
    d3 = lg3[:, -1].argmax(-1)
    assert draft.tokens.tolist() == [[int(d1), int(d2), int(d3)]]
    assert torch.equal(draft.logits[:, 2], lg3[:, -1])
    assert mtp_state.pos == 10
    # the chain wrote provisional MTP KV rows 10 and 11 (rewritten by the next reseed)
    assert torch.equal(mtp_state.kv.k[:, :, :12], ms.kv.k[:, :, :12])
