"""qwen36 demo: MTP speculative generation on the embedded default checkpoint, against plain decoding.

Prints the prompt and the generated text, the acceptance figures (mean accepted drafts and mean emitted
tokens per verify step, per-position acceptance, histogram) and tok/s of speculative vs plain decoding, both
measured in this run on the named backend. With ``--logprobs N`` it also prints, for both runs, every emitted
token's raw logprob and rank and the N most likely tokens, and how far the two runs' logprobs of the tokens they
share (the common prefix) lie apart. The embedded default (models/qwen36/default_checkpoint) is a small
model trained on Python standard-library sources (see its MODEL_CARD.md), so prompts should be Python code.
"""
from __future__ import annotations

import argparse

from ..errors import UserError
from .common import DEFAULT_CHECKPOINT, positive_int, print_logprobs, sampling_params
from .generate import add_spec_args

DEFAULT_PROMPT = '''class Counter:
    """Count hashable items."""

    def __init__(self, iterable=None):
        self.counts = {}'''


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="speculative (MTP) generation on the embedded default checkpoint vs plain decoding")
    p.add_argument("--checkpoint", "-c", default=None,
                   help="checkpoint directory (default: the embedded default, models/qwen36/default_checkpoint)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (Python code suits the default model)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--device", default="reference",
                   help="reference | reference-cuda | emulated-p150x2 | p150x2 | ... (no fallback between them)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads for the reference backend (1 is fastest for batch-1 decode of this small model)")
    add_spec_args(p, default_k=3)
    p.set_defaults(run=run)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_gap(a, b) -> tuple[int, float]:
    """(n, max |difference|) over the common prefix of two runs' emitted tokens: every number a TokenLogprobs
    carries for a token both runs emitted at the same index after the same history (its own logprob and the top-n
    values; the top-n ids are compared too, a different id there counts as an infinite gap)."""
    n, worst = 0, 0.0
    for x, y in zip(a, b):
        if x.token != y.token:
            break
        n += 1
        worst = max(worst, abs(x.logprob - y.logprob))
        if [t for t, _ in x.top] != [t for t, _ in y.top]:
            return n, float("inf")
        worst = max([worst] + [abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)])
    return n, worst


def plain_target(backend):
    """Plain decoding on the speculative backend's own model: on cards there is only one mesh to open, and
    the comparison must use the same weights and precision."""
    gen = getattr(backend, "gen", None)  # TTSpecBackend wraps a TTGenerator
    if gen is not None:
        return gen
    from .backends import ReferenceTarget

    return ReferenceTarget(backend.model, backend.label)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import torch

    from ..speculative.engine import speculative_generate
    from ..tokenizer import load_tokenizer
    from .backends import check_device
    from .common import torch_dtype
    from .speculative_generate import config_of, backend_config, depth_label, depth_policy, format_stats, load_backend

    check_device(args.device)
    if args.spec_k != "auto" and args.spec_k < 1:
        raise UserError(f"the demo is speculative: --spec-k must be >= 1 or auto, got {args.spec_k}")
    ckpt = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    if not (ckpt / "config.json").exists():
        raise UserError(f"no checkpoint at {ckpt} (config.json missing); the embedded default ships with the "
                        "repository in models/qwen36/default_checkpoint, or pass --checkpoint DIR")
    cfg_auto = config_of(ckpt) if args.spec_k == "auto" else None
    depth = depth_policy(args.spec_k, args.device, cfg_auto)
    fresh_depth = (lambda: depth) if isinstance(depth, int) else (lambda: depth_policy(args.spec_k, args.device, cfg_auto))
    params = sampling_params(args)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(ckpt)
    ids = tok.encode(args.prompt)
    if not ids:
        raise UserError("--prompt encodes to zero tokens")
    dtype = torch_dtype(args.dtype)
    max_len = len(ids) + args.max_new_tokens + (depth if isinstance(depth, int) else depth.k_max) + 2
    backend = load_backend(ckpt, args.device, dtype, args.commit, max_len, depth)  # speculative path (MTP required)
    target = plain_target(backend)  # plain decoding on the same model, device and precision
    cfg = backend_config(backend)
    eos = cfg.eos_token_id
    if any(i >= cfg.vocab_size for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {cfg.vocab_size})")

    release = getattr(backend, "release", lambda: None)  # TT: free the spec traces before plain decode allocates
    # warm-up (first-call allocations) so that the timed runs compare like with like
    speculative_generate(backend, [ids[:8]], 4, [fresh_depth()], [params], eos_ids=eos)
    release()
    target.generate([ids[:8]], 4, params, eos)

    t0 = time.perf_counter()
    result = speculative_generate(backend, [ids], args.max_new_tokens, [fresh_depth()], [params], eos_ids=eos)[0]
    t_spec = time.perf_counter() - t0
    release()
    t0 = time.perf_counter()
    plain_result = target.generate([ids], args.max_new_tokens, params, eos)[0]  # same sampling parameters
    plain = plain_result.tokens
    t_plain = time.perf_counter() - t0

    mode = params.describe()
    bar = "-" * 78
    print(f"checkpoint : {ckpt}")
    print(f"backend    : {backend.label} (speculative); {target.label} (plain)")
    print(f"mode       : {mode}, K={depth_label(depth)}, commit={args.commit}, threads={args.threads}")
    print(bar)
    print("prompt:")
    print(args.prompt.rstrip("\n"))
    print(bar)
    print("generated (speculative):")
    print(tok.decode(result.tokens))
    print(bar)
    print(format_stats(result))
    spec_tps = len(result.tokens) / t_spec
    plain_tps = len(plain) / t_plain
    print(f"speculative: {len(result.tokens)} tokens in {t_spec:.2f} s = {spec_tps:.1f} tok/s "
          f"({result.stats.steps} verify steps)")
    print(f"plain      : {len(plain)} tokens in {t_plain:.2f} s = {plain_tps:.1f} tok/s (one target forward per token)")
    print(f"speed-up   : {spec_tps / plain_tps:.2f}x  (measured in this run on {backend.label})")
    if "emulated" in backend.label:
        print("note       : emulated mesh = ttnn golden functions on the host CPU; these tok/s are emulator wall-clock, "
              "not a card figure (see `qwen36 probe decode-cost` / `gate-0b` for modelled P150a numbers)")
    if params.logprobs is not None:
        print(bar)
        print("speculative ", end="")
        print_logprobs(result.logprobs, tok)
        print("plain ", end="")
        print_logprobs(plain_result.logprobs, tok)
        n, gap = logprob_gap(result.logprobs, plain_result.logprobs)
        print(f"logprobs check: {n} shared leading tokens, max |speculative - plain| = {gap:.3g} (the verify's K+1-row "
              f"forward vs the 1-row decode: rounding only)")
        print(bar)
    if params.greedy:
        d = _first_difference(result.tokens, plain)
        print("greedy check: speculative output == plain greedy output" if d is None else
              f"greedy check: outputs differ from token {d} (near-tie logits: verify K+1-row vs 1-row decode numerics)")
    return 0
