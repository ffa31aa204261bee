"""Probe registry: name -> module. Kept import-light (no torch) so ``qwen36 --help`` stays fast.

A probe module provides:
    HELP: str                                   one line for ``qwen36 probe --help``
    add_arguments(parser) -> None               its own options (``--device`` and ``--records`` are common)
    run(args) -> probes.records.ProbeReport     does the work; the backend label comes from what ran
The ``probe`` command turns the report into one JSON line (probes.records) and exits non-zero on a fail.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

PROBES: dict[str, str] = {
    "gdn-transaction": "qwen36.probes.gdn_transaction",
    "decode-cost": "qwen36.probes.decode_cost",
    "verify-tp": "qwen36.probes.verify_tp",
    "lossless": "qwen36.probes.lossless",
    "gate-0b": "qwen36.probes.gate_0b",
    "gate-0a": "qwen36.probes.gate_0a",
    "gdn-transaction-tp": "qwen36.probes.gdn_transaction_tp",
    "emu-conformance": "qwen36.probes.emu_conformance",
    "memory": "qwen36.probes.memory",
    "prefix-cache": "qwen36.probes.prefix_cache",
    "prefill-cost": "qwen36.probes.prefill_cost",
    "precision-gate": "qwen36.probes.precision_gate",
    "acceptance": "qwen36.probes.acceptance",
    "calibration": "qwen36.probes.calibration",
}


def probe_names() -> list[str]:
    return sorted(PROBES)


def load_probe(name: str) -> ModuleType:
    if name not in PROBES:
        raise KeyError(f"unknown probe {name!r}; registered: {', '.join(probe_names())}")
    module = importlib.import_module(PROBES[name])
    for attr in ("HELP", "add_arguments", "run"):
        if not hasattr(module, attr):
            raise TypeError(f"probe module {PROBES[name]} lacks {attr!r} (see probes/registry.py)")
    return module

def probe_parser(name: str, module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"qwen36 probe {name}", description=module.HELP)
    p.add_argument("--device", default="reference", help="reference | reference-cuda | emulated-p150x2 | p150x2 | ...")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--records", type=Path, default=None,
                       help="append the run record to this .jsonl file")
    where.add_argument("--records-dir", type=Path, default=None,
                       help="write the run record to DIR/<probe>-<UTC>-<id>.jsonl (default: $QWEN36_RECORDS_DIR, "
                            "else bench/runs under the current directory)")
    module.add_arguments(p)
    return p
