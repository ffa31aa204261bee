"""What the speculative-transaction probes force, shared by the reference probe (gdn-transaction) and the TT one
(gdn-transaction-tp): drafts with a chosen acceptance length, and, for a batch, which user drafts how deep and
accepts how much. Pure functions of token lists; no model, no device."""
from __future__ import annotations

BATCH_KS = (2, 3)  # --batch: K = 1 leaves no room for a user with fewer valid drafts than the step's K


def forced_drafts(oracle: list[int], k: int, a: int, vocab: int) -> list[int]:
    """d_i = oracle token i for i <= a; d_{a+1} deliberately wrong; later ones from the oracle (irrelevant)."""
    d = list(oracle[:k])
    if a < k:
        d[a] = (oracle[a] + 1) % vocab
    return d


def user_plan(b: int, k: int) -> list[tuple[int | None, int]]:
    """(draft depth k_b or None = sits the step out, forced acceptance a_b) per user."""
    plan: list[tuple[int | None, int]] = [(k, 0), (k, k)]
    if b >= 4:
        plan += [(k - 1, k - 1) if k >= 2 else (k, 0), (None, 0)]
    plan += [(k, k // 2)] * (b - len(plan))
    return plan[:b]
