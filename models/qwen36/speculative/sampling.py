"""Sampling parameters and the one logits -> probabilities transform used for BOTH target and draft.

Rejection sampling is exact only if the target and the draft distributions go through the same transform
(temperature, then top-k, then top-p), so there is exactly one function for it: :func:`probs_from_logits`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .mechanisms import DRAFT_MODES

GREEDY_TEMPERATURE = 0.0  # temperature 0 means argmax decoding (no randomness at all)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: 0 -> greedy (argmax target, argmax drafts, greedy acceptance); > 0 -> stochastic.
    top_k: keep the k most likely tokens (0 = off). top_p: keep the smallest set whose mass reaches p (1 = off).
    seed: seeds the one torch.Generator that every random draw of a run comes from.
    draft: how the MTP picks drafts when stochastic: "sample" (from the transformed draft distribution)
        or "greedy" (argmax; acceptance then uses a one-hot draft distribution). Ignored when greedy.
    """

    temperature: float = GREEDY_TEMPERATURE
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft: str = "sample"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"draft must be 'sample' or 'greedy', got {self.draft!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == GREEDY_TEMPERATURE

    @property
    def sampled_drafts(self) -> bool:
        """Drafts drawn from the transformed draft distribution (stochastic run, draft="sample"); otherwise argmax
        drafts, whose draft distribution in stochastic acceptance is one-hot."""
        return not self.greedy and self.draft == "sample"

    def generator(self, device="cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k, top-p (stochastic params only)."""
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0 (greedy decoding uses argmax)")
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token always survives (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [B, V] -> token ids [B] (int64), one draw per row from ``generator``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> tokens [B]: argmax when greedy, else a draw from the transformed distribution."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, params), generator)
