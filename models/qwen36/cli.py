"""The ``qwen36`` command. Each subcommand lives in ``models/qwen36/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches, sets up logging, and turns a
:class:`qwen36.errors.UserError` into one ``error: ...`` line with exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import USER_ERROR_EXIT, UserError

# name -> module under qwen36.commands (imported lazily: `qwen36 --help` must not import torch/ttnn)
COMMANDS = {
    "make-tiny": "make_tiny",
    "logits": "logits",
    "generate": "generate",
    "chat": "chat",
    "demo": "demo",
    "probe": "probe",
    "records": "records",
    "bench": "bench",
    "cards-check": "cards_check",
    "report": "report",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen36", description="Qwen3.6 + MTP speculative decoding: reference, emulated mesh and P150a cards")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, including ttnn's import-time configuration dump and tt-metal's "
                             "device-layer info lines (hidden by default)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(f"qwen36.commands.{module}").add_parser(sub, name)
    return parser


_log_handler: int | None = None


def _stderr_sink(message) -> None:
    sys.stderr.write(message)  # looked up per message: main() may run in-process under a redirected stderr


def setup_logging(verbose: bool) -> None:
    """Our log lines go to stderr at INFO (DEBUG with --verbose); stdout carries only the command's output.
    ttnn's own logging is quietened where ttnn is imported (qwen36.tt_ops.ttnn_env), before the import."""
    global _log_handler
    from loguru import logger

    from .tt_ops.ttnn_env import set_verbose

    if _log_handler is None:
        try:
            logger.remove(0)  # loguru's default handler: stderr at DEBUG
        except ValueError:
            pass  # already removed by the embedding application
    else:
        logger.remove(_log_handler)
    _log_handler = logger.add(_stderr_sink, level="DEBUG" if verbose else "INFO")
    set_verbose(verbose)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        # a mistake the message explains (bad argument, missing checkpoint, no cards, ...): no traceback
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
