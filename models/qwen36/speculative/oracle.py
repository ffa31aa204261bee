"""Autoregressive oracle: replay a step's tokens one decode step at a time from the pre-step state.

Target: consume ``[pending, t_1..t_a]`` with single-row forwards (the arithmetic of plain greedy decoding).
MTP: the cache entry for position t comes from (h_t, embed(x_{t+1})) with h_t the target's post-norm hidden
(the MTP KV entry of position t needs h_t, known only once t is verified); the oracle writes the pending reseed rows and then the step's rows one row at a time, using
its own single-row hiddens. The result is what a committed state must equal (bitwise where the kernels
match, within stated tolerances where a multi-row forward computed it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.model import Qwen36Model
from ..reference.state import ModelState, MTPState
from .reference_backend import ReferenceLive, Reseed


@dataclass
class OracleResult:
    live: ReferenceLive  # target + MTP state after the step, MTP fully reseeded (mtp.pos == state.pos)
    logits: torch.Tensor  # [a+1, V] target logits of the consumed rows
    hidden: torch.Tensor  # [1, a+1, H]


def mtp_rows_serial(model: Qwen36Model, mtp: MTPState, reseed: Reseed) -> None:
    """Write MTP KV rows reseed.pos0.. one row per forward."""
    for j in range(reseed.tokens.shape[1]):
        model.mtp_forward(reseed.tokens[:, j:j + 1], reseed.hidden[:, j:j + 1], reseed.pos0 + j, mtp)
    mtp.pos = reseed.pos0 + reseed.tokens.shape[1]


@torch.no_grad()
def replay(model: Qwen36Model, pre: ReferenceLive, emitted: list[int]) -> OracleResult:
    """The state a step that emitted ``emitted`` (accepted drafts + final token) must leave behind."""
    live = pre.clone()
    n = live.state.pos
    logits, hidden = [], []
    for tok in [live.pending] + emitted[:-1]:
        out = model(torch.tensor([[tok]], device=live.reseed.tokens.device), live.state)
        logits.append(out.logits[0, -1])
        hidden.append(out.hidden)
    hidden_t = torch.cat(hidden, dim=1)
    mtp_rows_serial(model, live.mtp, live.reseed)
    live.reseed = Reseed(live.reseed.tokens.new_tensor([emitted]), hidden_t, n)
    mtp_rows_serial(model, live.mtp, live.reseed)
    live.reseed = Reseed(live.reseed.tokens[:, :0], hidden_t[:, :0], n + len(emitted))
    live.pending = emitted[-1]
    return OracleResult(live, torch.stack(logits), hidden_t)


@torch.no_grad()
def serial_decode(model: Qwen36Model, state: ModelState, first: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy single-row decode on ``state`` (advanced in place): consume ``first``, then each argmax.
    Returns (tokens [steps], logits [steps, V])."""
    tok, toks, logits = first, [], []
    dev = model.embed_tokens.weight.device
    for _ in range(steps):
        lg = model(torch.tensor([[tok]], device=dev), state).logits[0, -1]
        tok = int(lg.argmax())
        toks.append(tok)
        logits.append(lg)
    return toks, torch.stack(logits)


def greedy_continuation(model: Qwen36Model, pre: ReferenceLive, steps: int) -> list[int]:
    """The oracle's own next ``steps`` greedy tokens after the pending token (used to force acceptance lengths)."""
    return serial_decode(model, pre.state.clone(), pre.pending, steps)[0]


def first_difference(a, b) -> int | None:
    """Index of the first position where token lists ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def divergence_note(model: Qwen36Model, context, got, want) -> str:
    """Why two greedy continuations of ``context`` part: the reference model's top-2 logit margin where they first
    differ. A margin near zero is a near tie (a last-bit difference upstream can flip it); a large margin means the
    diverging path computed something else (a state bug). Empty when they do not differ."""
    i = first_difference(list(got), list(want))
    if i is None:
        return ""
    ids = torch.tensor([list(context) + list(want[:i])])
    logits = model(ids, model.new_state(1, ids.shape[1] + 1)).logits[0, -1].float()
    top2 = torch.topk(logits, 2)
    margin = float(top2.values[0] - top2.values[1])
    g = got[i] if i < len(got) else None
    w = want[i] if i < len(want) else None
    return (f"first difference at generated token {i} (got {g}, expected {w}): reference top-2 margin {margin:.4g} "
            f"(top-2 ids {top2.indices.tolist()}){' - a near tie' if margin < 0.05 else ''}")
