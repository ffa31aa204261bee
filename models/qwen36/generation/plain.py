"""Plain (non-speculative) decoding: one driver for every backend and any number of users (one user is B = 1).

    results = plain_generate(backend, prompts, max_new_tokens, params, eos_ids, arrivals=..., thinking=...)

A :class:`DecodeBackend` owns ``slots`` user slots and all model state: ``join`` prefills a prompt alone into a
free slot and emits the user's first token, ``step`` feeds every stepping user's last token as one decode row (one
forward over the slots) and emits each one's next token, ``leave`` frees a slot. The backend picks the tokens
(with each user's :class:`~.sampling.SamplingParams`, on the host from read-back logits rows (:class:`HostPicks`)
or on the device), so a device backend reads back only token ids.

The driver does the rest, the same for the torch reference and the TT model: arrivals (user i joins at step
``arrivals[i]`` into the lowest free slot, waiting while none is free), the thinking budget (one
:class:`~.thinking.ThinkingBudget` for every user, each counted on its own: once a user's budget is reached the
stop-thinking phrase's tokens replace its picks, one per step, each fed as the next decode row; the backend is told
which emissions are forced, so a host pick draws nothing there), EOS (kept) and per-user token limits, and each
user's :class:`PlainResult`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from .sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs
from .thinking import ForcedFeed, ThinkingBudget


@dataclass
class PlainResult:
    """One user's plain decode."""

    tokens: list[int]  # new tokens, cut after EOS (kept) and at the user's token limit
    logprobs: list[TokenLogprobs] | None = None  # one per token when the params asked for them
    logits: list[torch.Tensor] | None = None  # [V] fp32 per token: the row each was picked from (a backend keeping them)
    prefill: Any = None  # the backend's prefill result (tokens reused / computed, a prefix cache's lease)
    prefill_s: float | None = None  # wall time of the prefill and the first token's pick (time to first token)
    slot: int = -1  # the slot the user decoded in


@dataclass
class Pick:
    """What a backend emits for one user at one step: the token, its logprobs (when asked, never for a forced
    token), the logits row it came from (a backend that keeps them) and, from ``join``, the prefill's result."""

    token: int
    logprobs: TokenLogprobs | None = None
    logits: torch.Tensor | None = None
    prefill: Any = None


@runtime_checkable
class DecodeBackend(Protocol):
    """What :func:`plain_generate` drives. ``forced``: the token the driver emits for that user instead of a pick
    (the thinking budget's phrase); a backend that picks on the host then draws nothing, one that picks on the
    device keeps the user's penalty state in step with the forced token."""

    label: str
    slots: int

    def free_slots(self) -> list[int]:
        """Free slots, lowest first."""

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams, forced: int | None = None) -> Pick:
        """Prefill ``prompt`` alone into the free ``slot``; the user's first token (from the prompt's last row)."""

    def step(self, tokens: Mapping[int, int], forced: Mapping[int, int]) -> dict[int, Pick]:
        """One decode row per user in ``tokens`` (slot -> its last token), one forward; each user's next token."""

    def leave(self, slot: int) -> None:
        """Free ``slot`` (its user is done)."""


class HostPicks:
    """The host pick of a backend that reads its logits rows back: per slot the user's params, its seeded generator
    and its token history (penalties), the pick by :func:`~.sampling.pick_token` (argmax of the penalised row when
    greedy), logprobs when asked, the row kept when ``keep_logits``."""

    def __init__(self, vocab: int, device="cpu", keep_logits: bool = False):
        self.vocab, self.device, self.keep_logits = vocab, device, keep_logits
        self.users: dict[int, tuple[SamplingParams, torch.Generator | None, TokenHistory]] = {}

    def start(self, slot: int, prompt: Sequence[int], params: SamplingParams, logits: torch.Tensor,
              forced: int | None = None) -> Pick:
        """A user joined ``slot``: its first token from the prompt's last row ``logits`` [V]."""
        gen = params.generator(self.device) if not params.greedy else None
        self.users[slot] = (params, gen, TokenHistory(prompt, self.vocab, self.device))
        return self.next(slot, logits, forced)

    def next(self, slot: int, logits: torch.Tensor, forced: int | None = None) -> Pick:
        """The user's token from the row ``logits`` [V] (or ``forced``: no draw)."""
        params, gen, history = self.users[slot]
        lp = None
        if forced is None:
            tok = int(pick_token(logits.reshape(1, -1), params, gen, history.now()))
            if params.logprobs is not None:
                lp = token_logprobs(logits.reshape(-1), tok, params.logprobs)
        else:
            tok = int(forced)
        history.add([tok])
        return Pick(tok, lp, logits.reshape(-1).clone() if self.keep_logits else None)

    def stop(self, slot: int) -> None:
        self.users.pop(slot, None)


