"""Probe acceptance: greedy MTP acceptance per precision of the MTP head and the LM head, and what it buys.

For every precision in ``--precisions`` (names ``PrecisionSetting.named`` reads: ``performance+mtp=accuracy`` is
a bf8 target with a bf16 MTP layer, ``performance+lm_head=bfloat16`` a bf16 LM head shared by target and MTP) the
TT speculative path (traced verify + accept + commit + device MTP, shadow_commit, one user) decodes each held-out
prompt greedily at every K of ``--ks``; the fp32 torch reference (target and MTP head) decodes the same prompts
as the baseline. Per (precision, K), pooled over every step of every prompt: mean accepted drafts per step, mean
emitted tokens per step (accepted + 1), acceptance per draft position, the per-prompt spread, and the fraction of
prompts whose tokens equal the reference's greedy tokens (a block-float target may flip near ties; the
acceptance is then of a slightly different text). These figures are **measured** on the backend that ran.

Prompts: ``speculative/depth_prompts.json``'s ``--split`` (default ``eval``: prompts from the checkpoint's held-out
stdlib files, never trained on and not the ones the depth policy was fit on), ``--per-class`` of each class in
``--classes``.

``--gate CANDIDATE:BASELINE`` (e.g. ``performance-bf4:performance``): the acceptance-aware precision gate on the
trained checkpoint, thresholds fixed before the first run. Greedy agreement: over every prompt, the candidate's greedy
tokens before its first divergence from the baseline's, as a fraction of the generated tokens; it must be at least the
baseline's own agreement with the fp32 reference less ``AGREEMENT_DROP_MAX`` (3 points, the tolerance of
precision-gate's top-1 criterion, Tenstorrent's 91 -> 88 % for this change on Llama-3.2-1B): the candidate may move the
text away from the default no further than the default already stands from fp32. MTP acceptance: the candidate's mean
accepted drafts per step at least ``ACCEPTANCE_RATIO_MIN`` (95 %) of the baseline's at every K, since a precision
that saves a few percent of step time must not give it back in drafts. A failing gate says by how much.

``--step-records``: gate-0b records (``qwen36 probe gate-0b --preset 27b --ks 3,5 --precision P``). For each
precision with a record at that K: tok/s = mean emitted per step x 1000 / the record's calibrated shadow-commit
step time, with the record's band. That step time is **modelled (calibrated)** (tt_ops/cost_model.py) at 27B
shapes, while the acceptance comes from the small trained checkpoint: the product is a model of 27B tok/s under
this checkpoint's acceptance, labelled so. The emulator's arithmetic is the card's (docs/emulator.md), so the
precision's effect on acceptance is the one cards would show for these weights.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from qwen36.errors import UserError
from qwen36.probes.records import ProbeReport

NAME = "acceptance"
HELP = ("greedy MTP acceptance per precision of the MTP layer / LM head vs the fp32 reference on held-out prompts; "
        "tok/s = emitted per step / gate-0b's calibrated step time")
DEFAULT_PRECISIONS = ("performance", "performance+mtp=accuracy", "performance+lm_head=bfloat16",
                      "performance+lm_head=bfloat16+mtp=accuracy", "performance+mtp=performance-bf4")
DEFAULT_CLASSES = ("code-repetitive", "code-fresh", "prose")
REFERENCE = "reference fp32"
AGREEMENT_DROP_MAX = 0.03
ACCEPTANCE_RATIO_MIN = 0.95


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS), help="TT precision names, comma-separated")
    p.add_argument("--ks", default="3,5", help="draft depths K")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompt file (default: the package's speculative/depth_prompts.json)")
    p.add_argument("--split", default="eval", help="prompt split of the file (eval: held out from the depth fit too)")
    p.add_argument("--classes", default=",".join(DEFAULT_CLASSES))
    p.add_argument("--per-class", type=int, default=2, help="prompts per class")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--step-records", type=Path, nargs="*", default=[],
                   help="gate-0b records (.jsonl) whose calibrated step times turn emitted/step into tok/s")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the fp32 reference runs (their cells then come from --acceptance-records)")
    p.add_argument("--gate", default=None, metavar="CANDIDATE:BASELINE",
                   help="acceptance-aware precision gate of CANDIDATE against BASELINE (both in --precisions)")
    p.add_argument("--acceptance-records", type=Path, nargs="*", default=[],
                   help="earlier acceptance records: their measured cells are reused (same prompts, K and tokens "
                        "required) and those precisions are not run again")


def load_prompts(path: Path | None, split: str, classes, per_class: int) -> list[dict]:
    """The first ``per_class`` prompts of each class of ``split`` (file order)."""
    from qwen36.speculative import depth as depth_mod

    path = path or Path(depth_mod.__file__).with_name("depth_prompts.json")
    rows = json.loads(path.read_text())["prompts"]
    out = []
    for c in classes:
        got = [r for r in rows if r["split"] == split and r["class"] == c][:per_class]
        if len(got) < per_class:
            raise ValueError(f"{path}: {len(got)} '{split}' prompts of class {c!r}, asked for {per_class}")
        out += got
    return out


def pooled(results, ref_tokens=None) -> dict:
    """Acceptance figures pooled over every step of every prompt's GenerationResult."""
    acc = [a for r in results for a in r.stats.accepted]
    k = results[0].stats.k
    per_prompt = [r.stats.mean_accepted for r in results]
    steps = len(acc)
    mean = sum(acc) / steps
    out = {"k": k, "prompts": len(results), "steps": steps, "mean_accepted": mean, "mean_emitted": mean + 1.0,
           "per_position": [sum(a >= i for a in acc) / steps for i in range(1, k + 1)],
           "histogram": [acc.count(a) for a in range(k + 1)],
           "per_prompt_mean_accepted": per_prompt,
           "per_prompt_min_max": [min(per_prompt), max(per_prompt)]}
    if ref_tokens is not None:
        out["prompts_tokens_equal_reference"] = sum(r.tokens == t for r, t in zip(results, ref_tokens)) / len(results)
    return out


