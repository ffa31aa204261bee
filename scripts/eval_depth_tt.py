#!/usr/bin/env python3
"""`--spec-k auto` on the TT path vs the depth evaluation of scripts/fit_depth_policy.py, on held-out prompts.

    python scripts/eval_depth_tt.py [--device emulated-p150x2] [--per-class 1] [--max-new-tokens 64] [--out R.json]

The evaluation table of docs/depth.md replays depth policies on acceptance traces of the reference model (greedy:
a step of depth K at position n accepts min(K, L_n)). Whether that table holds for the TT path depends on one thing:
that the TT step (bf16 weights, device MTP, per-depth traces) accepts what the reference accepts. For each of the
first ``--per-class`` held-out prompts of every class this script

1. computes the prompt's reference acceptance trace (``fit_depth_policy.acceptance_trace``, CPU fp32);
2. runs ``speculative_generate`` on the TT backend with the controller the CLI builds for this device (the
   ``cost_key(device)`` table, K capped by the verify) and records its steps (K, accepted);
3. replays the same controller on the reference trace and compares: equal steps mean the replayed table is the
   TT path's table for that prompt; a difference is reported with the first step where it appears;
4. reports tokens per unit cost (the device's cost table, prefill = one decode step) of the TT run and of every
   fixed K on the reference trace (fixed-K runs on TT are not made: 7 more emulated runs per prompt).

The step costs are whatever the policy file's table says (``modelled`` for the P150a table); wall time on the
emulator is not a device cost and is only printed.
"""
from __future__ import annotations

import argparse
import json
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
from qwen36.speculative.depth import DepthPolicy, FixedDepth, cost_key  # noqa: E402
from qwen36.speculative.engine import speculative_generate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emulated-p150x2")
    ap.add_argument("--per-class", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n_new = args.max_new_tokens
    items = json.loads(fit.PROMPTS.read_text())["prompts"]
    held = [it for it in items if it["split"] == "eval"]
    chosen, per = [], {}
    for it in held:
        if per.get(it["class"], 0) < args.per_class:
            per[it["class"]] = per.get(it["class"], 0) + 1
            chosen.append(it)
    ref = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, require_mtp=True)
    costs = DepthPolicy.load().costs[cost_key(args.device)]
    cfg = config_of(DEFAULT_CHECKPOINT)
    make = lambda: depth_policy("auto", args.device, cfg)  # noqa: E731  (what the CLI runs)
    k_max = make().k_max
    max_len = max(len(it["ids"]) for it in chosen) + n_new + k_max + 2
    be = load_tt_backend(DEFAULT_CHECKPOINT, args.device, "shadow_commit", max_len, depths=make().depths)
    rows = []
    for it in chosen:
        trace, ref_plain = fit.acceptance_trace(ref, it["ids"], n_new)
        t0 = time.perf_counter()
        res = speculative_generate(be, it["ids"], n_new, make())
        wall = time.perf_counter() - t0
        tt_steps = list(zip(res.stats.depths, res.stats.accepted))
        _, replay_steps = fit.replay(trace, n_new, make())
        first_diff = next((i for i, (x, y) in enumerate(zip(tt_steps, replay_steps)) if x != y), None)
        tt_tpc = len(res.tokens) / (1.0 + sum(costs.costs[k] for k, _ in tt_steps))
        fixed = {k: fit.tokens_per_cost(trace, n_new, FixedDepth(k), costs) for k in costs.depths if k <= k_max}
        best_k = max(fixed, key=fixed.get)
        row = {"class": it["class"], "source": it["source"], "prompt_tokens": len(it["ids"]),
               "tt_equals_reference_greedy": res.tokens == ref_plain[: len(res.tokens)],
               "tt_steps": tt_steps, "replay_steps": replay_steps, "steps_equal": tt_steps == replay_steps,
               "first_step_differing": first_diff, "tt_auto_tokens_per_cost": tt_tpc,
               "replay_auto_tokens_per_cost": fit.tokens_per_cost(trace, n_new, make(), costs),
               "fixed_tokens_per_cost": fixed, "best_fixed_k": best_k,
               "tt_auto_over_best_fixed": tt_tpc / fixed[best_k], "emulator_wall_s": wall}
        rows.append(row)
        print(f"{it['class']:16s} steps equal {row['steps_equal']!s:5s} (first diff {first_diff}) "
              f"auto {tt_tpc:.3f} best fixed K={best_k} {fixed[best_k]:.3f} ratio {row['tt_auto_over_best_fixed']:.3f} "
              f"lossless-vs-reference {row['tt_equals_reference_greedy']} ({wall:.0f} s)", flush=True)
    be.close()
    report = {"device": be.label, "costs": {"table": cost_key(args.device), "source": costs.source,
                                            "note": costs.note, "per_k": costs.costs},
              "controller": make().describe(), "max_new_tokens": n_new, "prompts": rows}
    if args.out:
        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
