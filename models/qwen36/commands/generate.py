"""qwen36 generate: greedy or speculative (MTP) generation on the reference model or the TT model."""
from __future__ import annotations

import argparse
import time

from ..errors import UserError
from ..speculative.mechanisms import DEFAULT_MECHANISM, DRAFT_MODES, MECHANISMS
from .common import add_checkpoint_arg, parse_ids, positive_int, resolve_checkpoint, torch_dtype


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text (greedy, or speculative with --spec-k)")
    add_checkpoint_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--ids", type=parse_ids, help="prompt token ids, comma-separated")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--device", default="reference", help="reference | reference-cuda | emulated-p150x2 | p150x2 | ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    add_spec_args(p)
    p.set_defaults(run=run)


def add_spec_args(p: argparse.ArgumentParser, default_k: int = 0) -> None:
    """The speculative-decoding options shared by `generate` (default plain decoding) and `demo` (default K=3)."""
    g = p.add_argument_group("speculative decoding (MTP)")
    g.add_argument("--spec-k", type=spec_k_arg, default=default_k, metavar="K|auto",
                   help="draft depth K" + (" (0 = plain decoding)" if default_k == 0 else "") +
                        "; 'auto' picks K per step from running acceptance and the backend's step costs "
                        "(qwen36/speculative/depth_policy.json, docs/depth.md); every backend")
    g.add_argument("--commit", default=DEFAULT_MECHANISM, choices=MECHANISMS, help="GDN/conv state commit mechanism")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; >0 = stochastic rejection sampling")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--draft", default=DRAFT_MODES[0], choices=DRAFT_MODES,
                   help="stochastic mode only: MTP drafts sampled from the transformed draft distribution (default) "
                        "or argmax drafts (acceptance then uses a one-hot draft distribution)")


def spec_k_arg(text: str) -> int | str:
    """--spec-k: a non-negative integer or 'auto'."""
    from ..speculative.depth import parse_depth

    try:
        return parse_depth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def encode_prompt(args, ckpt):
    if args.ids is not None:
        return args.ids, None
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    ids = tok.encode(args.prompt)
    if not ids:
        raise UserError("--prompt encodes to zero tokens")
    return ids, tok


def run(args: argparse.Namespace) -> int:
    from loguru import logger

    from .backends import check_device, load_target

    check_device(args.device)
    if args.spec_k != "auto" and args.spec_k < 0:
        raise UserError(f"--spec-k must be >= 0, got {args.spec_k}")
    ckpt = resolve_checkpoint(args.checkpoint)
    ids, tok = encode_prompt(args, ckpt)
    if args.spec_k == "auto" or args.spec_k > 0:
        from .speculative_generate import run_speculative_generate

        return run_speculative_generate(args, ckpt, ids, tok)
    if args.temperature != 0.0:
        raise UserError("plain decoding here is greedy; stochastic sampling needs --spec-k >= 1")
    target = load_target(ckpt, args.device, torch_dtype(args.dtype))
    vocab = target.config.vocab_size
    if any(i >= vocab for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {vocab})")
    t0 = time.perf_counter()
    out = target.greedy(ids, args.max_new_tokens, target.config.eos_token_id)
    dt = time.perf_counter() - t0
    logger.info(f"[{target.label}] greedy: {len(out)} tokens in {dt:.2f} s ({len(out) / dt:.1f} tok/s, measured on this backend)")
    print("ids:", ",".join(map(str, out)))
    if tok is not None:
        print("prompt:", args.prompt)
        print("text:", tok.decode(out))
    return 0
