#!/usr/bin/env python3
"""Fit the draft-depth controller from data and evaluate it on held-out prompts.

    python scripts/fit_depth_policy.py --gate0b-record REC.jsonl [--prompts P.json] [--max-new-tokens 64]
        [--out models/qwen36/speculative/depth_policy.json] [--report bench/depth/depth_eval.json]

1. Acceptance traces (reference model, default checkpoint, greedy). For every prompt and every position n of its
   greedy continuation, L_n = how many of 7 MTP drafts made from the prefix up to n the target accepts. Made with
   the real engine pieces (ReferenceBackend draft/verify/accept at K=7) but committing one token per step, so every
   position is visited. Under greedy decoding a step of depth K at position n accepts exactly min(K, L_n) drafts
   (the MTP chain's first K drafts do not depend on K), so any depth policy can be replayed on the traces; the
   script checks that claim against real engine runs (below).
2. Step-cost tables, in units of one plain decode step: "reference" measured here (wall-clock medians of plain
   decode steps and of speculative steps per K on this CPU), "p150x2-27b" from a gate-0b record (modelled on the
   emulated mesh, or measured on cards, as the record says).
3. Fit on the "fit" prompts: the prior is the pooled conditional acceptance per position; decay and prior_weight
   by grid search maximising the mean over classes of (auto tokens per unit cost) / (best fixed K's), so that no
   class is sacrificed for another.
4. Evaluate on the "eval" prompts, per class and mixed: best fixed K (1..7), its tokens per unit cost, auto's, the
   ratio. Then run the real engine with --spec-k auto and each fixed K on the eval prompts: the output must equal
   plain greedy, and the measured accepted counts must equal the replay's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.io_utils import atomic_write_json
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.depth import (POLICY_FILE, POLICY_VERSION, DepthController, DepthParams, DepthPolicy,
                                      FixedDepth, StepCosts)
from qwen36.speculative.engine import Acceptance, speculative_generate
from qwen36.speculative.reference_backend import ReferenceBackend

PROMPTS = Path(__file__).resolve().parents[1] / "models" / "qwen36" / "speculative" / "depth_prompts.json"
K_MAX = 7
DECAYS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
PRIOR_WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0)


@torch.no_grad()
def plain_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy continuation and the wall-clock seconds of each one-token decode step."""
    dev = next(model.parameters()).device  # inputs on the model's device (CPU here; CUDA in eval_depth_cuda.py)
    state = model.new_state(1, len(prompt) + n + 2)
    out = model(torch.tensor([prompt], device=dev), state)
    tokens, times = [int(out.logits[0, -1].argmax())], []
    while len(tokens) < n:
        t0 = time.perf_counter()
        out = model(torch.tensor([[tokens[-1]]], device=dev), state)
        tokens.append(int(out.logits[0, -1].argmax()))
        times.append(time.perf_counter() - t0)
    return tokens, times


@torch.no_grad()
def acceptance_trace(model, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """(L_n for each emitted position, the emitted tokens): drafts of depth K_MAX at every position, one token
    committed per step."""
    be = ReferenceBackend(model, "shadow_commit", max_len=len(prompt) + n + K_MAX + 2, max_k=K_MAX)
    tokens, trace = [be.join(0, prompt)], []
    while len(tokens) < n:
        d = be.draft({0: K_MAX})
        v = be.verify(d)
        acc = be.accept(d, v)[0]
        trace.append(acc.num_accepted)
        be.commit({0: Acceptance(0, acc.tokens[:1])})
        tokens.append(acc.tokens[0])
    return trace, tokens


_MODEL = None


def _trace_job(job):
    key, ids, n_new = job
    global _MODEL
    torch.set_num_threads(1)
    if _MODEL is None:
        _MODEL = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, require_mtp=True)
    trace, emitted = acceptance_trace(_MODEL, ids, n_new)
    return key, trace, emitted, plain_greedy(_MODEL, ids, n_new)[0]


def replay(trace: list[int], n_new: int, policy) -> tuple[int, list[tuple[int, int]]]:
    """Steps (k, accepted) a depth policy takes to emit n_new tokens on a trace (the first token is prefill's)."""
    pos, emitted, steps = 0, 1, []
    while emitted < n_new:
        k = policy.choose()
        a = min(k, trace[pos])
        policy.observe(k, a)
        steps.append((k, a))
        emitted += a + 1
        pos += a + 1
    return emitted, steps


