#!/usr/bin/env python3
"""Train the embedded default checkpoint: a small Qwen3.6-architecture model plus its MTP head.

Two stages (``all`` runs both):

    python scripts/train_tiny.py prepare --data DATA_DIR [--vocab-size 4096]
        corpus = the Python standard library sources of the running interpreter (sorted relative paths,
        fixed exclusion rules, SHA-256 of the list + contents recorded), deterministic held-out split by
        path hash, byte-level BPE tokenizer trained on the training split, token streams as uint16.
    python scripts/train_tiny.py train --data DATA_DIR --out CKPT_DIR [--steps N --device cuda ...]
        trains target + MTP jointly, logs JSON lines, writes an HF-format checkpoint (config.json,
        model.safetensors with mtp.*, tokenizer files) plus training_log.jsonl and train_summary.json.

Loss (per batch of windows x_0..x_{T+1}):
    L = CE(target logits_p, x_{p+1})
        + sum_d w_d [ (1 - a) CE(mtp_d logits_p, x_{p+2}) + a * CE(mtp_d logits_p, softmax(target logits_{p+1})) ]
The MTP input at depth 1 is (h_p, embed(x_{p+1})) with h_p the target's post-norm hidden state, NOT detached
(DeepSeek-V3 style: the MTP loss also shapes the trunk). Depth d > 1 reproduces the inference chain exactly:
row p feeds the MTP's own post-norm output of row p-1 at depth d-1 and attends to the depth-1 ("reseeded")
MTP KV entries at positions <= p-d+1 plus the chain's own entries (see ``mtp_chain_forward``). The second
term distils the target's (detached) next-token distribution into the MTP: acceptance measures agreement
with the target, not with the data.

Deterministic given --seed on CPU (bit-identical reruns); on CUDA the step sequence and data order are
identical but kernels (atomics in backward) are not bit-reproducible.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from qwen36.config import FULL, LINEAR, Qwen36Config  # noqa: E402
from qwen36.io_utils import atomic_write, atomic_write_json, atomic_write_text  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# model presets
# ----------------------------------------------------------------------------------------------------------
_L4 = (LINEAR, LINEAR, LINEAR, FULL)
PRESETS: dict[str, Qwen36Config] = {
    # ~10.8 M parameters (incl. MTP), ~21 MB in bf16: the shipped default
    "default": Qwen36Config(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, layer_types=_L4 * 2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False, mtp_num_hidden_layers=1),
    # seconds on CPU: the training smoke test
    "smoke": Qwen36Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=_L4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False, mtp_num_hidden_layers=1),
}

# ----------------------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------------------
# Directory names excluded anywhere in the relative path.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                 # generated, not written code: codec tables and the pydoc topic dump
                 "encodings", "pydoc_data"}
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")  # machine-specific build configuration
VAL_MODULUS = 20  # a file is held out iff int(sha256(path)[:8], 16) % 20 == 0 (about 5 %)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_corpus(root: Path, max_files: int | None = None) -> list[str]:
    """Sorted POSIX relative paths of the stdlib's own .py sources under the fixed rules above."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        parts = rel.parts
        if any(x in EXCLUDED_DIRS for x in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        if any(x.startswith(EXCLUDED_PREFIXES) for x in parts):
            continue
        if not p.is_file():
            continue
        out.append(rel.as_posix())
    out.sort()
    return out[:max_files] if max_files else out


def is_val(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % VAL_MODULUS == 0


def read_corpus(root: Path, rels: list[str]) -> tuple[list[str], str]:
    """Texts (UTF-8, undecodable bytes replaced) and the SHA-256 of (path, length, bytes) for every file."""
    h = hashlib.sha256()
    texts = []
    for rel in rels:
        data = (root / rel).read_bytes()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
        texts.append(data.decode("utf-8", errors="replace"))
    return texts, h.hexdigest()


def prepare(data_dir: Path, vocab_size: int = 4096, max_files: int | None = None, root: Path | None = None) -> dict:
    from qwen36.tokenizer import EOS_TOKEN, save_hf_tokenizer, train_bpe

    root = root or stdlib_root()
    rels = list_corpus(root, max_files)
    if not rels:
        raise SystemExit(f"error: no .py files found under {root}")
    texts, corpus_sha = read_corpus(root, rels)
    split = ["val" if is_val(r) else "train" for r in rels]
    if max_files and "val" not in split:  # tiny smoke corpora: hold out the last file
        split[-1] = "val"
    train_texts = [t for t, s in zip(texts, split) if s == "train"]
    t0 = time.perf_counter()
    tok = train_bpe(train_texts, vocab_size=vocab_size, min_frequency=2)
    tok_s = time.perf_counter() - t0
    data_dir.mkdir(parents=True, exist_ok=True)
    eos = save_hf_tokenizer(tok, data_dir)
    assert tok.token_to_id(EOS_TOKEN) == eos
    if tok.get_vocab_size() > 65535:
        raise SystemExit("error: vocabulary too large for uint16 token streams")
    enc = tok.encode_batch(texts)
    streams: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    docs: dict[str, list[list]] = {"train": [], "val": []}
    offsets = {"train": 0, "val": 0}
    for rel, s, e in zip(rels, split, enc):
        ids = np.asarray(e.ids + [eos], dtype=np.uint16)
        docs[s].append([rel, offsets[s], len(ids)])
        offsets[s] += len(ids)
        streams[s].append(ids)
    for s in ("train", "val"):
        arr = np.concatenate(streams[s]) if streams[s] else np.zeros(0, np.uint16)
        atomic_write(data_dir / f"{s}.u16", lambda tmp, a=arr: a.tofile(tmp))
    n_chars = {s: sum(len(t) for t, sp in zip(texts, split) if sp == s) for s in ("train", "val")}
    manifest = {
        "python": sys.version,
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "stdlib_root": str(root),
        "selection": {"glob": "**/*.py", "excluded_dirs": sorted(EXCLUDED_DIRS), "excluded_prefixes": list(EXCLUDED_PREFIXES),
                      "excluded_file_prefix": "test_", "val_rule": f"int(sha256(relpath)[:8],16) % {VAL_MODULUS} == 0",
                      "max_files": max_files},
        "n_files": len(rels),
        "n_files_split": {s: split.count(s) for s in ("train", "val")},
        "n_chars": n_chars,
        "n_tokens": offsets,
        "corpus_sha256": corpus_sha,
        "file_list_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(),
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(), "min_frequency": 2,
                      "eos_token": EOS_TOKEN, "eos_id": eos, "train_seconds": round(tok_s, 1),
                      "tokenizer_json_sha256": hashlib.sha256((data_dir / "tokenizer.json").read_bytes()).hexdigest()},
        "docs": docs,
    }
    atomic_write_json(data_dir / "manifest.json", manifest)
    return manifest


def load_data(data_dir: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    train = np.fromfile(data_dir / "train.u16", dtype=np.uint16)
    val = np.fromfile(data_dir / "val.u16", dtype=np.uint16)
    return manifest, train, val


def unigram_ce(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of the add-one-smoothed unigram distribution of the training split."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val.astype(np.int64)].mean())


# ----------------------------------------------------------------------------------------------------------
# model init and the training-time MTP chain
# ----------------------------------------------------------------------------------------------------------
def init_weights(model, cfg: Qwen36Config, seed: int) -> None:
    """GPT-style init: N(0, 0.02) matrices, residual-output projections scaled by 1/sqrt(2 * n_layers);
    GDN decay parameters Mamba2-style (A ~ U[1, 16], dt log-uniform in [1e-3, 1e-1])."""
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    out_std = std / math.sqrt(2 * (cfg.num_hidden_layers + 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                t = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif leaf == "norm" and "linear_attn" in name:
                t = torch.ones(p.shape)  # GDN gated norm: plain weight
            elif p.ndim == 1:
                t = torch.zeros(p.shape)  # zero-centred norms
            elif leaf == "conv1d":
                t = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            elif leaf in ("o_proj", "out_proj", "down_proj"):
                t = torch.randn(p.shape, generator=gen) * out_std
            else:
                t = torch.randn(p.shape, generator=gen) * std
            p.copy_(t.to(p.dtype))


def chain_mask(t: int, depth: int, device) -> torch.Tensor:
    """Allowed keys [T, depth*T] for depth-``depth`` rows. Key block 0 = depth-1 entries (keys at positions
    <= p - depth + 1: the reseeded entries the inference chain sees), block j >= 1 = depth-(j+1) entries
    (exactly position p - (depth - 1 - j): the chain's own earlier rows, and itself)."""
    p = torch.arange(t, device=device)[:, None]
    kp = torch.arange(t, device=device)[None, :]
    blocks = [kp <= p - depth + 1]
    for j in range(1, depth):
        blocks.append(kp == p - (depth - 1 - j))
    return torch.cat(blocks, dim=1)


def mtp_chain_forward(model, hidden: torch.Tensor, next_tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Teacher-forced MTP chain for every anchor at once.

    hidden [B, T, H]: the target's post-norm h_p; next_tokens [B, T]: x_{p+1}. Returns the MTP post-norm
    hidden of every depth, [B, T, H] each. Row p of depth d is the inference chain's row at position p for
    anchor a = p - d + 1 (valid iff p >= d - 1): depth 1 is mtp_forward over the verified rows; depth d > 1
    takes (own post-norm output of row p-1 at depth d-1, embed(x_{p+1})) -- the forced draft token -- and
    attends to depth-1 entries at positions <= a and to the chain's own entries at a+1..p.
    """
    from qwen36.reference.layers import apply_partial_rope, rope_cos_sin

    mtp = model.mtp
    layer = mtp.layers[0]
    attn = layer.self_attn
    b, t, _ = hidden.shape
    hq, hkv, d = attn.hq, attn.hkv, attn.d
    e = mtp.pre_fc_norm_embedding(model.embed_tokens(next_tokens))
    positions = torch.arange(t, device=hidden.device).expand(b, t)
    ks, vs, outs = [], [], []
    h_in = hidden
    for depth_i in range(1, depth + 1):
        if depth_i > 1:
            h_in = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # row p <- row p-1 of the previous depth
        u = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(h_in)], dim=-1))
        x = layer.input_layernorm(u)
        qg = attn.q_proj(x).view(b, t, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, hq * d)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(b, t, hkv, d)).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, hkv, d).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, attn.rotary_dim, attn.theta, q.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        ks.append(k)
        vs.append(v)
        kk = torch.cat(ks, dim=2).repeat_interleave(hq // hkv, dim=1)  # q head i reads kv head i // rep
        vv = torch.cat(vs, dim=2).repeat_interleave(hq // hkv, dim=1)
        mask = chain_mask(t, depth_i, hidden.device)
        o = F.scaled_dot_product_attention(q, kk.to(q.dtype), vv.to(q.dtype), attn_mask=mask)
        o = o.transpose(1, 2).reshape(b, t, hq * d)
        u = u + attn.o_proj(o * torch.sigmoid(gate))
        u = u + layer.mlp(layer.post_attention_layernorm(u))
        outs.append(mtp.norm(u))
    return outs


def compute_losses(model, window: torch.Tensor, depth: int, weights: list[float], distill: float) -> tuple[torch.Tensor, dict]:
    """window [B, T+2]. Returns (total loss, metrics dict of detached floats/tensors)."""
    x = window[:, :-2]
    tgt = window[:, 1:-1]
    tgt2 = window[:, 2:]
    out = model(x)
    v = out.logits.shape[-1]
    main = F.cross_entropy(out.logits.reshape(-1, v), tgt.reshape(-1))
    total = main
    metrics = {"main_ce": main.detach()}
    hs = mtp_chain_forward(model, out.hidden, tgt, depth)
    t = x.shape[1]
    target_next = out.logits[:, 1:].detach()  # target's distribution for x_{p+2} (rows p = 0..T-2)
    target_argmax = target_next.argmax(-1)
    for di, (h, w) in enumerate(zip(hs, weights), start=1):
        lg = model.logits(h)
        valid = slice(di - 1, t)
        ce = F.cross_entropy(lg[:, valid].reshape(-1, v), tgt2[:, valid].reshape(-1))
        vd = slice(di - 1, t - 1)
        soft = F.softmax(target_next[:, di - 1:].float(), dim=-1)
        kd = F.cross_entropy(lg[:, vd].reshape(-1, v), soft.reshape(-1, v))
        total = total + w * ((1 - distill) * ce + distill * kd)
        agree = (lg[:, vd].detach().argmax(-1) == target_argmax[:, di - 1:]).float().mean()
        metrics[f"mtp{di}_ce"] = ce.detach()
        metrics[f"mtp{di}_distill"] = kd.detach()
        metrics[f"mtp{di}_agree"] = agree
    metrics["loss"] = total.detach()
    return total, metrics


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------
def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(length)]


def val_windows(stream: torch.Tensor, length: int, max_windows: int) -> torch.Tensor:
    n = min(max_windows, stream.numel() // length)
    return stream[: n * length].view(n, length)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, depth: int, weights, distill, batch: int, device, autocast) -> dict:
    model.eval()
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with autocast():
            _, m = compute_losses(model, w, depth, weights, distill)
        for k, val in m.items():
            sums[k] = sums.get(k, 0.0) + float(val) * w.shape[0]
        n += w.shape[0]
    model.train()
    return {k: v / max(n, 1) for k, v in sums.items()}


def lr_at(step: int, steps: int, lr: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    prog = (step - warmup) / max(1, steps - warmup)
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def export_weights(model) -> dict[str, torch.Tensor]:
    """Canonical-name tensors as stored: matrices bf16 (size), 1-D parameters fp32 (decays, norms)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        out[k] = (v.float() if v.ndim == 1 else v.to(torch.bfloat16)).contiguous()
    return out


def save_checkpoint(model, cfg: Qwen36Config, data_dir: Path, out_dir: Path) -> Path:
    import shutil

    from qwen36.tiny import write_checkpoint

    out_dir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out_dir, cfg, export_weights(model), tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data_dir / f, out_dir / f)
    return out_dir


def train(args) -> dict:
    prev_det = torch.are_deterministic_algorithms_enabled()
    try:
        return _train(args)
    finally:
        torch.use_deterministic_algorithms(prev_det)


def _train(args) -> dict:
    data_dir = Path(args.data)
    manifest, train_np, val_np = load_data(data_dir)
    vocab_tok = manifest["tokenizer"]["vocab_size"]
    eos = manifest["tokenizer"]["eos_id"]
    cfg = PRESETS[args.preset]
    if vocab_tok > cfg.vocab_size:
        raise SystemExit(f"error: tokenizer vocab {vocab_tok} exceeds preset vocab_size {cfg.vocab_size}")
    cfg = replace(cfg, eos_token_id=(eos,), pad_token_id=eos)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.use_deterministic_algorithms(True)
    from qwen36.reference.model import Qwen36Model

    model = Qwen36Model(cfg, with_mtp=True)
    init_weights(model, cfg, args.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    use_bf16 = args.precision == "bf16"

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16)

    weights = [float(x) for x in args.mtp_weights.split(",")]
    depth = len(weights)
    length = args.seq + 2
    train_t = torch.from_numpy(train_np.astype(np.int64))
    val_w = val_windows(torch.from_numpy(val_np.astype(np.int64)), length, args.val_windows)
    gen = torch.Generator().manual_seed(args.seed + 1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "training_log.jsonl"
    log_lines: list[str] = []

    def log(rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True)
        log_lines.append(line)
        print(line, flush=True)

    unigram = unigram_ce(train_np, val_np, cfg.vocab_size)
    log({"event": "start", "n_params": n_params, "n_params_mtp": n_mtp, "device": str(device),
         "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
         "torch": torch.__version__, "train_tokens": int(train_np.size), "val_tokens": int(val_np.size),
         "val_windows": int(val_w.shape[0]), "unigram_val_ce": unigram, "args": vars(args)})
    best = {"val_main_ce": float("inf")}
    best_state = None
    t0 = time.perf_counter()
    step = 0
    tokens = 0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        w = sample_windows(train_t, args.batch, length, gen).to(device, non_blocking=True)
        with autocast():
            loss, m = compute_losses(model, w, depth, weights, args.distill)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        tokens += args.batch * args.seq
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            rec = {"event": "train", "step": step, "lr": lr, "tokens": tokens, "grad_norm": float(gnorm),
                   "elapsed_s": round(time.perf_counter() - t0, 2)}
            rec.update({k: round(float(v), 5) for k, v in m.items()})
            if not math.isfinite(rec["loss"]):
                log({"event": "abort", "reason": "non-finite loss", "step": step})
                raise SystemExit("error: non-finite loss")
            log(rec)
        timed_out = args.max_minutes and (time.perf_counter() - t0) > 60 * args.max_minutes
        if (step + 1) % args.eval_every == 0 or last or timed_out:
            ev = evaluate(model, val_w, depth, weights, args.distill, args.batch, device, autocast)
            rec = {"event": "eval", "step": step, "tokens": tokens, "elapsed_s": round(time.perf_counter() - t0, 2)}
            rec.update({f"val_{k}": round(v, 5) for k, v in ev.items()})
            log(rec)
            if ev["main_ce"] < best["val_main_ce"]:
                best = {"val_main_ce": ev["main_ce"], "step": step, **{f"val_{k}": v for k, v in ev.items()}}
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if timed_out:
            log({"event": "stop", "reason": f"--max-minutes {args.max_minutes} reached", "step": step})
            break
    train_s = time.perf_counter() - t0
    if args.keep == "best" and best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    save_checkpoint(model, cfg, data_dir, out_dir)
    summary = {
        "n_params": n_params, "n_params_mtp": n_mtp, "steps_run": step + 1, "tokens_seen": tokens,
        "epochs": tokens / max(1, train_np.size), "train_seconds": round(train_s, 1), "kept": args.keep,
        "best": best, "unigram_val_ce": unigram, "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": sys.version, "args": vars(args),
        "corpus": {k: v for k, v in manifest.items() if k != "docs"},
        "command": "python " + " ".join(sys.argv),
    }
    atomic_write_text(log_path, "\n".join(log_lines) + "\n")
    atomic_write_json(out_dir / "train_summary.json", summary)
    return summary


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------
def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="checkpoint output directory")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-weights", default="0.5,0.3,0.2", help="MTP loss weight per chain depth (its length = depth)")
    p.add_argument("--distill", type=float, default=0.5, help="fraction of the MTP loss that distils the target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--keep", default="best", choices=["best", "last"], help="save the best-val or the last weights")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop early after this wall time (0 = off)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="corpus + tokenizer + token streams")
    pp.add_argument("--data", required=True)
    pp.add_argument("--vocab-size", type=int, default=4096)
    pp.add_argument("--max-files", type=int, default=None, help="first N files only (smoke tests)")
    pt = sub.add_parser("train", help="train from a prepared data directory")
    pt.add_argument("--data", required=True)
    add_train_args(pt)
    pa = sub.add_parser("all", help="prepare then train")
    pa.add_argument("--data", required=True)
    pa.add_argument("--vocab-size", type=int, default=4096)
    pa.add_argument("--max-files", type=int, default=None)
    add_train_args(pa)
    args = ap.parse_args(argv)
    if args.cmd in ("prepare", "all"):
        man = prepare(Path(args.data), args.vocab_size, args.max_files)
        print(json.dumps({k: v for k, v in man.items() if k != "docs"}, indent=1))
    if args.cmd in ("train", "all"):
        if args.precision is None:
            args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
        summary = train(args)
        print(json.dumps({k: v for k, v in summary.items() if k not in ("corpus", "args")}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
