"""qwen36 report FILES... --out DIR: probe run records -> a Markdown report and PNG plots.

What feeds what (the latest record of each probe is used; report.md lists every record read and the ones used):

  gate-0a      step time by component and by cost term (stacked bars: decode, speculative step at each K),
               programs per layer by op (decode step), tok/s vs K at the record's acceptance rates
  decode-cost  programs per layer by op when no gate-0a record is given; its per-token summary in the table
  gate-0b      verify_cost_ratio and phase costs per K in the table (the batch-1 record)
  prefill-cost calibrated time to first token per prompt length and per prefix-cache hit, with bands
  batch        decode-cost and gate-0b records at several batch sizes B (``--batch``; a record without one is B = 1):
               per B, plain decode ms/step and per-user / aggregate tok/s (decode-cost), and per K the packed
               verify's verify_cost_ratio and MTP tok/s per user and aggregate (gate-0b; a K the packed verify
               refused keeps its row with the reason); a plot of aggregate tok/s vs B
  lossless     acceptance per draft position and emitted tokens per verify step vs K (the probe's greedy runs of
               the checkpoint it names, per commit mechanism)

Every figure keeps its record's label: ``modelled`` (emulator counters through the cost model) or ``measured``
(timed on the named backend); plot titles carry it. Records of any other probe are refused: they carry nothing
this report shows, and a silent skip would hide a wrong file.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from qwen36.io_utils import atomic_write_text
from qwen36.probes.records import read_records

from .report_plots import (ReportError, COMPONENT_NAMES, acceptance_rows, categories, category_name, components,
                           md_table, ms_text, opt_text, ordered_steps, plot_acceptance, plot_batch, plot_breakdowns,
                           plot_programs, plot_tok_s, program_lists, pyplot, rates, setup, step_title)

SOURCES = ("gate-0a", "decode-cost", "gate-0b", "lossless", "prefill-cost")


def load(files) -> list[tuple[Path, dict]]:
    """Read every records file; refuse a file that is not run records of a probe the report shows."""
    out = []
    for f in map(Path, files):
        if not f.is_file():
            raise ReportError(f"{f}: no such records file")
        try:
            records = read_records(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ReportError(f"{f}: not a records file ({str(e).splitlines()[0]})") from None
        if not records:
            raise ReportError(f"{f}: no records")
        for r in records:
            probe = r.get("probe") if isinstance(r, dict) else None
            if probe is None or "performance" not in r or "cells" not in r:
                raise ReportError(f"{f}: not a probe run record (no probe / cells / performance fields)")
            if probe not in SOURCES:
                raise ReportError(f"{f}: records of probe {probe!r}; the report reads {', '.join(SOURCES)}")
            out.append((f, r))
    return out


def batch_of(r: dict) -> int:
    """Users per step of a decode-cost / gate-0b record (records made before ``--batch`` existed are B = 1)."""
    return int((r.get("config") or {}).get("batch", 1))


def latest(records: list[tuple[Path, dict]], probe: str, batch: int | None = None) -> tuple[Path, dict] | None:
    """The latest record of ``probe`` (of that batch size when ``batch`` is given)."""
    rs = [x for x in records if x[1]["probe"] == probe and (batch is None or batch_of(x[1]) == batch)]
    return max(rs, key=lambda x: (x[1].get("time_utc") or "", x[1].get("run_id") or "")) if rs else None


def _source_line(use: str, path: Path, r: dict) -> list[str]:
    perf = r.get("performance") or {}
    return [use, r["probe"], str(r.get("run_id")), str(r.get("time_utc")), (r.get("git_commit") or "-")[:10],
            str(r.get("backend")), str(perf.get("label", "-")), path.name]


def batch_rows(records: list[tuple[Path, dict]]) -> tuple[list[dict], list[dict], list[tuple[Path, dict]]]:
    """-> (decode rows per B from decode-cost, speculative rows per (B, K) from gate-0b, records used), the latest
    record of each (probe, B); MTP tok/s per user per acceptance scenario (aggregate = B x that). A K the packed
    verify refused has its row with ``refused`` set (the reason), not dropped."""
    used, dec, spec = [], [], []
    for b in sorted({batch_of(r) for _, r in records if r["probe"] == "decode-cost"}):
        path, r = latest(records, "decode-cost", b)
        p = r["performance"]
        used.append((path, r))
        dec.append({"batch": b, "label": p["label"], "ms": p["modelled_ms_per_step"], "per_user": p["modelled_tok_s"],
                    "aggregate": p.get("modelled_aggregate_tok_s", p["modelled_tok_s"])})
    for b in sorted({batch_of(r) for _, r in records if r["probe"] == "gate-0b"}):
        path, r = latest(records, "gate-0b", b)
        p = r["performance"]
        used.append((path, r))
        d_ms = p["decode"]["ms"]
        base = {"batch": b, "label": p["label"], "decode_ms": d_ms, "plain_per_user": 1e3 / d_ms,
                "plain_aggregate": b * 1e3 / d_ms}
        refused = p.get("ks_refused") or {}
        ks = sorted(p["verify_cost_ratio"], key=int)
        tok = p.get("mtp_tok_s_shadow_commit") or {}
        mine = []
        for k in sorted(refused, key=int):
            mine.append({**base, "k": int(k), "refused": refused[k]})
        for k in ks:
            mtp = {sc: by[k] for sc, by in tok.items() if by.get(k) is not None}
            mine.append({**base, "k": int(k), "rows": p["verify"][k]["rows"], "verify_ms": p["verify"][k]["ms"],
                         "ratio": p["verify_cost_ratio"][k], "mtp_per_user": mtp, "refused": None})
        if not mine:
            mine.append({**base, "k": None, "refused": "no K asked"})
        spec += sorted(mine, key=lambda x: x["k"] or 0)
    return dec, spec, used


def batch_section(plt, records: list[tuple[Path, dict]], out_dir: Path) -> tuple[list[str], list[Path], list[list[str]]]:
    """Markdown, plots and source lines of the batch tables; nothing unless some record has B > 1."""
    if not any(r["probe"] in ("decode-cost", "gate-0b") and batch_of(r) > 1 for _, r in records):
        return [], [], []
    dec, spec, used = batch_rows(records)
    md: list[str] = []
    if dec:
        one = next((x["aggregate"] for x in dec if x["batch"] == 1), None)
        md += ["", f"## Plain decode vs batch ({', '.join(sorted({x['label'] for x in dec}))}; decode-cost)", ""]
        md.append(md_table(["B", "ms/step", "tok/s per user", "aggregate tok/s", "aggregate vs B=1"],
                         [[str(x["batch"]), ms_text(x["ms"]), f"{x['per_user']:.1f}", f"{x['aggregate']:.1f}",
                           "-" if one is None else f"{x['aggregate'] / one:.1f}x"] for x in dec]))
    if spec:
        scens = sorted({sc for x in spec if x["refused"] is None for sc in x["mtp_per_user"]},
                       key=lambda p: ("/" in p, [-float(v) for v in p.split("/")]))
        md += ["", f"## Speculative step vs batch ({', '.join(sorted({x['label'] for x in spec}))}; gate-0b)", ""]
        rows = []
        for x in spec:
            head = [str(x["batch"]), ms_text(x["decode_ms"]), f"{x['plain_per_user']:.1f}", f"{x['plain_aggregate']:.1f}"]
            if x["refused"] is not None:
                rows.append(head + ["-" if x["k"] is None else str(x["k"]), "-", "-", "-"] + ["-"] * (2 * len(scens))
                            + [f"refused: {x['refused']}"])
                continue
            mtp = x["mtp_per_user"]
            rows.append(head + [str(x["k"]), str(x["rows"]), ms_text(x["verify_ms"]), f"{x['ratio']:.3f}"]
                        + [opt_text(mtp.get(sc), 1) for sc in scens]
                        + [opt_text(None if mtp.get(sc) is None else x["batch"] * mtp[sc], 1) for sc in scens] + [""])
        md.append(md_table(["B", "decode ms", "plain tok/s per user", "plain aggregate", "K", "verify rows", "verify ms",
                          "verify_cost_ratio"] + [f"MTP tok/s per user @ {sc}" for sc in scens]
                         + [f"MTP aggregate @ {sc}" for sc in scens] + ["note"], rows))
        md += ["", "MTP step = packed verify + acceptance + MTP draft (at B > 1 the batched device MTP: reseed over "
               "the B x (K+1) rows, chain of B rows per draft) + shadow_commit commit; acceptance scenarios are "
               "assumptions (every user at the same rate); aggregate = B x per user."]
    plots = [plot_batch(plt, dec, spec, out_dir / "batch_tok_s.png")]
    return md, plots, [_source_line(f"batch table (B={batch_of(r)})", p, r) for p, r in used]


# ---- the report ----------------------------------------------------------------------------------------------------
def _band(v: list | None, digits: int = 2) -> str:
    """``central (low-high)`` of a calibrated [central, low, high] triple."""
    if v is None:
        return "-"
    return f"{v[0]:.{digits}f} ({min(v[1:]):.{digits}f}-{max(v[1:]):.{digits}f})"


def calibrated_section(records: list[tuple[Path, dict]], used: list) -> list[str]:
    """The calibrated figures (docs/cost_model.md) beside the published measurements: the pins (Llama-3.1-8B on one
    P150, recomputed from tt_ops/calibration_workloads.py), our 27B figures from the latest decode-cost / gate-0b /
    gate-0a records with their bands, and measured 27B figures of other code on Blackhole (context, not pins)."""
    from qwen36.tt_ops.calibration_workloads import LLAMA_ANCHORS, QWEN36_27B_REFERENCES, anchor_workload
    from qwen36.tt_ops.cost_model import P150aCostModel, calibrated_figures

    md = ["## Calibrated figures beside the measured anchors", "",
          "*modelled (calibrated)*: emulator counts through tt_ops/cost_model.py's calibrated model, band = every "
          "constant at the fast / slow end of its sources' spread (docs/cost_model.md). *roofline*: the earlier "
          "model, a lower bound. *measured*: by the named source, on cards.", ""]
    rows = []
    for a in LLAMA_ANCHORS:
        w = anchor_workload(a)
        f = calibrated_figures(w.counts)
        rows.append([f"pin: {a.name}", _band([f["ms"], f["ms_low"], f["ms_high"]]),
                     ms_text(P150aCostModel().predict_ms(w.counts)), f"{a.measured_ms:.2f} (measured; {a.source})"])
    dc = latest(records, "decode-cost", 1)
    if dc and "calibrated" in dc[1]["performance"]:
        path, r = dc
        p = r["performance"]
        c = p["calibrated"]
        used.append(_source_line("calibrated 27B decode", path, r))
        rows.append([f"ours: 27B plain decode, 2x P150a TP=2, context {p['context_tokens']}",
                     _band([c["ms"], c["ms_low"], c["ms_high"]]), ms_text(p["modelled_ms_per_step"]), "-"])
    g0b = latest(records, "gate-0b", 1)
    if g0b and "calibrated" in g0b[1]["performance"]:
        path, r = g0b
        c = r["performance"]["calibrated"]
        used.append(_source_line("calibrated 27B speculative step", path, r))
        for k, st in c["step_ms_shadow_commit"].items():
            tok = c["mtp_tok_s_shadow_commit"].get("0.8/0.6/0.5", {}).get(k)
            ratio = c["verify_cost_ratio"][k]
            rows.append([f"ours: 27B MTP step K={k} (verify_cost_ratio {_band(ratio, 3)}"
                         + (f"; {_band(tok, 1)} tok/s at 0.8/0.6/0.5)" if tok else ")"),
                         _band(st), ms_text(r["performance"]["step_ms_shadow_commit"][k]), "-"])
    for ref in QWEN36_27B_REFERENCES:
        rows.append([f"other code: {ref.name}, {ref.hardware}", "-", "-",
                     f"{ref.ms_per_token:.1f} (measured; {ref.source})"])
    md.append(md_table(["figure", "calibrated ms (band)", "roofline ms", "measured ms"], rows))
    return md + [""]


def prefill_section(records: list[tuple[Path, dict]], used: list) -> list[str]:
    """Calibrated time to first token per prompt length and per prefix-cache hit, from the latest prefill-cost
    record (docs/cost_model.md "Prefill and time to first token")."""
    pc = latest(records, "prefill-cost")
    if not pc:
        return []
    path, r = pc
    p = r["performance"]
    used.append(_source_line("time to first token", path, r))
    md = ["", f"## Time to first token ({p['label']}, batch 1, TP={p['tp']}, prefill-cost)", "",
          f"{r.get('backend')}, preset {(r.get('config') or {}).get('preset')}, {p.get('precision')}, "
          f"{p['chunk_tokens']}-token chunks; not included: {'; '.join(p.get('uncalibrated', []))}", ""]
    md.append(md_table(["prompt tokens", "TTFT ms (band)", "prompt tok/s", "chunks", "compute excess ms",
                      "TFLOP/device"],
                     [[k, _band([t["ms"], t["ms_low"], t["ms_high"]], 0), f"{t['tok_s']:.0f}", str(t["chunks"]),
                       ms_text(t["breakdown"]["compute_excess_ms"]), f"{t['flops_per_device'] / 1e12:.1f}"]
                      for k, t in sorted(p["ttft"].items(), key=lambda kv: int(kv[0]))]))
    if p.get("prefix_reuse"):
        md += ["", "Prefix-cache hits (the hit's KV and GDN state reused, the rest prefilled from its position):", ""]
        md.append(md_table(["prompt", "hit", "prefilled", "TTFT ms (band)", "whole prompt ms", "saved ms"],
                         [[str(h["prompt_tokens"]), str(h["hit_tokens"]), str(h["prefilled_tokens"]),
                           _band([h["ms"], h["ms_low"], h["ms_high"]], 0), f"{h['full_prompt_ms']:.0f}",
                           f"{h['saved_ms']:.0f}"] for h in p["prefix_reuse"]]))
    return md


def write_report(files, out_dir: str | os.PathLike) -> dict[str, Any]:
    """-> {"markdown": path, "plots": [paths]}; raises ReportError on unusable input."""
    records = load(files)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    used: list[list[str]] = []
    md = ["# Run report", "",
          f"{len(records)} record(s) from {len({p for p, _ in records})} file(s). Figures keep their records' "
          "labels: *modelled* = emulator counters through the cost model (tt_ops/cost_model.py), *measured* = "
          "timed or counted on the named backend. The latest record of each probe is used.", ""]
    plots: list[Path] = []
    md += calibrated_section(records, used)

    g0a = latest(records, "gate-0a")
    if g0a:
        path, r = g0a
        perf = r["performance"]
        label = perf["label"]
        plots += plot_breakdowns(plt, r, out_dir)
        plots.append(plot_tok_s(plt, r, out_dir / "tok_s_vs_k.png"))
        used.append(_source_line("step breakdown, tok/s vs K", path, r))
        comps = components(perf)
        md += [f"## Step time by component ({label}, ms)", "", setup(r), ""]
        md.append(md_table(["step", "rows", "total"] + [COMPONENT_NAMES.get(c, c) for c in comps] + ["programs"],
                         [[step_title(s), str(s["rows"]), ms_text(s["ms"])]
                          + [ms_text(s["components"][c]["ms"]) if c in s["components"] else "-" for c in comps]
                          + [str(s.get("programs", "-"))] for _, s in ordered_steps(perf)]))
        cats = categories(perf)
        if cats:
            md += ["", f"## Step time by cost term ({label}, ms)", ""]
            md.append(md_table(["step", "total"] + [category_name(c) for c in cats],
                             [[step_title(s), ms_text(s["ms"])] + [ms_text(s["categories"].get(c, 0.0)) for c in cats]
                              for _, s in ordered_steps(perf)]))
        ks = sorted(int(k) for k in perf["spec_tok_s"])
        scen = rates(perf)
        md += ["", f"## Throughput ({label}, batch 1)", "",
               f"plain decode: {ms_text(perf['steps']['decode']['ms'])} ms/step, {perf['decode_tok_s']:.1f} tok/s", ""]
        md.append(md_table(["K", "step ms", "verify_cost_ratio"]
                         + [f"tokens/step @ {p}" for p in scen] + [f"tok/s @ {p}" for p in scen],
                         [[str(k), ms_text(perf["steps"][f"spec_k{k}"]["ms"]), f"{perf['verify_cost_ratio'][str(k)]:.3f}"]
                          + [opt_text(perf["tokens_per_step"][str(k)].get(p), 3) for p in scen]
                          + [opt_text(perf["spec_tok_s"][str(k)].get(p), 1) for p in scen] for k in ks]))
        md += ["", "Acceptance scenarios are assumptions, not measurements: a single rate p is the chance each draft "
               "is accepted given the previous ones were; a profile a1/a2/... is the fraction of steps accepting "
               "drafts 1..i (as the lossless records report it)."]

    prog_src = g0a if g0a and program_lists(g0a[1]) else latest(records, "decode-cost")
    if prog_src and program_lists(prog_src[1]):
        path, r = prog_src
        lists = program_lists(r)
        plots.append(plot_programs(plt, r, lists, out_dir / "programs_per_layer.png"))
        used.append(_source_line("programs per layer", path, r))
        md += ["", "## Programs per layer, decode step (emulator counts)", ""]
        md.append(md_table(["layer", "programs", "ops (count)"],
                         [[layer, str(sum(d.values())),
                           ", ".join(f"{op.removeprefix('ttnn.')} {n}" for op, n in
                                     sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))]
                          for layer, d in lists.items()]))

    dc = latest(records, "decode-cost", 1) or latest(records, "decode-cost")
    if dc:
        path, r = dc
        p = r["performance"]
        used.append(_source_line("decode-cost summary", path, r))
        md += ["", f"## decode-cost ({p['label']})", "", setup(r), ""]
        md.append(md_table(["programs/token", "GDN layer", "attention layer", "ms/step", "tok/s", "weight-stream floor ms",
                          "batch"],
                         [[str(p["programs"]["per_token"]), str(p["programs"]["gdn_layer"]),
                           str(p["programs"]["attention_layer"]), ms_text(p["modelled_ms_per_step"]),
                           f"{p['modelled_tok_s']:.1f}", ms_text(p["weight_stream_floor_ms"]), str(batch_of(r))]]))

    md += prefill_section(records, used)

    g0b = latest(records, "gate-0b", 1)
    if g0b:
        path, r = g0b
        p = r["performance"]
        used.append(_source_line("gate-0b table", path, r))
        ks = sorted(p["verify_cost_ratio"], key=int)
        md += ["", f"## gate-0b ({p['label']}, ms)", "", setup(r), ""]
        md.append(md_table(["K", "verify", "verify_cost_ratio", "accept", "draft", "commit (shadow)", "step"],
                         [[k, ms_text(p["verify"][k]["ms"]), f"{p['verify_cost_ratio'][k]:.3f}", ms_text(p["accept"][k]["ms"]),
                           ms_text(p["draft"][k]["total"]["ms"]), ms_text(p["commit_shadow_commit_by_k"][k]["ms"]),
                           ms_text(p["step_ms_shadow_commit"][k])] for k in ks]))

    batch_md, batch_plots, batch_used = batch_section(plt, records, out_dir)
    md += batch_md
    plots += batch_plots
    used += batch_used

    ll = latest(records, "lossless")
    if ll:
        path, r = ll
        rows = acceptance_rows(r)
        if rows:
            plots.append(plot_acceptance(plt, r, rows, out_dir / "acceptance.png"))
            used.append(_source_line("acceptance per position, tokens per step", path, r))
            md += ["", "## Acceptance (lossless probe, greedy; measured counts)", "",
                   f"{r.get('backend')}, checkpoint {(r.get('config') or {}).get('checkpoint')}", ""]
            md.append(md_table(["K", "mechanism", "verify steps", "tokens/step", "acceptance per position"],
                             [[str(x["k"]), x["mechanism"], str(x["steps"]), f"{x['mean_emitted']:.3f}",
                               ", ".join(f"{v:.3f}" for v in x["per_position"])] for x in rows]))

    if not used:
        raise ReportError("none of the records carries a figure this report shows")
    md += ["", "## Sources", ""]
    md.append(md_table(["used for", "probe", "run", "time (UTC)", "commit", "backend", "label", "file"], used))
    unused = [_source_line("not used (older record)", p, r) for p, r in records
              if not any(r.get("run_id") == u[2] and r["probe"] == u[1] for u in used)]
    if unused:
        md += ["", md_table(["", "probe", "run", "time (UTC)", "commit", "backend", "label", "file"], unused)]
    md += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(md) + "\n")
    return {"markdown": report, "plots": plots}


# ---- the command ------------------------------------------------------------------------------------
def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="Markdown report + PNG plots from run records (gate-0a, decode-cost, gate-0b, lossless, prefill-cost)",
                       description="Reads records files written by `qwen36 probe` and writes DIR/report.md and the "
                                   "plots it links (step breakdowns, programs per layer, acceptance, tok/s vs K; with "
                                   "decode-cost / gate-0b records at several --batch sizes, tok/s and "
                                   "verify_cost_ratio vs B).")
    p.add_argument("files", type=Path, nargs="+", help="records files (bench/runs/*.jsonl)")
    p.add_argument("--out", type=Path, default=Path("report"), help="output directory (default ./report)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = write_report(args.files, args.out)
    except ReportError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {out['markdown']} and {len(out['plots'])} plot(s): " + ", ".join(p.name for p in out["plots"]))
    return 0
