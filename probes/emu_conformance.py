"""Probe emu-conformance: the emulator against cases taken from Tenstorrent's own tests for the hand-emulated ops.

Runs every case of ``qwen36.testing.emulator_conformance`` (paged caches, paged SDPA decode incl. spec_multi_pos_tiles,
fused recurrent / chunked GDN, both rotary ops, the decode head split, the fused and indexed cache updates,
sparse_matmul, rms_norm, async collectives, the KDA convolution / gated norm / chunk-recurrence pieces and
gated_delta_attn_seq) on an emulated mesh and records, per op, the cases passed, failed and
skipped (each skip carries the reason the emulator cannot express it).
"""
from __future__ import annotations

import argparse
import time

from qwen36.probes.records import ProbeReport

NAME = "emu-conformance"
HELP = "emulator vs cases from Tenstorrent's op tests (passed / failed / skipped-with-reason per op)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ci-only", action="store_true", help="only the CI subset of the cases")


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.testing.emulator_conformance import run_cases, summarize
    from qwen36.tt_ops.device import open_mesh

    if not str(args.device).startswith("emulated-"):
        raise SystemExit(f"emu-conformance checks the emulator: pass --device emulated-p150x2 (got {args.device})")
    t0 = time.perf_counter()
    with open_mesh(args.device, trace_region_size=10_000_000) as ctx:
        results = run_cases(ctx, ci_only=args.ci_only)
        label = ctx.label
    cells = [dict(r, **{"pass": r["status"] != "failed"}) for r in results]
    per_op = summarize(results)
    return ProbeReport(probe=NAME, backend=label, config={"device": args.device, "ci_only": bool(args.ci_only)},
                       cells=cells, counters={"per_op": per_op},
                       gate_complete=not args.ci_only and all(r["status"] != "failed" for r in results),
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 2),
                              "skipped_cases_are_not_run": "each skipped cell states why the emulator cannot express it"})
