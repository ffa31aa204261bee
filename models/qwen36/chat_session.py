"""A multi-turn chat session: Qwen3.6's chat format (``chat.py``), the hybrid prefix cache (``prefix_cache.py``) and
the thinking budget (``generation/thinking.py``) on one backend. Used by ``qwen36 chat`` and the ``prefix-cache``
probe.

Per turn: the conversation is rendered with the template (thinking on unless the budget is 0) and generated through
the cache (the prompt resumes from its longest cached block boundary); the reply is split into reasoning and answer
and appended; then the history the next turn will repeat (``chat.history_ids``) is filled into the cache, off the
next turn's time to first token, so the next prompt prefills only its new tokens plus at most one block.

One runner generates a turn on the session's target (a reference model or a TT generator, each behind a small
adapter that says how it decodes, builds a speculative backend and fills the cache): plain decoding through the one
driver (``generation.plain``; greedy or sampled, thinking budget), or ``speculative_generate`` on a backend built for
the turn (any commit mechanism, thinking budget).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .chat import THINK_END, THINK_START, STOP_THINKING_PHRASE, history_ids, parse_turn, prompt_ids
from .prefix_cache import PrefixCache
from .generation.sampling import SamplingParams
from .generation.thinking import ThinkingBudget


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


class _Reference:
    """A reference ``Qwen36Model`` as the session's target: plain turns on ``reference.batch.generate``, speculative
    ones on a ``ReferenceBackend``, the cache filled by ``reference.prefix.fill``."""

    def __init__(self, model):
        self.model = model
        self.label = f"reference (torch {model.embed_tokens.weight.device.type.upper()})"

    def generate(self, prompt, max_new, params, eos, *, cache, keep_logits, thinking):
        from .reference.batch import generate

        return generate(self.model, [prompt], max_new, params, eos, prefix_cache=cache, keep_logits=keep_logits,
                        thinking=thinking)[0]

    def spec_backend(self, mechanism, k, cache, max_len):
        from .speculative.reference_backend import ReferenceBackend

        return ReferenceBackend(self.model, mechanism, max_len=max_len, max_k=k, prefix_cache=cache)

    def fill(self, ids, cache) -> int:
        from .reference.prefix import fill

        return fill(self.model, ids, cache)


class _TT:
    """A ``TTGenerator`` as the session's target: plain turns on its ``generate`` (GDN / conv / KV restored by device
    copies; the thinking phrase fed as decode rows), speculative ones on a ``TTSpecBackend`` with the device MTP
    drafter (the MTP prefill redone from cached hidden rows; the phrase through ``TTSpecBackend.inject``)."""

    def __init__(self, gen, drafter):
        self.gen, self.drafter = gen, drafter
        self.label = gen.label or "tt"

    def generate(self, prompt, max_new, params, eos, *, cache, keep_logits, thinking):
        return self.gen.generate([prompt], max_new, params, eos, prefix_cache=cache, keep_logits=keep_logits,
                                 thinking=thinking)[0]

    def spec_backend(self, mechanism, k, cache, max_len):
        from .tt.spec.build import build_spec_backend

        if self.drafter is None:
            raise ValueError("speculative chat on a TT device needs the device MTP drafter")
        self.gen.release_trace()
        return build_spec_backend(self.gen, self.drafter, depth=k, mechanism=mechanism, prefix_cache=cache)

    def fill(self, ids, cache) -> int:
        res = self.gen.prefill_cached(ids, cache)
        res.lease.release()
        return res.computed


class _Runner:
    """What generates one turn on the session's target: plain decoding (one driver, ``generation.plain``), or with
    ``spec_k`` ``speculative_generate`` on a backend built for the turn (the finished user leaves its slot: its
    cached prefix blocks become evictable). -> (tokens, prompt tokens reused, computed, time to first token,
    logits or None)."""

    def __init__(self, target, cache, keep_logits, spec_k, mechanism):
        self.target, self.cache, self.keep_logits = target, cache, keep_logits
        self.spec_k, self.mechanism = spec_k, mechanism
        self.label = target.label

    def run(self, prompt, max_new, params, eos, thinking):
        if not self.spec_k:
            res = self.target.generate(prompt, max_new, params, eos, cache=self.cache, keep_logits=self.keep_logits,
                                       thinking=thinking)
            pre = res.prefill
            reused, computed = (pre.reused, pre.computed) if pre is not None else (0, len(prompt))
            return res.tokens, reused, computed, res.prefill_s, res.logits
        from .speculative.engine import speculative_generate

        forced = len(thinking.phrase) if thinking is not None else 0  # the phrase's rows
        be = self.target.spec_backend(self.mechanism, self.spec_k, self.cache,
                                      len(prompt) + max_new + forced + self.spec_k + 2)
        try:
            res = speculative_generate(be, [prompt], max_new, [self.spec_k], [params], eos, thinking=thinking)[0]
        finally:
            getattr(be, "close", lambda: None)()
        self.label = f"{be.label} speculative K={self.spec_k} {be.mechanism.name}"
        return res.tokens, be.last_prefill.reused, be.last_prefill.computed, be.prefill_s, None

    def fill(self, ids):
        return self.target.fill(ids, self.cache) if self.cache is not None and len(ids) > 1 else 0


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
        if spec_k and drafter is None and not isinstance(target, Qwen36Model):
            raise ValueError("speculative chat on a TT device needs the device MTP drafter")
        tgt = _Reference(target) if isinstance(target, Qwen36Model) else _TT(target, drafter)
        self.runner = _Runner(tgt, cache, keep_logits if not spec_k else False, spec_k, mechanism)
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

