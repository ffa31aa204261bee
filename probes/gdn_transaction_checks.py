"""The comparing piece of probe gdn-transaction (probes/gdn_transaction.py): per-layer tensors against the oracle's
with the probe's tolerances, exact equality of a live state with a saved one, and the poisoning that makes any read
of a row or slot nobody owns visible (NaN in a batch-1 state; a large finite value in a batch's own past rows, where
a packed forward multiplies them by probability 0; NaN plus an odd position in the batch's free slot).

Tolerances. Where the oracle and the backend run the same kernels on the same rows (the abort leg;
snapshot/recompute at a = 0, which re-advance one row exactly like a decode step) equality must be bitwise.
Elsewhere the committed rows came from a multi-row forward: on CPU, nn.Linear over T rows and over 1 row
round differently in the last bits (measured max abs ~1e-6 on CPU, see TOLERANCES and docs/speculative.md),
so those compare with max-abs / PCC against TOLERANCES below.
"""
from __future__ import annotations

import torch

from qwen36.numerics import pcc
from qwen36.reference.state import GDNState, KVCache
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceLive

# name -> (max abs error, min PCC) for multi-row-vs-single-row comparisons (fp32). Measured worst cases over all
# 51 cells (torch 2.14 CPU): ci preset max abs 2.9e-6 (KV) / 4.1e-6 (continuation logits); 27b-ratios (--full)
# 5.4e-6 (KV), 4.3e-6 (conv), 2.7e-6 (recurrent); 1 - PCC < 1e-12 everywhere. The bounds sit ~10x above
# that and far below what one wrong row causes (an off-by-one slot: max abs > 1, PCC < 0.85).
TOLERANCES = {
    "gdn_recurrent": (5e-5, 0.999999),
    "conv": (5e-5, 0.999999),
    "target_kv": (5e-5, 0.999999),
    "mtp_kv": (5e-5, 0.999999),
    "continuation_logits": (1e-4, 0.999999),
}

PAST_POISON = 1.0e4  # large and finite: see the module docstring
FREE_SLOT_POS = 5  # the poisoned free slot's (odd) position


def compare(xs: list[torch.Tensor], ys: list[torch.Tensor], name: str, bitwise: bool) -> dict:
    """Per-layer tensors -> {bit_equal, max_abs, pcc (min over layers), pass} against TOLERANCES[name]."""
    bit = all(torch.equal(x, y) for x, y in zip(xs, ys))
    max_abs = max(float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(xs, ys))
    p = min(pcc(x, y) for x, y in zip(xs, ys))
    tol_abs, tol_pcc = TOLERANCES[name]
    ok = bit if bitwise else (max_abs <= tol_abs and p >= tol_pcc)
    return {"bit_equal": bit, "max_abs": max_abs, "pcc": p, "bitwise_required": bitwise, "pass": ok}


def kv_rows(caches, n: int) -> list[torch.Tensor]:
    return [t[:, :, :n] for c in caches for t in (c.k, c.v)]


def poison_live_past(live: ReferenceLive, end: int) -> None:
    """Fill a batch-1 copy's target and MTP KV rows >= end with NaN."""
    for c in live.state.kv_caches() + [live.mtp.kv]:
        c.k[:, :, end:] = float("nan")
        c.v[:, :, end:] = float("nan")


def poison_past(be: ReferenceBackend, slot: int, end: int, value: float = float("nan")) -> None:
    """Fill the user's target and MTP KV rows >= end (rejected / provisional rows) with ``value`` (NaN: it would
    spread through anything that read it)."""
    for c in be.state.kv_caches() + [be.mtp.kv]:
        c.k[slot, :, end:] = value
        c.v[slot, :, end:] = value


def live_equal(live: ReferenceLive, pre: ReferenceLive) -> dict[str, bool]:
    """Exact equality of everything a rejected step must not change (KV rows >= pos are scratch by design)."""
    g, h = live.state.gdn_states(), pre.state.gdn_states()
    n, m = pre.state.pos, pre.mtp.pos
    return {
        "pos": live.state.pos == n and live.mtp.pos == m,
        "pending": live.pending == pre.pending,
        "gdn_recurrent": all(torch.equal(x.recurrent, y.recurrent) for x, y in zip(g, h)),
        "conv": all(torch.equal(x.conv, y.conv) for x, y in zip(g, h)),
        "target_kv": all(torch.equal(x, y) for x, y in zip(kv_rows(live.state.kv_caches(), n), kv_rows(pre.state.kv_caches(), n))),
        "mtp_kv": all(torch.equal(x, y) for x, y in zip(kv_rows([live.mtp.kv], m), kv_rows([pre.mtp.kv], m))),
        "reseed": (live.reseed.pos0 == pre.reseed.pos0 and torch.equal(live.reseed.tokens, pre.reseed.tokens)
                   and torch.equal(live.reseed.hidden, pre.reseed.hidden)),
    }


def poison_free_slot(be: ReferenceBackend, slot: int) -> None:
    for s in be.state.layers:
        if isinstance(s, KVCache):
            s.k[slot], s.v[slot] = float("nan"), float("nan")
        else:
            s.recurrent = s.recurrent.index_fill(0, torch.tensor([slot], device=be.device), float("nan"))
            s.conv = s.conv.index_fill(0, torch.tensor([slot], device=be.device), float("nan"))
    be.mtp.kv.k[slot], be.mtp.kv.v[slot] = float("nan"), float("nan")
    be.state.pos = be.state.pos.index_fill(0, torch.tensor([slot], device=be.device), FREE_SLOT_POS)
    be.mtp.pos[slot] = FREE_SLOT_POS


def free_slot_intact(be: ReferenceBackend, slot: int) -> bool:
    gdn = [s for s in be.state.layers if isinstance(s, GDNState)]
    return (all(bool(g.recurrent[slot].isnan().all()) and bool(g.conv[slot].isnan().all()) for g in gdn)
            and int(be.state.pos[slot]) == FREE_SLOT_POS and not bool(be.occupied[slot]))


def poison_past_rows(be: ReferenceBackend, slot: int, end: int) -> None:
    poison_past(be, slot, end, PAST_POISON)
