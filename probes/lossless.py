"""Probe lossless: TT speculative greedy == TT plain greedy == reference greedy, token for token.

On the shipped checkpoint (models/qwen36/default_checkpoint, bf16 weights, TT accuracy preset unless --precision) by default; for
every K in --ks (gate: 1..7) and every commit mechanism, the TT speculative path (traced verify+accept,
traced commit + device MTP reseed/draft) must emit exactly the TT plain greedy tokens. Acceptance statistics per
cell are recorded (the MTP's real drafts).

TT plain greedy is held to the fp32 torch reference along TT's own path (the reference teacher-forced on the prompt
and TT's tokens): TT picks the reference's argmax at every row where the reference decides clearly (top-2 gap above
``CLEAR_GAP``), and every row's logits meet the preset's PCC gate. Where the reference's top-2 gap is below that,
bf16 arithmetic cannot order the two tokens (TT's logits sit ~0.1 from the reference's on the shipped checkpoint),
so a different pick there is recorded as a near tie, not judged. Whether the free-running reference emits the same
tokens is recorded too (``tokens_equal``).
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
# A reference top-2 gap above twice TT's largest logit error (accuracy preset, docs/tt_precision.md): a decision bf16
# arithmetic cannot reverse. The TT model tests use the same bound.
CLEAR_GAP = 0.25
DEFAULT_PROMPT = [5, 100, 7, 300, 12, 44, 901, 17, 3, 250]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT  # the shipped checkpoint, wherever we run from

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--ids", default=",".join(map(str, DEFAULT_PROMPT)), help="prompt token ids")
    p.add_argument("--precision", default="accuracy",
                   help="TT precision preset (accuracy | performance | performance-bf4); block-float presets err by more "
                        "than the clear-gap bound, so their 'TT plain greedy vs reference' cell can fail while "
                        "speculative == plain still must hold")


def plain_vs_reference(ref, prompt, plain, kept, precision: str) -> dict:
    """The "TT plain greedy vs reference" cell: ``plain`` (traced, device picks) and ``kept`` (the same decode with
    every logits row read back) must emit the same tokens; along that path the reference (teacher-forced) must not
    clearly prefer another token at any row, and every row's logits must meet the preset's PCC gate."""
    import torch

    from qwen36.numerics import pcc
    from qwen36.testing.pcc import PCC_GATES

    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(plain[:-1])])
        ref_rows = ref(ids, ref.new_state(1, ids.shape[1] + 1)).logits[0, len(prompt) - 1:].float()
    tt_rows = torch.stack([x.float() for x in kept.logits])
    top2 = ref_rows.topk(2, dim=-1)
    gaps = top2.values[:, 0] - top2.values[:, 1]
    picked = torch.tensor(plain)
    differ = picked != top2.indices[:, 0]
    clear = gaps > CLEAR_GAP
    pccs = [pcc(r, t) for r, t in zip(ref_rows, tt_rows)]
    gate = PCC_GATES["model_decode_bf16" if precision == "accuracy" else "model_decode_bf8"]
    same_paths = kept.tokens == plain
    ok = same_paths and not bool((differ & clear).any()) and min(pccs) >= gate
    cell = {"cell": "TT plain greedy vs reference", "pass": ok, "traced_equals_logits_readback": same_paths,
            "clear_rows": int(clear.sum()), "clear_rows_disagreeing": (differ & clear).nonzero().flatten().tolist(),
            "near_tie_rows_disagreeing": [{"row": int(i), "reference_gap": round(float(gaps[i]), 5),
                                           "tt": int(picked[i]), "reference": int(top2.indices[i, 0])}
                                          for i in (differ & ~clear).nonzero().flatten().tolist()],
            "logits_pcc_min": round(min(pccs), 6), "pcc_gate": gate,
            "logits_max_abs": round(float((ref_rows - tt_rows).abs().max()), 5),
            "logits_rel_l2": round(float((ref_rows - tt_rows).norm() / ref_rows.norm()), 6)}
    return cell


def run_matrix(gen, reader, ref, ref_tokens, prompt, ks, mechs, max_new, precision="accuracy") -> list[dict]:
    import torch

    from qwen36.speculative.engine import speculative_generate
    from qwen36.speculative.oracle import divergence_note
    from qwen36.generation.sampling import SamplingParams
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.build import build_spec_backend

    gen.use_trace = True
    plain = gen.generate([prompt], max_new)[0].tokens
    gen.release_trace()
    kept = gen.generate([prompt], max_new, SamplingParams(), keep_logits=True)[0]
    gen.release_trace()
    drafter = TTMTPDrafter(reader)

    def why(got, want) -> dict:
        """Where a failing cell first differs, with the reference's top-2 margin there (near tie or state bug)."""
        if got == want:
            return {}
        with torch.no_grad():
            return {"divergence": divergence_note(ref, prompt, got, want)}

    cells = [{**plain_vs_reference(ref, prompt, plain, kept, precision), "tokens_equal": plain == ref_tokens,
              **why(plain, ref_tokens)}]
    for k in ks:
        for m in mechs:
            be = build_spec_backend(gen, drafter, mechanism=m)
            r = speculative_generate(be, [prompt], max_new, [k])[0]
            be.close()
            ok = r.tokens == plain
            cells.append({"cell": f"K={k} {m}", "k": k, "mechanism": m, "tokens_equal_plain": ok,
                          "tokens_equal_reference": r.tokens == ref_tokens, "stats": r.stats.as_dict(),
                          "counters": be.counters.as_dict(), "pass": ok, **why(r.tokens, plain)})
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
        cells = run_matrix(gen, load_checkpoint(args.checkpoint, require_mtp=True), ref, ref_tokens, prompt, ks,
                           mechs, args.max_new_tokens, args.precision)
    finally:
        gen.close()
    return ProbeReport(probe=NAME, backend=gen.label,
                       config={"checkpoint": str(args.checkpoint), "ks": list(ks), "mechanisms": list(mechs),
                               "prompt": prompt, "max_new_tokens": args.max_new_tokens, "precision": args.precision},
                       cells=cells, gate_complete=set(ks) >= set(KS) and set(mechs) >= set(MECHANISMS),
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 2)})
