"""Probe gate-0a: where the time of one plain decode step and of one speculative step goes, at real Qwen3.6-27B
shapes on P150a x2.

Two splits of every step, each summing to the step total:

  * by component (layer type): embed, GDN mixer, attention mixer, MLP, LM head, sampling/accept, MTP draft,
    verify setup, commit, host readback; with the program list (op name -> count) of one layer of each type;
  * by cost term (emulator only): weight read per tensor group, KV-cache read, GDN-state read, other reads
    (activations, conv state, gathered table rows, second reads of small weights), dispatch (programs x cost
    per program), collectives, host readback.

Steps: ``decode`` = one 1-row target forward + argmax + the host readback plain decoding does (the device pick's
result: the token id, one fp32 value; the logits row stays on device); ``spec K`` (K in ``--ks``, default 1,3,7) = MTP draft (reseed over the K+1 rows +
chain) + ONE K+1-row verify forward + on-device acceptance + readback of the acceptance result + commit
(``--commit``). Modelled tok/s of a speculative step is reported per acceptance scenario (``--acceptance``): a single
rate p is the chance each draft is accepted given the ones before it were (tokens per step = sum_{i=0..K} p^i); a
profile ``a1/a2/...`` lists per-position acceptance as the engine reports it (``AcceptanceStats.per_position``: the
fraction of steps accepting drafts 1..i), giving 1 + a1 + ... + aK tokens per step for K up to its length.

On the emulated mesh every figure is **modelled**: the emulator's counters turned into P150a milliseconds by
tt_ops/cost_model.py, plus a host-readback model (:class:`HostReadbackModel`, assumed constants). On cards the same
command times each region with ``ttnn.synchronize_device`` before and after: **measured** (the cost-term split
needs the counters and is absent there). The label comes from the mesh that ran.

Method: gate-0b's bench and meter (probes/decode_cost.py, probes/gate_0b.py: the first GDN and the first attention
layer built with random weights at the real shapes, the step at position ``--context - 1``, regions extrapolated to
48 GDN + 16 attention layers, the LM-head-sized parts scaled in bytes to the real vocabulary, the same emulator byte
corrections). Each region additionally carries the bytes of the weights its module owns (each read once per call)
and the per-op program counts, so both flow through the same linear extrapolation as the counters.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

from qwen36.probes.decode_cost import build_bench, qwen36_27b_config
from qwen36.probes.gate_0b import draft_phase
from qwen36.probes.step_figures import tokens_per_step
from qwen36.probes.step_meter import Cost, Meter, total
from qwen36.probes.records import ProbeReport

NAME = "gate-0a"
ROOFLINE = "modelled (roofline lower bound)"
HELP = "per-step time breakdown (decode, speculative step at K=1,3,7) by cost term and layer type, program lists"
MEASURED = "measured"

# weight fields of each module -> tensor group (models/qwen36/tt/model/weights.py); a field not listed fails fast
GDN_FIELDS = {"in_proj": "gdn_in", "in_proj_z": "gdn_in", "in_proj_b": "gdn_in", "in_proj_a": "gdn_in",
              "out_proj": "gdn_out", "conv_taps": "norm", "qk_l2_weight": "norm", "neg_exp_a": "norm",
              "dt_bias": "norm", "norm": "norm"}
ATTN_FIELDS = {"qkv": "attn_qkv", "gate": "attn_qkv", "o_proj": "attn_o", "q_norm": "norm", "k_norm": "norm"}
MLP_FIELDS = {"gate": "mlp_gate_up", "up": "mlp_gate_up", "down": "mlp_down"}
MTP_FIELDS = {"fc": "attn_qkv", "norm_embedding": "norm", "norm_hidden": "norm", "final_norm": "norm"}
COMPONENTS = ("embed", "gdn", "attention", "mlp", "lm_head", "sampling_accept", "mtp_draft", "verify_setup", "commit",
              "host_readback")


def label_of(ctx) -> str:
    """The figures' label from the mesh that ran: the cost model's on the emulator, measured on cards."""
    from qwen36.tt_ops.cost_model import LABEL

    return LABEL if ctx.is_emulated else MEASURED


@dataclasses.dataclass(frozen=True)
class HostReadbackModel:
    """Device -> host readback on the emulator: ``reads x fixed cost + bytes / link bandwidth``. Assumed constants,
    not measurements: P150a's host link is PCIe 5.0 x16 (~63 GB/s raw each way, spec sheet); half is taken as the
    effective rate of a blocking read, and 30 us as the round trip of one ``to_torch`` of a device buffer. The same
    probe on cards times the readback instead."""

    link_gbps: float = 32.0
    fixed_us_per_read: float = 30.0

    def ms(self, reads: float, nbytes: float) -> float:
        return reads * self.fixed_us_per_read * 1e-3 + nbytes / (self.link_gbps * 1e9) * 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "ci"], help="27b: real shapes; ci: the tiny CI config")
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--context", type=int, default=4096, help="sequence length at the counted step")
    p.add_argument("--ks", default="1,3,7", help="draft depths K of the speculative steps")
    p.add_argument("--commit", default="shadow_commit", choices=["shadow_commit", "snapshot", "recompute"],
                   help="commit mechanism of the speculative step")
    p.add_argument("--acceptance", default="0.8,0.6,0.5,0.8/0.6/0.5",
                   help="acceptance scenarios for the modelled speculative tok/s: a rate p per draft given the previous "
                        "ones accepted, or a per-position profile a1/a2/... (fraction of steps accepting drafts 1..i)")
    p.add_argument("--vocab-sample", type=int, default=None,
                   help="vocabulary built (emulator default 4096, extrapolated to the real vocab; cards: the real one)")
    p.add_argument("--seed", type=int, default=0)


def _weights(obj, fields: dict, where: str, skip=()) -> Cost:
    """``w:<group>`` bytes per device of the weight dataclass ``obj``'s fields (lists summed), but ``skip``."""
    out = Cost()
    for f in dataclasses.fields(obj):
        if f.name == "layer_type" or f.name in skip:
            continue
        if f.name not in fields:
            raise KeyError(f"gate-0a: weight field {where}.{f.name} has no tensor group in probes/gate_0a.py")
        v = getattr(obj, f.name)
        for t in v if isinstance(v, (list, tuple)) else [v]:
            key = f"w:{fields[f.name]}{_dram_placement(t)}"
            out[key] = out.get(key, 0) + t.bytes_per_device()
    return out


