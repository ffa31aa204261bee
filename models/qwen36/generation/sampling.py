"""Sampling parameters and the one logits -> probabilities transform used for BOTH target and draft.

Rejection sampling is exact only if the target and the draft distributions go through the same transform, so there
is exactly one function for it: :func:`probs_from_logits`. The transform follows vLLM's sampler, in vLLM's order:

    penalties (repetition, frequency, presence)  ->  temperature  ->  min_p  ->  top-k  ->  top-p  ->  softmax

Greedy decoding (temperature 0) is the argmax of the penalised logits (:func:`penalize`).

Penalties need the context a row is predicted in: which token ids occur in the prompt or in the output so far, and
how often each occurs in the output (:class:`Penalties`; :class:`TokenHistory` keeps them for a generation and hands
out per-row views, so that verify row j of a speculative step sees the drafts d_1..d_j accepted before it, exactly
what plain decoding would have seen at that position).

Logprobs are vLLM's default ``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the model's raw logits, before any
penalty, temperature or truncation (:func:`token_logprobs`). They are therefore the same whatever the sampling
settings, and a speculative run reports the same numbers as plain decoding up to the verify forward's rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import UserError

GREEDY_TEMPERATURE = 0.0  # temperature 0 means argmax decoding (no randomness at all)
MAX_LOGPROBS = 20  # largest top-n a request may ask for (vLLM's default max_logprobs)
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2] (vLLM's and OpenAI's range)
# How the MTP picks drafts in a stochastic speculative run (SamplingParams.draft; its ``sampled_drafts`` is the one
# test of it): "sample" draws from the transformed draft distribution, "greedy" takes the argmax (one-hot drafts).
DRAFT_MODES = ("sample", "greedy")


class SamplingParamsError(UserError, ValueError):
    """A sampling parameter outside its range (a ValueError too, for callers that catch that)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated once here (vLLM's names and meanings).

    temperature: 0 -> greedy (argmax target, argmax drafts, greedy acceptance); > 0 -> stochastic.
    top_k: keep the k most likely tokens (0 or -1 = off). top_p: keep the smallest set whose mass reaches p (1 = off).
    seed: seeds the one torch.Generator that every random draw of a run comes from.
    draft: how the MTP picks drafts when stochastic: "sample" (from the transformed draft distribution)
        or "greedy" (argmax; acceptance then uses a one-hot draft distribution). Ignored when greedy.
    min_p: drop tokens whose probability (after temperature) is below min_p times the top token's (0 = off).
    repetition_penalty: > 0; tokens seen in the prompt or the output get positive logits divided by it and negative
        logits multiplied by it (1 = off).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in the
        output (presence, once) or times its number of occurrences in the output (frequency). 0 = off.
    logprobs: None = none; n in [0, MAX_LOGPROBS] = the emitted token's logprob plus the n most likely tokens'.
    """

    temperature: float = GREEDY_TEMPERATURE
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft: str = "sample"
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str):
            raise SamplingParamsError(msg)

        def real(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
            return float(v)

        if real("temperature") < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # one spelling of "off" from here on
        if not 0.0 < real("top_p") <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= real("min_p") <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if real("repetition_penalty") <= 0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= real(name) <= PENALTY_RANGE:
                bad(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off), got {getattr(self, name)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top-n per emitted token), got {self.logprobs!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.draft not in DRAFT_MODES:
            bad(f"draft must be 'sample' or 'greedy', got {self.draft!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is on (the logits then depend on the prompt and the output so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def sampled_drafts(self) -> bool:
        """Drafts drawn from the transformed draft distribution (stochastic run, draft="sample"); otherwise argmax
        drafts, whose draft distribution in stochastic acceptance is one-hot."""
        return not self.greedy and self.draft == "sample"

    def generator(self, device="cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)

    def describe(self) -> str:
        """One line for logs and the demo: "greedy" or "stochastic (T=..., seed=..., ...)", then what else is on."""
        opts = [f"{n}={getattr(self, n):g}" for n, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0),
                                                            ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                                            ("frequency_penalty", 0.0)) if getattr(self, n) != off]
        if self.logprobs is not None:
            opts.append(f"logprobs={self.logprobs}")
        if self.greedy:
            return "greedy" + (f" ({', '.join(opts)})" if opts else "")
        return f"stochastic (T={self.temperature:g}, seed={self.seed}, drafts={self.draft}" + "".join(
            f", {o}" for o in opts) + ")"


@dataclass
class Penalties:
    """The context the penalties read, broadcastable against logits ``[..., V]``: ``seen`` (bool, the token occurs
    in the prompt or the output) and ``counts`` (fp32, occurrences in the output)."""

    seen: torch.Tensor
    counts: torch.Tensor


class TokenHistory:
    """Prompt mask and output counts of one generation (batch 1), on the logits' device.

    :meth:`now` is the context of the next token; :meth:`rows` the contexts of the K+1 verify rows of a step with
    drafts d_1..d_K (row j has d_1..d_j added, because row j is used only when they were all accepted).
    :meth:`add` publishes emitted tokens (call it on commit only, so an aborted step leaves no trace)."""

    def __init__(self, prompt: Sequence[int], vocab: int, device="cpu"):
        self.vocab = vocab
        self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.prompt_mask[torch.as_tensor(list(prompt), dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)

    def clone(self) -> "TokenHistory":
        out = TokenHistory.__new__(TokenHistory)
        out.vocab, out.prompt_mask, out.counts = self.vocab, self.prompt_mask.clone(), self.counts.clone()
        return out

    def add(self, tokens: Sequence[int] | torch.Tensor) -> None:
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.counts.device).reshape(-1)
        self.counts.index_add_(0, t, torch.ones(t.numel(), device=self.counts.device))

    def now(self) -> Penalties:
        return Penalties(self.prompt_mask | (self.counts > 0), self.counts)

    def rows(self, drafts: torch.Tensor) -> Penalties:
        """drafts [K] (or [1, K]) -> contexts [K+1, V] of verify rows 0..K."""
        d = drafts.reshape(-1).to(self.counts.device)
        onehot = torch.nn.functional.one_hot(d, self.vocab).float()  # [K, V]
        added = torch.cat([torch.zeros(1, self.vocab, device=d.device), onehot.cumsum(0)], 0)  # [K+1, V]
        counts = self.counts[None] + added
        return Penalties(self.prompt_mask[None] | (counts > 0), counts)


def penalize(logits: torch.Tensor, params: SamplingParams, pen: Penalties | None) -> torch.Tensor:
    """fp32 logits after repetition, frequency and presence penalties (vLLM's formulas). No penalty -> fp32 copy."""
    x = logits.float()
    if not params.penalized:
        return x
    if pen is None:
        raise ValueError("penalties are on but no token context (Penalties) was given")
    r = params.repetition_penalty
    if r != 1.0:
        x = torch.where(pen.seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty != 0.0:
        x = x - params.frequency_penalty * pen.counts
    if params.presence_penalty != 0.0:
        x = x - params.presence_penalty * (pen.counts > 0).float()
    return x


def probs_from_logits(logits: torch.Tensor, params: SamplingParams, pen: Penalties | None = None) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after penalties, temperature, min_p, top-k, top-p."""
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0 (greedy decoding uses argmax)")
    x = penalize(logits, params, pen) / params.temperature
    if params.min_p > 0.0:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token always survives (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [B, V] -> token ids [B] (int64), one draw per row from ``generator``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               pen: Penalties | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B]: argmax of the penalised logits when greedy, else a draw from the transformed
    distribution."""
    if params.greedy:
        return penalize(logits, params, pen).argmax(-1)
    return sample(probs_from_logits(logits, params, pen), generator)


@dataclass(frozen=True)
class TokenLogprobs:
    """Raw logprobs of one emitted token: its own, its rank (1 = most likely) and the ``top`` n (id, logprob)."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "rank": self.rank,
                "top": [[t, lp] for t, lp in self.top]}


def token_logprobs(logits_row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """Raw logprobs (log_softmax of the unprocessed logits [V]) of ``token`` and the top ``n``."""
    lp = torch.log_softmax(logits_row.double().reshape(-1), -1)
    own = lp[int(token)]
    rank = int((lp > own).sum()) + 1
    top = lp.topk(n) if n > 0 else None
    pairs = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
    return TokenLogprobs(int(token), float(own), rank, pairs)
