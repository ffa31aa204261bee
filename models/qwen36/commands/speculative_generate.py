"""``qwen36 generate --spec-k K``: speculative generation with acceptance statistics."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..errors import UserError
from ..speculative.engine import GenerationResult, MechanismCounters, SpecBackend, speculative_generate_batch
from ..speculative.sampling import SamplingParams
from .backends import REFERENCE_DEVICES


def load_backend(ckpt: Path, device: str, dtype, mechanism: str, max_len: int, users: int = 1):
    """The speculative backend for --device: the torch reference, or the TT target + device MTP. ``users`` > 1
    (reference only): a list of that many backends, one per user, sharing one model's weights."""
    if device not in REFERENCE_DEVICES:
        if users != 1:
            raise UserError(f"batched speculative decoding ({users} users) runs on the reference backend only for now")
        return load_tt_backend(ckpt, device, mechanism, max_len)
    import torch

    from ..reference.model import Qwen36Model
    from ..speculative.reference_backend import ReferenceBackend

    if device == "reference-cuda" and not torch.cuda.is_available():
        raise UserError("--device reference-cuda but torch sees no CUDA device; use --device reference")
    model = Qwen36Model.from_checkpoint(ckpt, dtype=dtype, device="cuda" if device == "reference-cuda" else "cpu",
                                        require_mtp=True)
    if users == 1:
        return ReferenceBackend(model, mechanism, max_len=max_len)
    return [ReferenceBackend(model, mechanism, max_len=max_len) for _ in range(users)]


def load_tt_backend(ckpt: Path, device: str, mechanism: str, max_len: int, precision: str = "accuracy") -> SpecBackend:
    """TTSpecBackend on ``device`` (emulated-p150x2, p150x2, ...): traced verify+accept / commit+MTP draft."""
    from ..checkpoint import load_checkpoint
    from ..tt.generator import load_tt_target
    from ..tt.mtp_drafter import TTMTPDrafter
    from ..tt.spec_backend import TTSpecBackend

    block = 32
    gen = load_tt_target(ckpt, device, precision=precision, require_mtp=True,
                         max_seq_len=max(2 * block, -(-max_len // block) * block), block_size=block)
    return TTSpecBackend(gen, mechanism, drafter=TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True)))


def backend_config(backend):
    """The model config of a reference or TT backend."""
    cfg = getattr(backend, "config", None)
    return cfg if cfg is not None else backend.model.config


def format_stats(result: GenerationResult) -> str:
    s = result.stats
    hist = " ".join(f"{a}:{c}" for a, c in enumerate(s.histogram()))
    pos = " ".join(f"{p:.2f}" for p in s.per_position())
    text = (f"steps {s.steps}, mean accepted/step {s.mean_accepted:.3f} of {s.k}, mean emitted/step {s.mean_emitted:.3f}\n"
            f"per-position acceptance (d1..d{s.k}): {pos}\n"
            f"accepted-count histogram (a:steps): {hist}")
    if len(set(s.depths)) > 1:
        depths = " ".join(f"{k}:{c}" for k, c in enumerate(s.as_dict()["depth_histogram"], start=1))
        text += f"\ndraft depth per step: mean {s.mean_depth:.2f}, histogram (K:steps) {depths}"
    return text


def depth_policy(spec_k, device: str):
    """--spec-k as the engine takes it: the integer, or the fitted depth controller for this device's step costs.

    The TT step drafts the next step's MTP chain inside the current step's commit trace, at the current K, and
    its per-K device state (acceptor, ring slots, draft buffers) is built once per generation; switching K between
    steps is not implemented there yet, so 'auto' is refused on TT devices rather than run wrongly."""
    if spec_k != "auto":
        return spec_k
    from ..speculative.depth import DepthPolicy, cost_key

    if not device.startswith("reference"):
        raise UserError("--spec-k auto runs on the reference backend only for now: the TT step keeps one draft "
                        "depth per generation (it drafts the next step inside the current commit trace); "
                        "pass a fixed --spec-k K on " + device)
    return DepthPolicy.load().controller(cost_key(device))


def depth_label(depth) -> str:
    return str(depth) if isinstance(depth, int) else depth.describe()


def run_speculative_generate(args: argparse.Namespace, ckpt: Path, prompts: list[list[int]], texts: list[str] | None,
                             tok) -> int:
    """Speculative generation of one or several users (several: one backend per user, stepped together by
    ``speculative_generate_batch``; user i samples with seed ``--seed`` + i)."""
    from loguru import logger

    from ..checkpoint import CheckpointError
    from .common import torch_dtype
    from .generate import print_outputs

    b = len(prompts)
    try:
        params = [SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i, draft=args.draft)
                  for i in range(b)]
    except ValueError as e:
        raise UserError(str(e)) from None
    depths = [depth_policy(args.spec_k, args.device) for _ in range(b)]  # a depth controller tracks one user
    depth = depths[0]
    k_max = depth if isinstance(depth, int) else depth.k_max
    max_len = max(map(len, prompts)) + args.max_new_tokens + k_max + 2
    try:
        loaded = load_backend(ckpt, args.device, torch_dtype(args.dtype), args.commit, max_len, users=b)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    backends = [loaded] if b == 1 else loaded
    backend = backends[0]
    vocab = backend_config(backend).vocab_size
    if any(i >= vocab for ids in prompts for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {vocab})")
    t0 = time.perf_counter()
    results = speculative_generate_batch(backends, prompts, args.max_new_tokens, depths, params,
                                         eos_ids=backend_config(backend).eos_token_id)
    dt = time.perf_counter() - t0
    p = params[0]
    seed = f"seed={p.seed}" if b == 1 else f"seed={p.seed}+user"
    mode = "greedy" if p.greedy else f"sampling T={p.temperature} top_k={p.top_k} top_p={p.top_p} {seed} drafts={p.draft}"
    n = sum(len(r.tokens) for r in results)
    batch = "" if b == 1 else f" batch {b}:"
    logger.info(f"[{backend.label}] speculative K={depth_label(depth)} commit={args.commit} {mode}:{batch} {n} tokens "
                f"in {dt:.2f} s ({n / dt:.1f} tok/s, measured on this backend)")
    print_outputs([r.tokens for r in results], texts, tok)
    print(f"backend: {backend.label}  commit: {args.commit}  K: {depth_label(depth)}" + ("" if b == 1 else f"  users: {b}"))
    for i, r in enumerate(results):
        if b > 1:
            print(f"user {i}:")
        print(format_stats(r))
    c = MechanismCounters()
    for be in backends:
        c.add(be.counters)
    print(f"counters: state copies {c.state_copies}, state bytes moved {c.state_bytes_moved}, "
          f"GDN recurrence steps {c.recurrence_steps}, target forwards {c.target_forwards}, MTP forwards {c.mtp_forwards}")
    return 0