def _dram_placement(t) -> str:
    """``"@dram_sharded/<banks>"`` for a DRAM-sharded weight (its ``w:`` key then says the bandwidth it streams at,
    tt_ops/cost_model.py), else ``""`` (DRAM-interleaved)."""
    mc = t.memory_config()
    if mc.is_sharded() and mc.buffer_type.name == "DRAM" and mc.shard_spec is not None:
        return f"@dram_sharded/{mc.shard_spec.grid.num_cores()}"
    return ""


class BreakdownMeter(Meter):
    """gate-0b's :class:`Meter` whose regions (emulator) also carry, as extra keys of the linear cost vector,
    ``op:<name>`` program counts and the static bytes ``static(name)`` gives for the region's own module
    (``w:<group>`` weights, ``s:<kind>`` state), plus everything its nested regions carry."""

    def __init__(self, bench, static):
        super().__init__(bench)
        self.static = static
        self._frames: list[Cost] = []

    @contextlib.contextmanager
    def region(self, name: str):
        if not self.emulated:
            with super().region(name):
                yield
            return
        frame = Cost(self.static(name))
        self._frames.append(frame)
        try:
            with self.ctx.counters.scope(name) as c:
                with super().region(name):
                    yield
        finally:
            self._frames.pop()
        _, cost = self.log[-1]
        cost.update(frame)
        cost.update({f"op:{op}": n for op, n in c.programs_per_op.items()})  # programs (not calls) per op
        if self._frames:
            self._frames[-1].update(self._frames[-1].plus(frame))


def _scaled(c: Cost, times: float) -> Cost:
    return Cost().plus(c, times)


