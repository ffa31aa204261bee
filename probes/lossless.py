"""Probe lossless: TT speculative greedy == TT plain greedy == reference greedy, token for token.

On the shipped checkpoint (models/qwen36/default_checkpoint, bf16 weights, TT accuracy preset unless --precision) by default; for
every K in --ks (gate: 1..7) and every commit mechanism, the TT speculative path (traced verify+accept,
traced commit + device MTP reseed/draft) must emit exactly the TT plain greedy tokens, which must equal the
torch reference's greedy tokens. Acceptance statistics per cell are recorded (the MTP's real drafts).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen36.probes.records import ProbeReport
from qwen36.speculative.mechanisms import MECHANISMS

NAME = "lossless"
HELP = "TT speculative greedy == TT plain greedy == reference greedy (K x mechanisms, shipped checkpoint)"
KS = (1, 2, 3, 4, 5, 6, 7)
DEFAULT_PROMPT = [5, 100, 7, 300, 12, 44, 901, 17, 3, 250]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT  # the shipped checkpoint, wherever we run from

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--ids", default=",".join(map(str, DEFAULT_PROMPT)), help="prompt token ids")
    p.add_argument("--precision", default="accuracy",
                   help="TT precision preset (accuracy | performance | performance-bf4); block-float presets may flip "
                        "the reference's near ties, so their 'TT plain greedy vs reference' cell can fail while "
                        "speculative == plain still must hold")


def run_matrix(gen, reader, ref_tokens, prompt, ks, mechs, max_new) -> list[dict]:
    import torch

    from qwen36.reference.model import Qwen36Model
    from qwen36.speculative.engine import speculative_generate
    from qwen36.speculative.oracle import divergence_note
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.build import build_spec_backend

    gen.use_trace = True
    plain = gen.generate([prompt], max_new)[0].tokens
    gen.release_trace()
    drafter = TTMTPDrafter(reader)
    def why(got, want) -> dict:
        """Where a failing cell first differs, with the reference's top-2 margin there (near tie or state bug); the
        reference model is loaded only when a cell fails."""
        if got == want or gen.ckpt is None:
            return {}
        ref = Qwen36Model.from_checkpoint(gen.ckpt, dtype=torch.float32, with_mtp=False)
        return {"divergence": divergence_note(ref, prompt, got, want)}

    cells = [{"cell": "TT plain greedy vs reference", "tokens_equal": plain == ref_tokens, "pass": plain == ref_tokens,
              **why(plain, ref_tokens)}]
    for k in ks:
        for m in mechs:
            be = build_spec_backend(gen, drafter, mechanism=m)
            r = speculative_generate(be, [prompt], max_new, [k])[0]
            be.close()
            ok = r.tokens == plain
            cells.append({"cell": f"K={k} {m}", "k": k, "mechanism": m, "tokens_equal_plain": ok,
                          "tokens_equal_reference": r.tokens == ref_tokens, "stats": r.stats.as_dict(),
                          "counters": be.counters.as_dict(), "pass": ok and r.tokens == ref_tokens,
                          **why(r.tokens, plain if not ok else ref_tokens)})
    return cells


def run(args: argparse.Namespace) -> ProbeReport:
    import torch

    from qwen36.checkpoint import load_checkpoint
    from qwen36.reference.model import Qwen36Model
    from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator

    t0 = time.perf_counter()
    ks = tuple(int(x) for x in args.ks.split(","))
    mechs = tuple(args.mechanisms.split(","))
    prompt = [int(x) for x in args.ids.split(",")]
    ref = Qwen36Model.from_checkpoint(args.checkpoint, dtype=torch.float32, with_mtp=False)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        st = ref.new_state(1, len(prompt) + args.max_new_tokens + 2)
        out = ref(ids, st)
        ref_tokens = [int(out.logits[0, -1].argmax())]
        while len(ref_tokens) < args.max_new_tokens:
            out = ref(torch.tensor([[ref_tokens[-1]]]), st)
            ref_tokens.append(int(out.logits[0, -1].argmax()))
    gen = build_generator(args.checkpoint, args.device, precision=args.precision, max_seq_len=256,
                                      progress=False, pages=SMALL_PAGES, cache_dir=None, require_mtp=True)
    try:
        cells = run_matrix(gen, load_checkpoint(args.checkpoint, require_mtp=True), ref_tokens, prompt, ks, mechs,
                           args.max_new_tokens)
    finally:
        gen.close()
    return ProbeReport(probe=NAME, backend=gen.label,
                       config={"checkpoint": str(args.checkpoint), "ks": list(ks), "mechanisms": list(mechs),
                               "prompt": prompt, "max_new_tokens": args.max_new_tokens, "precision": args.precision},
                       cells=cells, gate_complete=set(ks) >= set(KS) and set(mechs) >= set(MECHANISMS),
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 2)})