def tokens_per_cost(trace: list[int], n_new: int, policy, costs: StepCosts) -> float:
    emitted, steps = replay(trace, n_new, policy)
    return emitted / (1.0 + sum(costs.costs[k] for k, _ in steps))  # prefill's token costs one decode step


def class_scores(traces: dict, items: list[dict], n_new: int, make_policy, costs: StepCosts) -> dict[str, float]:
    """Mean tokens per unit cost per class (and "mixed" over all prompts)."""
    by: dict[str, list[float]] = {}
    for it in items:
        v = tokens_per_cost(traces[it["key"]], n_new, make_policy(), costs)
        by.setdefault(it["class"], []).append(v)
        by.setdefault("mixed", []).append(v)
    return {c: statistics.fmean(v) for c, v in by.items()}


def pooled_prior(traces: list[list[int]]) -> tuple[float, ...]:
    """Conditional acceptance per position from K_MAX-deep traces: P(L >= i | L >= i-1)."""
    out = []
    for i in range(1, K_MAX + 1):
        reached = sum(1 for t in traces for x in t if x >= i - 1)
        acc = sum(1 for t in traces for x in t if x >= i)
        out.append(acc / max(1, reached))
    return tuple(out)


@torch.no_grad()
def reference_costs(model, prompts: list[list[int]], n_new: int, rounds: int = 8) -> StepCosts:
    """Measured on this machine: median wall-clock of a speculative step per K over the median plain decode step.
    Steps of every K and plain steps are interleaved round by round, so drifts in machine load hit all alike."""
    times: dict[int, list[float]] = {k: [] for k in range(0, K_MAX + 1)}  # 0 = plain decode step
    for p in prompts:
        spec = {}
        for k in range(1, K_MAX + 1):
            spec[k] = ReferenceBackend(model, "shadow_commit", max_len=len(p) + rounds * (K_MAX + 1) + 2, max_k=K_MAX)
            spec[k].join(0, p)
        state = model.new_state(1, len(p) + rounds + 2)
        dev = next(model.parameters()).device
        tok = int(model(torch.tensor([p], device=dev), state).logits[0, -1].argmax())
        for _ in range(rounds):
            t0 = time.perf_counter()
            tok = int(model(torch.tensor([[tok]], device=dev), state).logits[0, -1].argmax())
            times[0].append(time.perf_counter() - t0)
            for k, be in spec.items():
                t0 = time.perf_counter()
                d = be.draft({0: k})
                v = be.verify(d)
                be.commit(be.accept(d, v))
                times[k].append(time.perf_counter() - t0)
    t1 = statistics.median(times[0])
    return StepCosts("reference (torch CPU)", "measured", {k: statistics.median(times[k]) / t1 for k in range(1, K_MAX + 1)},
                     note=f"wall-clock medians of {len(times[0])} interleaved steps per K on {torch.get_num_threads()} "
                          f"torch thread(s), plain decode step {t1 * 1e3:.2f} ms, default checkpoint")


