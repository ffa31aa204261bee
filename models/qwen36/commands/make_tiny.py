"""qwen36 make-tiny OUT_DIR [--seed N --preset NAME]: a random-weight checkpoint in HF format."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub, name: str) -> None:
    from ..tiny import EXPERT_LAYOUTS, PRESETS  # light import (no torch model code)

    p = sub.add_parser(name, help="write a small random-weight Qwen3.6 checkpoint (HF format, incl. mtp.*)")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--preset", default="ci", choices=sorted(PRESETS))
    p.add_argument("--expert-layout", default="stacked", choices=EXPERT_LAYOUTS,
                   help="MoE presets: stacked experts.gate_up_proj/down_proj or per-expert experts.{e}.*_proj tensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="stored dtype (default float32, bfloat16 for 27b-layers)")
    p.add_argument("--no-mtp", action="store_true", help="omit the mtp.* tensors")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from loguru import logger

    from ..tiny import make_tiny
    from .common import torch_dtype

    dtype = args.dtype or ("bfloat16" if args.preset == "27b-layers" else "float32")
    out = make_tiny(args.out_dir, args.preset, seed=args.seed, dtype=torch_dtype(dtype), with_mtp=not args.no_mtp,
                    expert_layout=args.expert_layout)
    logger.info(f"wrote {args.preset} checkpoint (seed {args.seed}, {dtype}) to {out}")
    print(out)
    return 0
