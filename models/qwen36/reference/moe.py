"""Sparse mixture-of-experts MLP of the Qwen3.6 MoE sibling (35B-A3B): pure torch, the numerics oracle.

Per token row x:
    p = softmax(x @ W_router^T)             in fp32, over all E experts
    (w, idx) = topk(p, k); w = w / sum(w)   renormalised over the k picked experts, then cast to x's dtype
    y = sum_j w_j * SwiGLU_{idx_j}(x) + sigmoid(x . w_gate) * SwiGLU_shared(x)

The order (softmax over all experts, then top-k, then renormalise) is transformers' Qwen3_5MoeTopKRouter; it is
not the same as softmax over the top-k logits only once weights are cast. Rows are independent, so any [B, T]
(prefill, decode, K+1-row verify) works. Expert weights are stacked like transformers' modules:
``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``experts.down_proj`` [E, H, I].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen36Config
from .layers import SwiGLU


class TopKRouter(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k] int64)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i


class StackedExperts(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H]; each row goes through its k experts only (compute scales with k, not E)."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():
            rows, slot = torch.where(top_i == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Routed experts + gated shared expert; parameter names match the checkpoint (``mlp.gate.weight`` ...)."""

    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = StackedExperts(cfg)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (weights [..., k], expert ids [..., k]); for tests and routing statistics."""
        w, i = self.gate(x.reshape(-1, x.shape[-1]))
        return w.view(*x.shape[:-1], -1), i.view(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top_w, top_i = self.gate(flat)
        routed = self.experts(flat, top_i, top_w)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).view_as(x)
