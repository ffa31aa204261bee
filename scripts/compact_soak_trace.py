#!/usr/bin/env python
"""Write a soak recording (``scripts/soak_vllm.py --record F``: F and F.rows.pt) in the compact form a CI replay
checks bit for bit: the recording's JSON plus, per logits row the engine got, ``[sha256 of the row's fp32 bytes,
argmax, max]`` (key ``row_digests``: call index -> one entry per row), gzipped so that the same recording gives
the same bytes. The rows themselves (3120 x vocab fp32 for the 32-sequence soak) stay out of the
repository; a digest fails on any changed bit of its row.

    python scripts/compact_soak_trace.py /tmp/wsoak/s32_trace.json tests/data/vllm_tt_plugin_soak32_trace.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

import support_path  # noqa: F401  (tests/ on sys.path: the test-support package `support`)

from support.soak_oracle import row_digest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="the recording's JSON (its rows next to it as <trace>.rows.pt)")
    ap.add_argument("out", type=Path, help="the compact recording (.json.gz)")
    args = ap.parse_args()
    trace = json.loads(args.trace.read_text())
    rows = torch.load(args.trace.with_suffix(".rows.pt"))
    prefills = [i for i, c in enumerate(trace["calls"]) if c["call"] == "prefill_forward"]
    if sorted(rows) != prefills:
        raise SystemExit(f"{args.trace}: rows for calls {sorted(rows)[:5]}.., prefills at {prefills[:5]}..")
    for i in prefills:  # the rows are what the engine got: their argmax is what the recording says it read
        if rows[i].argmax(-1).tolist() != trace["calls"][i]["returned"]["tokens"]:
            raise SystemExit(f"{args.trace}: call {i}'s rows do not give its recorded tokens")
    trace["row_digests"] = {str(i): [row_digest(r) for r in rows[i]] for i in prefills}
    # no name and a fixed mtime in the gzip header: the same recording gives the same bytes wherever it is written
    args.out.write_bytes(gzip.compress(json.dumps(trace, separators=(",", ":")).encode(), mtime=0))
    print(f"{args.out}: {len(prefills)} prefill calls, {sum(r.shape[0] for r in rows.values())} rows, "
          f"{args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
