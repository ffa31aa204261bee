"""``qwen36 probe gdn-transaction --batch B``: the batched speculative transaction on the reference against each
user's own single-user autoregressive oracle.

B users (prompts of different lengths) share one ``ReferenceBackend`` with B + 1 slots; the extra slot stays
free and is poisoned with NaN (GDN recurrent + conv, target and MTP KV, an odd position) for the whole cell, so
any read of another slot's state by a user's rows would show up as NaN. Per cell (mechanism x K):
  1. every user joins, then 2 real batched speculative steps (non-trivial GDN state, MTP reseeded);
  2. one step with forced drafts (from each user's own greedy continuation with a wrong token at a_b + 1), so
     users accept different lengths in the same packed verify: user 0 a = 0, user 1 a = K and, at B >= 4,
     user 2 drafts only k = K - 1 (its last row inert) and accepts all of them, and user 3 sits the step out
     (all its rows inert); any further users accept K // 2;
  3. abort leg: draft -> verify -> abort leaves every user's state exactly as before (torch.equal);
  4. accept leg: draft -> verify -> accept -> commit; each stepping user's emitted tokens, GDN recurrent, conv
     and target KV rows [0, n_b + a_b + 1) match ``oracle.replay`` from its own pre-step state, and so do its MTP
     KV rows after the next draft's reseed (drawn after every user's rows past its accepted prefix were
     overwritten with a large finite value: see below); a user sitting the step out equals its pre-step state
     exactly; the poisoned free slot is still all NaN at its odd position, and every result is finite;
  5. continuation: 16 single-row greedy steps from each user's committed state (past rows NaN) vs its oracle.

Rows past a user's prefix are poisoned with a large finite value in the batch state, not NaN: a packed forward
reads every row up to the longest user's position and gives the rows past a user's own position probability 0,
and 0 * NaN is NaN (which is why a joining user's KV rows are zeroed). The per-user continuation runs on a
batch-1 copy, where NaN is used as in the single-user probe.

Tolerances are the single-user probe's (``gdn_transaction.TOLERANCES``); no comparison is required to be bitwise
(a [B, T] forward rounds differently from the oracle's [1, 1] ones), except the abort leg and the isolation
checks, which are exact.
"""
from __future__ import annotations

import torch

from qwen36.reference.state import GDNState, KVCache
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.oracle import greedy_continuation, replay, serial_decode
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft

from .gdn_transaction import (BATCH_KS, CONTINUATION_STEPS, DRIVE_STEPS, PROMPT_LEN, compare, forced_drafts, kv_rows,
                              live_equal, poison_live_past, poison_past)

PAST_POISON = 1.0e4  # large and finite: see the module docstring
FREE_SLOT_POS = 5  # the poisoned free slot's (odd) position


