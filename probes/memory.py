"""Probe memory: the per-card DRAM plan of the TT model on P150a x2 (TP=2) at a batch and context, and the largest
context that fits each batch.

What is counted (per device, the bytes of the tensors the TT code allocates, as the emulator sizes them: tile-accurate
block-float bytes, padded shards; nothing here is measured on cards):

* weights: the first GDN and the first attention layer built at the real shapes by the real loader (the same bench as
  decode-cost), times the layer counts; embedding and LM head built at ``--vocab-sample`` columns and scaled to the
  real vocabulary; the RoPE tables scaled to ``--max-len`` positions; MoE: the expert stack scaled from the built
  experts to the real count (every expert is resident);
* the MTP head (its fc, norms and decoder layer; embedding and LM head are the target's);
* KV: every attention layer plus the MTP layer's, whole pages of ``block_size`` tokens up to ``--max-len`` per user;
* GDN: the recurrent (fp32) and conv state of every GDN layer, one slot per user;
* the trace region the generator reserves (``tt/runtime/generator.py`` ``DEFAULT_TRACE_REGION``).

L1 per core: one eager decode step of the built layers (embedding, first GDN, first attention layer, head) runs on the
emulated mesh, and the most L1 a core's bank held for buffers during it is reported next to the bank size (the
emulator's L1 accounting, tt_ops/emulator/l1.py: buffers only, not the circular buffers ops create while they run).
Layers run one after another, so the step's peak is that of the whole model's step when no L1 buffer outlives its
layer.

Capacity: 32 GB of GDDR6 per Blackhole card (docs.tenstorrent.com, tt-system-firmware, "Tenstorrent Blackhole PCI
Express Cards": "32 GB of on-board GDDR6 memory"), taken as 32 GiB; what firmware and tt-metal reserve of it is not
known here, so the headroom is an upper bound. Activations, program binaries and the host-visible command queues are
not counted.
"""
from __future__ import annotations

import argparse


from qwen36.errors import UserError
from qwen36.probes.records import ProbeReport

NAME = "memory"
HELP = "per-card DRAM plan (weights, KV, GDN state, MTP, trace, headroom) and the largest context per batch on P150a"
CARD_BYTES = 32 * 1024 ** 3
GIB = 1024 ** 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "35b-a3b", "ci", "moe-ci"])
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--batch", default="1,8,32", help="users (slots), comma-separated")
    p.add_argument("--max-len", default="4096,16384,32768", help="tokens per user, comma-separated")
    p.add_argument("--vocab-sample", type=int, default=4096, help="vocabulary built (embedding / LM head scaled)")
    p.add_argument("--seed", type=int, default=0)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--{what}: comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise UserError(f"--{what}: positive integers, got {text!r}")
    return vals


def measure(device: str, cfg, base, precision: str, seed: int = 0) -> dict:
    """Per-device bytes of each allocation kind, per unit (layer, token, slot) and fixed."""
    from qwen36.probes.decode_cost import BUILT_EXPERTS, tensor_bytes, build_bench
    from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
    from qwen36.tt.model.weights import WeightLoader, load_mtp_weights

    from qwen36.probes.decode_cost import RandomCheckpoint

    ctx_len = 128
    bench = build_bench(device, cfg, precision, ctx_len, seed, probe=NAME, slots=1)
    try:
        w, st, a = bench.weights, bench.state, bench.args
        vocab_ratio = base.vocab_size / cfg.vocab_size
        expert_ratio = (base.num_experts / cfg.num_experts) if cfg.is_moe else 1.0

        def layer_bytes(lw) -> int:
            total = tensor_bytes(lw)
            if cfg.is_moe:  # every expert is resident: the built stack scaled to the real count
                m = lw.mlp
                stack = m.experts_gate_up.bytes_per_device() + m.experts_down.bytes_per_device()
                total += int(stack * (expert_ratio - 1)) + int(m.router.bytes_per_device() * (expert_ratio - 1))
            return total

        n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)
        rope = w.rope_cos.bytes_per_device() + w.rope_sin.bytes_per_device()
        positions = a.max_seq_len  # the RoPE tables hold max_seq_len rows
        mtp = load_mtp_weights(WeightLoader(RandomCheckpoint(cfg, seed), a, bench.ttnn, bench.mesh, progress=False))
        mtp_bytes = layer_bytes(mtp.layer) + tensor_bytes(mtp) - tensor_bytes(mtp.layer)
        k = st.layers[1].k
        kv_token = 2 * k.bytes_per_device() // (k.shape[0] * a.block_size)  # K + V per token, one attention layer
        gdn = st.layers[0]
        l1 = _decode_step_l1(bench)
        return {
            "label": "modelled (allocation plan)",
            "backend": bench.ctx.label,
            "tp": bench.ctx.num_devices,
            "built": {"vocab": cfg.vocab_size, "experts": cfg.num_experts if cfg.is_moe else None,
                      "experts_real": base.num_experts if cfg.is_moe else None,
                      "moe_built_experts": BUILT_EXPERTS if cfg.is_moe else None},
            "layers": {"gdn": n_gdn, "attention": n_attn},
            "block_size": a.block_size,
            "weights_bytes": {
                "gdn_layers": n_gdn * layer_bytes(w.layers[0]),
                "attention_layers": n_attn * layer_bytes(w.layers[1]),
                "embedding": int(w.embedding.bytes_per_device() * vocab_ratio),
                "lm_head": int(w.lm_head.bytes_per_device() * vocab_ratio),
                "final_norm": tensor_bytes(w.final_norm),
            },
            "rope_bytes_per_position": rope / positions,
            "mtp_bytes": mtp_bytes,
            "kv_bytes_per_token_per_attention_layer": kv_token,
            "kv_layers": n_attn + (1 if base.mtp_num_hidden_layers else 0),  # the MTP layer keeps its own KV
            "gdn_bytes_per_slot": n_gdn * (gdn.recurrent.bytes_per_device() + gdn.conv.bytes_per_device()),
            "trace_region_bytes": DEFAULT_TRACE_REGION,
            "card_bytes": CARD_BYTES,
            "max_position_embeddings": base.max_position_embeddings,
            "l1_per_core": l1,
        }
    finally:
        bench.close()


