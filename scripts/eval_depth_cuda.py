#!/usr/bin/env python3
"""The depth evaluation of scripts/fit_depth_policy.py with step costs measured on a CUDA device.

    python scripts/eval_depth_cuda.py [--device cuda] [--workers 16] [--per-class N] [--out R.json]

Same prompts, traces, fit and held-out table as fit_depth_policy.py; only the step-cost table differs: wall-clock
medians of interleaved speculative steps per K against plain decode steps of the reference model on ``--device``
(``fit_depth_policy.reference_costs``: every step ends in ``int(argmax)``, a device sync, so the clock sees the
device work). The acceptance traces are made on the CPU in ``--workers`` processes (greedy acceptance does not
depend on the step costs); ``--engine-checks`` held-out prompts per class then run the real engine on the device
with the fitted controller and fixed K = 1, 3, 7: output == plain greedy on the device, steps == the replay.
The controller's parameters are refitted for this cost table (what the policy file holds per table); the shipped
policy file is not changed. ``--per-class`` limits the prompts (smoke runs).
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
from qwen36.io_utils import atomic_write_json  # noqa: E402
from qwen36.reference.model import Qwen36Model  # noqa: E402
from qwen36.speculative.depth import DepthController, DepthParams, FixedDepth, StepCosts  # noqa: E402
from qwen36.speculative.engine import speculative_generate  # noqa: E402
from qwen36.speculative.reference_backend import ReferenceBackend  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--per-class", type=int, default=None, help="prompts per class and split (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--engine-checks", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start, n_new = time.perf_counter(), args.max_new_tokens
    items = json.loads(fit.PROMPTS.read_text())["prompts"]
    for i, it in enumerate(items):
        it["key"] = i
    if args.per_class is not None:
        seen: dict = {}
        keep = []
        for it in items:
            c = (it["class"], it["split"])
            if seen.get(c, 0) < args.per_class:
                seen[c] = seen.get(c, 0) + 1
                keep.append(it)
        items = keep
    jobs = [(it["key"], it["ids"], n_new) for it in items]
    if args.workers > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(args.workers) as pool:  # CPU traces, before CUDA is initialised
            results = pool.map(fit._trace_job, jobs, chunksize=1)
    else:
        results = [fit._trace_job(j) for j in jobs]
    traces = {key: trace for key, trace, _, _ in results}
    t_traces = time.perf_counter() - t_start
    dev = torch.device(args.device)
    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, device=str(dev), require_mtp=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    fit_items = [it for it in items if it["split"] == "fit"]
    held = [it for it in items if it["split"] == "eval"]
    measured = fit.reference_costs(model, [it["ids"] for it in fit_items[::2]], n_new)
    costs = StepCosts(f"reference (torch {dev.type.upper()}, {name})", "measured", measured.costs, measured.note)
    prior = fit.pooled_prior([traces[it["key"]] for it in fit_items])
    fixed_fit = {k: fit.class_scores(traces, fit_items, n_new, lambda k=k: FixedDepth(k), costs)
                 for k in range(1, fit.K_MAX + 1)}
    best = None
    for decay in fit.DECAYS:
        for w in fit.PRIOR_WEIGHTS:
            p = DepthParams(decay, prior, w)
            auto = fit.class_scores(traces, fit_items, n_new, lambda: DepthController(p, costs), costs)
            ratios = [auto[c] / max(fixed_fit[k][c] for k in fixed_fit) for c in auto]
            score = (min(ratios), statistics.fmean(ratios))
            if best is None or score > best[0]:
                best = (score, p)
    params = best[1]
    fixed = {k: fit.class_scores(traces, held, n_new, lambda k=k: FixedDepth(k), costs) for k in range(1, fit.K_MAX + 1)}
    auto = fit.class_scores(traces, held, n_new, lambda: DepthController(params, costs), costs)
    rows = {}
    for c in auto:
        kb = max(fixed, key=lambda k: fixed[k][c])
        rows[c] = {"best_fixed_k": kb, "best_fixed": fixed[kb][c], "auto": auto[c], "ratio": auto[c] / fixed[kb][c]}
    checked, per = 0, {}
    for it in held:
        if per.get(it["class"], 0) >= args.engine_checks:
            continue
        per[it["class"]] = per.get(it["class"], 0) + 1
        plain = fit.plain_greedy(model, it["ids"], n_new)[0]
        for make in [lambda: DepthController(params, costs)] + [lambda k=k: FixedDepth(k) for k in (1, 3, 7)]:
            be = ReferenceBackend(model, "shadow_commit", max_len=len(it["ids"]) + n_new + fit.K_MAX + 2,
                                  max_k=fit.K_MAX)
            res = speculative_generate(be, [it["ids"]], n_new, [make()])[0]
            _, steps = fit.replay(traces[it["key"]], n_new, make())
            real = list(zip(res.stats.depths, res.stats.accepted))
            if res.tokens != plain or real != steps[: len(real)]:
                raise SystemExit(f"error: prompt {it['key']} {make().describe()}: lossless {res.tokens == plain}, "
                                 f"steps {real} vs replay {steps}")
            checked += 1
    report = {"costs": {"backend": costs.backend, "source": costs.source, "note": costs.note, "per_k": costs.costs},
              "fit": {"decay": params.decay, "prior_weight": params.prior_weight, "fit_min_ratio": best[0][0],
                      "fit_mean_ratio": best[0][1]},
              "classes": rows, "prompts": {"fit": len(fit_items), "eval": len(held), "max_new_tokens": n_new},
              "engine_checks": {"runs": checked, "device": str(dev), "lossless": True, "replay_equals_engine": True},
              "seconds": {"traces_cpu": t_traces, "total": time.perf_counter() - t_start}}
    print(json.dumps(report, indent=1))
    if args.out:
        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
