"""Acceptance rules: greedy bookkeeping, the sampling transform, and exactness of rejection sampling
(chi-square against the target distribution, many samples, one vectorised call per configuration)."""
from __future__ import annotations

import pytest
import torch

from qwen36.speculative.acceptance import ONE_HOT_DRAFT, PLACEHOLDER_TOKEN_ID as P, greedy_accept, rejection_sample
from qwen36.generation.sampling import SamplingParams, probs_from_logits
from qwen36.testing.stats import P_VALUE_MIN, chi_square_p


def test_greedy_accept_prefix_correction_and_bonus():
    v = 10
    argmax_rows = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])  # target argmax per row, K = 3
    logits = torch.nn.functional.one_hot(argmax_rows, v).float()  # [B, K+1, V]
    drafts = torch.tensor([[9, 4, 5], [3, 4, 9], [3, 4, 5]])
    out, n = greedy_accept(drafts, logits)
    assert n.tolist() == [0, 2, 3]
    assert out.tolist() == [[3, P, P, P], [3, 4, 5, P], [3, 4, 5, 6]]  # correction 3 / correction 5 / bonus 6


def test_sampling_transform_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-4))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]  # the smallest set reaching top_p
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the most likely token always survives
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(logits, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


def _setup(v=6, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)  # context-independent target rows
    draft = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    return target, draft


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_rejection_sampling_matches_target_distribution(one_hot):
    """With a context-independent target (rows p_0..p_K), emitted token i must be distributed as p_{i}."""
    v, k, n = 6, 2, 200_000
    target, draft = _setup(v, k)
    g = torch.Generator().manual_seed(123)
    if one_hot:
        drafts = draft.argmax(-1).expand(n, k).clone()  # deterministic drafter
        dprobs = ONE_HOT_DRAFT
    else:
        drafts = torch.stack([torch.multinomial(draft[i], n, replacement=True, generator=g) for i in range(k)], 1)
        dprobs = draft.expand(n, k, v)
    out, num = rejection_sample(drafts, dprobs, target.expand(n, k + 1, v), g)
    assert out.shape == (n, k + 1) and ((out == P) == (torch.arange(k + 1) > num[:, None])).all()
    for i in range(k + 1):
        emitted = out[:, i][num >= i]  # token i is emitted by this step iff at least i drafts were accepted
        counts = torch.bincount(emitted, minlength=v)
        p = chi_square_p(counts, target[i])
        assert p > P_VALUE_MIN, f"position {i}: chi-square p={p:.2e}, counts {counts.tolist()} vs {target[i].tolist()}"
    # acceptance rate of d_1 is sum_x min(p, q) (sampled) or p(d) (one-hot): the rule does what it says
    rate = float((num >= 1).double().mean())
    want = float(target[0, drafts[0, 0]]) if one_hot else float(torch.minimum(target[0], draft[0]).sum())
    assert abs(rate - want) < 5e-3, (rate, want)


def test_chi_square_detects_a_wrong_rule():
    """Test the test: emitting the draft token unconditionally (no rejection) must fail the same check."""
    v, k, n = 6, 2, 200_000
    target, draft = _setup(v, k)
    g = torch.Generator().manual_seed(5)
    d1 = torch.multinomial(draft[0], n, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(d1, minlength=v), target[0]) < 1e-12


def test_rejection_sampling_is_seeded():
    target, draft = _setup()
    drafts = torch.tensor([[1, 2]] * 64)
    a = rejection_sample(drafts, draft.expand(64, 2, 6), target.expand(64, 3, 6), torch.Generator().manual_seed(7))
    b = rejection_sample(drafts, draft.expand(64, 2, 6), target.expand(64, 3, 6), torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_zero_target_probability_is_never_accepted():
    target = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # K = 1: the target never emits token 0 first
    out, n = rejection_sample(torch.tensor([[0]]), ONE_HOT_DRAFT, target, torch.Generator().manual_seed(0))
    assert n.item() == 0 and out.tolist() == [[1, P]]
