"""qwen36 generate: plain or speculative (MTP) generation, greedy or sampled, on the reference model or the TT model."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from ..generation.sampling import DRAFT_MODES, SamplingParams, SamplingParamsError
from ..speculative.mechanisms import DEFAULT_MECHANISM, MECHANISMS
from .common import (DEFAULT_TT_PRECISION, TT_PRECISIONS, add_checkpoint_arg, add_sampling_args, add_thinking_arg,
                     parse_ids, positive_int, precision_name, print_logprobs, print_outputs, read_messages,
                     resolve_checkpoint, sampling_params, torch_dtype)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text (plain, or speculative with --spec-k; greedy or sampled)")
    add_checkpoint_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append",
                     help="prompt text (needs the checkpoint's tokenizer); repeat for several users decoded as one batch")
    src.add_argument("--ids", type=parse_ids, action="append",
                     help="prompt token ids, comma-separated; repeat for several users")
    src.add_argument("--prompts-file", type=Path, metavar="FILE",
                     help="one user per line, all decoded as one batch: a JSON string (the prompt), or a JSON object "
                          "with \"prompt\" (text) or \"ids\" (token ids) and any of that user's own "
                          "temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, "
                          "frequency_penalty, seed, logprobs, max_tokens (the rest from the command line; "
                          "docs/speculative.md)")
    src.add_argument("--messages", type=Path, metavar="FILE",
                     help="a conversation (JSON list of {role, content}) rendered with the checkpoint's chat template "
                          "and its generation prompt (docs/chat.md)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--device", default="reference", help="reference | reference-cuda | emulated-p150x2 | p150x2 | ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--precision", default=None, type=precision_name,
                   help=f"TT devices: the precision preset (docs/tt_precision.md) of plain and speculative decoding alike, "
                        f"so that the two decode the same model (default {DEFAULT_TT_PRECISION}): one of "
                        f"{', '.join(TT_PRECISIONS)}, optionally with +<group>=<dtype> modifiers, e.g. "
                        f"performance+kv_cache=bfloat8_b (the bf8 KV cache, docs/memory.md); the reference's numerics "
                        f"are set by --dtype")
    add_spec_args(p)
    add_thinking_arg(p)
    p.set_defaults(run=run)


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


# The per-user settings a --prompts-file object line may carry: SamplingParams' fields (vLLM's names) and vLLM's
# max_tokens (this command's --max-new-tokens); a field a line leaves out takes the command line's value.
USER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "seed", "logprobs", "max_tokens")


@dataclass(frozen=True)
class PromptLine:
    """One user of --prompts-file: its prompt (text, or token ids) and the settings its line gives."""
    text: str | None
    ids: list[int] | None
    settings: dict = field(default_factory=dict)


def read_prompts_file(path: Path) -> list[PromptLine]:
    """--prompts-file: one user per non-blank line, a JSON string (the prompt) or a JSON object with "prompt"
    (text) or "ids" (token ids) plus any of USER_FIELDS. A bad line is a one-line UserError naming line and field."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"--prompts-file: cannot read {path}: {e.strerror}") from None
    users = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts-file {path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not a JSON string or object ({e.msg})") from None
        if isinstance(item, str):
            users.append(PromptLine(item, None))
            continue
        if not isinstance(item, dict):
            raise UserError(f"{where}: expected a JSON string or object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(USER_FIELDS) - {"prompt", "ids"})
        if unknown:
            raise UserError(f"{where}: unknown field {unknown[0]!r} (known: prompt, ids, {', '.join(USER_FIELDS)})")
        if ("prompt" in item) == ("ids" in item):
            raise UserError(f"{where}: give exactly one of \"prompt\" (text) and \"ids\" (token ids)")
        text, ids = item.get("prompt"), item.get("ids")
        if "prompt" in item and not isinstance(text, str):
            raise UserError(f"{where}: \"prompt\" must be a string, got {type(text).__name__}")
        if "ids" in item and not (isinstance(ids, list) and ids and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise UserError(f"{where}: \"ids\" must be a non-empty list of non-negative integers")
        settings = {k: v for k, v in item.items() if k in USER_FIELDS}
        mt = settings.get("max_tokens")
        if "max_tokens" in settings and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise UserError(f"{where}: max_tokens must be a positive integer, got {mt!r}")
        try:  # the sampling fields are checked here, before any model loads
            SamplingParams(**{k: v for k, v in settings.items() if k != "max_tokens"})
        except SamplingParamsError as e:
            raise UserError(f"{where}: {e}") from None
        users.append(PromptLine(text, ids, settings))
    if not users:
        raise UserError(f"--prompts-file {path} holds no prompt")
    if len({u.ids is None for u in users}) > 1:
        raise UserError(f"--prompts-file {path}: mixes text prompts and \"ids\" lines; use one kind per file")
    return users


def prompt_lines(args) -> list[PromptLine] | None:
    """The users of --prompt / --prompts-file (None when --ids or --messages gave the prompt)."""
    if args.prompt is not None:
        return [PromptLine(t, None) for t in args.prompt]
    if getattr(args, "prompts_file", None) is None:
        return None
    return read_prompts_file(args.prompts_file)


@dataclass(frozen=True)
class UserRequests:
    """Every user's prompt, sampling params and token budget (``per_user``: some --prompts-file line set one)."""
    prompts: list[list[int]]
    texts: list[str] | None
    tok: object
    params: list[SamplingParams]
    max_tokens: list[int]
    per_user: bool


def user_requests(args, ckpt, speculative: bool) -> UserRequests:
    """The run's users: prompts (encoded), and each user's params and budget: the command line's, with the
    settings of its --prompts-file line on top. A user whose line gives no seed gets what the command line gives
    user i: --seed + i speculative, --seed plain (each user has its own stream either way)."""
    base = sampling_params(args)
    lines = None if getattr(args, "messages", None) is not None else prompt_lines(args)
    if getattr(args, "messages", None) is not None:
        from ..chat import prompt_ids
        from ..tokenizer import load_chat_tokenizer

        messages = read_messages(args.messages)
        tok = load_chat_tokenizer(ckpt)
        ids = prompt_ids(tok, messages, enable_thinking=args.thinking_budget != 0)
        prompts, texts = [ids], [tok.decode(ids)]
    elif lines is None:
        prompts, texts, tok = args.ids, None, None
    elif lines[0].ids is not None:
        prompts, texts, tok = [u.ids for u in lines], None, None
    else:
        from ..tokenizer import load_tokenizer

        tok = load_tokenizer(ckpt)
        texts = [u.text for u in lines]
        prompts = [tok.encode(t) for t in texts]
        for i, user_ids in enumerate(prompts):
            if not user_ids:
                raise UserError("--prompt encodes to zero tokens" if len(prompts) == 1 else
                                f"prompt {i} encodes to zero tokens")
    settings = [u.settings for u in lines] if lines is not None else [{} for _ in prompts]
    params, budgets = [], []
    for i, s in enumerate(settings):
        seed = base.seed + i if speculative else base.seed
        fields = {k: v for k, v in s.items() if k != "max_tokens"}
        params.append(replace(base, **{"seed": seed, **fields}))
        budgets.append(s.get("max_tokens", args.max_new_tokens))
    return UserRequests(prompts, texts, tok, params, budgets, per_user=any(settings))


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
    from ..generation.thinking import ThinkingBudget

    tok = tok if tok is not None else load_chat_tokenizer(ckpt)
    start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
    return ThinkingBudget(args.thinking_budget, start, end, tuple(tok.encode(STOP_THINKING_PHRASE)))


def run(args: argparse.Namespace) -> int:
    from loguru import logger

    from .backends import REFERENCE_DEVICES, check_device, load_target

    check_device(args.device)
    if args.spec_k != "auto" and args.spec_k < 0:
        raise UserError(f"--spec-k must be >= 0, got {args.spec_k}")
    sampling_params(args)  # validated before any model is loaded
    precision = tt_precision(args)
    ckpt = resolve_checkpoint(args.checkpoint)
    speculative = args.spec_k == "auto" or args.spec_k > 0
    users = user_requests(args, ckpt, speculative)
    prompts, texts, tok = users.prompts, users.texts, users.tok
    if len(prompts) > 1 and args.spec_k == "auto" and args.device not in REFERENCE_DEVICES:
        raise UserError(f"--spec-k auto with several prompts (batch {len(prompts)}) on {args.device}: the batched TT "
                        f"verify runs K+1 rows for every user every step, so a per-user depth policy saves no verify "
                        f"work there; pass an integer --spec-k (or one prompt)")
    thinking = thinking_budget(args, ckpt, tok)
    if thinking is not None and any(p.logprobs is not None for p in users.params):
        raise UserError("--thinking-budget with logprobs is not supported (forced tokens have no sampled logprob)")
    if speculative:
        from .speculative_generate import run_speculative_generate

        return run_speculative_generate(args, ckpt, users, precision, thinking=thinking)
    target = load_target(ckpt, args.device, torch_dtype(args.dtype), precision=precision)
    vocab = target.config.vocab_size
    if any(i >= vocab for ids in prompts for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {vocab})")
    eos = target.config.eos_token_id
    t0 = time.perf_counter()
    params = users.params[0]
    # one plain driver for every backend and batch size (generation.plain): each user its own params and budget
    results = target.generate(prompts, users.max_tokens, users.params, eos, thinking=thinking)
    outputs, logprobs = [r.tokens for r in results], [r.logprobs for r in results]
    dt = time.perf_counter() - t0
    n = sum(map(len, outputs))
    batch = "" if len(prompts) == 1 else f" batch {len(prompts)}:"
    mode = "per-user settings" if users.per_user and len(prompts) > 1 else params.describe()
    logger.info(f"[{target.label}] plain {mode}:{batch} {n} tokens in {dt:.2f} s "
                f"({n / dt:.1f} tok/s, measured on this backend)")
    print_outputs(outputs, texts, tok)
    for i, lps in enumerate(logprobs):
        if lps is not None and len(prompts) > 1:
            print(f"user {i}:")
        print_logprobs(lps, tok)
    return 0
