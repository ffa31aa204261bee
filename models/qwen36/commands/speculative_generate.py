"""``qwen36 generate --spec-k K``: speculative generation with acceptance statistics."""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from ..errors import UserError
from ..speculative.engine import GenerationResult, MechanismCounters, speculative_generate
from .backends import REFERENCE_DEVICES


def load_backend(ckpt: Path, device: str, dtype, mechanism: str, max_len: int, depth=None, users: int = 1,
                 params=None, precision: str = "accuracy", per_user=None):
    """The speculative backend for --device: the torch reference, or the TT target + device MTP (the TT builders,
    ``tt.runtime.generator.build_generator`` and ``tt.spec.build.build_spec_backend``). ``depth``: the depth policy
    (an int K, or a controller: the TT backend allocates every depth it may pick; the reference sizes its verify for
    the largest). ``users``: the backend's slots (one packed verify per step for all users; on TT several users
    verify one fixed K). ``params``: the users' shared sampling parameters, seeds aside; ``per_user``: instead,
    every user's own params. ``precision``: the TT precision preset (`generate` passes the one its plain path
    uses, so that speculative and plain decoding run the same model)."""
    if device not in REFERENCE_DEVICES:
        from ..checkpoint import load_checkpoint
        from ..tt.runtime.generator import SPEC_PAGES, build_generator
        from ..tt.spec.build import build_spec_backend, check_spec_request
        from ..tt.spec.mtp_drafter import TTMTPDrafter

        check_spec_request(users, depth, per_user)  # before anything loads
        gen = build_generator(ckpt, device, precision=precision, require_mtp=True, max_len=max_len, pages=SPEC_PAGES)
        return build_spec_backend(gen, TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True)), users=users,
                                  depth=depth, mechanism=mechanism, params=params, per_user=per_user)
    import torch

    from ..reference.model import Qwen36Model
    from ..speculative.reference_backend import ReferenceBackend

    if device == "reference-cuda" and not torch.cuda.is_available():
        raise UserError("--device reference-cuda but torch sees no CUDA device; use --device reference")
    model = Qwen36Model.from_checkpoint(ckpt, dtype=dtype, device="cuda" if device == "reference-cuda" else "cpu",
                                        require_mtp=True)
    k_max = 8 if depth is None else depth if isinstance(depth, int) else depth.k_max
    return ReferenceBackend(model, mechanism, max_len=max_len, slots=users, max_k=k_max)


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


def depth_policy(spec_k, device: str, config=None):
    """--spec-k as the engine takes it: the integer, or the fitted depth controller for this device's step costs.

    On TT devices the controller's depths are capped by what the K+1-row verify holds (``tt.verify.max_spec_tiles``
    of the checkpoint's head_dim, read from ``config``)."""
    if spec_k != "auto":
        return spec_k
    from ..speculative.depth import DepthPolicy, cost_key

    k_max = None
    if not device.startswith("reference"):
        if config is None:
            raise ValueError("--spec-k auto on a TT device needs the model config (the verify bounds K by head_dim)")
        from ..tt.spec.verify import max_spec_tiles

        k_max = max_spec_tiles(config.head_dim) - 1
    return DepthPolicy.load().controller(cost_key(device), k_max=k_max)


def depth_label(depth) -> str:
    return str(depth) if isinstance(depth, int) else depth.describe()


def config_of(ckpt: Path):
    from ..config import Qwen36Config

    return Qwen36Config.from_file(ckpt)


def run_speculative_generate(args: argparse.Namespace, ckpt: Path, users, precision: str | None = None,
                             thinking=None) -> int:
    """Speculative generation of one or several users (several: one batched backend, every step one packed verify
    over all users, driven by ``speculative_generate``). ``users``: generate's ``UserRequests``, each user its own
    params and budget (without --prompts-file settings, the command line's with seed ``--seed`` + i).
    ``precision``: the TT preset `generate` resolved for its plain path too (None on the reference)."""
    from loguru import logger

    from ..checkpoint import CheckpointError
    from .common import print_logprobs, print_outputs, torch_dtype

    prompts, texts, tok, params = users.prompts, users.texts, users.tok, users.params
    b = len(prompts)
    first = params[0]
    # a B-slot TT backend holds one params (seeds aside) unless built with per-user stages
    shared = all(dataclasses.replace(p, seed=first.seed) == first for p in params)
    cfg_auto = config_of(ckpt) if args.spec_k == "auto" else None
    depths = [depth_policy(args.spec_k, args.device, config=cfg_auto) for _ in range(b)]  # a controller tracks one user
    depth = depths[0]
    k_max = depth if isinstance(depth, int) else depth.k_max
    max_len = max(map(len, prompts)) + max(users.max_tokens) + k_max + 2
    max_len += 0 if thinking is None else len(thinking.phrase)  # the forced phrase's rows
    try:
        kw = {} if precision is None else {"precision": precision}
        loaded = load_backend(ckpt, args.device, torch_dtype(args.dtype), args.commit, max_len, depth, users=b,
                              params=first, per_user=None if shared else params, **kw)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    backend = loaded
    vocab = backend_config(backend).vocab_size
    if any(i >= vocab for ids in prompts for i in ids):
        raise UserError(f"prompt ids outside the vocabulary (size {vocab})")
    t0 = time.perf_counter()
    results = speculative_generate(backend, prompts, users.max_tokens, depths, params,
                                   eos_ids=backend_config(backend).eos_token_id, thinking=thinking)
    dt = time.perf_counter() - t0
    mode = first.describe() + ("" if b == 1 else " (user i: seed + i)") if not users.per_user else (
        first.describe() if b == 1 else "per-user settings")
    n = sum(len(r.tokens) for r in results)
    batch = "" if b == 1 else f" batch {b}:"
    logger.info(f"[{backend.label}] speculative K={depth_label(depth)} commit={args.commit} {mode}:{batch} {n} tokens "
                f"in {dt:.2f} s ({n / dt:.1f} tok/s, measured on this backend)")
    print_outputs([r.tokens for r in results], texts, tok)
    if b == 1:
        print_logprobs(results[0].logprobs, tok)
    print(f"backend: {backend.label}  commit: {args.commit}  K: {depth_label(depth)}" + ("" if b == 1 else f"  users: {b}"))
    for i, r in enumerate(results):
        if b > 1:
            print(f"user {i}:")
            print_logprobs(r.logprobs, tok)
        print(format_stats(r))
    c = MechanismCounters()
    c.add(backend.counters)  # b > 1: the batch's (a packed forward counts once)
    print(f"counters: state copies {c.state_copies}, state bytes moved {c.state_bytes_moved}, "
          f"GDN recurrence steps {c.recurrence_steps}, target forwards {c.target_forwards}, MTP forwards {c.mtp_forwards}")
    return 0
