"""Gated full attention: q_proj emits [q | gate] per head, q/k zero-centred RMSNorm, partial RoPE, GQA,
output scaled by sigmoid(gate) before o_proj. KV cache rows are indexed by absolute position."""
from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen36Config
from .layers import RMSNorm, apply_partial_rope, rope_cos_sin
from .state import KVCache


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, 2 * self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos0: int, cache: KVCache | None = None) -> torch.Tensor:
        """x: [B, T, hidden] at positions pos0..pos0+T-1. Writes those rows of ``cache`` when given."""
        bsz, t, _ = x.shape
        qg = self.q_proj(x).view(bsz, t, self.hq, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:].reshape(bsz, t, self.hq * self.d)
        q = self.q_norm(q).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).view(bsz, t, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.hkv, self.d).transpose(1, 2)
        positions = torch.arange(pos0, pos0 + t, device=x.device).expand(bsz, t)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.theta, x.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)

        if cache is not None:
            if pos0 + t > cache.max_len:
                raise ValueError(f"KV cache overflow: positions up to {pos0 + t - 1} but cache holds {cache.max_len}")
            cache.k[:, :, pos0:pos0 + t] = k.to(cache.k.dtype)
            cache.v[:, :, pos0:pos0 + t] = v.to(cache.v.dtype)
            k, v = cache.k[:, :, : pos0 + t].to(x.dtype), cache.v[:, :, : pos0 + t].to(x.dtype)
        s = k.shape[2]
        # GQA without copies: q head i reads kv head i // (Hq / Hkv)
        rep = self.hq // self.hkv
        qr = q.reshape(bsz, self.hkv, rep, t, self.d)
        scores = (qr @ k[:, :, None].transpose(-1, -2)) * self.d ** -0.5  # [B, Hkv, rep, T, S]
        key_pos = torch.arange(s, device=x.device)
        query_pos = torch.arange(pos0, pos0 + t, device=x.device)
        mask = key_pos[None, :] > query_pos[:, None]  # causal in absolute positions
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = (probs @ v[:, :, None]).reshape(bsz, self.hq, t, self.d).transpose(1, 2).reshape(bsz, t, self.hq * self.d)
        return self.o_proj(o * torch.sigmoid(gate))
