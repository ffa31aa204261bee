"""qwen36 logits: teacher-forced logits for every position, saved as safetensors (tensor `logits`, [T, vocab])."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError
from .common import add_checkpoint_arg, parse_ids, resolve_checkpoint, torch_dtype


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="teacher-forced logits for every position of --ids")
    add_checkpoint_arg(p)
    p.add_argument("--ids", type=parse_ids, required=True, help="comma-separated token ids")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    p.add_argument("--device", default="reference", help="reference (torch) | emulated-p150x2 | p150x2 | ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from loguru import logger
    from safetensors.torch import save_file

    from ..io_utils import atomic_write
    from .backends import load_target

    ckpt = resolve_checkpoint(args.checkpoint)
    target = load_target(ckpt, args.device, torch_dtype(args.dtype))
    vocab = target.config.vocab_size
    bad = [i for i in args.ids if i >= vocab]
    if bad:
        raise UserError(f"--ids {bad} outside the vocabulary (size {vocab})")
    logits = target.teacher_forced_logits(torch.tensor(args.ids)).float().contiguous()
    atomic_write(args.out, lambda tmp: save_file({"logits": logits}, tmp, metadata={"backend": target.label}))
    logger.info(f"[{target.label}] logits {list(logits.shape)} -> {args.out}")
    print(args.out)
    return 0