class Figures:
    """Cost vector -> milliseconds by cost term (emulator: cost model + host-readback model; cards: wall-clock)."""

    def __init__(self, emulated: bool, vocab_ratio: float):
        from qwen36.tt_ops.cost_model import P150aCostModel

        self.emulated, self.ratio = emulated, vocab_ratio
        self.cm, self.host = P150aCostModel(), HostReadbackModel()

    def _dram_ms(self, nbytes: float, placement: str = "") -> float:
        """Modelled ms of ``nbytes`` read from DRAM at the bandwidth of ``placement`` (a ``bytes_read`` key suffix)."""
        from qwen36.tt_ops.emulator.counters import Counts

        c = Counts("bytes")
        c.bytes_read["bytes" + placement] = nbytes
        return self.cm.breakdown(c)["dram_ms"]

    def weight_bytes(self, cost: Cost) -> dict:
        """``group[@placement]`` -> weight bytes per device."""
        # LM-head weights only appear in vocab-scaled regions, whose read: keys were scaled already
        return {k[2:]: v * (self.ratio if k.split("@")[0] == "w:lm_head" else 1)
                for k, v in cost.items() if k.startswith("w:")}

    def of(self, cost: Cost) -> dict:
        from qwen36.tt_ops.cost_model import calibrated_figures

        if not self.emulated:
            return {"ms": cost.get("wall_ms", 0.0)}
        c = cost.counts("part")
        b = self.cm.breakdown(c)
        w = self.weight_bytes(cost)
        s = {k[2:]: v for k, v in cost.items() if k.startswith("s:")}
        # the categories sum to the step's DRAM term: weights at the bandwidth of their placement, state
        # (DRAM-interleaved) at the effective one, the rest ("other_reads": DRAM-interleaved activations, the bank
        # padding of DRAM-sharded weights) is what remains of the DRAM term; L1 reads cost nothing
        other = c.bytes_read_total - sum(w.values()) - sum(s.values()) - b["inputs"]["bytes_read_l1"]
        cats = {}
        for g, v in sorted(w.items()):
            if v:
                group, _, where = g.partition("@")
                key = f"weights:{group}"
                cats[key] = cats.get(key, 0.0) + self._dram_ms(v, "@" + where if where else "")
        cats.update({k: self._dram_ms(v) for k, v in sorted(s.items()) if v})
        cats["other_reads"] = b["dram_ms"] - sum(cats.values())
        cats["dispatch"] = b["dispatch_ms"]
        cats["collectives"] = b["collective_fixed_ms"] + b["collective_bw_ms"]
        host = self.host.ms(cost.get("host_reads", 0), cost.get("host_read_bytes", 0))
        if host:
            cats["host_readback"] = host
        ops = {k[3:]: round(v) for k, v in sorted(cost.items()) if k.startswith("op:") and round(v)}
        cal = calibrated_figures(c)
        cb = cal["breakdown"]
        cal_terms = {f"kernels:{k}": v for k, v in cb["kernel_ms_by_class"].items()}
        cal_terms.update(launch=cb["launch_ms"], dram_interleaved=cb["dram_interleaved_ms"],
                         dram_sharded=cb["dram_sharded_ms"],
                         collectives=cb["collective_fixed_ms"] + cb["collective_bw_ms"])
        if host:
            cal_terms["host_readback"] = host
        return {"ms": b["total_ms"] + host, "calibrated_ms": cal["ms"] + host, "calibrated_ms_low": cal["ms_low"] + host,
                "calibrated_ms_high": cal["ms_high"] + host, "calibrated_terms": cal_terms,
                "categories": cats, "programs": c.programs, "collectives": c.collectives,
                "bytes_read_per_device": c.bytes_read_total, "weight_bytes_per_device": round(sum(w.values())),
                "other_read_bytes_per_device": round(other), "per_op": ops}


def forward_components(regs: dict, corr: Cost, ratio: float, n_gdn: int, n_attn: int) -> tuple:
    """A target forward's regions -> (components extrapolated to every layer, one layer of each type)."""
    gdn = regs["layer0"].plus(regs["mlp0"], -1)
    attn = regs["layer1"].plus(regs["mlp1"], -1)
    comps = {"embed": regs["embed"].plus(corr), "gdn": _scaled(gdn, n_gdn), "attention": _scaled(attn, n_attn),
             "mlp": total(((regs["mlp0"], n_gdn), (regs["mlp1"], n_attn))),
             "lm_head": regs["lm_head"].vocab_scaled(ratio),
             "sampling_accept": regs["head"].plus(regs["lm_head"], -1).vocab_scaled(ratio)}
    per_layer = {"gdn_layer (mixer + norms)": gdn, "attention_layer (mixer + norms)": attn,
                 "mlp (GDN layer)": regs["mlp0"], "mlp (attention layer)": regs["mlp1"]}
    return comps, per_layer


