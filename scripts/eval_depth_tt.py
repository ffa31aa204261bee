#!/usr/bin/env python3
"""`--spec-k auto` on the TT path, per class, on the held-out prompts of the depth evaluation.

    python scripts/eval_depth_tt.py [--device emulated-p150x2] [--per-class 12] [--max-new-tokens 64]
        [--out bench/depth/depth_eval_tt.json] [--time-budget-s S] [--first-class prose] [--no-tt-traces]

The evaluation table of docs/depth.md replays depth policies on acceptance traces of the reference model (greedy:
a step of depth K at position n accepts min(K, L_n)). This script measures the TT path itself on the held-out
("eval" split) prompts of ``depth_prompts.json``, taken round-robin over the classes (prompt 1 of every class, then
prompt 2, ...) so that a run stopped early still covers every class evenly. For each prompt it

1. computes the prompt's reference acceptance trace (``fit_depth_policy.acceptance_trace``, CPU fp32);
2. runs ``speculative_generate`` on the TT backend with the controller the CLI builds for this device (the
   ``cost_key(device)`` table, K capped by the verify) and records its steps (K, accepted) and its tokens;
3. replays the same controller on the reference trace (equal steps: the TT step accepted what the reference does);
4. scores tokens per unit cost = emitted / (1 + sum of step costs) with the device's cost table (prefill's token
   costs one decode step). The TT run is scored like the replays: every token its steps emitted, including the
   ones past ``--max-new-tokens`` in the last step (the engine keeps only the first ``--max-new-tokens``), so the
   TT auto figure and the fixed-K figures count the same thing.

Then, like for like (the TT step is bf16 and can accept differently from the fp32 reference at near ties), it makes
the TT path's OWN acceptance trace of every prompt (``tt_acceptance_trace``: a K_MAX-deep TT step at every position,
one token committed per step), replays every fixed K and the controller on it, and checks that the recorded TT auto
run took exactly the steps of that replay. Prompts of ``--first-class`` go first, then the other classes round-robin.
Where the TT output differs from the reference's greedy it also runs TT's own plain greedy: the speculative output
must equal it (losslessness on TT). The TT auto runs already in the report are reused, not rerun.

Per class (and over all prompts: "mixed") the report holds the best fixed K *for the class* (highest mean tokens per
cost over the class's prompts), its mean, the TT auto run's mean and the ratio, twice: ``classes_tt`` with fixed K
on the TT traces (the like-for-like table) and ``classes`` with fixed K on the reference traces. The goal is ratio
>= 0.97 per class and > 1 on the mixed set. Results are written after every prompt; rerunning with the same
``--out`` keeps what is there (same prompt ids, same controller: description, fitted parameters and step costs) and
runs the rest. The step costs are whatever the policy file's table says (``modelled`` for the P150a table); wall
time on the emulator is not a device cost and is only recorded.
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
from qwen36.commands.speculative_generate import config_of, depth_policy, load_backend  # noqa: E402
from qwen36.io_utils import atomic_write_json  # noqa: E402
from qwen36.reference.model import Qwen36Model  # noqa: E402
from qwen36.speculative.depth import DepthPolicy, FixedDepth, StepCosts, cost_key  # noqa: E402
from qwen36.speculative.engine import Acceptance, speculative_generate  # noqa: E402

GOAL_CLASS_RATIO = 0.97


@torch.no_grad()
def tt_acceptance_trace(be, prompt: list[int], n: int, k_max: int = fit.K_MAX) -> tuple[list[int], list[int]]:
    """The TT path's own acceptance trace: (L_n for each emitted position, the emitted tokens), as
    ``fit_depth_policy.acceptance_trace`` makes it on the reference: a K_MAX-deep step (device MTP drafts, the
    K_MAX+1-row verify, on-device greedy acceptance) at every position, committing one token per step.

    ``be`` is a ``TTSpecBackend`` whose ``depths`` include k_max (the same per-depth traces ``--spec-k auto`` runs).
    The device commit, the GDN ring index and the MTP reseed all read the acceptor's on-device count, so writing 0
    into it after the read-back makes the step commit exactly one token: verify row 0's argmax, which is column 0 of
    the acceptor's result whatever was accepted (the first accepted draft equals it, or it is the correction). The
    write is a device copy between two trace replays (no allocation, nothing captured)."""
    ttnn = be.ttnn
    tokens, trace = [be.join(0, prompt)], []
    while len(tokens) < n:
        d = be.draft({0: k_max})
        v = be.verify(d)
        acc = be.accept(d, v)[0]
        trace.append(acc.num_accepted)
        ttnn.copy(be.step_state.c_zero, be.acceptor.count)
        be.plan_next_depths({0: k_max})
        be.commit({0: Acceptance(0, acc.tokens[:1])})
        tokens.append(acc.tokens[0])
    be.leave(0)
    be.release()
    return trace, tokens


def tt_plain_greedy(be, prompt: list[int], n: int) -> list[int]:
    """TT plain greedy on the speculative backend's generator. The backend's step traces are released first: the
    plain prefill allocates, and no device allocation may happen while a trace is live."""
    be.release()
    try:
        return be.gen.generate([prompt], n)[0].tokens
    finally:
        be.gen.release_trace()


@torch.no_grad()
def first_difference(model, prompt: list[int], spec: list[int], plain: list[int]) -> dict | None:
    """Where a TT speculative run and TT plain greedy part: the position, both tokens, and the fp32 reference's
    logits for both tokens after the common prefix (a gap far below one bf16 step at that magnitude is a near tie
    that the K+1-row verify and the 1-row decode may resolve differently)."""
    i = next((i for i, (x, y) in enumerate(zip(spec, plain)) if x != y), None)
    if i is None:
        return None
    dev = next(model.parameters()).device
    logits = model(torch.tensor([list(prompt) + plain[:i]], device=dev), model.new_state(1, len(prompt) + i + 2))
    lg = logits.logits[0, -1].float()
    top2 = torch.topk(lg, 2).values
    return {"position": i, "speculative_token": spec[i], "plain_token": plain[i],
            "reference_logit_plain_token": float(lg[plain[i]]), "reference_logit_speculative_token": float(lg[spec[i]]),
            "reference_argmax": int(lg.argmax()), "reference_top2_margin": float(top2[0] - top2[1])}


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


def _ratio_row(rs: list[dict], ks: list[int], fixed_key: str, goal: float, mixed: bool) -> dict:
    """Best fixed K of a group (highest mean over its prompts of ``fixed_key``), its mean, TT auto's mean, ratio."""
    fixed = {k: statistics.fmean(r[fixed_key][str(k)] for r in rs) for k in ks}
    kbest = max(fixed, key=fixed.get)
    auto = statistics.fmean(r["tt_auto_tokens_per_cost"] for r in rs)
    ratio = auto / fixed[kbest]
    return {"prompts": len(rs), "best_fixed_k": kbest, "best_fixed": fixed[kbest], "auto": auto, "ratio": ratio,
            "goal_met": ratio > goal if mixed else ratio >= goal}


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["class"], []).append(r)
    groups["mixed"] = list(rows)
    return groups


