"""Project-made checkpoints in HF format (config.json, model.safetensors with mtp.*, tokenizer).

Presets:
  ci          seconds on CPU; Hv/Hk = 3, head_dim != hidden/heads, partial rotary 0.25, 3 GDN : 1 attention
  ci-tied     like ci with tied embeddings (tests the tied path)
  27b-ratios  the real 27B head structure (24/4 attention heads of 256, 16/48 GDN heads of 128) at a small hidden size
  27b-layers  real 27B per-layer shapes (hidden 5120, MLP 17408) for one GDN and one attention layer; memory checks
  moe-ci      the MoE sibling (qwen3_5_moe_text) at ci size: 8 routed experts top-2 + a gated shared expert in
              every layer and in the MTP layer
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import mtp_shapes, target_shapes, to_hf, unstack_experts
from .config import FULL, LINEAR, Qwen36Config
from .io_utils import atomic_write, atomic_write_json

_CI = Qwen36Config(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, mtp_num_hidden_layers=1,
)

PRESETS: dict[str, Qwen36Config] = {
    "ci": _CI,
    "ci-tied": replace(_CI, tie_word_embeddings=True),
    # the CI config with GDN head dims of 32: the smallest whose GDN prefill takes ttnn's fused ops (tile-wide heads;
    # the CI config's 16 runs the composite prefill, tt/model/gdn_prefill.py)
    "ci-gdn32": replace(_CI, linear_key_head_dim=32, linear_value_head_dim=32),
    "27b-ratios": replace(
        _CI, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "27b-layers": replace(
        _CI, vocab_size=1024, hidden_size=5120, intermediate_size=17408, num_hidden_layers=2,
        layer_types=(LINEAR, FULL), num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "moe-ci": replace(_CI, intermediate_size=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
}
EXPERT_LAYOUTS = ("stacked", "per-expert")


def random_weights(cfg: Qwen36Config, seed: int, dtype: torch.dtype = torch.float32,
                   with_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Deterministic random weights (canonical names) with scales that keep activations O(1), the same bits on
    every host.

    torch's fp32 normal sampler gives other values on its scalar path (``ATEN_CPU_CAPABILITY=default``) than on its
    SIMD path, so fp32 draws made a different model on each host. Its fp64 sampler and fp64 uniform draws give the
    same bits under every capability, so the weights are drawn in fp64 and rounded once to ``dtype``. The one
    transcendental (A_log's log) goes through Python's ``math.log``: torch's fp64 log runs Sleef in its vector loop
    and libm in its scalar path, which differ in the last fp64 bit."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=f64)

    shapes = dict(target_shapes(cfg))
    if with_mtp:
        shapes.update(mtp_shapes(cfg))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            # decay per token exp(g) mostly in ~[0.7, 0.99]: the state keeps several tokens, so GDN outputs are
            # not dominated by one q.k product (a near-zero one makes the gated norm ill-conditioned in fp32)
            u = torch.empty(shape, dtype=f64).uniform_(0.05, 1.0, generator=gen)
            t = torch.tensor([math.log(x) for x in u.flatten().tolist()], dtype=f64).reshape(shape)
        elif name.endswith("dt_bias"):
            t = -1.0 + 0.1 * randn(shape)
        elif leaf == "norm" and "linear_attn" in name:  # gated norm: plain weight around 1
            t = 1.0 + 0.1 * randn(shape)
        elif len(shape) == 1:  # zero-centred norms: weight around 0
            t = 0.1 * randn(shape)
        elif leaf == "conv1d":
            t = randn(shape) * shape[-1] ** -0.5
        elif leaf == "embed_tokens":
            t = randn(shape)
        else:  # linear [out, in]
            t = randn(shape) * shape[-1] ** -0.5
        out[name] = t.to(dtype)
    return out


def write_checkpoint(out_dir: str | Path, cfg: Qwen36Config, weights: dict[str, torch.Tensor], *,
                     wrapped: bool = False, tokenizer: bool = True, expert_layout: str = "stacked") -> Path:
    """Write an HF-format directory: config.json, model.safetensors (HF key names), tokenizer files.

    ``expert_layout`` (MoE only): "stacked" experts.gate_up_proj/down_proj or "per-expert" experts.{e}.*_proj."""
    from .tokenizer import make_fixed_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        eos = make_fixed_tokenizer(out_dir, vocab_size=min(cfg.vocab_size, 1024))
        if not cfg.eos_token_id:
            cfg = replace(cfg, eos_token_id=(eos,))
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {expert_layout!r}; choose from {EXPERT_LAYOUTS}")
    if expert_layout == "per-expert":
        weights = unstack_experts(weights)
    hf = {to_hf(k, wrapped): v.contiguous() for k, v in weights.items()}
    atomic_write(out_dir / "model.safetensors", lambda tmp: save_file(hf, tmp, metadata={"format": "pt"}))
    cfg_dict = cfg.to_hf_dict()
    if wrapped:
        moe = cfg.is_moe
        cfg_dict = {"model_type": "qwen3_5_moe" if moe else "qwen3_5",
                    "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                    "text_config": cfg_dict, "tie_word_embeddings": cfg.tie_word_embeddings}
    atomic_write_json(out_dir / "config.json", cfg_dict)
    return out_dir


def make_tiny(out_dir: str | Path, preset: str = "ci", seed: int = 0, dtype: torch.dtype = torch.float32,
              with_mtp: bool = True, wrapped: bool = False, expert_layout: str = "stacked") -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    if not with_mtp:
        cfg = replace(cfg, mtp_num_hidden_layers=0)
    return write_checkpoint(out_dir, cfg, random_weights(cfg, seed, dtype, with_mtp=with_mtp), wrapped=wrapped,
                            expert_layout=expert_layout)
