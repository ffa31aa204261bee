"""Acceptance rules for speculative decoding: greedy and stochastic rejection sampling.

Vocabulary of one verify step with draft depth K (shapes per batch row):

* draft tokens ``d_1..d_K``: proposed by the MTP head (``draft_token_ids [B, K]``).
* target rows: one verify forward over ``[x_pending, d_1..d_K]`` gives K+1 target distributions;
  row i predicts the token after ``d_i`` (row 0 the one after the pending token).
* accepted tokens: the longest prefix ``d_1..d_a`` that passes the test (0 <= a <= K).
* recovered token: when ``d_{a+1}`` is rejected (a < K), one token sampled from the residual
  ``normalise(max(p_target(row a) - p_draft(a+1), 0))`` (greedy: the target argmax of row a, a correction).
* bonus token: when all K drafts are accepted, one token from target row K (greedy: its argmax).

Every step therefore emits ``a + 1`` tokens: the accepted ones then exactly one recovered-or-bonus token.
Output rows are ``[B, K+1]`` with :data:`PLACEHOLDER_TOKEN_ID` after the emitted tokens.

Stochastic rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): accept ``d_i`` with probability
``min(1, p_target(d_i) / p_draft(d_i))``. The emitted tokens are then distributed exactly as if sampled
from the target one by one. ``p_draft`` is one-hot at ``d_i`` when drafts are argmax picks (pass
``draft_probs=None``); then acceptance probability is ``p_target(d_i)`` and the residual is ``p_target``
with ``d_i`` removed. Both distributions must come from the same sampling transform
(:func:`..sampling.probs_from_logits`).
"""
from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1  # output slots after the recovered/bonus token
ONE_HOT_DRAFT = None  # draft_probs value meaning "drafts are argmax picks: p_draft is one-hot"


def _num_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, K] bool -> length of the all-True prefix per row [B] int64."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """-> output_token_ids [B, K+1]: accepted drafts, then ``final_token`` at column a, then placeholders."""
    b, k = draft_token_ids.shape
    cols = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    return out.scatter(1, num_accepted[:, None], final_token[:, None])


def greedy_accept(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance.

    draft_token_ids: [B, K] int64. target_logits: [B, K+1, V] (row i predicts the token after d_i).
    Returns (output_token_ids [B, K+1] with placeholders, num_accepted [B]).
    """
    target_argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    k = draft_token_ids.shape[1]
    num_accepted = _num_accepted(draft_token_ids == target_argmax[:, :k])
    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # correction (a < K) or bonus (a == K)
    return _assemble(draft_token_ids, num_accepted, final), num_accepted


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic acceptance (exact speculative sampling).

    draft_token_ids: [B, K] int64. draft_probs: [B, K, V] fp32, or ONE_HOT_DRAFT (None) for argmax drafts.
    target_probs: [B, K+1, V] fp32, after the same temperature/top-k/top-p transform as the drafts.
    generator: the run's seeded generator. Draws, in order: K uniforms per row, then one categorical per row.
    Returns (output_token_ids [B, K+1] with placeholders, num_accepted [B]).
    """
    b, k = draft_token_ids.shape
    idx = draft_token_ids[..., None]  # [B, K, 1]
    p_target = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, K]
    if draft_probs is ONE_HOT_DRAFT:
        p_draft = torch.ones_like(p_target)
        draft_dist = torch.zeros_like(target_probs[:, :k]).scatter(-1, idx, 1.0)  # [B, K, V]
    else:
        p_draft = draft_probs.gather(-1, idx).squeeze(-1)
        draft_dist = draft_probs
    uniform = torch.rand(b, k, generator=generator, device=target_probs.device)  # [B, K]
    # accept iff u < p_target / p_draft, written without a division (p_draft > 0 for any sampled draft)
    num_accepted = _num_accepted(uniform * p_draft < p_target)

    rows = torch.arange(b, device=target_probs.device)
    at = num_accepted.clamp(max=k - 1) if k > 0 else num_accepted
    residual = (target_probs[rows, at] - draft_dist[rows, at]).clamp_min(0.0)  # [B, V] recovered distribution
    # a residual of zero mass means p_target == p_draft, where rejection has probability 0; keep p_target there
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target_probs[rows, at])
    bonus = target_probs[:, k]  # [B, V]
    final_dist = torch.where((num_accepted == k)[:, None], bonus, residual)
    final = torch.multinomial(final_dist, 1, generator=generator).squeeze(1)
    return _assemble(draft_token_ids, num_accepted, final), num_accepted
