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

``--batch B`` (B >= 2) runs the batched transaction instead: B users in one packed verify, each checked against
its own single-user oracle (``gdn_transaction_batch.py``).

Tolerances. Where the oracle and the backend run the same kernels on the same rows (the abort leg;
snapshot/recompute at a = 0, which re-advance one row exactly like a decode step) equality must be bitwise.
Elsewhere the committed rows came from a multi-row forward: on CPU, nn.Linear over T rows and over 1 row
round differently in the last bits (measured max abs ~1e-6 on CPU, see TOLERANCES and docs/speculative.md),
so those compare with max-abs / PCC against TOLERANCES below.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from qwen36.numerics import pcc
from qwen36.errors import UserError
from qwen36.speculative.engine import speculative_step
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.oracle import greedy_continuation, replay, serial_decode
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft, ReferenceLive
from qwen36.speculative.sampling import SamplingParams
from qwen36.probes.records import ProbeReport

NAME = "gdn-transaction"
HELP = "speculative transaction: 3 GDN commit mechanisms x K x acceptance length vs the autoregressive oracle"
KS = (1, 2, 3, 7)
DRIVE_STEPS = 2
CONTINUATION_STEPS = 16
PROMPT_LEN = 12
BATCH_KS = (2, 3)  # --batch: K = 1 leaves no room for a user with fewer valid drafts than the step's K

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


# ---- comparisons ----------------------------------------------------------------------------------
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


# ---- one cell ---------------------------------------------------------------------------------------
def forced_drafts(oracle: list[int], k: int, a: int, vocab: int) -> list[int]:
    """d_i = oracle token i for i <= a; d_{a+1} deliberately wrong; later ones from the oracle (irrelevant)."""
    d = list(oracle[:k])
    if a < k:
        d[a] = (oracle[a] + 1) % vocab
    return d


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


def run_matrix(model, *, ks=KS, mechanisms=MECHANISMS, factory: BackendFactory = ReferenceBackend,
               seed: int = 0) -> tuple[list[dict], dict[str, dict]]:
    """All cells; returns (cells, counters summed per mechanism over the accept legs)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    cells, totals = [], {m: {} for m in mechanisms}
    for k in ks:
        for a in range(k + 1):
            for mech in mechanisms:
                cell = run_cell(model, factory, mech, k, a, prompt)
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
    if batch > 1:
        from .gdn_transaction_batch import run_batch_matrix
        cells, totals = run_batch_matrix(model, batch=batch, ks=ks, seed=args.seed)
    else:
        cells, totals = run_matrix(model, ks=ks, seed=args.seed)
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
