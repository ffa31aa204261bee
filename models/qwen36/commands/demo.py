"""qwen36 demo: the main job on the embedded default checkpoint."""
from __future__ import annotations

import argparse

from .common import DEFAULT_CHECKPOINT, torch_dtype


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="run the main job on the embedded default checkpoint")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from ..tiny import make_tiny
    from .backends import load_target

    ckpt = DEFAULT_CHECKPOINT
    if not (ckpt / "config.json").exists():
        ckpt = Path(tempfile.mkdtemp(prefix="qwen36-demo-")) / "ci"
        make_tiny(ckpt, "ci", seed=0)
        print(f"(no embedded default checkpoint yet: using a random-weight 'ci' checkpoint at {ckpt})")
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    target = load_target(ckpt, "reference", torch_dtype("float32"))
    ids = tok.encode(args.prompt)
    out = target.greedy(ids, args.max_new_tokens, target.config.eos_token_id)
    print(f"[{target.label}] checkpoint: {ckpt}")
    print("prompt:", args.prompt)
    print("generated:", tok.decode(out))
    return 0
