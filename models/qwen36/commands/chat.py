"""qwen36 chat: a multi-turn conversation in Qwen3.6's chat format with the hybrid prefix cache and the thinking
budget (docs/chat.md, docs/thinking.md). Interactive (one user message per line on stdin) or ``--messages FILE``
(a JSON list of messages whose user turns are replayed; one JSON object per turn on stdout)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import UserError
from .common import (add_checkpoint_arg, add_sampling_args, add_thinking_arg, positive_int, read_messages,
                     resolve_checkpoint, sampling_params, torch_dtype)

DEFAULT_PREFIX_BLOCK = 64  # tokens per cached block (docs/chat.md: why 64)
DEFAULT_PREFIX_BUDGET_MB = 1024


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix cache (docs/chat.md)")
    g.add_argument("--prefix-block", type=positive_int, default=DEFAULT_PREFIX_BLOCK,
                   help="tokens per cached block: a multiple of the TT KV page (64); smaller = less re-prefill per "
                        "turn, more GDN checkpoints per cached token")
    g.add_argument("--prefix-budget-mb", type=positive_int, default=DEFAULT_PREFIX_BUDGET_MB,
                   help="the most MiB of cached blocks (per device on TT); least recently used unreferenced blocks "
                        "are evicted")
    g.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt from token 0")


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="multi-turn chat (Qwen3.6 chat format, prefix cache, thinking budget)")
    add_checkpoint_arg(p)
    p.add_argument("--messages", type=Path, metavar="FILE",
                   help="JSON list of {role, content} messages: its user turns are replayed in order (its assistant "
                        "turns are replaced by the model's answers), one JSON line of statistics per turn")
    p.add_argument("--system", default=None, help="system message (interactive mode)")
    p.add_argument("--device", default="reference", help="reference | emulated-p150x2 | p150x2 | ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--precision", default="accuracy", help="TT precision preset (TT devices only)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="per turn")
    p.add_argument("--spec-k", type=int, default=0, help="MTP speculative decoding with K drafts (reference)")
    p.add_argument("--commit", default="shadow_commit", help="GDN commit mechanism of speculative decoding")
    p.add_argument("--preserve-thinking", action="store_true",
                   help="keep the reasoning of every earlier assistant turn in the history (Qwen3.6's kwarg)")
    add_thinking_arg(p)
    add_prefix_args(p)
    add_sampling_args(p)
    p.set_defaults(run=run, draft="sample")


def make_cache(args, with_mtp: bool):
    from ..prefix_cache import PrefixCache

    if args.no_prefix_cache:
        return None
    return PrefixCache(args.prefix_block, args.prefix_budget_mb << 20, with_mtp=with_mtp)


def load_chat_tokenizer(ckpt):
    from ..tokenizer import load_chat_tokenizer as load

    return load(ckpt)


def load_session(args, ckpt, tok):
    from ..chat_session import ChatSession
    from .backends import REFERENCE_DEVICES, check_device

    check_device(args.device)
    if args.thinking_budget is not None and args.thinking_budget < 0:
        raise UserError(f"--thinking-budget must be >= 0, got {args.thinking_budget}")
    if args.spec_k < 0:
        raise UserError(f"--spec-k must be >= 0, got {args.spec_k}")
    params = sampling_params(args)
    if params.logprobs is not None:
        raise UserError("chat prints no logprobs (use qwen36 generate --messages FILE --logprobs N)")
    drafter = None  # the device MTP drafter of speculative chat on TT
    if args.device in REFERENCE_DEVICES:
        from ..reference.model import Qwen36Model

        model = Qwen36Model.from_checkpoint(ckpt, dtype=torch_dtype(args.dtype), require_mtp=args.spec_k > 0)
        target, with_mtp = model, model.mtp is not None
    else:
        from ..tt.runtime.generator import build_generator

        if args.spec_k:
            from ..checkpoint import load_checkpoint
            from ..tt.spec.mtp_drafter import TTMTPDrafter

            drafter = TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True))
        target, with_mtp = build_generator(ckpt, args.device, precision=args.precision), False
    return ChatSession(target, tok, cache=make_cache(args, with_mtp), params=params,
                       max_new_tokens=args.max_new_tokens, thinking_budget=args.thinking_budget, spec_k=args.spec_k,
                       mechanism=args.commit, preserve_thinking=args.preserve_thinking, system=args.system,
                       drafter=drafter)


def run(args: argparse.Namespace) -> int:
    from ..chat_session import describe, user_turns_of

    ckpt = resolve_checkpoint(args.checkpoint)
    messages = read_messages(args.messages) if args.messages is not None else None
    tok = load_chat_tokenizer(ckpt)
    if messages is not None:
        system, turns = user_turns_of(messages)
        args.system = system
        if not turns:
            raise UserError(f"--messages {args.messages}: no user message to answer")
    session = load_session(args, ckpt, tok)
    if messages is not None:
        for i, text in enumerate(turns, start=1):
            st = session.turn(text)
            out = st.as_dict()
            out.update(turn=i, backend=session.label, timing="measured")
            del out["tokens"]
            print(json.dumps(out))
            print(describe(st, i, session.label), file=sys.stderr)
        return 0
    print(f"chat on {session.label}: one message per line, an empty line or EOF ends", file=sys.stderr)
    i = 0
    for line in sys.stdin:
        text = line.rstrip("\n")
        if not text:
            break
        i += 1
        st = session.turn(text)
        if st.reasoning:
            print(f"<think>{st.reasoning}</think>")
        print(st.answer)
        print(describe(st, i, session.label), file=sys.stderr)
    return 0