def p150_costs(record: Path) -> StepCosts:
    rec = json.loads(Path(record).read_text().strip().splitlines()[-1])
    perf = rec.get("performance") or {}
    fig = perf.get("figures", perf)
    label = fig.get("label", rec.get("performance", {}).get("label", "?"))
    cal = fig.get("calibrated")
    if cal is not None:  # the calibrated figures (docs/cost_model.md); the plain "ms" ones are the roofline bound
        steps = {k: v[0] for k, v in cal["step_ms_shadow_commit"].items()}
        decode, label = cal["decode_ms"][0], cal["label"]
    else:
        steps, decode = fig["step_ms_shadow_commit"], fig["decode"]["ms"]
    ks = sorted(int(k) for k in steps)
    if ks != list(range(1, K_MAX + 1)):
        raise SystemExit(f"error: {record}: gate-0b record has K = {ks}; run it with --ks 1,2,3,4,5,6,7")
    return StepCosts(f"{rec['backend']}, 27B", "modelled" if "modelled" in str(label) else "measured",
                     {k: steps[str(k)] / decode for k in ks},
                     note=f"gate-0b record {Path(record).name} ({label}): step = verify + accept + draft + shadow "
                          f"commit, plain decode {decode:.2f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate0b-record", type=Path, default=None, help="gate-0b record with --ks 1,2,3,4,5,6,7")
    ap.add_argument("--measure-only", action="store_true",
                    help="compute and cache the traces (--traces) and the reference step costs (--reference-costs), then stop")
    ap.add_argument("--engine-checks", type=int, default=2, help="held-out prompts per class run through the engine")
    ap.add_argument("--workers", type=int, default=1, help="processes computing traces (one torch thread each)")
    ap.add_argument("--reference-costs", type=Path, default=None,
                    help="step-cost table of the reference backend: read if it exists, else measured here and written")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=POLICY_FILE)
    ap.add_argument("--report", type=Path, default=None, help="write the evaluation table as JSON here")
    ap.add_argument("--traces", type=Path, default=None,
                    help="cache of the acceptance traces: read if it exists (same prompts and length), else written")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n_new = args.max_new_tokens
    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, require_mtp=True)
    items = json.loads(args.prompts.read_text())["prompts"]
    for i, it in enumerate(items):
        it["key"] = i

    t0 = time.perf_counter()
    traces, plain = {}, {}
    fingerprint = {"prompts": [it["ids"] for it in items], "max_new_tokens": n_new}
    if args.traces and args.traces.exists():
        cached = json.loads(args.traces.read_text())
        if cached["fingerprint"] != fingerprint:
            raise SystemExit(f"error: {args.traces} holds traces of other prompts or another length; delete it")
        traces = {int(k): v for k, v in cached["traces"].items()}
        plain = {int(k): v for k, v in cached["plain"].items()}
    else:
        jobs = [(it["key"], it["ids"], n_new) for it in items]
        if args.workers > 1:
            import multiprocessing as mp
            with mp.get_context("fork").Pool(args.workers) as pool:
                results = pool.map(_trace_job, jobs, chunksize=1)
        else:
            results = [_trace_job(j) for j in jobs]
        for key, trace, emitted, tokens in results:
            if emitted != tokens:
                raise SystemExit(f"error: prompt {key}: one-token-per-step speculative output != plain greedy")
            traces[key], plain[key] = trace, tokens
        if args.traces:
            atomic_write_json(args.traces, {"fingerprint": fingerprint, "traces": traces, "plain": plain})
    print(f"traces: {len(items)} prompts x {n_new} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    fit = [it for it in items if it["split"] == "fit"]
    held = [it for it in items if it["split"] == "eval"]
    prior = pooled_prior([traces[it["key"]] for it in fit])
    if args.reference_costs and args.reference_costs.exists():
        t = json.loads(args.reference_costs.read_text())
        ref_costs = StepCosts(t["backend"], t["source"], {int(k): v for k, v in t["costs"].items()}, t["note"])
    else:
        ref_costs = reference_costs(model, [it["ids"] for it in fit[::2]], n_new)
        if args.reference_costs:
            atomic_write_json(args.reference_costs, {"backend": ref_costs.backend, "source": ref_costs.source,
                                                     "costs": ref_costs.costs, "note": ref_costs.note})
    if args.measure_only:
        return 0
    if args.gate0b_record is None:
        raise SystemExit("error: --gate0b-record is needed to fit (the P150a x2 step costs)")
    tables = {"reference": ref_costs, "p150x2-27b": p150_costs(args.gate0b_record)}

    fitted, report = {}, {"classes": {}, "tables": {}, "fit": {}}
    for key, costs in tables.items():
        fixed_fit = {k: class_scores(traces, fit, n_new, lambda k=k: FixedDepth(k), costs) for k in range(1, K_MAX + 1)}
        best = None
        for decay in DECAYS:
            for w in PRIOR_WEIGHTS:
                p = DepthParams(decay, prior, w)
                auto = class_scores(traces, fit, n_new, lambda: DepthController(p, costs), costs)
                ratios = [auto[c] / max(fixed_fit[k][c] for k in fixed_fit) for c in auto]
                score = (min(ratios), statistics.fmean(ratios))  # the worst class first, then the average
                if best is None or score > best[0]:
                    best = (score, p)
        fitted[key] = best[1]
        report["fit"][key] = {"decay": best[1].decay, "prior_weight": best[1].prior_weight,
                              "fit_min_ratio": best[0][0], "fit_mean_ratio": best[0][1]}
        print(f"[{key}] fitted decay={best[1].decay} prior_weight={best[1].prior_weight} "
              f"(fit split: worst class ratio {best[0][0]:.4f}, mean {best[0][1]:.4f})", file=sys.stderr)

    for key, costs in tables.items():
        fixed = {k: class_scores(traces, held, n_new, lambda k=k: FixedDepth(k), costs) for k in range(1, K_MAX + 1)}
        auto = class_scores(traces, held, n_new, lambda: DepthController(fitted[key], costs), costs)
        rows = {}
        for c in auto:
            kbest = max(fixed, key=lambda k: fixed[k][c])
            rows[c] = {"best_fixed_k": kbest, "best_fixed": fixed[kbest][c], "auto": auto[c],
                       "ratio": auto[c] / fixed[kbest][c]}
        report["classes"][key] = rows
        report["tables"][key] = {"source": costs.source, "costs": costs.costs, "note": costs.note}

    # real engine runs on held-out prompts, on this machine: lossless, and the engine's steps == the replay's. The
    # traces are recomputed here (they may come from another machine, whose float rounding can flip a near-tie).
    checked, trace_diffs = 0, 0
    per_class: dict[str, int] = {}
    for it in held:
        if per_class.get(it["class"], 0) >= args.engine_checks:
            continue
        per_class[it["class"]] = per_class.get(it["class"], 0) + 1
        local_trace, local_plain = acceptance_trace(model, it["ids"], n_new)
        trace_diffs += sum(a != b for a, b in zip(local_trace, traces[it["key"]]))
        if local_plain != plain_greedy(model, it["ids"], n_new)[0]:
            raise SystemExit(f"error: prompt {it['key']}: one-token-per-step speculative output != plain greedy")
        for make in [lambda: DepthController(fitted["reference"], tables["reference"])] + \
                    [lambda k=k: FixedDepth(k) for k in (1, 3, 7)]:
            be = ReferenceBackend(model, "shadow_commit", max_len=len(it["ids"]) + n_new + K_MAX + 2, max_k=K_MAX)
            depth = make()
            res = speculative_generate(be, [it["ids"]], n_new, [depth])[0]
            if res.tokens != local_plain:
                raise SystemExit(f"error: prompt {it['key']} {depth.describe()}: speculative output != plain greedy")
            _, steps = replay(local_trace, n_new, make())
            real = list(zip(res.stats.depths, res.stats.accepted))
            if real != steps[: len(real)]:
                raise SystemExit(f"error: prompt {it['key']} {depth.describe()}: engine steps {real} != replay {steps}")
            checked += 1
    report["engine_checks"] = {"runs": checked, "prompts": sum(per_class.values()), "lossless": True,
                               "replay_equals_engine": True, "trace_positions_differing_from_cached": trace_diffs}

    policy = DepthPolicy(POLICY_VERSION, tables, fitted, provenance={
        "fitted_by": "scripts/fit_depth_policy.py", "checkpoint": "default checkpoint (models/qwen36/default_checkpoint)",
        "prompts": f"{args.prompts.name}: {len(fit)} fit / {len(held)} eval prompts, {n_new} new tokens each",
        "grid": {"decay": DECAYS, "prior_weight": PRIOR_WEIGHTS}, "prior": "pooled conditional acceptance (fit split)",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    atomic_write_json(args.out, policy.to_json())
    if args.report:
        atomic_write_json(args.report, report)
    for key, rows in report["classes"].items():
        print(f"\n{key} ({tables[key].source} step costs)")
        print("| class | best fixed K | its tokens/cost | auto tokens/cost | auto / best |")
        print("|---|---|---|---|---|")
        for c, r in sorted(rows.items()):
            print(f"| {c} | {r['best_fixed_k']} | {r['best_fixed']:.3f} | {r['auto']:.3f} | {r['ratio']:.3f} |")
    print(f"\nwrote {args.out}; {checked} engine runs lossless and equal to the replay; cached traces differ from "
          f"this machine's at {trace_diffs} positions of the checked prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