def summarize(rows: list[dict], ks: list[int]) -> dict[str, dict]:
    """Per class and "mixed", fixed K replayed on the REFERENCE traces against the TT auto run: best fixed K for the
    class (mean over its prompts), its mean, auto's mean, ratio."""
    out = {}
    for c, rs in _groups(rows).items():
        goal = 1.0 if c == "mixed" else GOAL_CLASS_RATIO
        out[c] = _ratio_row(rs, ks, "fixed_tokens_per_cost", goal, c == "mixed")
        out[c].update({"replay_auto": statistics.fmean(r["replay_auto_tokens_per_cost"] for r in rs),
                       "steps_equal_replay": sum(r["steps_equal"] for r in rs),
                       "equal_reference_greedy": sum(r["tt_equals_reference_greedy"] for r in rs),
                       "lossless": all(r["tt_equals_reference_greedy"] or r.get("tt_equals_tt_plain_greedy", False)
                                       for r in rs)})
    return out


def summarize_tt(rows: list[dict], ks: list[int]) -> dict[str, dict]:
    """Like for like: fixed K replayed on the TT path's OWN acceptance traces against the TT auto run, over the
    prompts that have a TT trace. Also: how many TT auto runs took exactly the steps of the controller replayed on
    the TT trace, and the TT-trace replay of auto (equal to the run's figure when every run matches)."""
    rows = [r for r in rows if "tt_trace" in r]
    out = {}
    for c, rs in (_groups(rows).items() if rows else []):
        goal = 1.0 if c == "mixed" else GOAL_CLASS_RATIO
        out[c] = _ratio_row(rs, ks, "tt_fixed_tokens_per_cost", goal, c == "mixed")
        out[c].update({"tt_replay_auto": statistics.fmean(r["tt_replay_auto_tokens_per_cost"] for r in rs),
                       "steps_equal_tt_replay": sum(r["tt_steps_equal_tt_replay"] for r in rs)})
    return out


def table(summary: dict[str, dict], equal_key: str = "steps_equal_replay") -> str:
    lines = ["| class | prompts | best fixed K | its tokens / unit cost | TT auto tokens / unit cost | auto / best | "
             "TT steps == replay |", "|---|---|---|---|---|---|---|"]
    for c in sorted(summary, key=lambda c: (c == "mixed", c)):
        s = summary[c]
        lines.append(f"| {c} | {s['prompts']} | {s['best_fixed_k']} | {s['best_fixed']:.3f} | {s['auto']:.3f} | "
                     f"{s['ratio']:.3f} | {s[equal_key]}/{s['prompts']} |")
    return "\n".join(lines)


