"""qwen36 records FILE...: summarise run-record files (JSON lines written by probes) as a table."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="summarise probe run records (.jsonl) as a table")
    p.add_argument("files", type=Path, nargs="+", help="records files (bench/runs/*.jsonl)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qwen36.probes.records import read_records, summarize

    records = []
    for f in args.files:
        if not f.is_file():
            raise UserError(f"records file {f} does not exist")
        try:
            records += read_records(f)
        except ValueError as e:
            raise UserError(str(e)) from None
    if not records:
        raise UserError("no records in " + ", ".join(map(str, args.files)))
    print(summarize(records))
    return 0
