"""Modelled cost of the batched speculative verify (tt/batch_spec.py) against the batched plain decode at the same
B, at real layer shapes on the emulated mesh: verify_cost_ratio(B, K) = cost(B x (K+1)-row packed verify) /
cost(B-row decode step). Counted the way ``qwen36 probe gate-0b`` counts the single-user ratio (probes/gate_0b.py:
the first GDN and first attention layer built, scaled to the layer counts; LM head bytes scaled from the built
vocabulary to the real one; embedding / RoPE gathers corrected to the rows read), and priced by the P150a cost
model: every figure is MODELLED, not measured.

    .venv/bin/python scripts/batch_verify_cost.py --batch 8 --k 3        # 27B, performance preset, context 4096
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch


def measure(batch: int, k: int, preset: str, precision: str, context: int, vocab: int, seed: int = 0) -> dict:
    from qwen36.probes.decode_cost import build_bench, build_config
    from qwen36.probes.gate_0b import Meter, _phase_figures, total
    from qwen36.tt.accept import DeviceAcceptor
    from qwen36.tt.batch_spec import BatchSpecDeviceState
    from qwen36.tt.state import allocate_decode_inputs
    from qwen36.tt_ops.cost_model import LABEL, P150aCostModel

    cfg, base = build_config(preset, vocab)
    bench = build_bench("emulated-p150x2", cfg, precision, context, seed, probe="batch-verify-cost", slots=batch)
    try:
        ttnn, mesh, model, state, a = bench.ttnn, bench.mesh, bench.model, bench.state, bench.args
        meter = Meter(bench)
        model.region = meter.region
        meter.instrument(model, "embed", gather="embed")
        meter.instrument(model, "rope_rows", gather="rope")
        ratio = base.vocab_size / cfg.vocab_size
        n_gdn, n_attn = len(cfg.gdn_layer_ids), len(cfg.attention_layer_ids)
        pos = context - 1 - k

        def layers(regs):
            return total(((regs["embed"], 1), (regs["layer0"], n_gdn), (regs["layer1"], n_attn),
                          (regs["head"].vocab_scaled(ratio), 1)))

        for layer in model.layers:
            if hasattr(layer.mixer, "prepare_batch"):
                layer.mixer.prepare_batch(batch)
        inputs = allocate_decode_inputs(ttnn, mesh, batch=batch)
        model.copy_host_to_device(model.prepare_decode_inputs_host([1] * batch, [pos] * batch), inputs)
        meter.run("decode", lambda: model.decode_forward(inputs, state))
        regs, corr = meter.take()
        decode = layers(regs).plus(corr)

        dec = SimpleNamespace(slots=batch, model=model, state=state)  # what BatchSpecDeviceState reads of a decoder
        st = BatchSpecDeviceState(dec, k, "shadow_commit")
        acc = DeviceAcceptor(ttnn, mesh, k=k, vocab=cfg.vocab_size, batch=batch, ring_heads=a.gdn_hv_d).allocate()
        st.attach_acceptor(acc)
        st.start()  # ring slot 0 and the ring index (outside the counted regions)
        t, heads, bs = k + 1, a.hkv_d, a.block_size
        pt = state.page_table_host
        ps = [pos + j for j in range(t)]
        st.write("tokens", torch.ones(1, batch * t, dtype=torch.int32))
        st.write("rope_idx", torch.tensor([ps] * batch, dtype=torch.int32).reshape(1, -1))
        st.write("phys_rows", torch.tensor([[int(pt[b, p // bs]) * bs + p % bs for p in ps] for b in range(batch)],
                                           dtype=torch.int32).reshape(1, -1))
        st.write("bounds", torch.tensor(ps, dtype=torch.int32).repeat(batch * heads))
        st.write("head_page_table", (pt.to(torch.int32)[:, None, :] * heads
                                     + torch.arange(heads, dtype=torch.int32)[None, :, None]).reshape(batch * heads, -1))
        st.write("row_mask", torch.ones(batch, t, 1))
        st.write("active", torch.ones(1, batch, 1, 1))
        meter.instrument(st, "pre_verify", region_name=lambda: "pre_verify")
        meter.take()
        meter.run("verify", st.verify)
        regs, corr = meter.take()
        inner = total(((regs["verify"], 1), (regs["embed"], -1), (regs["layer0"], -1), (regs["layer1"], -1),
                       (regs["head"], -1), (regs["pre_verify"], -1)))
        verify = layers(regs).plus(inner).plus(corr)
        cm = P150aCostModel()
        d, v = _phase_figures(decode, cm, True), _phase_figures(verify, cm, True)
        return {"label": LABEL, "backend": bench.ctx.label, "preset": preset, "precision": precision,
                "context_tokens": context, "batch": batch, "k": k, "verify_rows": batch * t,
                "decode_ms": d["ms"], "verify_ms": v["ms"], "verify_cost_ratio": v["ms"] / d["ms"],
                "decode_programs": d["programs"], "verify_programs": v["programs"],
                "decode_bytes_read_per_device": sum(d["bytes_read_per_device"].values()),
                "verify_bytes_read_per_device": sum(v["bytes_read_per_device"].values())}
    finally:
        bench.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--preset", default="27b")
    p.add_argument("--precision", default="performance")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--vocab-sample", type=int, default=4096)
    a = p.parse_args()
    print(json.dumps(measure(a.batch, a.k, a.preset, a.precision, a.context, a.vocab_sample), indent=1))


if __name__ == "__main__":
    main()