def step_times(paths) -> dict:
    """{(precision, K): ([central, low, high] calibrated shadow-commit step ms, record path, run_id)} from gate-0b
    records (single-user ones; the last record wins where several cover the same cell)."""
    out = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            r = json.loads(line)
            if r.get("probe") != "gate-0b" or r["config"].get("batch", 1) != 1:
                continue
            cal = (r.get("performance") or {}).get("calibrated")
            if not cal:
                continue
            for k, ms in cal["step_ms_shadow_commit"].items():
                out[(r["config"]["precision"], int(k))] = (ms, str(p), r.get("run_id"), cal["label"],
                                                           r["config"].get("preset"))
    return out


def tok_s(emitted: float, ms) -> list[float]:
    """[central, low, high] tok/s from [central, low, high] ms (low tok/s goes with the high step time)."""
    return [emitted * 1e3 / ms[0], emitted * 1e3 / ms[2], emitted * 1e3 / ms[1]]


def reference_runs(ckpt: Path, prompts, ks, max_new: int) -> dict:
    import torch

    from qwen36.reference.model import Qwen36Model
    from qwen36.speculative.engine import speculative_generate
    from qwen36.speculative.reference_backend import ReferenceBackend

    model = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for k in ks:
            be = ReferenceBackend(model, "shadow_commit", max_len=max(len(p) for p in prompts) + max_new + 8, max_k=k)
            out[k] = [speculative_generate(be, [p], max_new, [k])[0] for p in prompts]
    return out


