"""qwen36 generate: plain or speculative (MTP) generation, greedy or sampled, on the reference model or the TT model."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..errors import UserError
from ..speculative.mechanisms import DEFAULT_MECHANISM, DRAFT_MODES, MECHANISMS
from .common import (add_checkpoint_arg, add_sampling_args, add_thinking_arg, parse_ids, positive_int, print_logprobs,
                     print_outputs, read_messages, resolve_checkpoint, sampling_params, torch_dtype)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text (plain, or speculative with --spec-k; greedy or sampled)")
    add_checkpoint_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append",
                     help="prompt text (needs the checkpoint's tokenizer); repeat for several users decoded as one batch")
    src.add_argument("--ids", type=parse_ids, action="append",
                     help="prompt token ids, comma-separated; repeat for several users")
    src.add_argument("--prompts-file", type=Path, metavar="FILE",
                     help="one prompt per line, each a JSON string; all decoded as one batch")
    src.add_argument("--messages", type=Path, metavar="FILE",
                     help="a conversation (JSON list of {role, content}) rendered with the checkpoint's chat template "
                          "and its generation prompt (docs/chat.md)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--device", default="reference", help="reference | reference-cuda | emulated-p150x2 | p150x2 | ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--precision", default=None, choices=TT_PRECISIONS,
                   help=f"TT devices: the precision preset (docs/tt_precision.md) of plain and speculative decoding alike, "
                        f"so that the two decode the same model (default {DEFAULT_TT_PRECISION}); the reference's "
                        f"numerics are set by --dtype")
    add_spec_args(p)
    add_thinking_arg(p)
    p.set_defaults(run=run)


# The TT precision presets (tt/model/model_config.py PrecisionSetting.named) and the one `generate` uses unless told.
TT_PRECISIONS = ("accuracy", "performance", "performance-bf4")
DEFAULT_TT_PRECISION = "performance"


def tt_precision(args: argparse.Namespace) -> str | None:
    """The precision preset of this run: None on the reference devices (refusing --precision there), else
    --precision or the default preset."""
    from .backends import REFERENCE_DEVICES

    if args.device in REFERENCE_DEVICES:
        if args.precision is not None:
            raise UserError(f"--precision applies to the TT devices; on {args.device} the numerics are set by --dtype")
        return None
    return args.precision or DEFAULT_TT_PRECISION


def add_spec_args(p: argparse.ArgumentParser, default_k: int = 0) -> None:
    """The speculative-decoding options shared by `generate` (default plain decoding) and `demo` (default K=3)."""
    g = p.add_argument_group("speculative decoding (MTP)")
    g.add_argument("--spec-k", type=spec_k_arg, default=default_k, metavar="K|auto",
                   help="draft depth K" + (" (0 = plain decoding)" if default_k == 0 else "") +
                        "; 'auto' picks K per step from running acceptance and the backend's step costs "
                        "(qwen36/speculative/depth_policy.json, docs/depth.md); every backend")
    g.add_argument("--commit", default=DEFAULT_MECHANISM, choices=MECHANISMS, help="GDN/conv state commit mechanism")
    g.add_argument("--draft", default=DRAFT_MODES[0], choices=DRAFT_MODES,
                   help="stochastic mode only: MTP drafts sampled from the transformed draft distribution (default) "
                        "or argmax drafts (acceptance then uses a one-hot draft distribution)")
    add_sampling_args(p)


def spec_k_arg(text: str) -> int | str:
    """--spec-k: a non-negative integer or 'auto'."""
    from ..speculative.depth import parse_depth

    try:
        return parse_depth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prompt_texts(args) -> list[str] | None:
    """The prompt texts of --prompt / --prompts-file (None when --ids gave token ids)."""
    if args.prompt is not None:
        return args.prompt
    if args.prompts_file is None:
        return None
    try:
        lines = args.prompts_file.read_text().splitlines()
    except OSError as e:
        raise UserError(f"--prompts-file: cannot read {args.prompts_file}: {e.strerror}") from None
    texts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--prompts-file {args.prompts_file} line {n}: not a JSON string ({e.msg})") from None
        if not isinstance(text, str):
            raise UserError(f"--prompts-file {args.prompts_file} line {n}: expected a JSON string, got "
                            f"{type(text).__name__}")
        texts.append(text)
    if not texts:
        raise UserError(f"--prompts-file {args.prompts_file} holds no prompt")
    return texts


def encode_prompts(args, ckpt) -> tuple[list[list[int]], list[str] | None, object]:
    """-> (token ids per user, prompt texts or None, tokenizer or None)."""
    if getattr(args, "messages", None) is not None:
        from ..chat import prompt_ids
        from ..tokenizer import load_chat_tokenizer

        messages = read_messages(args.messages)
        tok = load_chat_tokenizer(ckpt)
        ids = prompt_ids(tok, messages, enable_thinking=args.thinking_budget != 0)
        return [ids], [tok.decode(ids)], tok
    texts = prompt_texts(args)
    if texts is None:
        return args.ids, None, None
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    ids = [tok.encode(t) for t in texts]
    for i, user_ids in enumerate(ids):
        if not user_ids:
            raise UserError("--prompt encodes to zero tokens" if len(ids) == 1 else f"prompt {i} encodes to zero tokens")
    return ids, texts, tok


def thinking_budget(args, ckpt, tok):
    """The run's ThinkingBudget (None without --thinking-budget), from the chat tokenizer's markers and phrase."""
    if args.thinking_budget is None:
        return None
    if args.thinking_budget < 0:
        raise UserError(f"--thinking-budget must be >= 0, got {args.thinking_budget}")
    if args.logprobs is not None:
        raise UserError("--thinking-budget with --logprobs is not supported (forced tokens have no sampled logprob)")
    from ..chat import STOP_THINKING_PHRASE, THINK_END, THINK_START
    from ..tokenizer import load_chat_tokenizer
    from ..speculative.thinking import ThinkingBudget

    tok = tok if tok is not None else load_chat_tokenizer(ckpt)
    start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
    return ThinkingBudget(args.thinking_budget, start, end, tuple(tok.encode(STOP_THINKING_PHRASE)))


def run(args: argparse.Namespace) -> int:
    from loguru import logger

    from .backends import REFERENCE_DEVICES, check_device, load_target

    check_device(args.device)
    if args.spec_k != "auto" and args.spec_k < 0:
        raise UserError(f"--spec-k must be >= 0, got {args.spec_k}")
    params = sampling_params(args)  # validated before any model is loaded
    precision = tt_precision(args)
    ckpt = resolve_checkpoint(args.checkpoint)
    prompts, texts, tok = encode_prompts(args, ckpt)
    speculative = args.spec_k == "auto" or args.spec_k > 0
    if len(prompts) > 1 and args.spec_k == "auto" and args.device not in REFERENCE_DEVICES:
        raise UserError(f"--spec-k auto with several prompts (batch {len(prompts)}) on {args.device}: the batched TT "
                        f"verify runs K+1 rows for every user every step, so a per-user depth policy saves no verify "
                        f"work there; pass an integer --spec-k (or one prompt)")
    thinking = thinking_budget(args, ckpt, tok)
    if speculative:
        from .speculative_generate import run_speculative_generate

        return run_speculative_generate(args, ckpt, prompts, texts, tok, precision, thinking=thinking)
    target = load_target(ckpt, args.device, torch_dtype(args.dtype), precision=precision)
    vocab = target.config.vocab_size
    if any(i >= vocab for ids in prompts for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {vocab})")
    t0 = time.perf_counter()
    if thinking is not None and len(prompts) == 1:
        if args.device in REFERENCE_DEVICES:
            from ..speculative.plain import plain_generate

            result = plain_generate(target.model, prompts[0], args.max_new_tokens, params,
                                    target.config.eos_token_id, thinking=thinking)
        else:  # TT: the phrase fed as decode rows, each replacing the step's pick
            result = target.generate(prompts[0], args.max_new_tokens, params, target.config.eos_token_id,
                                     thinking=thinking)
        outputs, logprobs = [result.tokens], result.logprobs
    elif len(prompts) == 1:
        result = target.generate(prompts[0], args.max_new_tokens, params, target.config.eos_token_id)
        outputs, logprobs = [result.tokens], result.logprobs
    else:
        sampled = not params.greedy or params.penalized
        if params.logprobs is not None or sampled and not hasattr(target, "sample_batch"):
            raise UserError(f"several prompts (batch {len(prompts)}) on {args.device} decode plain greedy only (no "
                            f"{'--logprobs' if params.logprobs is not None else 'temperature or penalties'}; "
                            f"sampled batches run on the TT devices); pass one prompt, or add --spec-k")
        if sampled:
            outputs = target.sample_batch(prompts, args.max_new_tokens, params, target.config.eos_token_id,
                                          thinking=thinking)
        else:
            outputs = target.greedy_batch(prompts, args.max_new_tokens, target.config.eos_token_id,
                                          thinking=thinking)
        logprobs = None
    dt = time.perf_counter() - t0
    n = sum(map(len, outputs))
    batch = "" if len(prompts) == 1 else f" batch {len(prompts)}:"
    logger.info(f"[{target.label}] plain {params.describe()}:{batch} {n} tokens in {dt:.2f} s "
                f"({n / dt:.1f} tok/s, measured on this backend)")
    print_outputs(outputs, texts, tok)
    print_logprobs(logprobs, tok)
    return 0
