#!/usr/bin/env python3
"""`--spec-k auto` on the TT path, per class, on the held-out prompts of the depth evaluation.

    python scripts/eval_depth_tt.py [--device emulated-p150x2] [--per-class 12] [--max-new-tokens 64]
        [--out docs/depth_eval_tt.json] [--time-budget-s S]

The evaluation table of docs/depth.md replays depth policies on acceptance traces of the reference model (greedy:
a step of depth K at position n accepts min(K, L_n)). This script measures the TT path itself on the held-out
("eval" split) prompts of ``depth_prompts.json``, taken round-robin over the classes (prompt 1 of every class, then
prompt 2, ...) so that a run stopped early still covers every class evenly. For each prompt it

1. computes the prompt's reference acceptance trace (``fit_depth_policy.acceptance_trace``, CPU fp32);
2. runs ``speculative_generate`` on the TT backend with the controller the CLI builds for this device (the
   ``cost_key(device)`` table, K capped by the verify) and records its steps (K, accepted) and its tokens;
3. replays the same controller on the reference trace: equal steps mean the TT step accepted exactly what the
   reference accepts, so the replayed fixed-K figures of that prompt are the TT path's too;
4. scores tokens per unit cost = emitted / (1 + sum of step costs) with the device's cost table (prefill's token
   costs one decode step). The TT run is scored like the replays: every token its steps emitted, including the
   ones past ``--max-new-tokens`` in the last step (the engine keeps only the first ``--max-new-tokens``), so the
   TT auto figure and the fixed-K figures count the same thing. Fixed-K runs on TT are not made (7 more emulated
   runs per prompt on a CPU); their figures come from the reference trace.

Per class (and over all prompts: "mixed") the report holds the best fixed K *for the class* (highest mean tokens per
cost over the class's prompts), its mean, the TT auto run's mean and the ratio; the goal is ratio >= 0.97 per class
and > 1 on the mixed set. Results are written after every prompt; rerunning with the same ``--out`` keeps the
prompts already there (same ids, same controller) and runs the rest. The step costs are whatever the policy file's
table says (``modelled`` for the P150a table); wall time on the emulator is not a device cost and is only recorded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_depth_policy as fit  # noqa: E402

from qwen36.commands.common import DEFAULT_CHECKPOINT  # noqa: E402
from qwen36.commands.speculative_generate import config_of, depth_policy, load_tt_backend  # noqa: E402
from qwen36.io_utils import atomic_write_json  # noqa: E402
from qwen36.reference.model import Qwen36Model  # noqa: E402
from qwen36.speculative.depth import DepthPolicy, FixedDepth, StepCosts, cost_key  # noqa: E402
from qwen36.speculative.engine import speculative_generate  # noqa: E402

GOAL_CLASS_RATIO = 0.97


def held_out_round_robin(items: list[dict], per_class: int) -> list[dict]:
    """Held-out prompts (with their index in the prompt file as ``key``), prompt 1 of every class, then 2, ..."""
    by: dict[str, list[dict]] = {}
    for i, it in enumerate(items):
        if it["split"] == "eval":
            by.setdefault(it["class"], []).append(dict(it, key=i))
    return [by[c][j] for j in range(per_class) for c in by if j < len(by[c])]


def steps_tokens_per_cost(steps, costs: StepCosts) -> float:
    """Tokens per unit cost of a run given its steps (K, accepted): prefill's token plus a+1 per step."""
    return (1 + sum(a + 1 for _, a in steps)) / (1.0 + sum(costs.costs[k] for k, _ in steps))