def tt_runs(ckpt: Path, device: str, precision: str, prompts, ks, max_new: int):
    """{K: [GenerationResult per prompt]}, backend label."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.speculative.engine import speculative_generate
    from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.build import build_spec_backend

    longest = max(len(p) for p in prompts) + max_new + max(ks) + 2
    gen = build_generator(ckpt, device, precision=precision, max_seq_len=-(-longest // 64) * 64, progress=False,
                          pages=SMALL_PAGES, cache_dir=None, require_mtp=True)
    try:
        drafter = TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True))
        out = {}
        for k in ks:
            out[k] = []
            for p in prompts:
                be = build_spec_backend(gen, drafter, mechanism="shadow_commit")
                try:
                    out[k].append(speculative_generate(be, [p], max_new, [k])[0])
                finally:
                    be.close()
        return out, gen.label
    finally:
        gen.close()


POOLED_KEYS = ("k", "prompts", "steps", "mean_accepted", "mean_emitted", "per_position", "histogram",
               "per_prompt_mean_accepted", "per_prompt_min_max", "prompts_tokens_equal_reference", "tokens_per_prompt")
SAME_RUN_KEYS = ("checkpoint", "split", "classes", "per_class", "prompt_sources", "max_new_tokens", "mechanism")


def earlier_cells(paths, config: dict, ks) -> tuple[dict, dict, str | None]:
    """Measured cells of earlier acceptance records ({precision: {K: figures}}, {precision: record path}, their
    backend), refusing a record of other prompts or token counts."""
    figures, source, backend = {}, {}, None
    for p in paths:
        for line in Path(p).read_text().splitlines():
            r = json.loads(line)
            if r.get("probe") != NAME:
                continue
            diff = [k for k in SAME_RUN_KEYS if r["config"].get(k) != config[k]]
            if diff:
                raise ValueError(f"{p}: acceptance record of another run ({', '.join(diff)} differ): not reusable here")
            for c in r["cells"]:
                if c["k"] in ks:
                    figures.setdefault(c["precision"], {})[c["k"]] = {x: c[x] for x in POOLED_KEYS if x in c}
                    source[c["precision"]] = str(p)
            if r["config"]["precisions"]:
                backend = r["backend"]
    return figures, source, backend


def agreement(got, want) -> float:
    """Greedy agreement of token lists ``got`` with ``want`` (one per prompt): the tokens before the first divergence,
    pooled over prompts, as a fraction of the generated tokens."""
    same = total = 0
    for g, w in zip(got, want):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        same, total = same + n, total + len(w)
    return same / total if total else 0.0


def gate_cell(spec: str, figures: dict, ks) -> dict:
    """The acceptance-aware gate of ``CANDIDATE:BASELINE`` (module doc): greedy agreement and MTP acceptance."""
    cand, base = spec.split(":")
    k0 = ks[0]  # greedy speculative decoding is lossless: the tokens are those of plain greedy at every K
    tokens = {p: figures[p][k0]["tokens_per_prompt"] for p in (cand, base)}
    if REFERENCE not in figures:
        raise UserError("--gate needs the fp32 reference runs (drop --no-reference or give its acceptance record)")
    ref = figures[REFERENCE][k0]["tokens_per_prompt"]
    a_cb, a_br, a_cr = agreement(tokens[cand], tokens[base]), agreement(tokens[base], ref), agreement(tokens[cand], ref)
    need = a_br - AGREEMENT_DROP_MAX
    def ratio(c, b):  # a baseline that accepted nothing loses nothing to a candidate that accepts as little
        return c / b if b > 0 else (1.0 if c == 0 else float("inf"))

    ratios = {k: ratio(figures[cand][k]["mean_accepted"], figures[base][k]["mean_accepted"]) for k in ks}
    agree_ok = a_cb >= need
    accept_ok = all(r >= ACCEPTANCE_RATIO_MIN for r in ratios.values())
    return {"cell": f"gate {cand} vs {base}", "precision": cand, "baseline": base, "k": k0, "steps": 1,
            "greedy_agreement_vs_baseline": a_cb, "baseline_agreement_vs_reference": a_br,
            "candidate_agreement_vs_reference": a_cr, "greedy_agreement_min": need, "greedy_agreement_ok": agree_ok,
            "greedy_agreement_shortfall": max(0.0, need - a_cb), "acceptance_ratio": ratios,
            "acceptance_ratio_min": ACCEPTANCE_RATIO_MIN, "acceptance_ok": accept_ok,
            "acceptance_shortfall": {k: max(0.0, ACCEPTANCE_RATIO_MIN - r) for k, r in ratios.items()},
            "gate": True, "pass": agree_ok and accept_ok,
            "failed": [n for n, ok in (("greedy_agreement", agree_ok), ("acceptance", accept_ok)) if not ok]}


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.tt.model.model_config import PrecisionSetting

    t0 = time.perf_counter()
    ks = tuple(int(x) for x in args.ks.split(","))
    precisions = [p for p in args.precisions.split(",") if p]
    for p in precisions:
        PrecisionSetting.named(p)  # a bad name fails before any run
    if args.gate and (args.gate.count(":") != 1 or any(x not in precisions for x in args.gate.split(":"))):
        raise UserError(f"--gate {args.gate!r}: give CANDIDATE:BASELINE, both among --precisions")
    rows = load_prompts(args.prompts, args.split, [c for c in args.classes.split(",") if c], args.per_class)
    prompts = [r["ids"] for r in rows]
    config = {"checkpoint": str(args.checkpoint), "precisions": precisions, "ks": list(ks), "split": args.split,
              "classes": args.classes.split(","), "per_class": args.per_class,
              "prompt_sources": [r.get("source") for r in rows], "max_new_tokens": args.max_new_tokens,
              "mechanism": "shadow_commit", "step_records": [str(x) for x in args.step_records],
              "acceptance_records": [str(x) for x in args.acceptance_records]}
    figures, source, label = earlier_cells(args.acceptance_records, config, ks)
    steps = step_times(args.step_records)
    wall = {}
    if REFERENCE not in figures and not args.no_reference:
        t = time.perf_counter()
        ref = reference_runs(args.checkpoint, prompts, ks, args.max_new_tokens)
        wall[REFERENCE] = round(time.perf_counter() - t, 1)
        figures[REFERENCE] = {k: {**pooled(ref[k]), "tokens_per_prompt": [r.tokens for r in ref[k]]} for k in ks}
    ref_tokens = ({k: figures[REFERENCE][k]["tokens_per_prompt"] for k in ks} if REFERENCE in figures
                  else {k: None for k in ks})
    for p in precisions:
        if p in figures:
            continue
        t = time.perf_counter()
        got, label = tt_runs(args.checkpoint, args.device, p, prompts, ks, args.max_new_tokens)
        wall[p] = round(time.perf_counter() - t, 1)
        figures[p] = {k: {**pooled(got[k], ref_tokens[k]), "tokens_per_prompt": [r.tokens for r in got[k]]} for k in ks}
    cells = []
    for p, by_k in figures.items():
        for k, f in by_k.items():
            cell = {"cell": f"{p} K={k}", "precision": p, **f, "acceptance_label": "measured",
                    "measured_in": source.get(p, "this run")}
            if p != REFERENCE and REFERENCE in figures:
                r = figures[REFERENCE][k]["mean_accepted"]
                cell["mean_accepted_vs_reference"] = f["mean_accepted"] / r if r else None  # None: nothing accepted
            st = steps.get((p, k))
            if st is not None:
                cell.update({"step_ms_27b": st[0], "step_label": st[3], "step_record": st[1], "step_run_id": st[2],
                             "step_preset": st[4], "tok_s_27b": tok_s(f["mean_emitted"], st[0]),
                             "tok_s_label": f"{st[3]} step time x measured acceptance (this checkpoint)"})
            cell["pass"] = f["steps"] > 0
            cells.append(cell)
    if args.gate:
        cells.append(gate_cell(args.gate, figures, ks))
    print_figures(cells, label)
    return ProbeReport(probe=NAME, backend=label or "torch reference (no TT precision run)", config=config,
                       cells=cells, gate_complete=len(prompts) >= 6 and bool(steps),
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 1), "wall_s": wall,
                              "reference_backend": "torch fp32 reference (target + MTP head)"})


def print_figures(cells, label) -> None:
    for c in cells:
        if c.get("gate"):
            print(f"[measured on {label}] {c['cell']}: greedy agreement with {c['baseline']} "
                  f"{c['greedy_agreement_vs_baseline']:.1%} (needs >= {c['greedy_agreement_min']:.1%}: "
                  f"{c['baseline']} vs fp32 {c['baseline_agreement_vs_reference']:.1%} less 3 points), acceptance "
                  + ", ".join(f"K={k} {r:.1%}" for k, r in c["acceptance_ratio"].items())
                  + f" of {c['baseline']}'s (needs >= {c['acceptance_ratio_min']:.0%}): "
                  + ("PASS" if c["pass"] else "FAIL"))
            continue
        line = (f"[measured on {label if c['precision'] != REFERENCE else 'torch reference'}] {c['cell']}: "
                f"accepted/step {c['mean_accepted']:.3f} (per prompt {c['per_prompt_min_max'][0]:.2f}-"
                f"{c['per_prompt_min_max'][1]:.2f}), emitted/step {c['mean_emitted']:.3f}, per position "
                + "/".join(f"{x:.2f}" for x in c["per_position"]) + f", {c['steps']} steps")
        if c.get("mean_accepted_vs_reference") is not None:
            line += f", {c['mean_accepted_vs_reference']:.1%} of the reference's"
        print(line)
        if "tok_s_27b" in c:
            v, ms = c["tok_s_27b"], c["step_ms_27b"]
            print(f"  [{c['step_label']} step at {c['step_preset']}] step {ms[0]:.2f} ms ({ms[1]:.2f}-{ms[2]:.2f}) -> "
                  f"{v[0]:.1f} tok/s ({v[1]:.1f}-{v[2]:.1f})")
