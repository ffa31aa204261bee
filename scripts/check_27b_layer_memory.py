"""Memory/feasibility check: the real 27B per-layer shapes (hidden 5120, MLP 17408, 24/4 attention heads of 256,
16/48 GDN heads of 128) for one GDN and one attention layer + the MTP head, random weights, written as an HF
checkpoint (bf16), loaded lazily through the normal loader and run forward on CPU. Prints peak RSS.

    python scripts/check_27b_layer_memory.py [--tokens 64] [--keep DIR]
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--keep", type=Path, default=None, help="write the checkpoint here and keep it")
    args = ap.parse_args()

    from qwen36.reference.model import Qwen36Model
    from qwen36.tiny import make_tiny

    out = args.keep or Path(tempfile.mkdtemp(prefix="qwen36-27b-layers-"))
    t0 = time.perf_counter()
    make_tiny(out, "27b-layers", seed=0, dtype=torch.bfloat16)
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**30
    t1 = time.perf_counter()
    print(f"checkpoint: {out} ({size:.2f} GiB, bf16) written in {t1 - t0:.1f} s; peak RSS so far {peak_rss_gib():.2f} GiB")
    model = Qwen36Model.from_checkpoint(out, dtype=torch.bfloat16, require_mtp=True)
    n_params = sum(p.numel() for p in model.parameters())
    t2 = time.perf_counter()
    print(f"loaded {n_params / 1e6:.0f} M parameters (bf16) in {t2 - t1:.1f} s; peak RSS {peak_rss_gib():.2f} GiB")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        state = model.new_state(1, args.tokens + args.decode_steps + 8)
        o = model(ids, state)
        tok = o.logits[:, -1:].argmax(-1)
        for _ in range(args.decode_steps):
            o = model(tok, state)
            tok = o.logits[:, -1:].argmax(-1)
        mtp = model.new_mtp_state(1, args.tokens + 8)
        model.mtp_forward(ids[:, 1:], o.hidden.expand(1, args.tokens - 1, -1), 0, mtp)
    t3 = time.perf_counter()
    ok = bool(torch.isfinite(o.logits).all())
    print(f"prefill {args.tokens} tokens + {args.decode_steps} decode steps + MTP pass in {t3 - t2:.1f} s; "
          f"finite logits: {ok}; peak RSS {peak_rss_gib():.2f} GiB (measured, torch CPU)")
    if args.keep is None:
        shutil.rmtree(out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
