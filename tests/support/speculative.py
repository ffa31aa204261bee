"""Test support for the speculative engine: drafters with a known acceptance pattern, and the seeded prompts the
engine's and the sampler's tests share."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from qwen36.speculative.engine import Acceptance, speculative_step
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft


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



def engine_prompts(vocab: int, n: int = 3) -> list[list[int]]:
    """Up to six seeded prompts of lengths 5, 17, 30, 9, 12, 3 (30 > 16: a chunked prefill on the CI checkpoint)."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in (5, 17, 30, 9, 12, 3)[:n]]


def penalty_prompts(vocab: int) -> list[list[int]]:
    """Two seeded prompts (4 and 19 tokens) on which sampling penalties change greedy output."""
    # seed 12: the penalties change plain greedy output on both prompts of the ci checkpoint (10 of 16 tokens each);
    # on most seeds the untrained model repeats nothing in 16 tokens on the short prompt and they change nothing
    g = torch.Generator().manual_seed(12)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 19)]


class ScriptedDrafter(ReferenceBackend):
    """Drafts from each user's known greedy continuation ``scripts[slot]`` (each token wrong with probability
    ``wrong``), so every acceptance length occurs. The real MTP still runs first (reseed + chain), then its tokens
    are replaced."""

    def __init__(self, model, mechanism, max_len, scripts=(), prompt_lens=(), wrong: float = 0.3, seed: int = 0,
                 slots: int = 1):
        super().__init__(model, mechanism, max_len, slots=slots)
        self.scripts, self.prompt_lens, self.wrong = list(scripts), list(prompt_lens), wrong
        self.g = torch.Generator().manual_seed(seed)
        self.committed: list[dict[int, Acceptance]] = []

    def draft(self, depths):
        super().draft(depths)
        tokens = {}
        for slot, k in depths.items():
            i = int(self.state.pos[slot]) - self.prompt_lens[slot] + 1  # tokens emitted; the pending one is script[i-1]
            toks = (self.scripts[slot][i:i + k] + [0] * k)[:k]
            bad = torch.rand(k, generator=self.g) < self.wrong
            tokens[slot] = torch.tensor([[(t + 1) % self.model.config.vocab_size if w else t
                                          for t, w in zip(toks, bad.tolist())]])
        return ReferenceDraft(dict(depths), tokens, {s: None for s in depths})

    def commit(self, acceptances):
        super().commit(acceptances)
        self.committed.append(dict(acceptances))


class DistDrafter(ReferenceBackend):
    """Drafts from a fixed distribution ``q`` [V] (sampled drafts) or fixed tokens (one-hot drafts), so the
    draft overlaps the target's top-k support and both accept and reject paths occur; every user in the step
    drafts that way (``slots`` users)."""

    def __init__(self, model, mechanism, max_len, q=None, fixed=None, slots: int = 1):
        super().__init__(model, mechanism, max_len, slots=slots)
        self.q, self.fixed = q, fixed
        self.g = torch.Generator().manual_seed(5)

    def draft(self, depths):
        super().draft(depths)
        tokens, probs = {}, {}
        for slot, k in sorted(depths.items()):
            if self.q is not None:
                tokens[slot] = torch.multinomial(self.q, k, replacement=True, generator=self.g)[None]
                probs[slot] = self.q.expand(1, k, -1).clone()
            else:
                tokens[slot], probs[slot] = torch.tensor([self.fixed[:k]]), None
        return ReferenceDraft(dict(depths), tokens, probs)


def two_token_counts(be: ReferenceBackend, pre, k: int, n: int, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Counts [V, V] of the first two tokens emitted from the live state ``pre`` over ``n`` speculative runs of depth
    ``k``, run ``be.slots`` at a time: every slot restarts from ``pre`` with its own sampler running on (each slot
    joined with its own seed), and slots that have emitted two tokens sit the rest of the round out (inert, per the
    backend contract). Also every step's accepted count, so callers can check both the accept and reject paths ran."""
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted: list[int] = []
    done = 0
    while done < n:
        users = range(min(be.slots, n - done))
        for b in users:
            be.restore(b, pre)
        emitted: dict[int, list[int]] = {b: [] for b in users}
        while any(len(e) < 2 for e in emitted.values()):
            for b, acc in speculative_step(be, {b: k for b, e in emitted.items() if len(e) < 2}).items():
                accepted.append(acc.num_accepted)
                emitted[b] += acc.tokens
        for e in emitted.values():
            counts[e[0], e[1]] += 1
        done += len(users)
    return counts, accepted
