"""The ``qwen36`` command. Each subcommand lives in ``models/qwen36/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under qwen36.commands (imported lazily: `qwen36 --help` must not import torch/ttnn)
COMMANDS = {
    "make-tiny": "make_tiny",
    "logits": "logits",
    "generate": "generate",
    "demo": "demo",
    "probe": "probe",
    "records": "records",
    "report": "report",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen36", description="Qwen3.6 + MTP speculative decoding: reference, emulated mesh and P150a cards")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(f"qwen36.commands.{module}").add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
