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

    def forward(self, x: torch.Tensor, pos0: int | torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x: [B, T, hidden] at positions pos0..pos0+T-1. Writes those rows of ``cache`` when given.

        pos0: one int for every row, or a LongTensor [B] of per-row first positions (a batch of users whose
        sequences have different lengths: row b writes and attends to its own cache rows only, 0..pos0[b]+T-1)."""
        bsz, t, _ = x.shape
        qg = self.q_proj(x).view(bsz, t, self.hq, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:].reshape(bsz, t, self.hq * self.d)
        q = self.q_norm(q).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).view(bsz, t, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.hkv, self.d).transpose(1, 2)
        per_row = isinstance(pos0, torch.Tensor)
        first = pos0.to(x.device)[:, None] if per_row else torch.full((bsz, 1), pos0, device=x.device)
        positions = first + torch.arange(t, device=x.device)  # [B, T] absolute position of every row
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.theta, x.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)

        if cache is not None:
            end = int(positions.max()) + 1
            if end > cache.max_len:
                raise ValueError(f"KV cache overflow: positions up to {end - 1} but cache holds {cache.max_len}")
            if per_row:  # element (b, t) goes to cache row positions[b, t] of user b
                rows = torch.arange(bsz, device=x.device)[:, None]
                cache.k[rows, :, positions] = k.transpose(1, 2).to(cache.k.dtype)
                cache.v[rows, :, positions] = v.transpose(1, 2).to(cache.v.dtype)
            else:
                cache.k[:, :, pos0:pos0 + t] = k.to(cache.k.dtype)
                cache.v[:, :, pos0:pos0 + t] = v.to(cache.v.dtype)
            k, v = cache.k[:, :, :end].to(x.dtype), cache.v[:, :, :end].to(x.dtype)
        elif per_row:
            raise ValueError("per-row positions need a KV cache (rows at different positions share no prefix)")
        s = k.shape[2]
        # GQA without copies: q head i reads kv head i // (Hq / Hkv)
        rep = self.hq // self.hkv
        qr = q.reshape(bsz, self.hkv, rep, t, self.d)
        scores = (qr @ k[:, :, None].transpose(-1, -2)) * self.d ** -0.5  # [B, Hkv, rep, T, S]
        mask = torch.arange(s, device=x.device) > positions[:, :, None]  # [B, T, S]: causal in absolute positions
        scores = scores.masked_fill(mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = (probs @ v[:, :, None]).reshape(bsz, self.hq, t, self.d).transpose(1, 2).reshape(bsz, t, self.hq * self.d)
        return self.o_proj(o * torch.sigmoid(gate))