def measure(device: str, cfg, precision: str, context: int, ks, mechanism: str, seed: int, real_vocab: int,
            acceptance=("0.8", "0.6", "0.5", "0.8/0.6/0.5")) -> dict:
    from qwen36.generation.sampling import SamplingParams
    from qwen36.tt.spec.accept import DeviceAcceptor
    from qwen36.tt.spec.commit import commit
    from qwen36.tt.spec.mtp import TTMTPHead
    from qwen36.tt.runtime.sampler import DeviceSampler
    from qwen36.tt.runtime.sampler_transform import SamplerStages
    from qwen36.tt.model.state import allocate_decode_inputs
    from qwen36.tt.spec.verify import SpecDeviceState
    from qwen36.tt.model.weights import GDN_PREFILL_ONLY, WeightLoader, load_mtp_weights

    from qwen36.probes.decode_cost import RandomCheckpoint

    bench = build_bench(device, cfg, precision, context, seed, probe=NAME, emulated_only=False)
    try:
        ttnn, mesh, model, state, a = bench.ttnn, bench.mesh, bench.model, bench.state, bench.args
        emulated = bool(bench.ctx.is_emulated)
        ratio = real_vocab / cfg.vocab_size
        if not emulated and ratio != 1:
            raise SystemExit("gate-0a on cards measures wall-clock: build the real vocabulary (omit --vocab-sample)")
        mtp_w = load_mtp_weights(WeightLoader(RandomCheckpoint(cfg, seed), a, ttnn, mesh, progress=False))
        static = {}
        if emulated:
            w = bench.weights
            for i, lw in enumerate(w.layers):
                st = state.layers[i]
                static[f"layer{i}"] = Cost({"w:norm": lw.input_norm.bytes_per_device() + lw.post_norm.bytes_per_device()})
                if i == 0:
                    static[f"mixer{i}"] = _weights(lw.mixer, GDN_FIELDS, "GDNWeights", skip=GDN_PREFILL_ONLY).plus(
                        Cost({"s:gdn_state": st.recurrent.bytes_per_device()}))
                else:
                    static[f"mixer{i}"] = _weights(lw.mixer, ATTN_FIELDS, "AttentionWeights").plus(
                        Cost({"s:kv_cache": bench.kv_read_bytes()}))
                static[f"mlp{i}"] = _weights(lw.mlp, MLP_FIELDS, "MLPWeights")
            head_key = f"w:lm_head{_dram_placement(w.lm_head)}"  # where the decode layout placed it (decode_matmuls.py)
            static["lm_head"] = Cost({"w:norm": w.final_norm.bytes_per_device(), head_key: w.lm_head.bytes_per_device()})
            static["logits"] = Cost({head_key: w.lm_head.bytes_per_device()})
            ml = mtp_w.layer
            mtp_static = total(((_weights(mtp_w, MTP_FIELDS, "MTPWeights", skip=("layer",)), 1),
                                (Cost({"w:norm": ml.input_norm.bytes_per_device() + ml.post_norm.bytes_per_device()}), 1),
                                (_weights(ml.mixer, ATTN_FIELDS, "MTP AttentionWeights"), 1),
                                (_weights(ml.mlp, MLP_FIELDS, "MTP MLPWeights"), 1)))
        else:
            mtp_static = Cost()

        def static_of(name: str) -> Cost:
            return mtp_static if name.startswith("body") else static.get(name, Cost())

        meter = BreakdownMeter(bench, static_of)
        model.region = meter.region
        meter.instrument(model, "embed", gather="embed")
        meter.instrument(model, "rope_rows", region_name=lambda idx: f"rope{int(idx.shape[-1])}", gather="rope")
        meter.instrument(model, "head", region_name=lambda *_: "lm_head")
        for i, layer in enumerate(model.layers):
            meter.instrument(layer.mixer, "forward", region_name=lambda *_, i=i: f"mixer{i}")
            meter.instrument(layer.mlp, "forward", region_name=lambda *_, i=i: f"mlp{i}")
        n_gdn, n_attn = len(cfg.gdn_layer_ids), len(cfg.attention_layer_ids)
        pos = context - 1
        fig = Figures(emulated, ratio)

        def readback(name: str, fn, tensors, reads: int) -> Cost:
            meter.run(name, fn)
            regs, _ = meter.take()
            if not emulated:
                return regs[name]
            nbytes = sum(t.bytes_per_device() * s for t, s in tensors)
            return regs[name].plus(Cost(host_reads=reads, host_read_bytes=nbytes))

        # ---- plain decode step ------------------------------------------------------------------------
        inputs = allocate_decode_inputs(ttnn, mesh)
        model.copy_host_to_device(model.prepare_decode_inputs_host([1], pos), inputs)
        out = meter.run("decode", lambda: model.decode_forward(inputs, state))
        regs, corr = meter.take()
        decode, decode_layers = forward_components(regs, corr, ratio, n_gdn, n_attn)
        # plain decoding picks on device (tt/runtime/sampler.py DeviceSampler; greedy = one argmax over the row, which the
        # head region's argmax stands for here) and reads back only the pick's small result from device 0
        sampler = DeviceSampler(ttnn, mesh, cfg.vocab_size,
                                stages=SamplerStages.of([SamplingParams()], cfg.vocab_size)).allocate()
        decode["host_readback"] = readback("readback", sampler.read, [(sampler.result, 1)], reads=1)
        steps = {"decode": _step(fig, "decode", 0, decode, decode_layers)}

        # ---- speculative steps ------------------------------------------------------------------------
        # the verify's per-KV-head cache view is a reshape the emulator counts as the free view it is on cards
        for k in ks:
            acc = DeviceAcceptor(ttnn, mesh, k=k, vocab=cfg.vocab_size, ring_heads=a.gdn_hv_d).allocate()
            step_state = SpecDeviceState(model, state, k, mechanism)
            step_state.attach_acceptor(acc)
            step_state.start(pos, 1)
            step_state.write_drafts([(7 * j + 3) % cfg.vocab_size for j in range(k)])
            meter.instrument(step_state, "pre_verify", region_name=lambda: "pre_verify")
            meter.take()
            vout = meter.run("verify", step_state.verify)
            regs, corr = meter.take()
            comps, per_layer = forward_components(regs, corr, ratio, n_gdn, n_attn)
            comps["verify_setup"] = total(((regs["verify"], 1), (regs["embed"], -1), (regs["layer0"], -1),
                                           (regs["layer1"], -1), (regs["head"], -1), (regs["pre_verify"], -1)))
            res = meter.run("accept", lambda: acc.greedy(vout.out.logits, step_state.drafts))
            comps["sampling_accept"] = comps["sampling_accept"].plus(meter.take()[0]["accept"].vocab_scaled(ratio))
            # the acceptance result (tokens + count), read from every device (replicas checked equal)
            comps["host_readback"] = readback("readback", acc.read_result, [(acc.result, a.num_devices)],
                                              reads=a.num_devices)
            pre = regs["pre_verify"]
            no_layers = vout.without_gdn_kept()
            meter.run("commit", lambda: commit(step_state, vout, res))
            meter.run("commit_fixed", lambda: commit(step_state, no_layers, res))
            cregs, _ = meter.take()
            per_gdn = cregs["commit"].plus(cregs["commit_fixed"], -1)
            comps["commit"] = total(((cregs["commit_fixed"], 1), (per_gdn, n_gdn), (pre, n_gdn)))
            comps["mtp_draft"] = draft_phase(meter, model, mtp_w, TTMTPHead, k, pos, ratio)["total"]
            steps[f"spec_k{k}"] = _step(fig, "spec", k, comps, per_layer)

        d_fwd = _forward_ms(steps["decode"])
        out = {
            "label": label_of(bench.ctx),
            "backend": bench.ctx.label,
            "precision": precision,
            "tp": bench.ctx.num_devices,
            "layers": {"gdn": n_gdn, "attention": n_attn},
            "vocab": {"built": cfg.vocab_size, "extrapolated_to": real_vocab},
            "context_tokens": context,
            "commit_mechanism": mechanism,
            "steps": steps,
            "verify_cost_ratio": {str(k): _forward_ms(steps[f"spec_k{k}"]) / d_fwd for k in ks},
            "decode_tok_s": 1e3 / steps["decode"]["ms"],
            "spec_tok_s": {str(k): {p: tokens_per_step(p, k) * 1e3 / steps[f"spec_k{k}"]["ms"] for p in acceptance
                                    if tokens_per_step(p, k) is not None} for k in ks},
            "tokens_per_step": {str(k): {p: tokens_per_step(p, k) for p in acceptance if tokens_per_step(p, k) is not None}
                                for k in ks},
        }
        if emulated:
            out["cost_model_constants"] = dataclasses.asdict(fig.cm)
            out["host_readback_model"] = {**dataclasses.asdict(fig.host), "label": "assumed"}
            out["calibrated"] = calibrated_block(steps, ks, acceptance)
        return out
    finally:
        bench.close()


