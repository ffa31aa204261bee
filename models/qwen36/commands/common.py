"""Argument helpers shared by subcommands."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import DEFAULT_CHECKPOINT  # noqa: F401  (re-exported for the commands)
from ..errors import UserError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float64"}


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--ids must be non-negative, got {text!r}")
    return ids


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", "-c", type=Path, default=None,
                   help="HF checkpoint directory (default: $HF_MODEL, else the embedded default checkpoint)")


def resolve_checkpoint(arg: Path | None) -> Path:
    if arg is not None:
        path, source = arg, "--checkpoint"
    elif os.environ.get("HF_MODEL"):
        path, source = Path(os.environ["HF_MODEL"]), "$HF_MODEL"
    else:
        path, source = DEFAULT_CHECKPOINT, "embedded default"
    if not path.is_dir():
        raise UserError(f"checkpoint directory {path} ({source}) does not exist")
    return path


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]
