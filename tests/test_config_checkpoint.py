"""Config parsing/validation and the checkpoint loader's rejections: each error names the problem."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen36.checkpoint import CheckpointError, load_checkpoint, mtp_shapes
from qwen36.config import FULL, LINEAR, ConfigError, Qwen36Config
from qwen36.reference.model import Qwen36Model


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(d, **changes):
    p = d / "config.json"
    raw = json.loads(p.read_text())
    raw.update(changes)
    p.write_text(json.dumps(raw))


def test_flat_and_nested_configs_parse_the_same(ckpt_factory):
    flat = Qwen36Config.from_file(ckpt_factory("ci-tied"))
    nested = Qwen36Config.from_file(ckpt_factory("ci-tied", wrapped=True))
    assert flat == nested
    assert flat.tie_word_embeddings and flat.gdn_heads_per_key_head == 3 and flat.rotary_dim == 8


def test_full_attention_interval_builds_layer_types():
    raw = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "full_attention_interval": 4, "linear_num_key_heads": 1, "linear_num_value_heads": 3}
    cfg = Qwen36Config.from_dict(raw)
    assert cfg.layer_types == tuple([LINEAR] * 3 + [FULL]) * 2
    assert cfg.attention_layer_ids == [3, 7]


def test_real_27b_config_values():
    raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
           "text_config": {"vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                           "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                               "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                           "eos_token_id": 248044}}
    cfg = Qwen36Config.from_dict(raw)
    assert cfg.gdn_conv_dim == 10240 and cfg.rotary_dim == 64 and len(cfg.attention_layer_ids) == 16
    assert len(mtp_shapes(cfg)) == 15 and mtp_shapes(cfg)["mtp.fc.weight"] == (5120, 10240)


@pytest.mark.parametrize("change,field", [
    ({"linear_num_value_heads": 7}, "linear_num_value_heads"),
    ({"num_key_value_heads": 3}, "num_attention_heads"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "layer_types"),
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope_parameters.rope_type"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers"),
])
def test_config_errors_name_the_field(ci_ckpt, change, field):
    raw = json.loads((ci_ckpt / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        Qwen36Config.from_dict(raw)


def test_missing_required_field():
    with pytest.raises(ConfigError, match="'num_hidden_layers': missing"):
        Qwen36Config.from_dict({"model_type": "qwen3_5_text"})


def test_malformed_json(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    (d / "config.json").write_text('{"model_type": "qwen3_5_text", ')
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_checkpoint(d)


def test_missing_key_is_named(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.linear_attn.A_log"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): \['layers.1.linear_attn.A_log'\]"):
        load_checkpoint(d)


def test_wrong_shape_is_named(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'layers.3.self_attn.k_proj.weight' has shape \[3, 64\], expected \[64, 64\]"):
        load_checkpoint(d)


def test_unexpected_key_is_named(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.bogus.weight"] = torch.zeros(2)
    sd["model.visual.blocks.0.weight"] = torch.zeros(2)  # vision tower: ignored, not unexpected
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): \['layers.0.bogus.weight'\]"):
        load_checkpoint(d)


def _shard(d):
    """Split model.safetensors into two shards with an index."""
    sd = load_file(d / "model.safetensors")
    keys = sorted(sd)
    half = len(keys) // 2
    parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for fname, ks in parts.items():
        save_file({k: sd[k] for k in ks}, d / fname)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    return parts


def test_sharded_checkpoint_loads_identically(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    _shard(d)
    a, b = Qwen36Model.from_checkpoint(ci_ckpt), Qwen36Model.from_checkpoint(d)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def test_missing_index_shard_is_named(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    parts = _shard(d)
    gone = sorted(parts)[1]
    (d / gone).unlink()
    with pytest.raises(CheckpointError, match=f"missing: \\['{gone}'\\]"):
        load_checkpoint(d)


def test_missing_mtp_with_speculation(ckpt_factory):
    d = ckpt_factory("ci", with_mtp=False)
    load_checkpoint(d)  # fine without speculation
    with pytest.raises(CheckpointError, match=r"speculative decoding needs the MTP head.*no 'mtp\.\*' tensors"):
        load_checkpoint(d, require_mtp=True)
    with pytest.raises(CheckpointError, match="mtp"):
        Qwen36Model.from_checkpoint(d, require_mtp=True)


def test_partial_mtp_set_is_reported(tmp_path, ci_ckpt):
    d = copy_ckpt(ci_ckpt, tmp_path / "c")
    sd = load_file(d / "model.safetensors")
    del sd["mtp.fc.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'mtp.fc.weight'"):
        load_checkpoint(d)


def test_tied_embeddings_share_weights(ckpt_factory):
    m = Qwen36Model.from_checkpoint(ckpt_factory("ci-tied"))
    assert m.lm_head is None
    h = torch.randn(1, 1, m.config.hidden_size)
    assert torch.equal(m.logits(h), (h @ m.embed_tokens.weight.t()).float())


def test_no_checkpoint_files(tmp_path, ci_ckpt):
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(ci_ckpt / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_checkpoint(d)


def test_tokenizer_loads_with_autotokenizer(ci_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ci_ckpt))
    text = "def fibonacci(n):\n    return n"
    assert tok.decode(tok.encode(text)) == text
    cfg = Qwen36Config.from_file(ci_ckpt)
    assert cfg.eos_token_id == (tok.eos_token_id,)


def test_make_tiny_is_deterministic(tmp_path):
    from qwen36.tiny import make_tiny

    a, b = make_tiny(tmp_path / "a", "ci", seed=5), make_tiny(tmp_path / "b", "ci", seed=5)
    c = make_tiny(tmp_path / "c", "ci", seed=6)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