def tt_trace_order(rows: list[dict], first: str = "prose") -> list[dict]:
    """The order TT traces are made in: every prompt of class ``first``, then the other classes round-robin (in
    the order the rows already have), so a run stopped by its time budget covers the other classes evenly."""
    head = [r for r in rows if r["class"] == first]
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["class"] != first:
            by.setdefault(r["class"], []).append(r)
    n = max((len(v) for v in by.values()), default=0)
    return head + [by[c][j] for j in range(n) for c in by if j < len(by[c])]


def add_tt_trace(row: dict, trace: list[int], trace_tokens: list[int], ref_plain: list[int], n_new: int,
                 make_policy, costs: StepCosts, ks: list[int]) -> None:
    """Score a prompt on its TT trace: every fixed K and the controller replayed on it, and whether the TT auto run
    took exactly the replay's steps."""
    _, steps = fit.replay(trace, n_new, make_policy())
    steps = [list(s) for s in steps]
    differing = sum(a != b for a, b in zip(trace, row["reference_trace"]))
    row.update({"tt_trace": trace, "tt_trace_tokens_equal_reference_greedy": trace_tokens == ref_plain[: len(trace_tokens)],
                "tt_fixed_tokens_per_cost": {str(k): fit.tokens_per_cost(trace, n_new, FixedDepth(k), costs)
                                             for k in ks},
                "tt_replay_steps": steps, "tt_steps_equal_tt_replay": row["tt_steps"] == steps,
                "tt_replay_auto_tokens_per_cost": steps_tokens_per_cost(steps, costs),
                "tt_trace_positions_differing_from_reference": differing})
    if trace_tokens != ref_plain[: len(trace_tokens)]:
        row["tt_trace_tokens"] = trace_tokens


