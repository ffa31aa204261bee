"""The MoE sibling (qwen3_5_moe) on the pure-torch reference: config parsing, both expert weight layouts,
parity with transformers' Qwen3_5MoeForCausalLM, verify-shaped rows, and lossless speculation on moe-ci.

Tolerance: max abs logit error <= 1e-4 in fp32, as for the dense model.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qwen36.checkpoint import CheckpointError, load_checkpoint
from qwen36.config import ConfigError, Qwen36Config
from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model
from qwen36.tiny import PRESETS

ATOL = 1e-4
PROMPT_LEN = 45
DECODE_STEPS = 16


def _real_35b_a3b_text() -> dict:
    return {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "full_attention_interval": 4,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001, "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 24], "mrope_interleaved": True}}


def test_moe_config_nested_and_text_only_agree_with_transformers():
    from transformers import Qwen3_5MoeTextConfig

    text = _real_35b_a3b_text()
    nested = Qwen36Config.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False})
    flat = Qwen36Config.from_dict({"model_type": "qwen3_5_moe_text", **text})
    assert nested == flat
    assert flat.is_moe and flat.num_experts == 256 and flat.num_experts_per_tok == 8
    assert flat.moe_intermediate_size == 512 and flat.shared_expert_intermediate_size == 512
    assert flat.gdn_layer_ids == [i for i in range(40) if i % 4 != 3] and len(flat.attention_layer_ids) == 10
    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in flat.to_hf_dict().items()
                                  if k not in ("model_type", "architectures", "torch_dtype")})
    assert list(hf.layer_types) == list(flat.layer_types)
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "vocab_size", "hidden_size"):
        assert getattr(hf, k) == getattr(flat, k), k
    assert Qwen36Config.from_dict(flat.to_hf_dict()) == flat
    # defaults of transformers' Qwen3_5MoeTextConfig are the 35B-A3B ones
    d = Qwen3_5MoeTextConfig()
    assert (d.hidden_size, d.num_hidden_layers, d.num_experts, d.num_experts_per_tok, d.vocab_size) == \
        (2048, 40, 256, 8, 248320)


@pytest.mark.parametrize("patch,field", [
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_moe_config_errors_name_the_field(patch, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        Qwen36Config.from_dict({"model_type": "qwen3_5_moe_text", **_real_35b_a3b_text(), **patch})


def test_dense_config_with_expert_fields_is_refused():
    raw = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4}
    with pytest.raises(ConfigError, match="'num_experts'"):
        Qwen36Config.from_dict(raw)


@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_checkpoint_layouts_load_to_identical_weights(ckpt_factory, layout):
    ckpt = ckpt_factory("moe-ci", seed=3, expert_layout=layout)
    keys = load_file(ckpt / "model.safetensors").keys()
    if layout == "per-expert":
        assert "model.layers.0.mlp.experts.7.up_proj.weight" in keys and "mtp.layers.0.mlp.experts.0.gate_proj.weight" in keys
        assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    else:
        assert "model.layers.0.mlp.experts.gate_up_proj" in keys and "mtp.layers.0.mlp.experts.down_proj" in keys
    reader = load_checkpoint(ckpt, require_mtp=True)
    cfg = reader.config
    assert reader.shape_of("layers.1.mlp.experts.gate_up_proj") == (8, 64, cfg.hidden_size)
    assert reader.shape_of("mtp.layers.0.mlp.experts.down_proj") == (8, cfg.hidden_size, 32)
    ref = Qwen36Model.from_checkpoint(ckpt_factory("moe-ci", seed=3, expert_layout="stacked"))
    got = Qwen36Model.from_checkpoint(ckpt)
    for (n, a), (m, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_per_expert_checkpoint_problems_named(ckpt_factory, tmp_path):
    import shutil
    from safetensors.torch import save_file

    src = ckpt_factory("moe-ci", seed=3, expert_layout="per-expert")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.2.mlp.experts.5.up_proj.weight"]
    sd["model.layers.0.mlp.experts.9.down_proj.weight"] = torch.zeros(64, 32)
    sd["model.layers.1.mlp.shared_expert_gate.weight"] = torch.zeros(2, 64)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "layers.2.mlp.experts.5.up_proj.weight" in msg and "missing" in msg
    assert "layers.0.mlp.experts.9.down_proj.weight" in msg and "unexpected" in msg
    assert "tensor 'layers.1.mlp.shared_expert_gate.weight' has shape [2, 64], expected [1, 64]" in msg


def hf_moe_model(ckpt):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    raw = json.loads((ckpt / "config.json").read_text())
    text = raw.get("text_config", raw)
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "architectures", "torch_dtype")})
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    # our stacked canonical layout is transformers' module layout; per-expert checkpoints go through our reader
    reader = load_checkpoint(ckpt)
    sd = {("" if n.startswith("lm_head.") else "model.") + n: t for n, t in reader.iter_tensors(
        [n for n in reader.names if not n.startswith("mtp.")])}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("wrapped,layout", [(False, "stacked"), (True, "per-expert")])
@torch.no_grad()
def test_moe_prefill_and_decode_match_transformers(ckpt_factory, wrapped, layout):
    ckpt = ckpt_factory("moe-ci", seed=1, wrapped=wrapped, expert_layout=layout)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == ("qwen3_5_moe" if wrapped else "qwen3_5_moe_text")
    ours = Qwen36Model.from_checkpoint(ckpt)
    ref = hf_moe_model(ckpt)
    cfg = ours.config
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=gen)
    state = ours.new_state(1, PROMPT_LEN + DECODE_STEPS + 1)
    o = ours(prompt, state)
    r = ref(prompt, use_cache=True)
    err = (o.logits - r.logits).abs().max().item()
    assert err <= ATOL, f"prefill max abs logit error {err:.3e} > {ATOL}"
    # the routing really is sparse and varied: several experts win across the prompt
    top_i = ours.layers[0].mlp.route(ours.layers[0].input_layernorm(ours.embed_tokens(prompt)))[1]
    assert top_i.shape == (1, PROMPT_LEN, 2) and len(torch.unique(top_i)) >= 4
    cache = r.past_key_values
    tok = o.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(DECODE_STEPS):
        o = ours(tok, state)
        r = ref(tok, cache=cache, use_cache=True)
        cache = r.past_key_values
        err = (o.logits - r.logits).abs().max().item()
        assert err <= ATOL, f"decode step {step} max abs logit error {err:.3e} > {ATOL}"
        assert torch.equal(o.logits.argmax(-1), r.logits.argmax(-1)), f"argmax differs at decode step {step}"
        tok = o.logits[:, -1].argmax(-1, keepdim=True)


def test_router_order_softmax_topk_renormalise():
    from qwen36.reference.moe import TopKRouter

    cfg = PRESETS["moe-ci"]
    r = TopKRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    w, i = r(x)
    p = torch.softmax((x @ r.weight.t()).double(), -1)
    pw, pi = p.topk(2, -1)
    assert torch.equal(i, pi)
    torch.testing.assert_close(w.double(), pw / pw.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


@torch.no_grad()
def test_moe_verify_rows_match_one_by_one(ckpt_factory):
    """K+1 verify rows in one forward == the same tokens fed one at a time (MoE rows are independent)."""
    model = Qwen36Model.from_checkpoint(ckpt_factory("moe-ci", seed=2))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 512, (2, 20), generator=gen)
    rows = torch.randint(0, 512, (2, 4), generator=gen)
    s1, s2 = model.new_state(2, 64), model.new_state(2, 64)
    model(prompt, s1), model(prompt, s2)
    batched = model(rows, s1, per_token_states=True).logits
    single = torch.cat([model(rows[:, j:j + 1], s2).logits for j in range(4)], dim=1)
    assert (batched - single).abs().max().item() <= ATOL
    h = model(rows[:, :1], model.new_state(2, 8)).hidden
    mtp_logits, _ = model.mtp_forward(rows[:, 1:2], h, 0, model.new_mtp_state(2, 8))
    assert mtp_logits.shape == (2, 1, 512) and torch.isfinite(mtp_logits).all()


@pytest.fixture(scope="module")
def moe_model(ckpt_factory):
    return Qwen36Model.from_checkpoint(ckpt_factory("moe-ci", seed=0), require_mtp=True)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_lossless_on_moe(moe_model, k):
    """The backend-agnostic engine on the MoE reference: greedy speculative == plain greedy for every commit
    mechanism, with scripted drafts (every acceptance length occurs) and with the MoE MTP's own drafts."""
    from qwen36.speculative.engine import speculative_generate
    from qwen36.speculative.mechanisms import MECHANISMS
    from qwen36.speculative.reference_backend import ReferenceBackend

    from qwen36.testing.speculative import ScriptedDrafter, engine_prompts as prompts

    ps = prompts(moe_model.config.vocab_size)
    for mechanism in MECHANISMS:
        ref = generate(moe_model, [torch.tensor(ps[0])], 20 + k)[0].tokens
        be = ScriptedDrafter(moe_model, mechanism, 64, [ref], [len(ps[0])], seed=k)
        out = speculative_generate(be, [ps[0]], 20, [k])[0]
        assert out.tokens == ref[:20], f"scripted drafts, K={k} {mechanism}"
        assert len(set(out.stats.accepted)) > 1 or k == 1
        for p in ps[1:]:
            ref = generate(moe_model, [torch.tensor(p)], 10)[0].tokens
            out = speculative_generate(ReferenceBackend(moe_model, mechanism, 64), [p], 10, [k])[0]
            assert out.tokens == ref, f"MTP drafts, K={k} {mechanism}, prompt len {len(p)}"


