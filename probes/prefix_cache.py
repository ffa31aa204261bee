"""Probe prefix-cache: replay a multi-turn conversation through the hybrid prefix cache; record hits, tokens saved and
the exactness checks; plus the modelled time-to-first-token saving at the 27B shapes.

Per turn (the same command on the reference, the emulated mesh and cards; the backend label comes from what ran):
the chat session (``qwen36.chat_session``: Qwen3.6 chat template, cache filled with each finished turn's history)
serves the turn warm; then the same prompt is served cold on the same backend (an empty cache of the same block
size). A cell passes when the warm tokens equal the cold ones, every logits row is bit-identical where the backend
returns rows (plain decoding), and the warm prefill computed at most the prompt's new tokens plus one block (new =
tokens after the longest common prefix with the history the previous turn left). Wall times are measured on the
backend that ran; on the emulator they are emulator times, not card times.

The 27B figure (``performance.ttft_27b_modelled``) is an analytic roofline, not a measurement and not calibrated
against cards: per prefill chunk of ``CHUNK`` rows the time is the larger of (weights + KV read) / the effective DRAM
bandwidth of ``tt_ops/cost_model.py`` and the chunk's matmul + attention FLOPs / the public BF16 peak, plus the cost
model's dispatch per program; both cards split the work (TP=2). Cold prefills the whole prompt, warm restores the
cached blocks (a device copy of their KV and one GDN checkpoint) and prefills the rest.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from qwen36.probes.records import ProbeReport

NAME = "prefix-cache"
HELP = "multi-turn chat through the hybrid prefix cache: hits, tokens saved, warm == cold exactness; modelled 27B TTFT"
TURNS = ("def add(a, b):", "import os\nimport sys", "class Stack:\n    def __init__(self):",
         "for i in range(10):", "def main():\n    args = parse()", "with open(path) as f:", "try:\n    run()")
SYSTEM = "You write Python code."

# --- the 27B TTFT roofline (module doc) -------------------------------------------------------------------
CHUNK = 256  # TTModelArgs.prefill_chunk default
BF16_PEAK_TFLOPS = 332.0  # P150a BF16 dense peak, public (Tenstorrent, after the 120-core firmware); not measured
PREFILL_PROGRAMS_PER_CHUNK = 2267  # the 27B decode step's program count (decode-cost record, B = 1): a prefill
                                   # chunk runs the same layer ops; the count is an assumption, not a count


def model_flops_per_token(cfg, context: int) -> float:
    """Matmul FLOPs of one token at the 27B shapes (2 per multiply-add) plus attention scores over ``context``
    keys and the GDN recurrence (chunked form, ~4 Dk Dv per head per token)."""
    h, c = cfg.hidden_size, cfg
    gdn = h * (c.gdn_conv_dim + c.linear_num_value_heads * c.linear_value_head_dim + 2 * c.linear_num_value_heads) \
        + c.linear_num_value_heads * c.linear_value_head_dim * h
    attn = h * (2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim) \
        + c.num_attention_heads * c.head_dim * h
    mlp = 3 * h * c.intermediate_size
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = c.num_hidden_layers - n_attn
    matmul = 2 * (n_gdn * gdn + n_attn * attn + c.num_hidden_layers * mlp)
    scores = n_attn * 4 * context * c.num_attention_heads * c.head_dim
    recur = n_gdn * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return matmul + scores + recur


def ttft_27b_modelled(prefix: int = 16384, new: int = 256, block: int = 64) -> dict:
    """Modelled TTFT (ms) of a prompt of ``prefix`` + ``new`` tokens, cold vs warm (prefix cached up to its last
    whole block)."""
    from qwen36.probes.decode_cost import qwen36_27b_config
    from qwen36.tt_ops.cost_model import P150aCostModel

    cfg, cm, tp = qwen36_27b_config(), P150aCostModel(), 2
    weight_bytes_dev = 13.63e9  # per device per forward at the performance preset (decode-cost record, B = 1)
    kv_per_token = sum(t == "full_attention" for t in cfg.layer_types) * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    gdn_ckpt = (cfg.num_hidden_layers - cfg.num_hidden_layers // 4) * (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        + (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * 2)

    def prefill_ms(start: int, end: int) -> tuple[float, dict]:
        total, parts = 0.0, {"bandwidth_ms": 0.0, "compute_ms": 0.0, "dispatch_ms": 0.0}
        for s in range(start, end, CHUNK):
            rows = min(CHUNK, end - s)
            ctx = s + rows / 2
            bw = (weight_bytes_dev + (s + rows) * kv_per_token / tp) / (cm.dram_bw_gbps * 1e9) * 1e3
            fl = rows * model_flops_per_token(cfg, int(ctx)) / tp / (BF16_PEAK_TFLOPS * 1e12) * 1e3
            dp = PREFILL_PROGRAMS_PER_CHUNK * cm.dispatch_us_per_program / 1e3
            total += max(bw, fl) + dp
            parts["bandwidth_ms"] += bw
            parts["compute_ms"] += fl
            parts["dispatch_ms"] += dp
        return total, parts

    n = prefix + new
    hit = (min(prefix, n - 1)) // block * block
    cold, cold_parts = prefill_ms(0, n)
    # warm: restore = read + write the cached KV rows and one GDN checkpoint (device copies), then the rest
    restore = 2 * (hit * kv_per_token + gdn_ckpt) / tp / (cm.dram_bw_gbps * 1e9) * 1e3
    # a warm prefill's pieces start on block boundaries: the tail after the hit
    warm_rest, warm_parts = prefill_ms(hit, n)
    warm = restore + warm_rest
    return {"label": "modelled (analytic roofline; not calibrated: no card measurement)", "prefix_tokens": prefix,
            "new_tokens": new, "block": block, "tokens_reused": hit, "cold_ms": round(cold, 1),
            "warm_ms": round(warm, 1), "saving_ms": round(cold - warm, 1), "speedup": round(cold / warm, 1),
            "restore_ms": round(restore, 2), "cold_parts_ms": {k: round(v, 1) for k, v in cold_parts.items()},
            "warm_parts_ms": {k: round(v, 1) for k, v in warm_parts.items()},
            "assumptions": {"dram_gbps_effective": cm.dram_bw_gbps, "bf16_peak_tflops": BF16_PEAK_TFLOPS,
                            "weight_bytes_per_device": weight_bytes_dev, "chunk": CHUNK,
                            "programs_per_chunk": PREFILL_PROGRAMS_PER_CHUNK,
                            "dispatch_us_per_program": cm.dispatch_us_per_program, "tp": tp}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from qwen36 import DEFAULT_CHECKPOINT

    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--block", type=int, default=32, help="prefix-cache block (on TT a multiple of the 32-token page)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--spec-k", type=int, default=0, help="speculative decoding (reference, or TT with the device MTP)")
    p.add_argument("--commit", default="shadow_commit")
    p.add_argument("--thinking-budget", type=int, default=None)
    p.add_argument("--prefix-27b", type=int, default=16384, help="shared prefix of the modelled 27B TTFT")


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
        from qwen36.tt.runtime.generator import TTGenerator

        target = TTGenerator.from_checkpoint(args.checkpoint, args.device, precision="accuracy", max_seq_len=512,
                                             progress=False, block_size=32, prefill_chunk=64)
        with_mtp, drafter = False, None
        if args.spec_k:
            from qwen36.checkpoint import load_checkpoint
            from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

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
                     "ttft_27b_modelled": ttft_27b_modelled(args.prefix_27b, 256, 64)},
        notes={"wall_s_measured": round(time.perf_counter() - t0, 2),
               "timing": f"ttft_*_s_measured: wall time on {session.label}"})
