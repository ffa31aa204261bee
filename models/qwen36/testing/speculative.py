"""Test support for the speculative engine: drafters with a known acceptance pattern."""
from __future__ import annotations

from typing import Callable, Sequence


def oracle_drafter(prompt: Sequence[int], plain: Sequence[int], vocab: int = 512) -> Callable[[list[int], int], list[int]]:
    """Host drafter for TTSpecBackend: drafts from the known greedy sequence ``prompt + plain`` with a deliberate
    miss at every 3rd and 5th position, so that steps accept mixed lengths a."""
    seq = list(prompt) + list(plain)

    def draft(hist: list[int], k: int) -> list[int]:
        i = len(hist)
        out = []
        for j in range(k):
            tok = seq[i + j] if i + j < len(seq) else 0
            if (i + j) % 3 == 0 or (i + j) % 5 == 0:
                tok = (tok + 1) % vocab
            out.append(tok)
        return out

    return draft

