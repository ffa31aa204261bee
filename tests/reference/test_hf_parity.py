"""The pure-torch reference equals transformers' Qwen3_5ForCausalLM built from the same config and weights.

Tolerance: max abs logit error <= 1e-5 x the largest |logit| of the step, in fp32 (both implementations compute in
fp32; the residual comes from different GDN chunk orderings and matmul shapes, so it scales with the logits). Measured
on seeds 0-4 of ci and ci-tied (prompt and 32 decode steps below): worst 1.9e-6 x max|logit| on ci (logits up to
~4.6, errors up to 8e-6) and 3.3e-6 x on ci-tied (logits up to ~62: the tied head is the N(0, 1) embedding, no
1/sqrt(hidden) scale; errors up to 1.05e-4), so the bound has a 3x margin over the worst seed.
"""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file

from qwen36.reference.model import Qwen36Model

RTOL = 1e-5
PROMPT_LEN = 45
DECODE_STEPS = 32


def hf_model(ckpt):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    raw = json.loads((ckpt / "config.json").read_text())
    text = raw.get("text_config", raw)
    cfg = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "architectures", "torch_dtype")})
    model = Qwen3_5ForCausalLM(cfg).eval()
    sd = {k.replace("model.language_model.", "model."): v for k, v in load_file(ckpt / "model.safetensors").items()
          if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def cache_kwarg(model) -> str:
    """Name under which this transformers' forward takes the running cache: ``cache`` in recent releases (the old name
    still works there, deprecated), ``past_key_values`` before (5.20 on Python 3.10). An unknown keyword lands
    silently in ``**kwargs``, so guessing wrong runs every decode step without the cache."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise AssertionError(f"{type(model).__name__}.forward takes neither cache nor past_key_values: {list(params)}")


@pytest.mark.parametrize("preset,wrapped", [("ci", False), ("ci-tied", True),
                                            pytest.param("27b-ratios", False, marks=pytest.mark.slow)])
@torch.no_grad()
def test_prefill_and_decode_match_transformers(ckpt_factory, preset, wrapped):
    ckpt = ckpt_factory(preset, seed=1, wrapped=wrapped)
    ours = Qwen36Model.from_checkpoint(ckpt)
    ref = hf_model(ckpt)
    cfg = ours.config
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=gen)

    state = ours.new_state(1, PROMPT_LEN + DECODE_STEPS + 1)
    o = ours(prompt, state)
    r = ref(prompt, use_cache=True)
    err, tol = (o.logits - r.logits).abs().max().item(), RTOL * r.logits.abs().max().item()
    assert err <= tol, f"{preset}: prefill max abs logit error {err:.3e} > {tol:.3e}"
    cache = r.past_key_values
    cache_arg = cache_kwarg(ref)
    worst = 0.0
    tok = o.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(DECODE_STEPS):
        o = ours(tok, state)
        r = ref(tok, **{cache_arg: cache}, use_cache=True)
        assert r.past_key_values is cache, f"{preset}: transformers did not continue the cache passed as {cache_arg}="
        assert cache.get_seq_length() == PROMPT_LEN + step + 1
        err, tol = (o.logits - r.logits).abs().max().item(), RTOL * r.logits.abs().max().item()
        worst = max(worst, err)
        assert err <= tol, f"{preset}: decode step {step} max abs logit error {err:.3e} > {tol:.3e}"
        assert torch.equal(o.logits.argmax(-1), r.logits.argmax(-1)), f"{preset}: argmax differs at decode step {step}"
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
    assert state.pos == PROMPT_LEN + DECODE_STEPS
