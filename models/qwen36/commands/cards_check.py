"""qwen36 cards-check --device p150x2: the card suite (every card-only test and TT probe, in order, one record each).

See qwen36/probes/card_suite.py for the steps and docs/cards.md for the first card run."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run the card suite (smoke, layer PCC, traced decode, every TT probe) in order",
                       description="Runs, in order, a device smoke test, the cards-marked tests and the TT probes on "
                                   "one backend, writing one record per step, and stops at the first failure. "
                                   "p150 / p150x2 run on cards, or on ttsim when TT_METAL_SIMULATOR is set; "
                                   "emulated-p150x2 runs the same sequence on the emulated mesh.")
    p.add_argument("--device", default="p150x2",
                   help="p150x2 (default), p150, emulated-p150x2 (the card tests need a 2-device mesh)")
    p.add_argument("--size", choices=["full", "ci"], default="full",
                   help="full: the gates at their real sizes (default); ci: the smallest options, to test the sequence")
    p.add_argument("--records-dir", type=Path, default=None,
                   help="folder for the per-step records (default: cards-check-<UTC>/ in $QWEN36_RECORDS_DIR, else in "
                        "bench/runs/ under the current directory)")
    p.add_argument("--list", action="store_true", help="print the steps for this device and size, run nothing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qwen36.probes.card_suite import build_steps, run_suite
    from qwen36.tt_ops.device import DeviceSelectionError, resolve_device_name

    from qwen36.errors import UserError

    try:
        device = resolve_device_name(args.device)
    except DeviceSelectionError as e:
        raise UserError(str(e)) from None
    if args.list:
        for i, step in enumerate(build_steps(device, args.size), 1):
            print(f"{i:2d}. {step.describe()}")
        return 0
    results = run_suite(device, args.size, args.records_dir)
    return 0 if results and all(r.verdict != "fail" for r in results) else 1
