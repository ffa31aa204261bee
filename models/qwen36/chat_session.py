"""A multi-turn chat session: Qwen3.6's chat format (``chat.py``), the hybrid prefix cache (``prefix_cache.py``) and
the thinking budget (``speculative/thinking.py``) on one backend. Used by ``qwen36 chat`` and the ``prefix-cache``
probe.

Per turn: the conversation is rendered with the template (thinking on unless the budget is 0) and generated through
the cache (the prompt resumes from its longest cached block boundary); the reply is split into reasoning and answer
and appended; then the history the next turn will repeat (``chat.history_ids``) is filled into the cache, off the
next turn's time to first token, so the next prompt prefills only its new tokens plus at most one block.

Runners (what generates one turn):
* reference, plain: ``plain_generate`` (greedy or sampled, thinking budget);
* reference, speculative: ``ReferenceBackend`` + ``speculative_generate`` (any commit mechanism, thinking budget);
* TT (emulated mesh or cards), plain: ``TTGenerator.generate`` (GDN / conv / KV restored by device copies; thinking
  budget with the phrase fed as decode rows);
* TT, speculative: ``TTSpecBackend`` with the device MTP drafter (the MTP prefill redone from cached hidden rows);
  thinking budget through ``TTSpecBackend.inject`` (the phrase through the step's own traces).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .chat import THINK_END, THINK_START, STOP_THINKING_PHRASE, history_ids, parse_turn, prompt_ids
from .prefix_cache import PrefixCache
from .speculative.sampling import SamplingParams
from .speculative.thinking import ThinkingBudget


@dataclass
class TurnStats:
    prompt_tokens: int
    reused: int  # prompt tokens restored from the cache
    computed: int  # prompt tokens prefilled at this turn (time to first token)
    filled: int  # history tokens prefilled into the cache after the previous turn (off this turn's TTFT)
    ttft_s: float  # measured: prefill + first token
    new_tokens: int
    decode_s: float  # measured: the rest of the turn
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    reasoning: str = ""
    answer: str = ""
    thinking_phrase_at: int | None = None

    @property
    def tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else float("nan")

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("logits",)}
        d["tok_s"] = self.tok_s
        return d


class _RefPlain:
    def __init__(self, model, cache, keep_logits):
        self.model, self.cache, self.keep_logits = model, cache, keep_logits
        self.label = f"reference (torch {model.embed_tokens.weight.device.type.upper()})"

    def run(self, prompt, max_new, params, eos, thinking):
        from .speculative.plain import plain_generate

        res = plain_generate(self.model, prompt, max_new, params, eos, prefix_cache=self.cache,
                             keep_logits=self.keep_logits, thinking=thinking)
        return res.tokens, res.prefill.reused, res.prefill.computed, res.prefill_s, res.logits

    def fill(self, ids):
        from .reference.prefix import fill

        return fill(self.model, ids, self.cache) if self.cache is not None and len(ids) > 1 else 0


class _RefSpec(_RefPlain):
    def __init__(self, model, cache, mechanism, k):
        super().__init__(model, cache, False)
        self.mechanism, self.k = mechanism, k

    def run(self, prompt, max_new, params, eos, thinking):
        from .speculative.engine import speculative_generate
        from .speculative.reference_backend import ReferenceBackend

        forced = len(thinking.phrase) if thinking is not None else 0  # the phrase's rows
        be = ReferenceBackend(self.model, self.mechanism, max_len=len(prompt) + max_new + forced + self.k + 2,
                              max_k=self.k, prefix_cache=self.cache)
        # the finished user leaves its slot: its cached prefix blocks become evictable
        res = speculative_generate(be, [prompt], max_new, [self.k], [params], eos, thinking=thinking)[0]
        self.label = be.label + f" speculative K={self.k} {be.mechanism.name}"
        return res.tokens, be.last_prefill.reused, be.last_prefill.computed, be.prefill_s, None


class _TTPlain:
    def __init__(self, gen, cache, keep_logits):
        self.gen, self.cache, self.keep_logits = gen, cache, keep_logits
        self.label = gen.label or "tt"

    def run(self, prompt, max_new, params, eos, thinking):
        res = self.gen.generate(prompt, max_new, params, eos, prefix_cache=self.cache, keep_logits=self.keep_logits,
                                thinking=thinking)
        reused, computed = (res.prefill.reused, res.prefill.computed) if res.prefill is not None else (0, len(prompt))
        return res.tokens, reused, computed, res.prefill_s, res.logits

    def fill(self, ids):
        if self.cache is None or len(ids) < 2:
            return 0
        res = self.gen.prefill_cached(ids, self.cache)
        res.lease.release()
        return res.computed


class _TTSpec(_TTPlain):
    """TTSpecBackend (traced verify / commit, device MTP drafter) through the cache: the target state is restored,
    the MTP prefill redone over the prompt from the (cached + computed) hidden rows (tt/runtime/prefix.py)."""

    def __init__(self, gen, cache, mechanism, k, drafter):
        super().__init__(gen, cache, False)
        self.mechanism, self.k, self.drafter = mechanism, k, drafter

    def run(self, prompt, max_new, params, eos, thinking):
        from .speculative.engine import speculative_generate
        from .tt.spec.spec_backend import TTSpecBackend

        self.gen.release_trace()
        be = TTSpecBackend(self.gen, self.mechanism, drafter=self.drafter, prefix_cache=self.cache)
        try:
            res = speculative_generate(be, [prompt], max_new, [self.k], [params], eos, thinking=thinking)[0]
        finally:
            be.close()
        self.label = f"{be.label} speculative K={self.k} {be.mechanism.name}"
        return res.tokens, be.last_prefill.reused, be.last_prefill.computed, be.prefill_s, None


class ChatSession:
    """One conversation. ``target``: a reference ``Qwen36Model`` or a ``TTGenerator``; ``cache``: a PrefixCache or
    None; ``spec_k`` > 0: speculative (reference only); ``thinking_budget``: None (unlimited), 0 (non-thinking
    mode) or N."""

    def __init__(self, target, tok, *, cache: PrefixCache | None, params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 64, thinking_budget: int | None = None, spec_k: int = 0,
                 mechanism: str = "shadow_commit", preserve_thinking: bool = False, keep_logits: bool = False,
                 system: str | None = None, drafter=None):
        from .reference.model import Qwen36Model

        self.tok, self.cache, self.params, self.max_new = tok, cache, params, max_new_tokens
        self.preserve = preserve_thinking
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(target, Qwen36Model):
            self.runner = _RefSpec(target, cache, mechanism, spec_k) if spec_k else _RefPlain(target, cache, keep_logits)
        else:
            if spec_k and drafter is None:
                raise ValueError("speculative chat on a TT device needs the device MTP drafter")
            self.runner = (_TTSpec(target, cache, mechanism, spec_k, drafter) if spec_k
                           else _TTPlain(target, cache, keep_logits))
        start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
        self.thinking_on = thinking_budget != 0
        self.thinking = (ThinkingBudget(thinking_budget, start, end, tuple(tok.encode(STOP_THINKING_PHRASE)))
                         if thinking_budget else None)
        eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        self.eos = tuple(sorted(eos))
        self.filled = 0
        self.last_prompt: list[int] = []
        self.last_history: list[int] = []  # what the next prompt starts with (filled into the cache)

    @property
    def label(self) -> str:
        return self.runner.label

    def turn(self, text: str) -> TurnStats:
        self.messages.append({"role": "user", "content": text})
        prompt = prompt_ids(self.tok, self.messages, enable_thinking=self.thinking_on, preserve_thinking=self.preserve)
        self.last_prompt = prompt
        t0 = time.perf_counter()
        tokens, reused, computed, ttft, logits = self.runner.run(prompt, self.max_new, self.params, self.eos,
                                                                 self.thinking)
        total = time.perf_counter() - t0
        turn = parse_turn(self.tok, tokens, thinking_open=self.thinking_on)
        self.messages.append(turn.message())
        phrase = list(self.thinking.phrase) if self.thinking else None
        # where the stop-thinking phrase starts (it may be cut by the token limit)
        injected = next((i for i in range(len(tokens)) if phrase and tokens[i:i + len(phrase)] == phrase[:len(tokens) - i]),
                        None)
        stats = TurnStats(len(prompt), reused, computed, self.filled, ttft, len(tokens), total - ttft, tokens, logits,
                          turn.reasoning, turn.answer, injected)
        # what the next turn repeats goes into the cache now, off its time to first token
        self.last_history = history_ids(self.tok, self.messages, preserve_thinking=self.preserve)
        self.filled = self._fill(self.last_history)
        return stats

    def _fill(self, ids: list[int]) -> int:
        """Cache the whole blocks of ``ids`` not cached yet (a prefill up to the last block boundary before its last
        token); returns the tokens computed (0 when nothing new would be cached)."""
        if self.cache is None:
            return 0
        b = self.cache.block_size
        cut = (len(ids) - 1) // b * b
        if cut == 0 or len(self.cache.match(ids, cut)) * b == cut:
            return 0
        return self.runner.fill(ids[: cut + 1])

    def serve_cold(self, prompt: list[int]):
        """The same request served cold on the same backend: an empty cache of the same block size (the same
        prefill pieces), nothing else changed. -> (tokens, logits or None, ttft_s)."""
        warm = self.runner.cache
        self.runner.cache = PrefixCache(warm.block_size, warm.budget_bytes, warm.with_mtp) if warm is not None else None
        try:
            tokens, _, _, ttft, logits = self.runner.run(prompt, self.max_new, self.params, self.eos, self.thinking)
        finally:
            self.runner.cache = warm
        return tokens, logits, ttft


def replay(session: ChatSession, user_turns: Sequence[str]) -> list[TurnStats]:
    return [session.turn(t) for t in user_turns]


def user_turns_of(messages: list[dict]) -> tuple[str | None, list[str]]:
    """(system text or None, the user messages in order) of a --messages conversation; its assistant messages are
    replaced by the model's own answers when replayed."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    return system, [m["content"] for m in messages if m["role"] == "user"]


def describe(stats: TurnStats, i: int, label: str) -> str:
    tok_s = f"{stats.tok_s:.1f}" if stats.tok_s == stats.tok_s else "n/a"
    return (f"turn {i}: prompt {stats.prompt_tokens} tokens, prefill reused {stats.reused} / computed "
            f"{stats.computed} (history filled after the last turn: {stats.filled}), TTFT {stats.ttft_s * 1000:.1f} ms, "
            f"{stats.new_tokens} new tokens at {tok_s} tok/s (measured on {label})")

