"""Plain (non-speculative) decoding on the torch reference with the full sampling transform: the baseline that
speculative sampling must match in distribution, and that speculative greedy (with or without penalties) must match
token for token.

One target forward per token; the token is picked by :func:`.sampling.pick_token` with the penalty context of the
tokens emitted so far (:class:`.sampling.TokenHistory`), from one seeded generator (reproducible run to run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..prefix_cache import PrefixCache
from ..reference.prefix import PrefillResult, prefill as cached_prefill
from .sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs


@dataclass
class PlainResult:
    tokens: list[int]  # new tokens, cut after EOS (kept) and at max_new_tokens
    logprobs: list[TokenLogprobs] | None = None  # one per token when params.logprobs is not None
    logits: list[torch.Tensor] | None = None  # [V] fp32 per token, when asked for (``keep_logits``)
    prefill: PrefillResult | None = None  # tokens reused / computed by the prefill (a prefix cache's hit)


@torch.no_grad()
def plain_generate(model, prompt: Sequence[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                   eos_ids: Sequence[int] = (), prefix_cache: PrefixCache | None = None,
                   keep_logits: bool = False) -> PlainResult:
    """Batch 1: chunked prefill, then one recurrent decode step per token (the reference model's own calls).
    ``prefix_cache``: resume the prompt from its longest cached block boundary (``reference.prefix``); the
    request's blocks are released when it returns."""
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    dev = model.embed_tokens.weight.device
    gen = params.generator(dev) if not params.greedy else None
    history = TokenHistory(prompt, model.config.vocab_size, dev)
    state = model.new_state(1, len(prompt) + max_new_tokens + 1)
    pre = cached_prefill(model, state, prompt, prefix_cache)  # no cache: one forward over the prompt
    logits = pre.logits  # [1, V]
    tokens: list[int] = []
    lps: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
    kept: list[torch.Tensor] | None = [] if keep_logits else None
    try:
        while True:
            tok = int(pick_token(logits, params, gen, history.now()))
            tokens.append(tok)
            history.add([tok])
            if lps is not None:
                lps.append(token_logprobs(logits[0], tok, params.logprobs))
            if kept is not None:
                kept.append(logits[0].clone())
            if tok in eos_ids or len(tokens) >= max_new_tokens:
                return PlainResult(tokens, lps, kept, pre)
            logits = model(torch.tensor([[tok]], device=dev), state).logits[:, -1]
    finally:
        if pre.lease is not None:
            pre.lease.release()