def calibrated_block(steps: dict, ks, acceptance) -> dict:
    """The calibrated figures of the record (docs/cost_model.md "Record keys"), each [central, low, high]: step
    ms, decode and speculative tok/s per acceptance scenario, and the forward-only verify_cost_ratio (central)."""
    from qwen36.tt_ops.cost_model import CALIBRATED_LABEL

    ends = ("calibrated_ms", "calibrated_ms_low", "calibrated_ms_high")
    ms = {name: [s[e] for e in ends] for name, s in steps.items()}

    def fwd(step):
        return sum(step["components"][c]["calibrated_ms"] for c in FORWARD if c in step["components"])

    return {"label": CALIBRATED_LABEL, "note": "[central, low, high]; tok/s low goes with ms high",
            "step_ms": ms, "decode_tok_s": [1e3 / ms["decode"][i] for i in (0, 2, 1)],
            "spec_tok_s": {str(k): {p: [tokens_per_step(p, k) * 1e3 / ms[f"spec_k{k}"][i] for i in (0, 2, 1)]
                                    for p in acceptance if tokens_per_step(p, k) is not None} for k in ks},
            "verify_cost_ratio": {str(k): fwd(steps[f"spec_k{k}"]) / fwd(steps["decode"]) for k in ks},
            "terms_ms": {name: s["calibrated_terms"] for name, s in steps.items()}}


