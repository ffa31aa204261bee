"""Probe precision-gate: the end-to-end gate for a weight-precision change, on a trained checkpoint.

A precision preset (``--candidate``, default ``performance-bf4``) is compared with the shipped default
(``--baseline``, ``performance``) on next-token distributions of held-out text: teacher-forced logits of the
embedded default checkpoint (trained weights: real statistics, peaked next-token distributions) over the 256-token
held-out windows of ``heldout_eval.json`` (``--windows`` of them, 8 = 2,048 positions), each window a fresh TT
prefill, against the fp32 reference on the same bf16 weights. Per preset: PCC, rel L2 and max abs of the logits,
top-1 agreement with the reference's argmax, and the symmetric KL of the softmax distributions (what sampling
draws from): mean, p99 and max over positions.

The gate (both must hold; thresholds fixed before the first run, relative to what the shipped default already
costs, because the project has no absolute accuracy target for the 27B):

* top-1: the candidate's agreement with the reference at most ``TOP1_DROP_MAX`` (3 points) below the baseline's.
  Tenstorrent's own figure for this change: tt-metal models/tt_transformers/PERF.md measures Llama-3.2-1B on N300
  with only FF1/FF3 moved from bfp8 to bfp4 (FF2 bfp8): top-1 91 -> 88 %, the mix it ships as performance mode.
* symmetric KL: the candidate's mean at most ``KL_RATIO_MAX`` (2x) the baseline's: the candidate may cost as much
  distribution error again as the default already does, not more.

A small trained model is not the 27B: 8 layers stack less per-layer error than 64 (docs/tt_precision.md), so a pass
here is necessary, not sufficient, and the per-layer gate (``PCC_GATES['layer_bf8']``) is reported beside it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen36.probes.records import ProbeReport

NAME = "precision-gate"
HELP = ("end-to-end gate of a precision preset vs the default: top-1 agreement and symmetric KL of teacher-forced "
        "next-token distributions on the trained checkpoint's held-out text (>= 2,000 positions)")
TOP1_DROP_MAX = 0.03
KL_RATIO_MAX = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--candidate", default="performance-bf4", help="precision preset under test")
    p.add_argument("--baseline", default="performance", help="precision preset it must not fall behind")
    p.add_argument("--windows", type=int, default=8, help="held-out 256-token windows (8 = 2,048 positions)")


def symmetric_kl(a_logits, b_logits):
    """Per-row KL(p||q) + KL(q||p) of the softmax distributions, in fp64 (nats)."""
    import torch

    la = torch.log_softmax(a_logits.double(), dim=-1)
    lb = torch.log_softmax(b_logits.double(), dim=-1)
    return ((la.exp() - lb.exp()) * (la - lb)).sum(-1)


def compare(exp, got) -> dict:
    """Logit and distribution figures of ``got`` against ``exp`` ([N, V] each)."""
    import torch

    from qwen36.numerics import pcc

    d = (exp.double() - got.double())
    kl = symmetric_kl(exp, got)
    return {"pcc": pcc(exp, got), "rel_l2": float(d.norm() / exp.double().norm()), "max_abs": float(d.abs().max()),
            "top1_agreement": float((exp.argmax(-1) == got.argmax(-1)).double().mean()),
            "sym_kl_mean": float(kl.mean()), "sym_kl_p99": float(torch.quantile(kl, 0.99)),
            "sym_kl_max": float(kl.max()), "positions": int(exp.shape[0])}


def gate(cand: dict, base: dict) -> dict:
    drop = base["top1_agreement"] - cand["top1_agreement"]
    ratio = cand["sym_kl_mean"] / base["sym_kl_mean"] if base["sym_kl_mean"] > 0 else float("inf")
    return {"top1_drop": drop, "top1_drop_max": TOP1_DROP_MAX, "top1_ok": drop <= TOP1_DROP_MAX,
            "sym_kl_ratio": ratio, "sym_kl_ratio_max": KL_RATIO_MAX, "sym_kl_ok": ratio <= KL_RATIO_MAX}


def teacher_forced(ckpt, device: str, precision: str, windows):
    """([N, V] fp32 logits of every window's fresh prefill, backend label)."""
    import torch

    from qwen36.tt.runtime.generator import TTGenerator

    gen = TTGenerator.from_checkpoint(ckpt, device, precision=precision, max_seq_len=256, use_trace=False,
                                      progress=False)
    try:
        return torch.cat([gen.teacher_forced_logits(torch.tensor(w)) for w in windows]), gen.label
    finally:
        gen.close()


def run(args: argparse.Namespace) -> ProbeReport:
    import json

    import torch

    from qwen36.reference.model import Qwen36Model

    t0 = time.perf_counter()
    held = json.loads((args.checkpoint / "heldout_eval.json").read_text())
    windows = held["loss_windows"][: args.windows]
    if len(windows) < args.windows:
        raise ValueError(f"{args.checkpoint}/heldout_eval.json has {len(windows)} windows, asked for {args.windows}")
    ref = Qwen36Model.from_checkpoint(args.checkpoint, dtype=torch.float32, with_mtp=False)
    with torch.no_grad():
        exp = torch.cat([ref(torch.tensor([w]), ref.new_state(1, len(w) + 1)).logits[0] for w in windows])
    got, label, wall = {}, None, {}
    for preset in (args.baseline, args.candidate):
        t = time.perf_counter()
        got[preset], label = teacher_forced(args.checkpoint, args.device, preset, windows)
        wall[preset] = round(time.perf_counter() - t, 1)
    base, cand = compare(exp, got[args.baseline]), compare(exp, got[args.candidate])
    g = gate(cand, base)
    between = compare(got[args.baseline], got[args.candidate])
    cells = [{"cell": f"{args.baseline} vs fp32 reference", **base, "pass": True},
             {"cell": f"{args.candidate} vs fp32 reference", **cand, **g, "pass": g["top1_ok"] and g["sym_kl_ok"]},
             {"cell": f"{args.candidate} vs {args.baseline}", **between, "pass": True}]
    return ProbeReport(probe=NAME, backend=label,
                       config={"checkpoint": str(args.checkpoint), "candidate": args.candidate,
                               "baseline": args.baseline, "windows": len(windows),
                               "positions": sum(len(w) for w in windows)},
                       cells=cells, gate_complete=sum(len(w) for w in windows) >= 2000,
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 1), "tt_wall_s": wall})