def summarize(rows: list[dict], ks: list[int]) -> dict[str, dict]:
    """Per class and "mixed": best fixed K for the class (mean over its prompts), its mean, auto's mean, ratio."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["class"], []).append(r)
    groups["mixed"] = list(rows)
    out = {}
    for c, rs in groups.items():
        fixed = {k: statistics.fmean(r["fixed_tokens_per_cost"][str(k)] for r in rs) for k in ks}
        kbest = max(fixed, key=fixed.get)
        auto = statistics.fmean(r["tt_auto_tokens_per_cost"] for r in rs)
        out[c] = {"prompts": len(rs), "best_fixed_k": kbest, "best_fixed": fixed[kbest], "auto": auto,
                  "ratio": auto / fixed[kbest], "replay_auto": statistics.fmean(r["replay_auto_tokens_per_cost"] for r in rs),
                  "steps_equal_replay": sum(r["steps_equal"] for r in rs),
                  "equal_reference_greedy": sum(r["tt_equals_reference_greedy"] for r in rs),
                  "lossless": all(r["tt_equals_reference_greedy"] or r.get("tt_equals_tt_plain_greedy", False)
                                  for r in rs)}
        goal = 1.0 if c == "mixed" else GOAL_CLASS_RATIO
        out[c]["goal_met"] = out[c]["ratio"] > goal if c == "mixed" else out[c]["ratio"] >= goal
    return out


def table(summary: dict[str, dict]) -> str:
    lines = ["| class | prompts | best fixed K | its tokens / unit cost | TT auto tokens / unit cost | auto / best | "
             "TT steps == replay |", "|---|---|---|---|---|---|---|"]
    for c in sorted(summary, key=lambda c: (c == "mixed", c)):
        s = summary[c]
        lines.append(f"| {c} | {s['prompts']} | {s['best_fixed_k']} | {s['best_fixed']:.3f} | {s['auto']:.3f} | "
                     f"{s['ratio']:.3f} | {s['steps_equal_replay']}/{s['prompts']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emulated-p150x2")
    ap.add_argument("--per-class", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="JSON report, rewritten after every prompt (and resumed)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no new prompt once this many seconds have passed (the report stays consistent)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    n_new = args.max_new_tokens
    items = json.loads(fit.PROMPTS.read_text())["prompts"]
    chosen = held_out_round_robin(items, args.per_class)
    costs = DepthPolicy.load().costs[cost_key(args.device)]
    cfg = config_of(DEFAULT_CHECKPOINT)
    make = lambda: depth_policy("auto", args.device, cfg)  # noqa: E731  (what the CLI runs)
    controller = make().describe()
    k_max = make().k_max
    ks = [k for k in costs.depths if k <= k_max]
    done: dict[int, dict] = {}
    if args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("controller") == controller and old.get("max_new_tokens") == n_new:
            done = {r["key"]: r for r in old.get("prompts", []) if "key" in r and items[r["key"]]["ids"] == r["ids"]}
    ref = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, require_mtp=True)
    max_len = max(len(it["ids"]) for it in chosen) + n_new + k_max + 2
    be = None
    rows = [done[it["key"]] for it in chosen if it["key"] in done]

    def write() -> None:
        summary = summarize(rows, ks) if rows else {}
        report = {"device": be.label if be is not None else args.device,
                  "costs": {"table": cost_key(args.device), "source": costs.source, "note": costs.note,
                            "per_k": costs.costs},
                  "controller": controller, "max_new_tokens": n_new,
                  "scoring": "tokens per unit cost = (1 + sum of (accepted + 1) over steps) / (1 + sum of step costs); "
                             "fixed K from the reference acceptance trace; auto from the TT run's own steps",
                  "per_class_requested": args.per_class, "classes": summary, "prompts": rows}
        if args.out:
            atomic_write_json(args.out, report)

    def backend():
        nonlocal be
        if be is None:
            be = load_tt_backend(DEFAULT_CHECKPOINT, args.device, "shadow_commit", max_len, depths=make().depths)
        return be

    def check_tt_plain(row: dict, auto_tokens: list[int]) -> None:
        """Where TT differs from the reference's greedy (bf16 TT vs fp32 reference at a near tie), the speculative
        run must still equal TT's own plain greedy: that is the losslessness claim on TT."""
        if not row["tt_equals_reference_greedy"] and "tt_equals_tt_plain_greedy" not in row:
            gen = backend().gen
            row["tt_equals_tt_plain_greedy"] = auto_tokens == gen.greedy(row["ids"], n_new)
            gen.release_trace()

    for row in rows:  # resumed rows recorded before this check existed
        if not row["tt_equals_reference_greedy"] and "tt_equals_tt_plain_greedy" not in row:
            res = speculative_generate(backend(), row["ids"], n_new, make())
            check_tt_plain(row, res.tokens)
            write()
    for it in chosen:
        if it["key"] in done:
            continue
        if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
            print(f"time budget reached: {len(rows)} prompts done", flush=True)
            break
        backend()
        trace, ref_plain = fit.acceptance_trace(ref, it["ids"], n_new)
        t0 = time.perf_counter()
        res = speculative_generate(be, it["ids"], n_new, make())
        wall = time.perf_counter() - t0
        tt_steps = [list(s) for s in zip(res.stats.depths, res.stats.accepted)]
        _, replay_steps = fit.replay(trace, n_new, make())
        replay_steps = [list(s) for s in replay_steps]
        first_diff = next((i for i, (x, y) in enumerate(zip(tt_steps, replay_steps)) if x != y), None)
        fixed = {str(k): fit.tokens_per_cost(trace, n_new, FixedDepth(k), costs) for k in ks}
        row = {"key": it["key"], "class": it["class"], "source": it["source"], "ids": it["ids"],
               "prompt_tokens": len(it["ids"]), "reference_trace": trace,
               "tt_equals_reference_greedy": res.tokens == ref_plain[: len(res.tokens)],
               "tt_steps": tt_steps, "replay_steps": replay_steps, "steps_equal": tt_steps == replay_steps,
               "first_step_differing": first_diff,
               "tt_auto_tokens_per_cost": steps_tokens_per_cost(tt_steps, costs),
               "replay_auto_tokens_per_cost": steps_tokens_per_cost(replay_steps, costs),
               "fixed_tokens_per_cost": fixed, "emulator_wall_s": wall}
        check_tt_plain(row, res.tokens)
        rows.append(row)
        write()
        best = max(fixed, key=fixed.get)
        print(f"{it['class']:16s} #{it['key']:3d} steps equal {row['steps_equal']!s:5s} (first diff {first_diff}) "
              f"auto {row['tt_auto_tokens_per_cost']:.3f} prompt's best fixed K={best} {fixed[best]:.3f} "
              f"lossless-vs-reference {row['tt_equals_reference_greedy']} ({wall:.0f} s)", flush=True)
    if be is not None:
        be.close()
    write()
    if rows:
        print(table(summarize(rows, ks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
