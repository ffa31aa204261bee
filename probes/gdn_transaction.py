"""Probe gdn-transaction: every commit mechanism x draft depth K x acceptance length a against the oracle.

For K in {1, 2, 3, 7}, a in [0, K], every mechanism in ``mechanisms.MECHANISMS``, one cell:
  1. prefill + 2 real speculative steps (the live state is non-trivial: GDN slots, MTP reseeded);
  2. drafts forced from the oracle's own greedy continuation with a wrong token at position a+1, so the
     greedy acceptance length is exactly a;
  3. abort leg: draft -> verify -> abort; the live state must equal the pre-step state exactly (torch.equal
     on GDN recurrent + conv, positions, pending token, reseed rows, KV rows below pos / mtp.pos);
  4. accept leg (after the abort): draft -> verify -> accept -> commit; emitted tokens, GDN recurrent, conv,
     target KV rows [0, n+a+1) and, after the next draft's reseed, MTP KV rows [0, n+a+1) are compared with
     the autoregressive oracle (single-row replay from the pre-step state);
  5. continuation: with every KV row past the accepted prefix (target and MTP) overwritten by NaN, the next
     draft's MTP reseed and 16 more single-row greedy decode steps from the committed state match the oracle's.
Step counters are checked against the mechanism's expected formula.

Tolerances. Where the oracle and the backend run the same kernels on the same rows (the abort leg;
snapshot/recompute at a = 0, which re-advance one row exactly like a decode step) equality must be bitwise.
Elsewhere the committed rows came from a multi-row forward: on CPU, nn.Linear over T rows and over 1 row
round differently in the last bits (measured max abs ~1e-6 on CPU, see TOLERANCES and docs/speculative.md),
so those compare with max-abs / PCC against ``gdn_transaction_checks.TOLERANCES``.

``--batch B`` (B >= 2) runs the batched transaction instead, B users in one packed verify, each against its own
single-user autoregressive oracle (``run_batch_cell``). B users (prompts of different lengths) share one
``ReferenceBackend`` with B + 1 slots; the extra slot stays free and is poisoned with NaN (GDN recurrent + conv, target and MTP KV, an odd position) for the whole cell, so
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

Tolerances are the single-user cells'; no comparison is required to be bitwise
(a [B, T] forward rounds differently from the oracle's [1, 1] ones), except the abort leg and the isolation
checks, which are exact.

Pieces: ``transaction_plan`` (forced drafts, the batch's per-user plan; shared with gdn-transaction-tp),
``gdn_transaction_checks`` (comparisons, tolerances, poisoning); this module drives the cells.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from qwen36.errors import UserError
from qwen36.speculative.engine import speculative_step
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.oracle import greedy_continuation, replay, serial_decode
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft
from qwen36.generation.sampling import SamplingParams
from qwen36.probes.records import ProbeReport

from .gdn_transaction_checks import (TOLERANCES, compare, free_slot_intact, kv_rows, live_equal, poison_free_slot,
                                     poison_live_past, poison_past, poison_past_rows)
from .transaction_plan import BATCH_KS, forced_drafts, user_plan

NAME = "gdn-transaction"
HELP = "speculative transaction: 3 GDN commit mechanisms x K x acceptance length vs the autoregressive oracle"
KS = (1, 2, 3, 7)
DRIVE_STEPS = 2
CONTINUATION_STEPS = 16
PROMPT_LEN = 12

BackendFactory = Callable[..., ReferenceBackend]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full", action="store_true",
                   help="real 27B GDN head shapes (48 value / 16 key heads, 128x128 fp32 state): the 27b-ratios preset")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this checkpoint (needs mtp.*) instead of a generated one")
    p.add_argument("--ks", default=",".join(map(str, KS)), help="draft depths, comma-separated (gate: 1,2,3,7)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated checkpoint and the prompt")
    p.add_argument("--batch", type=int, default=1,
                   help="B >= 2: the batched transaction (B users in one packed verify, each against its own "
                        "single-user oracle; --ks defaults to 2,3 there); 1: the single-user matrix")


# ---- one cell, one user ------------------------------------------------------------------------------
def run_cell(model, factory: BackendFactory, mechanism: str, k: int, a: int, prompt: list[int]) -> dict:
    vocab = model.config.vocab_size
    max_len = len(prompt) + (DRIVE_STEPS + 3) * (k + 1) + CONTINUATION_STEPS + 4
    be = factory(model, mechanism, max_len=max_len)  # one slot: the user is slot 0
    be.join(0, prompt, SamplingParams())
    for _ in range(DRIVE_STEPS):
        speculative_step(be, {0: k})
    pre = be.live(0)
    n = pre.state.pos
    cont = greedy_continuation(model, pre, k + 1)
    forced = ReferenceDraft({0: k}, {0: torch.tensor([forced_drafts(cont, k, a, vocab)], device=be.device)}, {0: None})
    failed: list[str] = []

    # abort leg
    be.draft({0: k})
    be.verify(forced)
    be.abort()
    abort = live_equal(be.live(0), pre)
    failed += [f"abort:{name}" for name, ok in abort.items() if not ok]

    # accept leg
    before = be.counters.as_dict()
    be.draft({0: k})  # the real MTP draft: reseeds the MTP cache and writes provisional chain rows
    verify = be.verify(forced)
    acc = be.accept(forced, verify)[0]
    be.commit({0: acc})
    counters = {key: v - before[key] for key, v in be.counters.as_dict().items()}
    expected = be.mechanism.expected_step_counters(k, acc.num_accepted, *be.gdn_layout)
    counters_ok = all(counters[key] == v for key, v in expected.items())
    if not counters_ok:
        failed.append("counters")
    tokens_ok = acc.num_accepted == a and acc.tokens == cont[: a + 1]
    if not tokens_ok:
        failed.append("tokens")

    orc = replay(model, pre, acc.tokens)
    bitwise = be.mechanism.rerun_rows(k, acc.num_accepted) == 1  # a = 0 re-advanced like one decode step
    live = be.live(0)
    end = n + acc.num_accepted + 1
    results = {
        "gdn_recurrent": compare([g.recurrent for g in live.state.gdn_states()],
                                 [g.recurrent for g in orc.live.state.gdn_states()], "gdn_recurrent", bitwise),
        "conv": compare([g.conv for g in live.state.gdn_states()], [g.conv for g in orc.live.state.gdn_states()], "conv", bitwise),
        "target_kv": compare(kv_rows(live.state.kv_caches(), end), kv_rows(orc.live.state.kv_caches(), end), "target_kv", bitwise),
    }
    pos_ok = live.state.pos == orc.live.state.pos == end and live.pending == orc.live.pending
    if not pos_ok:
        failed.append("pos")

    # rows past the accepted prefix must never affect later results: poison them (NaN would spread)
    poison_past(be, 0, end)
    # MTP: the next draft reseeds rows n..n+a from the verify's hiddens; compare, then drop that draft
    be.draft({0: k})
    results["mtp_kv"] = compare(kv_rows([be.live(0).mtp.kv], end), kv_rows([orc.live.mtp.kv], end), "mtp_kv", False)
    be.abort()
    live = be.live(0)  # the committed state with its rows past the prefix poisoned

    # continuation: serial decode from the committed state vs from the oracle's state
    toks_be, lg_be = serial_decode(model, live.state.clone(), live.pending, CONTINUATION_STEPS)
    toks_or, lg_or = serial_decode(model, orc.live.state.clone(), orc.live.pending, CONTINUATION_STEPS)
    results["continuation_logits"] = compare([lg_be], [lg_or], "continuation_logits", bitwise)
    cont_tokens_ok = toks_be == toks_or
    if not cont_tokens_ok:
        failed.append("continuation_tokens")
    failed += [name for name, r in results.items() if not r["pass"]]
    return {
        "cell": f"K={k} a={a} {mechanism}", "k": k, "a": a, "mechanism": mechanism,
        "accepted": acc.num_accepted, "tokens_ok": tokens_ok, "pos_ok": pos_ok, "abort": abort,
        **results, "continuation_tokens_equal": cont_tokens_ok,
        "counters": counters, "counters_expected": expected, "failed": failed, "pass": not failed,
    }


# ---- one cell, B users in one packed verify -------------------------------------------------------------
def run_batch_cell(model, mechanism: str, k: int, b: int, prompts: list[list[int]],
                   factory: BackendFactory = ReferenceBackend) -> dict:
    vocab = model.config.vocab_size
    plan = user_plan(b, k)
    max_len = max(map(len, prompts)) + (DRIVE_STEPS + 3) * (k + 1) + CONTINUATION_STEPS + 4
    be = factory(model, mechanism, max_len=max_len, slots=b + 1, max_k=k)
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


# ---- the matrix ---------------------------------------------------------------------------------------
def run_matrix(model, *, batch: int = 1, ks=None, mechanisms=MECHANISMS, factory: BackendFactory = ReferenceBackend,
               seed: int = 0) -> tuple[list[dict], dict[str, dict]]:
    """Every cell for ``batch`` users: one user, every (K, a, mechanism) (:func:`run_cell`); B >= 2 users in one
    packed verify, every (K, mechanism), each user's a from ``user_plan`` (:func:`run_batch_cell`). ``ks`` defaults
    to ``KS`` (one user) or ``BATCH_KS``. User i's prompt: PROMPT_LEN + 3i random ids. Returns (cells, counters summed
    per mechanism over the accept legs)."""
    if batch < 1:
        raise ValueError(f"the probe needs B >= 1 users, got {batch}")
    ks = ks if ks is not None else KS if batch == 1 else BATCH_KS
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (PROMPT_LEN + 3 * i,), generator=gen).tolist()
               for i in range(batch)]
    if batch == 1:
        grid = [(mech, lambda m, k=k, a=a: run_cell(model, factory, m, k, a, prompts[0]))
                for k in ks for a in range(k + 1) for mech in mechanisms]
    else:
        grid = [(mech, lambda m, k=k: run_batch_cell(model, m, k, batch, prompts, factory))
                for k in ks for mech in mechanisms]
    cells, totals = [], {m: {} for m in mechanisms}
    for mech, cell_of in grid:
        cell = cell_of(mech)
        cells.append(cell)
        for key, v in cell["counters"].items():
            totals[mech][key] = totals[mech].get(key, 0) + v
    return cells, totals


# ---- entry point ------------------------------------------------------------------------------------
def load_model(args):
    from qwen36.devices import REFERENCE_DEVICES, check_device
    from qwen36.reference.model import Qwen36Model
    from qwen36.tiny import make_tiny

    check_device(args.device)
    if args.device not in REFERENCE_DEVICES:
        raise UserError(f"probe {NAME} runs the reference engine (--device reference|reference-cuda); "
                        f"for the TT path on {args.device} use `qwen36 probe gdn-transaction-tp --device {args.device}`")
    if args.device == "reference-cuda" and not torch.cuda.is_available():
        raise UserError("--device reference-cuda but torch sees no CUDA device")
    dev = "cuda" if args.device == "reference-cuda" else "cpu"
    preset = "27b-ratios" if args.full else "ci"
    if args.checkpoint is not None:
        return Qwen36Model.from_checkpoint(args.checkpoint, device=dev, require_mtp=True), str(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="qwen36-probe-") as tmp:  # weights are fully loaded before cleanup
        ckpt = make_tiny(Path(tmp) / preset, preset, seed=args.seed)
        return Qwen36Model.from_checkpoint(ckpt, device=dev, require_mtp=True), f"generated {preset} (seed {args.seed})"


def run(args: argparse.Namespace) -> ProbeReport:
    batch = getattr(args, "batch", 1)
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    ks_arg = args.ks
    if batch > 1 and ks_arg == ",".join(map(str, KS)):  # the default: the batched matrix has its own
        ks_arg = ",".join(map(str, BATCH_KS))
    ks = tuple(int(x) for x in ks_arg.split(","))
    if any(k < 1 for k in ks):
        raise UserError(f"--ks must be positive draft depths, got {args.ks!r}")
    t0 = time.perf_counter()
    model, source = load_model(args)
    cells, totals = run_matrix(model, batch=batch, ks=ks, seed=args.seed)
    cfg = model.config
    backend = ReferenceBackend(model).label
    return ProbeReport(
        probe=NAME, backend=backend,
        config={"checkpoint": source, "full": bool(args.full), "ks": list(ks), "mechanisms": list(MECHANISMS),
                "seed": args.seed, "batch": batch, "prompt_len": PROMPT_LEN, "drive_steps": DRIVE_STEPS,
                "continuation_steps": CONTINUATION_STEPS, "tolerances": TOLERANCES,
                "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                          "gdn_value_heads": cfg.linear_num_value_heads, "gdn_key_heads": cfg.linear_num_key_heads,
                          "gdn_head_dims": [cfg.linear_key_head_dim, cfg.linear_value_head_dim]}},
        cells=cells, counters=totals,
        gate_complete=set(ks) >= set(KS) if batch == 1 else set(ks) >= set(BATCH_KS),
        notes={"wall_s_measured": round(time.perf_counter() - t0, 2),
               "peak_rss_mib_measured": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)},
    )