def user_plan(b: int, k: int) -> list[tuple[int | None, int]]:
    """(draft depth k_b or None = sits the step out, forced acceptance a_b) per user."""
    plan: list[tuple[int | None, int]] = [(k, 0), (k, k)]
    if b >= 4:
        plan += [(k - 1, k - 1) if k >= 2 else (k, 0), (None, 0)]
    plan += [(k, k // 2)] * (b - len(plan))
    return plan[:b]


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


def run_batch_cell(model, mechanism: str, k: int, b: int, prompts: list[list[int]]) -> dict:
    vocab = model.config.vocab_size
    plan = user_plan(b, k)
    max_len = max(map(len, prompts)) + (DRIVE_STEPS + 3) * (k + 1) + CONTINUATION_STEPS + 4
    be = ReferenceBackend(model, mechanism, max_len=max_len, slots=b + 1, max_k=k)
    free = b
    for slot, p in enumerate(prompts):
        be.join(slot, p)
    for _ in range(DRIVE_STEPS):
        depths = {s: k for s in range(b)}
        d = be.draft(depths)
        be.commit(be.accept(d, be.verify(d)))
    poison_free_slot(be, free)
    pre = {s: be.live(s) for s in range(b)}
    stepping = {s: kb for s, (kb, _) in enumerate(plan) if kb is not None}
    forced, cont = {}, {}
    for s, kb in stepping.items():
        cont[s] = greedy_continuation(model, pre[s], kb + 1)
        forced[s] = torch.tensor([forced_drafts(cont[s], kb, plan[s][1], vocab)], device=be.device)
    forced_draft = ReferenceDraft(stepping, forced, {s: None for s in stepping})
    failed: list[str] = []

    # abort leg: every user exactly as before
    be.draft(stepping)
    be.verify(forced_draft)
    be.abort()
    abort = {s: live_equal(be.live(s), pre[s]) for s in range(b)}
    failed += [f"abort:user{s}:{name}" for s, r in abort.items() for name, ok in r.items() if not ok]
    if not free_slot_intact(be, free):
        failed.append("abort:free_slot")

    # accept leg
    before = be.counters.as_dict()
    be.draft(stepping)
    verify = be.verify(forced_draft)
    accepted = be.accept(forced_draft, verify)
    be.commit(accepted)
    counters = {key: v - before[key] for key, v in be.counters.as_dict().items()}
    users, oracles = [], {}
    for s, (kb, a) in enumerate(plan):
        live = be.live(s)
        if kb is None:  # sat the step out: untouched
            same = live_equal(live, pre[s])
            users.append({"user": s, "k": None, "untouched": same, "pass": all(same.values())})
            if not all(same.values()):
                failed.append(f"user{s}:touched")
            continue
        acc = accepted[s]
        orc = oracles[s] = replay(model, pre[s], acc.tokens)
        end = pre[s].state.pos + acc.num_accepted + 1
        r = {
            "gdn_recurrent": compare([g.recurrent for g in live.state.gdn_states()],
                                     [g.recurrent for g in orc.live.state.gdn_states()], "gdn_recurrent", False),
            "conv": compare([g.conv for g in live.state.gdn_states()], [g.conv for g in orc.live.state.gdn_states()],
                            "conv", False),
            "target_kv": compare(kv_rows(live.state.kv_caches(), end), kv_rows(orc.live.state.kv_caches(), end),
                                 "target_kv", False),
        }
        tokens_ok = acc.num_accepted == a and acc.tokens == cont[s][: a + 1]
        pos_ok = live.state.pos == orc.live.state.pos == end and live.pending == orc.live.pending
        users.append({"user": s, "k": kb, "a": a, "accepted": acc.num_accepted, "tokens_ok": tokens_ok,
                      "pos_ok": pos_ok, "prompt_len": len(prompts[s]), **r})
        failed += [f"user{s}:{name}" for name, ok in (("tokens", tokens_ok), ("pos", pos_ok)) if not ok]
        failed += [f"user{s}:{name}" for name, x in r.items() if not x["pass"]]
    if not free_slot_intact(be, free):
        failed.append("free_slot")
    if not bool(verify.logits[:b].isfinite().all()):
        failed.append("nonfinite_logits")

    # MTP: the next draft reseeds each user's rows n..n+a; past rows poisoned (large, finite) first
    for s in stepping:
        poison_past_rows(be, s, pre[s].state.pos + accepted[s].num_accepted + 1)
    be.draft(stepping)
    for u in users:
        s = u["user"]
        if s in stepping:
            end = pre[s].state.pos + accepted[s].num_accepted + 1
            u["mtp_kv"] = compare(kv_rows([be.live(s).mtp.kv], end), kv_rows([oracles[s].live.mtp.kv], end),
                                  "mtp_kv", False)
            if not u["mtp_kv"]["pass"]:
                failed.append(f"user{s}:mtp_kv")
    be.abort()

    # continuation of each stepping user on a batch-1 copy of its committed state
    for u in users:
        s = u["user"]
        if s not in stepping:
            continue
        live, orc = be.live(s), oracles[s].live
        poison_live_past(live, live.state.pos)
        toks_be, lg_be = serial_decode(model, live.state, live.pending, CONTINUATION_STEPS)
        toks_or, lg_or = serial_decode(model, orc.state.clone(), orc.pending, CONTINUATION_STEPS)
        u["continuation_logits"] = compare([lg_be], [lg_or], "continuation_logits", False)
        u["continuation_tokens_equal"] = toks_be == toks_or
        failed += [f"user{s}:{name}" for name, ok in (("continuation_logits", u["continuation_logits"]["pass"]),
                                                     ("continuation_tokens", toks_be == toks_or)) if not ok]
        u["pass"] = not any(f.startswith(f"user{s}:") for f in failed)
    return {"cell": f"B={b} K={k} {mechanism}", "batch": b, "k": k, "mechanism": mechanism,
            "plan": [{"k": kb, "a": a} for kb, a in plan], "users": users, "abort": abort,
            "counters": counters, "failed": failed, "pass": not failed}


def run_batch_matrix(model, *, batch: int, ks=BATCH_KS, mechanisms=MECHANISMS, seed: int = 0):
    """All (mechanism, K) cells for B = ``batch`` users; returns (cells, counters summed per mechanism)."""
    if batch < 2:
        raise ValueError(f"the batched probe needs B >= 2 users, got {batch}")
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (PROMPT_LEN + 3 * i,), generator=gen).tolist()
               for i in range(batch)]
    cells, totals = [], {m: {} for m in mechanisms}
    for k in ks:
        for mech in mechanisms:
            cell = run_batch_cell(model, mech, k, batch, prompts)
            cells.append(cell)
            for key, v in cell["counters"].items():
                totals[mech][key] = totals[mech].get(key, 0) + v
    return cells, totals
