"""Chi-square goodness of fit for the statistical tests of speculative sampling (reference engine, TT device
acceptor and sampler): observed counts against the law the target samples from."""
from __future__ import annotations

import torch

P_VALUE_MIN = 1e-3  # fixed seeds make these deterministic; 1e-3 leaves room for an unlucky-but-valid seed


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed ``counts`` vs expected ``probs`` (cells with expected < 5 merged)."""
    n = counts.sum()
    expected = probs.double() * n
    order = expected.argsort(descending=True)
    e, o = expected[order], counts.double()[order]
    big = e >= 5
    e = torch.cat([e[big], e[~big].sum()[None]]) if (~big).any() else e
    o = torch.cat([o[big], o[~big].sum()[None]]) if (~big).any() else o
    keep = e > 0
    e, o = e[keep], o[keep]
    stat = ((o - e) ** 2 / e).sum()
    dof = e.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def chi2_p(observed, expected) -> float:
    """Pearson chi-square p-value of ``observed`` counts vs ``expected`` counts (not probabilities: summed
    per-step expectations are allowed); cells with expected < 5 are pooled into one. Observations in a
    zero-probability cell fail an assertion rather than being dropped."""
    o = torch.as_tensor(observed, dtype=torch.float64).flatten()
    e = torch.as_tensor(expected, dtype=torch.float64).flatten()
    assert abs(float(o.sum() - e.sum())) < 1e-6 * float(e.sum()) + 1e-9, (o.sum(), e.sum())
    small = e < 5
    if small.any():
        o = torch.cat([o[~small], o[small].sum()[None]])
        e = torch.cat([e[~small], e[small].sum()[None]])
    keep = e > 0
    assert float(o[~keep].sum()) == 0.0, "observations in a zero-probability cell"
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    dof = o.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def rank_cell(probs_row: torch.Tensor, token: int, top_k: int) -> int:
    """Cell of ``token`` = its rank among the kept (nonzero) tokens by descending probability; ``top_k`` (one past
    the last kept rank of a top-k law) = a token the law gives probability 0."""
    kept = probs_row.nonzero().flatten()
    order = kept[probs_row[kept].argsort(descending=True)].tolist()
    return order.index(token) if token in order else top_k
