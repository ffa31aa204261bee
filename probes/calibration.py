"""Probe calibration: the calibrated cost model's prediction for a published workload at any mesh, batch and context,
beside the measurements it is pinned to.

``--workload tt-qwen36``: Tenstorrent's own Qwen3.6-27B (tt-metal ``models/demos/blackhole/qwen36``, the pre-fused
decode), restated from its source as emulator counts (tt_ops/calibration_qwen36.py, calibration_qwen36_prefill.py)
and charged by the same ``CalibratedP150aModel`` as this project's figures, plus the host part of its demo loop
(tt_ops/calibration_qwen36_pins.py). Prints ``decode: X ms/step (band LO-HI)`` for one step of ``--batch`` users at
``--context`` and ``ttft: Y ms (band LO-HI)`` for a prompt of ``--context`` tokens (B = 1), then every pinned and
compared measurement with the model's figure and error. Point it at another published figure by choosing its mesh,
batch and context. Nothing runs on a device: every figure is ``modelled (calibrated)``; a cell per pin fails when the
model leaves +-15 % of the measurement.
"""
from __future__ import annotations

import argparse

from qwen36.probes.records import ProbeReport

NAME = "calibration"
HELP = ("calibrated prediction for a published workload (--workload tt-qwen36: Tenstorrent's qwen36 restated) at "
        "--mesh 1x2|1x4, --batch, --context, beside the measurements it is pinned to")
WORKLOADS = ("tt-qwen36",)
MESHES = {"1x2": 2, "1x4": 4}
PIN_TOLERANCE = 0.15
BACKEND = "cost model on restated counts (no device)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="tt-qwen36", help="the restated published workload")
    p.add_argument("--mesh", choices=sorted(MESHES), default="1x2", help="1x2: 2x P150a (TP=2); 1x4: P300x2 (TP=4)")
    p.add_argument("--batch", type=int, default=1, help="decode users in the step (1-32; the TTFT is for one)")
    p.add_argument("--context", type=int, default=128,
                   help="decode: every user at this position; ttft: a prompt of this many tokens")


def _band(f: dict, digits: int) -> str:
    return f"{f['ms']:.{digits}f} ms{{}} (band {f['ms_low']:.{digits}f}-{f['ms_high']:.{digits}f})"


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.errors import UserError
    from qwen36.tt_ops.calibration_qwen36 import SOURCES
    from qwen36.tt_ops.calibration_qwen36_pins import QWEN36_ANCHORS, anchor_figures, decode_figures, ttft_figures
    from qwen36.tt_ops.cost_model import CALIBRATED_LABEL, CALIBRATION, PREFILL_CALIBRATION

    if args.device != "reference":
        raise UserError(f"calibration runs no device (it charges restated counts); --device {args.device} does not apply")
    if not 1 <= args.batch <= 32:
        raise UserError(f"--batch {args.batch}: the restated decode runs 1-32 users in one row tile")
    if args.context < 1:
        raise UserError(f"--context {args.context} must be at least 1")
    tp = MESHES[args.mesh]
    dec = decode_figures(tp, args.batch, args.context)
    ttft = ttft_figures(tp, args.context)
    print(f"[{CALIBRATED_LABEL}] {args.workload}, mesh {args.mesh} (TP={tp}), batch {args.batch}, context "
          f"{args.context}; {dec['programs']} programs per step")
    print("decode: " + _band(dec, 2).format("/step"))
    print("ttft: " + _band(ttft, 0).format("") + f" (prompt {args.context} tokens, B = 1)")
    cells = [{"cell": f"prediction {args.mesh} B={args.batch} context={args.context}", "pass": True,
              "decode_ms": [dec["ms"], dec["ms_low"], dec["ms_high"]],
              "ttft_ms": [ttft["ms"], ttft["ms_low"], ttft["ms_high"]]}]
    print("measured (pinned: +-15 %; compared: reported only)")
    for a in QWEN36_ANCHORS:
        f = anchor_figures(a)
        err = f["ms"] / a.measured_ms - 1
        ok = abs(err) <= PIN_TOLERANCE and f["ms_low"] <= a.measured_ms <= f["ms_high"]
        cell = {"cell": a.name, "kind": a.kind, "pinned": a.pinned, "measured_ms": a.measured_ms,
                "modelled_ms": [f["ms"], f["ms_low"], f["ms_high"]], "error": err, "source": a.source,
                "pass": ok if a.pinned else True}
        if not a.pinned:
            cell["why_not_pinned"] = a.why
        cells.append(cell)
        tag = ("pin " + ("ok  " if ok else "FAIL")) if a.pinned else "compared"
        print(f"  {tag}  {a.name}: measured {a.measured_ms:.2f} ms, modelled {f['ms']:.2f} ms "
              f"({f['ms_low']:.2f}-{f['ms_high']:.2f}), {err * 100:+.1f} %")
    constants = {c.name: [c.value, c.low, c.high] for c in (*CALIBRATION.values(), *PREFILL_CALIBRATION.values())}
    performance = {"label": CALIBRATED_LABEL, "workload": args.workload, "mesh": args.mesh, "tp": tp,
                   "decode": {k: dec[k] for k in ("ms", "ms_low", "ms_high", "device_ms", "host_ms", "programs",
                                                  "collectives", "bytes_read_per_device", "regions", "breakdown")},
                   "ttft": {k: ttft[k] for k in ("ms", "ms_low", "ms_high", "device_ms", "host_ms", "passes", "head_ms",
                                                 "flops_per_device")},
                   "constants": constants}
    return ProbeReport(probe=NAME, backend=BACKEND,
                       config={"workload": args.workload, "mesh": args.mesh, "batch": args.batch,
                               "context": args.context, "sources": SOURCES},
                       cells=cells, gate_complete=True, performance=performance)
