"""Thinking budget: at N thinking tokens without a ``</think>``, inject Qwen's stop-thinking phrase and go on.

Qwen3's technical report (section 4.3) gives the rule: when the thinking reaches the user's budget, insert the
stop-thinking instruction (``qwen36.chat.STOP_THINKING_PHRASE``, which closes the block with ``</think>``) and let
the model answer. The phrase enters as forced tokens, committed like a prefill continuation: one target forward over
[last token, phrase...], whose last row picks the next token.

Counting: the tokens *generated* after the opening ``<think>`` (the Qwen3.6 generation prompt ends with
``<think>\\n``, so every generated token is a thinking token until ``</think>``; a model that opens the block itself
starts counting after its ``<think>``). ``</think>`` is not counted and ends the thinking. At exactly N counted tokens
the phrase follows. Budget 0: the phrase comes first (a chat turn with budget 0 is rendered in non-thinking mode
instead, where no block is open: ``qwen36.chat``).

Speculation: a step can emit several tokens at once; the tracker cuts its accepted tokens right after the N-th
thinking token (committing fewer rows is a valid commit for every mechanism: the state after row a' < a, the next
token pending), the drafts past it are dropped, then the backend's ``inject`` runs the forced rows and re-seeds the
MTP from them. The emitted tokens equal plain decoding's with the same injection (greedy; tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ThinkingBudget:
    budget: int
    start_id: int  # <think>
    end_id: int  # </think>
    phrase: tuple[int, ...]  # the stop-thinking phrase's token ids (contains end_id)

    def __post_init__(self):
        if self.budget < 0:
            raise ValueError(f"thinking budget must be >= 0, got {self.budget}")
        if self.end_id not in self.phrase:
            raise ValueError("the stop-thinking phrase must close the thinking block (contain </think>)")

    def tracker(self, prompt: Sequence[int]) -> "ThinkingTracker":
        return ThinkingTracker(self, prompt)


class ThinkingTracker:
    """One request's thinking state: open or not, tokens counted, whether the phrase was injected."""

    def __init__(self, spec: ThinkingBudget, prompt: Sequence[int]):
        self.spec = spec
        p = list(prompt)
        last_open = max((i for i, t in enumerate(p) if t == spec.start_id), default=-1)
        last_close = max((i for i, t in enumerate(p) if t == spec.end_id), default=-1)
        self.open = last_open > last_close
        self.count = 0
        self.injected_at: int | None = None  # output index where the phrase starts

    def inject_first(self) -> bool:
        """Budget 0 with the block open at the prompt's end: the phrase comes before any generated token."""
        return self.open and self.spec.budget == 0

    def cut(self, tokens: Sequence[int], emitted_before: int) -> tuple[int, bool]:
        """``tokens``: newly emitted, in order (``emitted_before`` tokens came before them). Returns how many to
        keep and whether the phrase follows them (the budget was reached at the last kept one)."""
        for i, t in enumerate(tokens):
            if self.injected_at is not None:
                break
            if self.open:
                if t == self.spec.end_id:
                    self.open = False
                    continue
                self.count += 1
                if self.count >= self.spec.budget:
                    self.open = False
                    self.injected_at = emitted_before + i + 1
                    return i + 1, True
            elif t == self.spec.start_id:
                self.open, self.count = True, 0
                if self.spec.budget == 0:
                    self.open = False
                    self.injected_at = emitted_before + i + 1
                    return i + 1, True
        return len(tokens), False

    def forced(self, emitted_before: int) -> list[int]:
        """The phrase, marked as injected at output index ``emitted_before``."""
        self.open = False
        self.injected_at = emitted_before
        return list(self.spec.phrase)


class ForcedFeed:
    """A plain decoder's thinking budget, one token per step: once the budget is reached the phrase's tokens replace
    the decoder's picks, one per step, each fed as the next decode row (what ``plain_generate``'s one forward over
    the phrase computes, a row at a time). Used alike by every plain decoder, at one user or a batch of them."""

    def __init__(self, spec: ThinkingBudget, prompt: Sequence[int]):
        self.tracker = spec.tracker(prompt)
        self.queue: list[int] = []

    def forced_next(self, index: int) -> int | None:
        """The forced token at output index ``index``, or None when the decoder's own pick goes there (a forced
        token is never an end of sequence: the phrase is emitted whole, up to the token limit)."""
        if not self.queue and index == 0 and self.tracker.inject_first():
            self.queue = self.tracker.forced(0)
        return self.queue.pop(0) if self.queue else None

    def picked(self, token: int, index: int) -> None:
        """The decoder's own pick ``token`` was emitted at ``index``: the phrase follows it when it reached the
        budget."""
        if self.tracker.cut([token], index)[1]:
            self.queue = self.tracker.forced(index + 1)

    def choose(self, pick: int, index: int) -> tuple[int, bool]:
        """For decoders that pick every step anyway (a device sampler): the token emitted at ``index`` given the
        pick there, and whether it was forced (the pick is then dropped)."""
        forced = self.forced_next(index)
        if forced is not None:
            return forced, True
        self.picked(pick, index)
        return pick, False
