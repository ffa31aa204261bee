"""Explicit decode state: KV caches, GDN recurrent + conv state, positions. Clone, compare, restore.

All state of one sequence batch lives in these objects, never inside the modules, so the speculative
engine can snapshot, restore, or swap it without touching the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Attention cache of one layer. k, v: [B, Hkv, max_len, head_dim]. Row p holds position p."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, max_len: int, head_dim: int, dtype, device) -> "KVCache":
        z = torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device)
        return cls(z, z.clone())

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def clone(self) -> "KVCache":
        return KVCache(self.k.clone(), self.v.clone())

    def copy_(self, other: "KVCache") -> None:
        self.k.copy_(other.k)
        self.v.copy_(other.v)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class GDNState:
    """Gated DeltaNet state of one layer.

    recurrent: [B, Hv, Dk, Dv] fp32 (S in ``o = S^T q``).
    conv: [B, conv_dim, kernel-1]: the last kernel-1 pre-conv inputs per channel (a shift register).
    """

    recurrent: torch.Tensor
    conv: torch.Tensor

    @classmethod
    def empty(cls, batch: int, hv: int, dk: int, dv: int, conv_dim: int, kernel: int, dtype, device) -> "GDNState":
        return cls(
            torch.zeros(batch, hv, dk, dv, dtype=torch.float32, device=device),
            torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device),
        )

    def clone(self) -> "GDNState":
        return GDNState(self.recurrent.clone(), self.conv.clone())

    def copy_(self, other: "GDNState") -> None:
        self.recurrent.copy_(other.recurrent)
        self.conv.copy_(other.conv)

    def nbytes(self) -> int:
        return self.recurrent.numel() * 4 + self.conv.numel() * self.conv.element_size()


LayerState = KVCache | GDNState


@dataclass
class ModelState:
    """Target-model state: one entry per layer and the next position to be written (== tokens consumed)."""

    layers: list[LayerState]
    pos: int = 0

    def clone(self) -> "ModelState":
        return ModelState([s.clone() for s in self.layers], self.pos)

    def copy_(self, other: "ModelState") -> None:
        for a, b in zip(self.layers, other.layers):
            a.copy_(b)
        self.pos = other.pos

    def gdn_states(self) -> list[GDNState]:
        return [s for s in self.layers if isinstance(s, GDNState)]

    def kv_caches(self) -> list[KVCache]:
        return [s for s in self.layers if isinstance(s, KVCache)]


@dataclass
class MTPState:
    """State of the MTP head: its own KV cache. Entry t is computed from (h_t, embed(x_{t+1}))."""

    kv: KVCache
    pos: int = 0

    def clone(self) -> "MTPState":
        return MTPState(self.kv.clone(), self.pos)

    def copy_(self, other: "MTPState") -> None:
        self.kv.copy_(other.kv)
        self.pos = other.pos


def kv_equal_upto(a: KVCache, b: KVCache, n: int) -> bool:
    """Bit equality of the first n positions (rows past the accepted prefix are garbage by design)."""
    return torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])