@torch.no_grad()
def plain_generate(backend: DecodeBackend, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   params: SamplingParams | Sequence[SamplingParams] | None = None, eos_ids: Sequence[int] = (), *,
                   arrivals: Sequence[int] | None = None, thinking: ThinkingBudget | None = None) -> list[PlainResult]:
    """Decode ``prompts`` on ``backend`` (module doc): user i with ``params[i]`` (one ``SamplingParams`` for every
    user, or one per user; default greedy), its token limit (``max_new_tokens``: one count or one per user), joining
    at step ``arrivals[i]`` (default 0). Each user stops at its EOS (kept; a forced token never ends it) or its limit
    and leaves its slot while the others go on; its tokens depend on its own inputs only."""
    prompts = [[int(t) for t in torch.as_tensor(p).reshape(-1).tolist()] for p in prompts]  # lists, tensors
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts")
    params = [SamplingParams()] * n if params is None else params
    params = [params] * n if isinstance(params, SamplingParams) else list(params)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    arrivals = [0] * n if arrivals is None else list(arrivals)
    if not len(params) == len(limits) == len(arrivals) == n:
        raise ValueError(f"{n} prompts but {len(params)} sampling params, {len(limits)} token limits and "
                         f"{len(arrivals)} arrivals")
    if min(limits) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if min(arrivals) < 0:
        raise ValueError(f"arrival steps must be >= 0, got {arrivals}")
    if thinking is not None and any(p.logprobs is not None for p in params):
        raise ValueError("logprobs with a thinking budget are not supported (forced tokens have no sampled logprob)")
    results = [PlainResult([], [] if p.logprobs is not None else None) for p in params]
    feeds = [ForcedFeed(thinking, p) if thinking is not None else None for p in prompts]
    active: dict[int, int] = {}  # slot -> user
    pending = sorted(range(n), key=lambda i: (arrivals[i], i))

    def forced(user: int) -> int | None:
        feed = feeds[user]
        return feed.forced_next(len(results[user].tokens)) if feed is not None else None

    def emit(user: int, pick: Pick, was_forced: bool) -> None:
        res, feed = results[user], feeds[user]
        if feed is not None and not was_forced:
            feed.picked(pick.token, len(res.tokens))
        res.tokens.append(pick.token)
        if res.logprobs is not None:
            res.logprobs.append(pick.logprobs)
        if pick.logits is not None:
            res.logits = (res.logits or []) + [pick.logits]
        if (not was_forced and pick.token in eos_ids) or len(res.tokens) >= limits[user]:
            del active[res.slot]
            backend.leave(res.slot)

    step = 0
    while pending or active:
        while pending and arrivals[pending[0]] <= step and backend.free_slots():
            user, slot = pending.pop(0), backend.free_slots()[0]
            res = results[user]
            res.slot, active[slot] = slot, user
            f = forced(user)
            t0 = time.perf_counter()
            pick = backend.join(slot, prompts[user], params[user], f)
            res.prefill, res.prefill_s = pick.prefill, time.perf_counter() - t0
            emit(user, pick, f is not None)
        if active:
            fs = {slot: f for slot, user in active.items() if (f := forced(user)) is not None}
            picks = backend.step({slot: results[user].tokens[-1] for slot, user in active.items()}, fs)
            for slot, user in list(active.items()):
                emit(user, picks[slot], slot in fs)
        step += 1
    return results