def parse_scenario(text: str) -> str:
    """Validate one ``--acceptance`` scenario (a rate ``p`` or a profile ``a1/a2/...``); returns its key."""
    vals = [float(v) for v in text.split("/")]
    if not all(0 <= v <= 1 for v in vals) or ("/" in text and vals != sorted(vals, reverse=True)):
        raise SystemExit(f"gate-0a: acceptance scenario {text!r}: rates in [0, 1], a profile non-increasing")
    return "/".join(f"{v:g}" for v in vals)


FORWARD = ("embed", "gdn", "attention", "mlp", "lm_head", "verify_setup")


def _forward_ms(step: dict) -> float:
    """The target forward alone (gate-0b's verify_cost_ratio terms): no sampling, draft, commit or readback."""
    return sum(step["components"][c]["ms"] for c in FORWARD if c in step["components"])


def _step(fig: Figures, kind: str, k: int, comps: dict, per_layer: dict) -> dict:
    parts = {name: fig.of(c) for name, c in comps.items()}
    step = {"kind": kind, "k": k, "rows": k + 1, "ms": sum(p["ms"] for p in parts.values()),
            "components": {name: parts[name] for name in COMPONENTS if name in parts}}
    if fig.emulated:
        cats: dict = {}
        for p in parts.values():
            for c, v in p["categories"].items():
                cats[c] = cats.get(c, 0.0) + v
        step["categories"] = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
        for end in ("calibrated_ms", "calibrated_ms_low", "calibrated_ms_high"):
            step[end] = sum(p[end] for p in parts.values())
        terms: dict = {}
        for p in parts.values():
            for t, v in p["calibrated_terms"].items():
                terms[t] = terms.get(t, 0.0) + v
        step["calibrated_terms"] = dict(sorted(terms.items(), key=lambda kv: -kv[1]))
        step["programs"] = sum(p["programs"] for p in parts.values())
        step["programs_per_layer"] = {name: fig.of(c)["per_op"] for name, c in per_layer.items()}
        step["programs_per_layer"].update({name: parts[name]["per_op"] for name in
                                           ("embed", "lm_head", "sampling_accept", "mtp_draft", "verify_setup",
                                            "commit") if name in parts})
    return step


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.tiny import PRESETS

    base = qwen36_27b_config() if args.preset == "27b" else PRESETS["ci"]
    device = args.device if args.device != "reference" else "emulated-p150x2"
    ks = sorted({int(x) for x in str(args.ks).split(",") if x.strip()})
    acceptance = tuple(parse_scenario(x.strip()) for x in str(args.acceptance).split(",") if x.strip())
    vocab = args.vocab_sample
    if vocab is None:
        vocab = 4096 if device.startswith("emulated") else base.vocab_size
    cfg = dataclasses.replace(base, vocab_size=min(vocab, base.vocab_size), eos_token_id=())
    fig = measure(device, cfg, args.precision, args.context, ks, args.commit, args.seed, base.vocab_size, acceptance)
    steps = fig["steps"]
    tol = 1e-9
    cells = [
        {"cell": "components sum to the step total", "pass": all(
            abs(sum(c["ms"] for c in s["components"].values()) - s["ms"]) <= tol * s["ms"] for s in steps.values())},
        {"cell": "speculative step cost grows with K", "step_ms": [steps[f"spec_k{k}"]["ms"] for k in ks],
         "pass": all(steps[f"spec_k{x}"]["ms"] < steps[f"spec_k{y}"]["ms"] for x, y in zip(ks, ks[1:]))
         and all(r >= 1 for r in fig["verify_cost_ratio"].values())},
    ]
    if "categories" in steps["decode"]:
        cells += [
            {"cell": "cost terms sum to the step total", "pass": all(
                abs(sum(s["categories"].values()) - s["ms"]) <= tol * s["ms"] for s in steps.values())},
            {"cell": "attributed weight/state bytes within the counted reads",
             "min_other_read_bytes": min(c["other_read_bytes_per_device"] for s in steps.values()
                                         for c in s["components"].values() if "other_read_bytes_per_device" in c),
             "pass": all(c["other_read_bytes_per_device"] >= 0 for s in steps.values() for c in s["components"].values()
                         if "other_read_bytes_per_device" in c)},
        ]
    lab = fig["label"]
    print(f"[{lab}] gate-0a {args.preset} {args.precision} tp{fig['tp']} on {fig['backend']}, context {args.context}:")
    for name, s in steps.items():
        comp = ", ".join(f"{c} {v['ms']:.2f}" for c, v in s["components"].items())
        print(f"  {name}: {s['ms']:.2f} ms = {comp}")
        if "categories" in s:
            print("    by cost term: " + ", ".join(f"{c} {v:.2f}" for c, v in s["categories"].items())
                  + f"; {s['programs']} programs")
    cal = fig.get("calibrated")
    if cal is not None:
        for name, (c, lo, hi) in cal["step_ms"].items():
            top = ", ".join(f"{t} {v:.2f}" for t, v in list(cal["terms_ms"][name].items())[:6])
            print(f"  [{cal['label']}] {name}: {c:.2f} ms ({lo:.2f}-{hi:.2f}); largest terms: {top}")
        print(f"  [{cal['label']}] decode {cal['decode_tok_s'][0]:.1f} tok/s; speculative tok/s "
              + "; ".join(f"K={k}: " + ", ".join(f"{p} {v[0]:.1f}" for p, v in cal["spec_tok_s"][str(k)].items())
                          for k in ks)
              + "; verify_cost_ratio " + ", ".join(f"K={k} {v:.3f}" for k, v in cal["verify_cost_ratio"].items()))
        print(f"  [{ROOFLINE}] the figures above the calibrated lines are the roofline lower bound")
    print(f"  [{lab}] decode {fig['decode_tok_s']:.1f} tok/s; speculative tok/s at acceptance "
          + "; ".join(f"K={k}: " + ", ".join(f"{p} {v:.1f}" for p, v in fig["spec_tok_s"][str(k)].items())
                      for k in ks))
    return ProbeReport(probe=NAME, backend=fig["backend"],
                       config={"preset": args.preset, "precision": args.precision, "context": args.context,
                               "ks": ks, "commit": args.commit, "acceptance": list(acceptance),
                               "vocab_built": cfg.vocab_size, "real_vocab": base.vocab_size, "seed": args.seed},
                       cells=cells, counters={name: {"ms": s["ms"], "programs": s.get("programs")}
                                              for name, s in steps.items()},
                       gate_complete=True, performance=fig)
