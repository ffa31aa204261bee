"""qwen36 report FILES... --out DIR: a Markdown table and PNG plots from probe run records (probes/dashboard.py)."""
from __future__ import annotations

import argparse
from pathlib import Path


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
    from qwen36.probes.dashboard import ReportError, write_report

    try:
        out = write_report(args.files, args.out)
    except ReportError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {out['markdown']} and {len(out['plots'])} plot(s): " + ", ".join(p.name for p in out["plots"]))
    return 0
