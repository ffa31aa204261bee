"""Gated DeltaNet (GDN) layer: causal depthwise conv, chunked prefill, recurrent decode, fp32 state.

Per value head, per token (decay first, then the delta-rule write, then read the new state):
    S <- exp(g) S
    u  = beta (v - S^T k)
    S <- S + k u^T
    o  = S^T q
with q, k L2-normalised (eps inside the root), q scaled by Dk^-0.5, g = -exp(A_log) softplus(a + dt_bias),
beta = sigmoid(b). Value head j reads key head j // (Hv / Hk).

State tensors are never modified in place: a forward assigns fresh tensors to ``state.recurrent`` /
``state.conv``. The speculative engine relies on this (a shallow copy of a state is a free snapshot).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen36Config
from .layers import GatedRMSNorm
from .state import GDNState

L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, Hk, Dk] -> fp32 [B, Hv, T, Dk]: L2-normalise, scale q, expand key heads to value heads."""
    rep = hv // q.shape[2]
    dt = _compute_dtype(q)
    q = l2_normalize(q.to(dt)) * q.shape[-1] ** -0.5
    k = l2_normalize(k.to(dt))
    q = q.repeat_interleave(rep, dim=2).transpose(1, 2)
    k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    return q, k


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The recurrence runs in fp32 (fp64 when the inputs are fp64, for numerics checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def recurrent_gated_delta_rule(q, k, v, g, beta, state, per_token: bool = False):
    """Token-by-token recurrence (decode and the K+1-row verify).

    q, k: [B, H, T, Dk] (prepared); v: [B, H, T, Dv]; g, beta: [B, H, T]; state: [B, H, Dk, Dv] fp32.
    Returns (o [B, H, T, Dv] fp32, final state, per-token states [B, T, H, Dk, Dv] or None).
    """
    dt = _compute_dtype(q)
    q, k, v, g, beta, s = (x.to(dt) for x in (q, k, v, g, beta, state))
    outs, states = [], []
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
        if per_token:
            states.append(s)
    o = torch.stack(outs, dim=2)
    return o, s, (torch.stack(states, dim=1) if per_token else None)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64):
    """Chunked (WY / UT-transform) form of the same recurrence, for prefill. Same shapes as the recurrent form.

    Inside a chunk with cumulative log-decay G (G_i = g_1 + ... + g_i) and entry state S0:
        (I + A) U = beta*V - beta*exp(G)*(K S0),   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)
        O = exp(G) (Q S0) + (exp(G_i - G_j) q_i.k_j)_{j<=i} U
        S_end = exp(G_C) S0 + (exp(G_C - G) K)^T U
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    dt = _compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)

    G = g.cumsum(-1)
    diff = G[..., :, None] - G[..., None, :]  # G_i - G_j
    lower_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay_ij = diff.masked_fill(~lower_incl, float("-inf")).exp()  # 0 above the diagonal
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., None] * kk * decay_ij).tril(-1)
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    rhs_v = beta[..., None] * v
    rhs_k = (beta * G.exp())[..., None] * k
    sol = torch.linalg.solve_triangular(A + eye, torch.cat([rhs_v, rhs_k], dim=-1), upper=False, unitriangular=True)
    w_v, w_k = sol[..., :dv], sol[..., dv:]  # U = w_v - w_k S0
    qk = (q @ k.transpose(-1, -2)) * decay_ij
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]

    s = state.to(dt)
    out = torch.empty(b, h, n, chunk, dv, dtype=dt, device=q.device)
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ s
        out[:, :, c] = q_dec[:, :, c] @ s + qk[:, :, c] @ u
        s = chunk_decay[:, :, c] * s + k_dec[:, :, c].transpose(-1, -2) @ u
    return out.reshape(b, h, n * chunk, dv)[:, :, :t], s


@dataclass
class GDNPerToken:
    """State after every row of a multi-row forward (the shadow_commit slots)."""

    recurrent: torch.Tensor  # [B, T, Hv, Dk, Dv] fp32
    conv: torch.Tensor  # [B, T, conv_dim, kernel-1]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv_dim = cfg.gdn_conv_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, h, bias=False)

    def new_state(self, batch: int, dtype, device) -> GDNState:
        return GDNState.empty(batch, self.hv, self.dk, self.dv, self.conv_dim, self.kernel, dtype, device)

    def forward(self, x: torch.Tensor, state: GDNState | None = None, *, mode: str = "auto",
                per_token: bool = False) -> tuple[torch.Tensor, GDNPerToken | None]:
        """x: [B, T, hidden]. Advances ``state`` (by reassignment) when given. mode: auto | chunk | recurrent."""
        bsz, t, _ = x.shape
        if state is None:
            state = self.new_state(bsz, x.dtype, x.device)  # stateless (training / one-shot prefill)
        # causal depthwise conv over [conv window | new inputs]
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        window = torch.cat([state.conv.to(mixed.dtype), mixed], dim=-1)  # [B, C, kernel-1+T]
        conv_out = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim))  # [B, C, T]
        keep = self.kernel - 1
        new_conv = window[..., -keep:] if keep > 0 else window[..., :0]
        conv_per_token = window.unfold(-1, keep, 1)[:, :, 1:].permute(0, 2, 1, 3) if per_token else None

        q, k, v = torch.split(conv_out.transpose(1, 2), [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = prepare_qk(q.reshape(bsz, t, self.hk, self.dk), k.reshape(bsz, t, self.hk, self.dk), self.hv)
        v = v.reshape(bsz, t, self.hv, self.dv).transpose(1, 2)
        dt = _compute_dtype(x)
        beta = torch.sigmoid(self.in_proj_b(x).to(dt)).transpose(1, 2)  # [B, Hv, T]
        g = (-self.A_log.to(dt).exp() * F.softplus(self.in_proj_a(x).to(dt) + self.dt_bias.to(dt))).transpose(1, 2)

        use_recurrent = mode == "recurrent" or per_token or (mode == "auto" and t <= 16)
        if mode not in ("auto", "chunk", "recurrent"):
            raise ValueError(f"unknown GDN mode {mode!r}")
        if use_recurrent:
            o, s, s_tok = recurrent_gated_delta_rule(q, k, v, g, beta, state.recurrent, per_token=per_token)
        else:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, state.recurrent)
            s_tok = None
        state.recurrent, state.conv = s, new_conv

        o = o.transpose(1, 2).to(x.dtype)  # [B, T, Hv, Dv]
        z = self.in_proj_z(x).reshape(bsz, t, self.hv, self.dv)
        y = self.norm(o, z).reshape(bsz, t, self.hv * self.dv)
        extra = GDNPerToken(s_tok, conv_per_token) if per_token else None
        return self.out_proj(y), extra