def controller_fingerprint(device: str, controller: str) -> dict:
    """What a resumed report must share with this run: the controller's description, its fitted parameters and its
    step costs (a refit changes the parameters, not the description)."""
    pol = DepthPolicy.load()
    key = cost_key(device)
    p = pol.params[key]
    return {"controller": controller, "decay": p.decay, "prior": list(p.prior), "prior_weight": p.prior_weight,
            "costs": {str(k): v for k, v in sorted(pol.costs[key].costs.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emulated-p150x2")
    ap.add_argument("--per-class", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="JSON report, rewritten after every prompt (and resumed)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no new prompt once this many seconds have passed (the report stays consistent)")
    ap.add_argument("--no-tt-traces", action="store_true", help="TT auto runs only (no TT acceptance traces)")
    ap.add_argument("--first-class", default="prose", help="the class whose TT traces are made first")
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
    fingerprint = controller_fingerprint(args.device, controller)
    k_max = make().k_max
    ks = [k for k in costs.depths if k <= k_max]
    done: dict[int, dict] = {}
    resumed_device = None  # the label of the backend that made the resumed rows
    if args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("controller_fingerprint") == fingerprint and old.get("max_new_tokens") == n_new:
            done = {r["key"]: r for r in old.get("prompts", []) if "key" in r and items[r["key"]]["ids"] == r["ids"]}
            resumed_device = old.get("device") if done else None
    ref = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, require_mtp=True)
    max_len = max(len(it["ids"]) for it in chosen) + n_new + k_max + 2
    be = None
    rows = [done[it["key"]] for it in chosen if it["key"] in done]

    def write() -> None:
        summary = summarize(rows, ks) if rows else {}
        report = {"device": be.label if be is not None else resumed_device or args.device,
                  "costs": {"table": cost_key(args.device), "source": costs.source, "note": costs.note,
                            "per_k": costs.costs},
                  "controller": controller, "controller_fingerprint": fingerprint, "max_new_tokens": n_new,
                  "scoring": "tokens per unit cost = (1 + sum of (accepted + 1) over steps) / (1 + sum of step costs); "
                             "auto from the TT run's own steps; fixed K replayed on an acceptance trace: the TT "
                             "path's own (classes_tt, like for like) or the reference's (classes)",
                  "per_class_requested": args.per_class, "classes_tt": summarize_tt(rows, ks), "classes": summary,
                  "prompts": rows}
        if args.out:
            atomic_write_json(args.out, report)

    def backend():
        nonlocal be
        if be is None:
            be = load_backend(DEFAULT_CHECKPOINT, args.device, None, "shadow_commit", max_len, make())
        return be

    def over_budget() -> bool:
        if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
            print(f"time budget reached: {len(rows)} prompts with a TT auto run, "
                  f"{sum('tt_trace' in r for r in rows)} with a TT trace", flush=True)
            return True
        return False

    def check_tt_plain(row: dict, auto_tokens: list[int]) -> None:
        """Where TT differs from the reference's greedy (bf16 TT vs fp32 reference at a near tie), the speculative
        run must still equal TT's own plain greedy: that is the losslessness claim on TT."""
        if not row["tt_equals_reference_greedy"] and "tt_equals_tt_plain_greedy" not in row:
            plain = tt_plain_greedy(backend(), row["ids"], n_new)
            row["tt_equals_tt_plain_greedy"] = auto_tokens == plain
            row["tt_auto_tokens"], row["tt_plain_greedy_tokens"] = auto_tokens, plain

    for it in chosen:
        if it["key"] in done:
            continue
        if over_budget():
            break
        backend()
        trace, ref_plain = fit.acceptance_trace(ref, it["ids"], n_new)
        t0 = time.perf_counter()
        res = speculative_generate(be, [it["ids"]], n_new, [make()])[0]
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

    # TT acceptance traces (and, where TT differs from the reference's greedy, TT's own plain greedy), class
    # --first-class first; the TT auto runs already recorded are reused, not rerun
    for row in ([] if args.no_tt_traces else tt_trace_order(rows, args.first_class)):
        if "tt_trace" in row and (row["tt_equals_reference_greedy"] or "tt_equals_tt_plain_greedy" in row):
            continue
        if over_budget():
            break
        if not row["tt_equals_reference_greedy"] and "tt_equals_tt_plain_greedy" not in row:
            # the auto run's tokens (earlier reports did not store them)
            res = speculative_generate(backend(), [row["ids"]], n_new, [make()])[0]
            if [list(s) for s in zip(res.stats.depths, res.stats.accepted)] != row["tt_steps"]:
                raise SystemExit(f"error: prompt {row['key']}: the TT auto run is not reproducible (steps differ "
                                 "from the recorded run)")
            check_tt_plain(row, res.tokens)
        if "tt_trace" not in row:
            t0 = time.perf_counter()
            trace, trace_tokens = tt_acceptance_trace(backend(), row["ids"], n_new, k_max)
            row["tt_trace_wall_s"] = time.perf_counter() - t0
            ref_plain, _ = fit.plain_greedy(ref, row["ids"], n_new)
            add_tt_trace(row, trace, trace_tokens, ref_plain, n_new, make, costs, ks)
            if "tt_plain_greedy_tokens" in row:
                row["tt_trace_tokens_equal_tt_plain_greedy"] = trace_tokens == row["tt_plain_greedy_tokens"]
        write()
        f = row["tt_fixed_tokens_per_cost"]
        best = max(f, key=f.get)
        print(f"{row['class']:16s} #{row['key']:3d} TT trace: auto steps == TT-trace replay "
              f"{row['tt_steps_equal_tt_replay']!s:5s}, {row['tt_trace_positions_differing_from_reference']} positions "
              f"differ from the reference trace; auto {row['tt_auto_tokens_per_cost']:.3f} prompt's best fixed "
              f"K={best} {f[best]:.3f}; TT == TT plain greedy {row.get('tt_equals_tt_plain_greedy', '-')} "
              f"({row['tt_trace_wall_s']:.0f} s)", flush=True)
    for row in rows:  # where TT speculative != TT plain greedy: how close a tie it was (reference model only)
        if row.get("tt_equals_tt_plain_greedy") is False and "tt_vs_tt_plain_first_difference" not in row:
            row["tt_vs_tt_plain_first_difference"] = first_difference(ref, row["ids"], row["tt_auto_tokens"],
                                                                      row["tt_plain_greedy_tokens"])
            print(f"{row['class']:16s} #{row['key']:3d} TT auto != TT plain greedy: "
                  f"{row['tt_vs_tt_plain_first_difference']}", flush=True)
    for row in rows:  # where the TT trace's tokens leave the reference's greedy: how close a tie it was
        if "tt_trace_tokens" in row and "tt_trace_vs_reference_first_difference" not in row:
            ref_plain, _ = fit.plain_greedy(ref, row["ids"], n_new)
            row["tt_trace_vs_reference_first_difference"] = first_difference(ref, row["ids"], row["tt_trace_tokens"],
                                                                             ref_plain)
            print(f"{row['class']:16s} #{row['key']:3d} TT trace tokens != reference greedy: "
                  f"{row['tt_trace_vs_reference_first_difference']}", flush=True)
    if be is not None:
        be.close()
    write()
    if rows:
        print("fixed K on the reference traces:\n" + table(summarize(rows, ks)))
        tt = summarize_tt(rows, ks)
        if tt:
            print("fixed K on the TT traces (like for like):\n" + table(tt, "steps_equal_tt_replay"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