def test_make_tiny_moe_ci_cli_is_deterministic(tmp_path, capsys):
    from qwen36.cli import main

    for name, seed, layout in (("a", 4, "stacked"), ("b", 4, "stacked"), ("c", 5, "stacked"), ("d", 4, "per-expert")):
        assert main(["make-tiny", str(tmp_path / name), "--preset", "moe-ci", "--seed", str(seed),
                     "--expert-layout", layout]) == 0
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], c["model.layers.0.mlp.gate.weight"])
    cfg = Qwen36Config.from_file(tmp_path / "a")
    assert cfg == PRESETS["moe-ci"].__class__.from_file(tmp_path / "d") and cfg.is_moe and cfg.has_mtp
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert sum(k.startswith("mtp.") for k in a) == 4 + 6 + 2 + 7  # fc, 3 norms; attention; layer norms; MoE block
    # the per-expert file is the same model
    da = Qwen36Model.from_checkpoint(tmp_path / "a").state_dict()
    dd = Qwen36Model.from_checkpoint(tmp_path / "d").state_dict()
    assert all(torch.equal(da[k], dd[k]) for k in da)


def test_tt_split_checks_name_the_moe_fields():
    """A MoE config splits its experts' and shared expert's intermediate dims over the mesh: one that does not
    divide fails fast naming the field (the dense intermediate_size, 0 for MoE, is not checked)."""
    from dataclasses import replace

    from qwen36.tt.model.model_config import TPSplitError, TTModelArgs

    args = TTModelArgs.from_config(PRESETS["moe-ci"], 2)
    assert (args.moe_intermediate_d, args.shared_intermediate_d) == (16, 32)
    with pytest.raises(TPSplitError, match="moe_intermediate_size"):
        TTModelArgs.from_config(replace(PRESETS["moe-ci"], moe_intermediate_size=33), 2)
    with pytest.raises(TPSplitError, match="shared_expert_intermediate_size"):
        TTModelArgs.from_config(replace(PRESETS["moe-ci"], shared_expert_intermediate_size=65), 2)
    TTModelArgs.from_config(PRESETS["ci"], 2)  # the dense preset still passes
