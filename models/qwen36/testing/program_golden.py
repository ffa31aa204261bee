"""The program golden of the TT speculative step: gate-0b (``probes/gate_0b.py``) on the ci preset, emulated P150a
x2, at one user (``measure``: the single-user step) and at four users (``measure_batch``: the packed batched step),
K = 1, 2, 3; per phase (decode, verify, accept, draft and its parts, commit per K and per mechanism, the per-layer
parts) the emulator's program count per op, collectives and bytes read per device. These are counters of what the
emulated step runs, not times.

The golden in ``tests/data/`` is compared exactly by ``tests/test_tt_spec_program_golden.py``: a change to the
programs of the speculative step (a refactor that should be invisible, or a deliberate change) shows up there op by
op. Regenerate it only for a deliberate, reviewed change, with the command in its ``command`` field:

    .venv/bin/python -m qwen36.testing.program_golden --write tests/data/tt_spec_program_golden.json
"""
from __future__ import annotations

import argparse
import json

PRESET, DEVICE, PRECISION, CONTEXT, VOCAB, KS, COMMIT_K, SEED = "ci", "emulated-p150x2", "performance", 4096, 4096, \
    (1, 2, 3), 3, 0
BATCHES = (1, 4)
COMMAND = "python -m qwen36.testing.program_golden --write tests/data/tt_spec_program_golden.json"


def _phases(node, path: str, out: dict) -> None:
    """Collect every phase figure (a dict carrying the counters ``_figures`` added) under its path in the record."""
    if isinstance(node, dict):
        if "_counts" in node:
            out[path] = node["_counts"]
            return
        for k, v in node.items():
            _phases(v, f"{path}/{k}" if path else str(k), out)


def gate0b_programs(batch: int) -> dict:
    """{phase path: {"programs": {op: n}, "collectives": n, "collective_bytes": n, "bytes_read": {dtype: n}}} of
    gate-0b at ``batch`` users (1: ``measure``; > 1: ``measure_batch``), plus ``ks_refused`` at B > 1."""
    from qwen36.probes import gate_0b

    orig = gate_0b.phase_figures

    def figures(cost, cm, emulated):
        out = orig(cost, cm, emulated)
        c = cost.counts("phase")
        out["_counts"] = {"programs": dict(sorted(c.programs_per_op.items())), "collectives": c.collectives,
                          "collective_bytes": c.collective_bytes, "bytes_read": dict(sorted(c.bytes_read.items()))}
        return out

    cfg, base = gate_0b.build_config(PRESET, VOCAB)
    gate_0b.phase_figures = figures
    try:
        if batch == 1:
            fig = gate_0b.measure(DEVICE, cfg, PRECISION, CONTEXT, list(KS), COMMIT_K, SEED, base.vocab_size,
                                  real_cfg=base)
        else:
            fig = gate_0b.measure_batch(DEVICE, cfg, PRECISION, CONTEXT, list(KS), COMMIT_K, SEED, base.vocab_size,
                                        batch, real_cfg=base)
    finally:
        gate_0b.phase_figures = orig
    out: dict = {}
    _phases(fig, "", out)
    if batch > 1:
        out["ks_refused"] = fig["ks_refused"]
    return out


def golden() -> dict:
    return {"command": COMMAND,
            "what": f"gate-0b {PRESET} preset on {DEVICE} ({PRECISION}, context {CONTEXT}, vocab {VOCAB}, ks "
                    f"{','.join(map(str, KS))}, commit_k {COMMIT_K}, seed {SEED}): emulator counters per phase",
            "batches": {str(b): gate0b_programs(b) for b in BATCHES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", required=True, help="the golden JSON to (over)write")
    args = p.parse_args()
    from qwen36.io_utils import atomic_write_text

    atomic_write_text(args.write, json.dumps(golden(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
