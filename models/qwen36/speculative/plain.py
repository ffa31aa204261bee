"""Plain (non-speculative) decoding on the torch reference with the full sampling transform: the baseline that
speculative sampling must match in distribution, and that speculative greedy (with or without penalties) must match
token for token.

One target forward per token; the token is picked by :func:`.sampling.pick_token` with the penalty context of the
tokens emitted so far (:class:`.sampling.TokenHistory`), from one seeded generator (reproducible run to run)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..prefix_cache import PrefixCache
from ..reference.prefix import PrefillResult, prefill as cached_prefill
from .thinking import ThinkingBudget
from .sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs


@dataclass
class PlainResult:
    tokens: list[int]  # new tokens, cut after EOS (kept) and at max_new_tokens
    logprobs: list[TokenLogprobs] | None = None  # one per token when params.logprobs is not None
    logits: list[torch.Tensor] | None = None  # [V] fp32 per token, when asked for (``keep_logits``)
    prefill: PrefillResult | None = None  # tokens reused / computed by the prefill (a prefix cache's hit)
    prefill_s: float | None = None  # wall time of the prefill and the first token's pick (time to first token)


@torch.no_grad()
def plain_generate(model, prompt: Sequence[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                   eos_ids: Sequence[int] = (), prefix_cache: PrefixCache | None = None,
                   keep_logits: bool = False, thinking: ThinkingBudget | None = None) -> PlainResult:
    """Batch 1: chunked prefill, then one recurrent decode step per token (the reference model's own calls).
    ``prefix_cache``: resume the prompt from its longest cached block boundary (``reference.prefix``); the
    request's blocks are released when it returns. ``thinking``: the thinking budget (``thinking.py``): at N
    thinking tokens the stop-thinking phrase is forced, as one forward over [last token, phrase...]."""
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    tracker = thinking.tracker(prompt) if thinking is not None else None
    if tracker is not None and params.logprobs is not None:
        raise ValueError("logprobs with a thinking budget are not supported (forced tokens have no sampled logprob)")
    tokens: list[int] = []
    if tracker is not None and tracker.inject_first():  # budget 0, block open: the phrase is part of the prefill
        tokens = tracker.forced(0)
        prompt = list(prompt) + tokens
    dev = model.embed_tokens.weight.device
    gen = params.generator(dev) if not params.greedy else None
    history = TokenHistory(prompt[: len(prompt) - len(tokens)], model.config.vocab_size, dev)
    history.add(tokens)
    extra = len(thinking.phrase) if thinking is not None else 0
    state = model.new_state(1, len(prompt) + max_new_tokens + extra + 1)
    t0 = time.perf_counter()
    pre = cached_prefill(model, state, prompt, prefix_cache)  # no cache: one forward over the prompt
    logits = pre.logits  # [1, V]
    ttft = None
    lps: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
    kept: list[torch.Tensor] | None = [] if keep_logits else None
    try:
        while True:
            tok = int(pick_token(logits, params, gen, history.now()))
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            tokens.append(tok)
            history.add([tok])
            if lps is not None:
                lps.append(token_logprobs(logits[0], tok, params.logprobs))
            if kept is not None:
                kept.append(logits[0].clone())
            if tok in eos_ids or len(tokens) >= max_new_tokens:
                return PlainResult(tokens[:max_new_tokens], lps, kept, pre, ttft)
            rows = [tok]
            if tracker is not None and tracker.cut([tok], len(tokens) - 1)[1]:  # the budget is reached at tok
                forced = tracker.forced(len(tokens))
                rows += forced
                tokens += forced
                history.add(forced)
                if len(tokens) >= max_new_tokens:
                    return PlainResult(tokens[:max_new_tokens], lps, kept, pre, ttft)
            out = model(torch.tensor([rows], device=dev), state).logits  # forced rows: a prefill continuation
            if kept is not None:
                kept += [row.clone() for row in out[0, :-1]]
            logits = out[:, -1]
    finally:
        if pre.lease is not None:
            pre.lease.release()
