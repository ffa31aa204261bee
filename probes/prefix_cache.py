"""Probe prefix-cache: replay a multi-turn conversation through the hybrid prefix cache; record hits, tokens saved and
the exactness checks; plus the modelled time-to-first-token saving at the 27B shapes.

Per turn (the same command on the reference, the emulated mesh and cards; the backend label comes from what ran):
the chat session (``qwen36.chat_session``: Qwen3.6 chat template, cache filled with each finished turn's history)
serves the turn warm; then the same prompt is served cold on the same backend (an empty cache of the same block
size). A cell passes when the warm tokens equal the cold ones, every logits row is bit-identical where the backend
returns rows (plain decoding), and the warm prefill computed at most the prompt's new tokens plus one block (new =
tokens after the longest common prefix with the history the previous turn left). Wall times are measured on the
backend that ran; on the emulator they are emulator times, not card times.

With ``--ttft-preset`` (e.g. ``27b``) the record also carries ``performance.ttft_modelled``: the time to first
token of a prompt of ``--ttft-prefix`` + 256 tokens served cold and warm (the prefix, a whole number of KV pages,
cached), **modelled (calibrated)** by ``probe prefill-cost``'s term (its real chunks counted on the emulated
mesh at that preset's shapes, priced by ``tt_ops/cost_model.py``'s calibrated constants) plus the warm request's
restore: device copies of the cached KV rows and one GDN checkpoint per layer, read and written at the calibrated
interleaved DRAM bandwidth. Device time only; the counting takes minutes at the 27B shapes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen36.errors import UserError
from qwen36.probes.records import ProbeReport

NAME = "prefix-cache"
HELP = "multi-turn chat through the hybrid prefix cache: hits, tokens saved, warm == cold exactness; modelled TTFT"
TURNS = ("def add(a, b):", "import os\nimport sys", "class Stack:\n    def __init__(self):",
         "for i in range(10):", "def main():\n    args = parse()", "with open(path) as f:", "try:\n    run()")
SYSTEM = "You write Python code."

def ttft_modelled(preset: str, prefix: int, new: int = 256, precision: str = "performance", seed: int = 0) -> dict:
    """Calibrated TTFT (ms, with bands) of ``prefix`` + ``new`` tokens cold and warm at ``preset``'s shapes, TP=2
    (module doc). The warm prefill starts at ``prefix``, which must be a KV page boundary (a TT prefill starts on
    one); each prefill runs in the model's chunks (prefill-cost counts every chunk size they need)."""
    from qwen36.probes.decode_cost import build_config
    from qwen36.probes.prefill_cost import default_chunk, figures, measure_units, rows_needed
    from qwen36.tt.model.model_config import TTModelArgs
    from qwen36.tt_ops.cost_model import CalibratedP150aModel

    cfg, base = build_config(preset, 4096)
    if base.is_moe:
        raise UserError(f"--ttft-preset {preset}: the MoE presets are priced by `qwen36 probe prefill-cost` alone")
    block = TTModelArgs.__dataclass_fields__["block_size"].default
    if prefix <= 0 or new <= 0 or prefix % block:
        raise UserError(f"--ttft-prefix {prefix} must be a positive multiple of the KV page ({block} tokens): the warm "
                        f"prefill starts there; new tokens {new} must be positive")
    rows = rows_needed(default_chunk(), block, [prefix + new], [(prefix + new, prefix)])
    unit = measure_units("emulated-p150x2", cfg, precision, seed, base.vocab_size, rows=rows)
    tp = unit["tp"]
    n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)
    cold = figures(unit, n_gdn, n_attn, prefix + new)
    warm = figures(unit, n_gdn, n_attn, new, start=prefix)
    kv_per_token = n_attn * base.num_key_value_heads * base.head_dim * 2 * 2  # K and V, bf16
    gdn_ckpt = n_gdn * (base.linear_num_value_heads * base.linear_key_head_dim * base.linear_value_head_dim * 4
                        + (base.linear_conv_kernel_dim - 1) * base.gdn_conv_dim * 2)  # fp32 recurrent + bf16 conv
    restore_bytes = 2 * (prefix * kv_per_token + gdn_ckpt) // tp  # read + write, per device
    restore = {key: restore_bytes / (CalibratedP150aModel(which).interleaved_gbps("bfloat16") * 1e9) * 1e3
               for which, key in (("value", "ms"), ("low", "ms_low"), ("high", "ms_high"))}
    out = {"label": cold["label"], "preset": preset, "precision": precision, "tp": tp, "backend": unit["backend"],
           "prefix_tokens": prefix, "new_tokens": new, "tokens_reused": prefix,
           "restore_bytes_per_device": restore_bytes,
           "cold_ms": {k: round(cold[k], 1) for k in ("ms", "ms_low", "ms_high")},
           "warm_ms": {k: round(warm[k] + restore[k], 1) for k in ("ms", "ms_low", "ms_high")},
           "restore_ms": {k: round(v, 4) for k, v in restore.items()}}
    out["speedup"] = round(cold["ms"] / out["warm_ms"]["ms"], 1)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--block", type=int, default=32, help="prefix-cache block (on TT a multiple of the 32-token page)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--spec-k", type=int, default=0, help="speculative decoding (reference, or TT with the device MTP)")
    p.add_argument("--commit", default="shadow_commit")
    p.add_argument("--thinking-budget", type=int, default=None)
    p.add_argument("--ttft-preset", default=None, choices=["27b", "ci"],
                   help="also model the calibrated TTFT cold vs warm at this preset's shapes (module doc; minutes at 27b)")
    p.add_argument("--ttft-prefix", type=int, default=16384, help="the shared prefix of the modelled TTFT (tokens)")


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> ProbeReport:
    import torch

    from qwen36.tokenizer import load_chat_tokenizer
    from qwen36.chat_session import ChatSession
    from qwen36.prefix_cache import PrefixCache

    t0 = time.perf_counter()
    if not 1 <= args.turns <= len(TURNS):
        raise ValueError(f"--turns must be in [1, {len(TURNS)}]")
    tok = load_chat_tokenizer(args.checkpoint)
    reference = args.device.startswith("reference")
    if reference:
        from qwen36.reference.model import Qwen36Model

        target = Qwen36Model.from_checkpoint(args.checkpoint, dtype=torch.float32, require_mtp=args.spec_k > 0)
        with_mtp = target.mtp is not None
        drafter = None
    else:
        from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator

        target = build_generator(args.checkpoint, args.device, precision="accuracy", max_seq_len=512, progress=False,
                                 pages=SMALL_PAGES, cache_dir=None)
        with_mtp, drafter = False, None
        if args.spec_k:
            from qwen36.checkpoint import load_checkpoint
            from qwen36.tt.speculative.mtp_drafter import TTMTPDrafter

            drafter = TTMTPDrafter(load_checkpoint(args.checkpoint, require_mtp=True))
    cache = PrefixCache(args.block, 1 << 34, with_mtp=with_mtp)
    session = ChatSession(target, tok, cache=cache, max_new_tokens=args.max_new_tokens,
                          thinking_budget=args.thinking_budget, spec_k=args.spec_k, mechanism=args.commit,
                          keep_logits=args.spec_k == 0, system=SYSTEM, drafter=drafter)
    cells, history = [], []
    try:
        for i, text in enumerate(TURNS[: args.turns], start=1):
            st = session.turn(text)
            prompt = session.last_prompt
            new = len(prompt) - _common(prompt, history)
            cold_tokens, cold_logits, cold_ttft = session.serve_cold(prompt)
            exact_tokens = cold_tokens == st.tokens
            if st.logits is not None and cold_logits is not None:
                exact_logits = len(st.logits) == len(cold_logits) and all(
                    torch.equal(a, b) for a, b in zip(st.logits, cold_logits))
                max_abs = max((float((a - b).abs().max()) for a, b in zip(st.logits, cold_logits)), default=0.0)
            else:
                exact_logits, max_abs = None, None  # the speculative path returns no logits rows
            bound = st.computed <= new + args.block
            phrase_ok = (args.thinking_budget is None or not args.thinking_budget or st.thinking_phrase_at is None
                         or st.thinking_phrase_at == args.thinking_budget)
            failed = [name for name, ok in (("tokens", exact_tokens), ("logits", exact_logits is not False),
                                            ("one_block", bound), ("thinking_phrase_at", phrase_ok)) if not ok]
            cells.append({"turn": i, "prompt_tokens": len(prompt), "new_tokens_in_prompt": new,
                          "reused": st.reused, "computed": st.computed, "history_filled_before": st.filled,
                          "generated": st.new_tokens, "thinking_phrase_at": st.thinking_phrase_at,
                          "exact_tokens": exact_tokens, "exact_logits": exact_logits, "logits_max_abs": max_abs,
                          "computed_within_new_plus_one_block": bound,
                          "ttft_warm_s_measured": round(st.ttft_s, 4), "ttft_cold_s_measured": round(cold_ttft, 4),
                          "pass": not failed, "failed": failed})
            history = session.last_history
    finally:
        if not reference:
            target.close()
    saved = sum(c["reused"] for c in cells)
    return ProbeReport(
        probe=NAME, backend=session.label,
        config={"checkpoint": str(args.checkpoint), "turns": args.turns, "block": args.block,
                "max_new_tokens": args.max_new_tokens, "spec_k": args.spec_k, "commit": args.commit,
                "thinking_budget": args.thinking_budget},
        cells=cells, counters={"cache": cache.stats.as_dict(), "cache_bytes": cache.bytes},
        gate_complete=args.turns >= 5,
        performance={"tokens_reused_total": saved,
                     "tokens_computed_total": sum(c["computed"] for c in cells),
                     **({"ttft_modelled": ttft_modelled(args.ttft_preset, args.ttft_prefix)}
                        if args.ttft_preset else {})},
        notes={"wall_s_measured": round(time.perf_counter() - t0, 2),
               "timing": f"ttft_*_s_measured: wall time on {session.label}"})