def _decode_step_l1(bench) -> dict:
    """Peak L1 per core (buffers) over one eager decode step of the bench's layers, per device (module doc)."""
    from qwen36.config import FULL
    from qwen36.tt.model.state import allocate_decode_inputs
    from qwen36.tt_ops.emulator.mesh import P150A_L1_BANKS

    mesh, model = bench.mesh, bench.model
    for layer in model.layers:
        if layer.layer_type != FULL:
            layer.mixer.prepare_batch(1)
    inputs = allocate_decode_inputs(bench.ttnn, mesh)
    model.copy_host_to_device(model.prepare_decode_inputs_host([1], bench.context - 1), inputs)
    before = mesh.l1_in_use()
    mesh.reset_l1_peak()
    model.decode_forward(inputs, bench.state)
    return {"label": "emulated decode step: L1 buffers per core (circular buffers not counted)",
            "held_before_step_bytes": before, "peak_bytes": mesh.l1_peak_per_core(),
            "bank_bytes": mesh.l1_bank_bytes, "banks": P150A_L1_BANKS}


def plan(m: dict, batch: int, max_len: int) -> dict:
    """Per-card bytes of every kind at ``batch`` users of ``max_len`` tokens (whole KV pages) and the headroom."""
    bs = m["block_size"]
    tokens = -(-max_len // bs) * bs
    parts = {"weights": sum(m["weights_bytes"].values()) + int(m["rope_bytes_per_position"] * max_len),
             "mtp": m["mtp_bytes"],
             "kv": batch * tokens * m["kv_layers"] * m["kv_bytes_per_token_per_attention_layer"],
             "gdn_conv_state": batch * m["gdn_bytes_per_slot"],
             "trace": m["trace_region_bytes"]}
    used = sum(parts.values())
    return {"batch": batch, "max_len": max_len, **{k: v for k, v in parts.items()}, "total": used,
            "headroom": m["card_bytes"] - used, "fits": used <= m["card_bytes"]}


def largest_context(m: dict, batch: int) -> int:
    """Most tokens per user (whole pages) that fit ``batch`` users on one card (0 if none), at most the model's
    ``max_position_embeddings``."""
    bs = m["block_size"]
    fixed = sum(m["weights_bytes"].values()) + m["mtp_bytes"] + m["trace_region_bytes"] + batch * m["gdn_bytes_per_slot"]
    per_token = batch * m["kv_layers"] * m["kv_bytes_per_token_per_attention_layer"] + m["rope_bytes_per_position"]
    free = m["card_bytes"] - fixed
    return max(0, min(int(free // per_token), m["max_position_embeddings"]) // bs * bs)


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.probes.decode_cost import build_config

    device = args.device if args.device != "reference" else "emulated-p150x2"
    batches, lens = _ints(args.batch, "batch"), _ints(args.max_len, "max-len")
    cfg, base = build_config(args.preset, args.vocab_sample)
    m = measure(device, cfg, base, args.precision, args.seed)
    rows = [plan(m, b, n) for b in batches for n in lens]
    m["plans"] = rows
    m["largest_context"] = {str(b): largest_context(m, b) for b in batches}
    lab = m["label"]
    print(f"[{lab}] memory {args.preset} {args.precision} tp{m['tp']} on {m['backend']}: per card (GiB), of "
          f"{CARD_BYTES / GIB:.0f}")
    print("  B x max_len: weights + MTP + KV + GDN/conv state + trace = total, headroom")
    for r in rows:
        print(f"  {r['batch']:>3} x {r['max_len']:>6}: {r['weights'] / GIB:.2f} + {r['mtp'] / GIB:.2f} + "
              f"{r['kv'] / GIB:.2f} + {r['gdn_conv_state'] / GIB:.2f} + {r['trace'] / GIB:.2f} = "
              f"{r['total'] / GIB:.2f}, headroom {r['headroom'] / GIB:.2f}{'' if r['fits'] else '  DOES NOT FIT'}")
    l1 = m["l1_per_core"]
    print(f"  L1 per core, buffers of one emulated decode step (circular buffers not counted): peak "
          f"{max(l1['peak_bytes']) / 1024:.1f} KiB of a {l1['bank_bytes'] / 1024:.1f} KiB bank ({l1['banks']} per chip)")
    print("  largest context per user that fits: "
          + ", ".join(f"B={b} {n} tokens" for b, n in m["largest_context"].items()))
    cells = [{"cell": "parts add up", "pass": all(r["total"] == r["weights"] + r["mtp"] + r["kv"]
                                                   + r["gdn_conv_state"] + r["trace"] for r in rows)},
             {"cell": "largest context fits and one more page does not", "pass": all(
                 plan(m, b, n)["fits"] and not plan(m, b, n + m["block_size"])["fits"]
                 for b, n in ((int(b), n) for b, n in m["largest_context"].items())
                 if 0 < n < m["max_position_embeddings"] // m["block_size"] * m["block_size"])}]
    return ProbeReport(probe=NAME, backend=m["backend"],
                       config={"preset": args.preset, "precision": args.precision, "batch": batches,
                               "max_len": lens, "vocab_sample": cfg.vocab_size, "seed": args.seed},
                       cells=cells, counters={}, gate_complete=True, performance=m)


__all__ = ["CARD_BYTES", "largest_context", "measure", "plan", "run"]

