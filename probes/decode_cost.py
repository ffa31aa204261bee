"""Probe decode-cost: device work of one traced decode step at real Qwen3.6-27B shapes, from the emulator's
counters, turned into *modelled* P150a x2 time by tt_ops/cost_model.py. Never a measurement.

Method (``--preset 27b``):
  * the real 27B config (64 layers = 48 GDN + 16 attention, hidden 5120, MLP 17408, 24/4 x 256 attention
    heads, 16/48 x 128 GDN heads) with random bf16 weights, converted by the real TT loader at the chosen
    precision and TP width; only the first GDN layer and the first attention layer are built;
  * the vocabulary is cut to ``--vocab-sample`` for the run; the LM-head region (weights, logits, all_gather,
    argmax) is extrapolated linearly in vocab to 248320 (its final-norm bytes, < 0.1 % of the region, are
    scaled along);
  * one decode step runs with a counter scope around the embedding, each layer and the head (the same ops the
    decode trace records; checked against a captured trace's counts);
  * per token = embed + 48 x GDN layer + 16 x attention layer + head.
``--preset 35b-a3b`` (the MoE sibling) is built the same way with 64 routed experts instead of 256 (see
``BUILT_EXPERTS``); the router's extra bytes at 256 experts are added per MoE layer, and the weight bytes per token
count the k routed experts each layer reads, not the resident expert stack.
``--batch B`` counts one step of the batched plain decode (tt/runtime/batch.py): B user rows, every user at position
``--context - 1`` with its own KV pages and GDN slot. The emulator's counters charge each op what it reads, so a
weight matrix is read once per step whatever B, while activation tiles, each user's KV blocks (paged SDPA decode
reads every user's blocks up to its own position) and the B-slot GDN ring are charged for all users; per-user
tok/s = 1000 / (ms per step), aggregate = B x that.
The step is counted at position ``--context - 1``: the emulator's paged SDPA decode accounting reads the KV
blocks up to that position (and ``paged_update_cache`` the row tiles it touches), so KV bytes are those of a
``--context``-token sequence. One byte correction: the emulator counts a gather's whole table as read, but an
embedding / RoPE-table lookup reads one row per token.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import zlib

import torch

from qwen36.probes.records import ProbeReport
from qwen36.errors import UserError

NAME = "decode-cost"
HELP = "modelled P150a decode cost (programs, weight bytes, collectives, ms/step, tok/s) at real 27B / 35B-A3B shapes"
REAL_VOCAB = 248320


def qwen36_27b_config():
    from qwen36.config import FULL, LINEAR, Qwen36Config

    return Qwen36Config(
        vocab_size=REAL_VOCAB, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        layer_types=tuple(FULL if i % 4 == 3 else LINEAR for i in range(64)),
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
        mtp_num_hidden_layers=1)


# the 35B-A3B MoE sibling is built with BUILT_EXPERTS routed experts instead of 256: the expert matmuls read only
# the listed groups (bytes independent of E while rows*k <= E; 64 covers a K=7 verify's 8 rows x top-8), so only
# the router's bytes depend on E, and those are added back exactly (``router_correction``)
BUILT_EXPERTS = 64


def qwen36_35b_a3b_config():
    """transformers 5.24 ``Qwen3_5MoeTextConfig`` defaults: 40 layers (3 GDN : 1 attention), hidden 2048, 16/2
    attention heads of 256, 16/32 GDN heads of 128, 256 experts top-8 (intermediate 512) + a gated shared expert
    (intermediate 512), vocab 248320, partial rotary 0.25, one MTP layer."""
    from qwen36.config import FULL, LINEAR, Qwen36Config

    return Qwen36Config(
        vocab_size=REAL_VOCAB, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
        layer_types=tuple(FULL if i % 4 == 3 else LINEAR for i in range(40)),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
        mtp_num_hidden_layers=1, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512)


def build_config(preset: str, vocab: int):
    """(config to build, real config) for a probe preset: the vocabulary cut to ``vocab``; the MoE preset also
    built with BUILT_EXPERTS experts."""
    from qwen36.tiny import PRESETS

    base = {"27b": qwen36_27b_config, "35b-a3b": qwen36_35b_a3b_config}.get(preset, lambda: PRESETS[preset])()
    cfg = dataclasses.replace(base, vocab_size=min(vocab, base.vocab_size), eos_token_id=())
    if base.is_moe and base.num_experts > BUILT_EXPERTS:
        cfg = dataclasses.replace(cfg, num_experts=BUILT_EXPERTS)
    return cfg, base


def router_correction(built, real, rows: int, router_dtype: str, routing_dtype: str) -> dict:
    """Bytes per device one MoE block reads at ``real``'s expert count beyond what the ``built`` config read: the
    router weight's extra columns (H x extra, read whole every call) and the extra logit/probability tiles that
    softmax and top-k read ([rows, E] fp32). Programs are the same (one op each whatever E)."""
    from qwen36.tt_ops.emulator.tensor import TILE_BYTES

    extra = real.num_experts - built.num_experts
    if extra <= 0:
        return {}
    weight = built.hidden_size * extra // 1024 * TILE_BYTES[router_dtype.upper()]
    acts = 2 * (-(-rows // 32)) * (extra // 32) * TILE_BYTES[routing_dtype.upper()]
    out = {router_dtype: weight}
    out[routing_dtype] = out.get(routing_dtype, 0) + acts
    return out


class RandomCheckpoint:
    """Reader-shaped source of random bf16 weights (``.config``, ``.get(name)``), generated per tensor on demand
    with the scales of models/qwen36/tiny.py (activations O(1)); nothing is written to disk."""

    def __init__(self, cfg, seed: int = 0):
        from qwen36.checkpoint import mtp_shapes, target_shapes

        self.config, self.seed = cfg, seed
        self.shapes = target_shapes(cfg)
        self.has_mtp = cfg.mtp_num_hidden_layers > 0
        if self.has_mtp:
            self.shapes.update(mtp_shapes(cfg))

    def get(self, name: str, dtype=None) -> torch.Tensor:
        shape = self.shapes[name]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(0.05, 1.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = -1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = (1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        return t.to(torch.bfloat16 if dtype is None else dtype)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "35b-a3b", "ci", "moe-ci"],
                   help="27b / 35b-a3b: real shapes (the MoE sibling built with 64 experts, router bytes added back); "
                        "ci / moe-ci: the tiny CI configs")
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--context", type=int, default=4096,
                   help="sequence length at the counted step (the decode attends to this many KV positions)")
    p.add_argument("--contexts", default="",
                   help="further sequence lengths (comma-separated, e.g. 128,16384,65536,131072,262144), each counted "
                        "by its own decode step on the same build; calibrated figures per context in the record")
    p.add_argument("--vocab-sample", type=int, default=4096,
                   help="vocabulary actually built (LM head extrapolated to the real vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-matmuls", default="mcast_1d", choices=["mcast_1d", "dram_sharded", "interleaved"],
                   help="decode layout of the MLP and LM-head matmuls (tt/model/decode_matmuls.py): mcast_1d (1D "
                        "multicast matmuls on DRAM-interleaved weights, the default), dram_sharded (DRAM-sharded "
                        "weights), interleaved (ttnn's default program configs), for A/B figures")
    p.add_argument("--dram-readers", type=int, default=2, choices=[1, 2, 3],
                   help="readers per DRAM bank asked of the DRAM-sharded decode matmuls (num_workers_per_dram_bank; "
                        "tt/model/decode_matmuls.py decode_readers_per_bank: a matmul whose bank shards the rule refuses "
                        "keeps one); 1: the 0.81.1 default, for A/B figures")
    p.add_argument("--batch", type=int, default=1,
                   help="users decoded per step (batched plain decode, tt/runtime/batch.py; 1, 8 or 32 are the buckets)")


def tensor_bytes(obj, read_by_decode: bool = False) -> int:
    """Per-device bytes of every device tensor inside a weights dataclass / list (``read_by_decode``: only those a
    decode step reads, the GDN weights only the prefill reads left out)."""
    from qwen36.tt.model.weights import GDN_PREFILL_ONLY, GDNWeights

    if obj is None:
        return 0
    if hasattr(obj, "bytes_per_device"):
        return int(obj.bytes_per_device())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, read_by_decode) for o in obj)
    if dataclasses.is_dataclass(obj):
        skip = ("layer_type",) + (GDN_PREFILL_ONLY if read_by_decode and isinstance(obj, GDNWeights) else ())
        return sum(tensor_bytes(getattr(obj, f.name), read_by_decode) for f in dataclasses.fields(obj)
                   if f.name not in skip)
    return 0


def vocab_scaled_counts(counts, name: str, ratio: float):
    from qwen36.tt_ops.emulator.counters import Counts

    c = Counts(name)
    c.programs, c.collectives = counts.programs, counts.collectives
    c.collective_bytes = int(counts.collective_bytes * ratio)
    for k, v in counts.bytes_read.items():
        c.bytes_read[k] = int(v * ratio)
    for k, v in counts.per_op.items():
        c.per_op[k] = v
    for k, v in counts.programs_per_op.items():
        c.programs_per_op[k] = v
    for op, reads in counts.bytes_read_per_op.items():
        for k, v in reads.items():
            c.bytes_read_per_op[op][k] = int(v * ratio)
    for k, v in counts.collectives_per_op.items():
        c.collectives_per_op[k] = v
    for k, v in counts.collective_bytes_per_op.items():
        c.collective_bytes_per_op[k] = int(v * ratio)
    return c


@dataclasses.dataclass
class CostBench:
    """The first GDN + first attention layer of a config built on the emulated mesh (random weights at the
    config's shapes), with a region recorder: ``model.region`` = :meth:`region` records each named part of a
    forward into ``regions``. Shared by decode-cost and gate-0b."""

    ctx: object
    cfg: object
    args: object
    weights: object
    model: object
    state: object
    context: int
    regions: dict = dataclasses.field(default_factory=dict)

    @property
    def ttnn(self):
        return self.ctx.ttnn

    @property
    def mesh(self):
        return self.ctx.mesh_device

    @contextlib.contextmanager
    def region(self, name):
        with self.ctx.counters.scope(name) as c:
            yield c
        self.regions[name] = c

    def dtype_name(self, group) -> str:
        return self.args.dtype(group, self.ttnn).name

    def corrected_embed(self, counts, rows: int):
        """An embedding/RoPE region of ``rows`` tokens: the emulator counts each gather's whole table as read;
        on cards a lookup reads one row per token (module docstring)."""
        from qwen36.tt.model.model_config import TensorGroup

        w, h, d = self.weights, self.cfg.hidden_size, self.cfg.head_dim
        out = counts.copy(counts.name)
        emb = w.embedding.bytes_per_device() - rows * h * 2
        rope = w.rope_cos.bytes_per_device() + w.rope_sin.bytes_per_device() - rows * 2 * d * 4
        for key, extra in ((self.dtype_name(TensorGroup.EMBEDDING), emb), (self.dtype_name(TensorGroup.ROPE), rope)):
            out.bytes_read[key] -= extra
            out.bytes_read_per_op["ttnn.embedding"][key] -= extra  # both tables are read by ttnn.embedding
        return out

    def kv_read_bytes(self) -> int:
        """K and V bytes of one attention layer (per device) up to the counted context."""
        k = self.state.layers[1].k
        per_block = k.bytes_per_device() // k.shape[0]
        return 2 * (-(-self.context // self.args.block_size)) * per_block

    def close(self) -> None:
        self.ctx.close()


def build_bench(device: str, cfg, precision: str, context: int, seed: int = 0, probe: str = NAME,
                emulated_only: bool = True, decode_matmuls: str = "mcast_1d", slots: int = 1,
                dram_readers: int = 2, numerics: str = "strict", **args_kw) -> CostBench:
    """Open the mesh (emulated unless ``emulated_only`` is False) and build the first GDN + first attention layer
    of ``cfg`` with state for ``slots`` users of a ``context``-token sequence (plus 64 positions of head room).
    ``numerics`` (emulator only): ``"exact"`` computes faster with the same counts (prefill-cost uses it; a test
    compares the counts of both). ``args_kw`` go to TTModelArgs (``prefill_chunk``, ``block_size``)."""
    from qwen36.tt_ops.device import open_mesh

    from qwen36.config import FULL
    from qwen36.tt.model.model import TTQwen36Model
    from qwen36.tt.model.model_config import PrecisionSetting, TTModelArgs
    from qwen36.tt.model.state import allocate_state
    from qwen36.tt.model.weights import WeightLoader

    ctx = open_mesh(device, trace_region_size=64 << 20, **({"numerics": numerics} if numerics != "strict" else {}))
    if emulated_only and not ctx.is_emulated:
        ctx.close()
        raise UserError(f"{probe} reads the emulator's counters; run it with --device emulated-p150x2 "
                        "(on cards, profile the real trace with tracy instead)")
    try:
        gdn_id, attn_id = cfg.layer_types.index("linear_attention"), cfg.layer_types.index(FULL)
        args = TTModelArgs.from_config(cfg, ctx.num_devices, PrecisionSetting.named(precision),
                                       max_seq_len=context + 64, decode_matmuls=decode_matmuls,
                                       dram_readers=dram_readers, **args_kw)
        weights = WeightLoader(RandomCheckpoint(cfg, seed), args, ctx.ttnn, ctx.mesh_device, progress=False).load(
            layers=[gdn_id, attn_id])
        model = TTQwen36Model(args, weights, ctx.ttnn, ctx.mesh_device)
        state = allocate_state(args, ctx.ttnn, ctx.mesh_device, [gdn_id, attn_id], slots=slots)
    except BaseException:
        ctx.close()
        raise
    bench = CostBench(ctx, cfg, args, weights, model, state, context)
    model.region = bench.region
    return bench


def _moe_corrected(counts, corr: dict):
    """A MoE layer's counts with the router's bytes at the real expert count (``router_correction``) added."""
    out = counts.copy(counts.name)
    for k, v in corr.items():
        out.bytes_read[k] += v
        out.bytes_read_per_op["ttnn.linear"][k] += v  # the router matmul's extra columns
    return out


def token_counts(name: str, parts) -> "Counts":
    """Sum of (Counts, times) pairs (negative times subtract) under ``name``."""
    from qwen36.tt_ops.emulator.counters import Counts

    total = Counts(name)
    for part, times in parts:
        total.add(part, times)
    return total


def calibrated_block(counts, users: int = 1, tokens_per_step: float = 1.0) -> dict:
    """The calibrated figure of one step (tt_ops/cost_model.py ``calibrated_figures``, docs/cost_model.md "Record
    keys") with per-user and aggregate tok/s over ``users`` and the constants it used."""
    from qwen36.tt_ops.cost_model import CALIBRATION, calibrated_figures

    f = calibrated_figures(counts, tokens_per_step)
    f["aggregate_tok_s"], f["aggregate_tok_s_low"], f["aggregate_tok_s_high"] = (
        users * f["tok_s"], users * f["tok_s_low"], users * f["tok_s_high"])
    f["constants"] = {n: [c.value, c.low, c.high] for n, c in CALIBRATION.items()}
    return f


def program_ranking(parts: dict) -> list:
    """Every op of the step by calibrated time: ``parts`` = {region: (Counts, times per step)}; one row per (region,
    op name) with its programs and milliseconds per step, largest first (cost_model ``per_op_ms``)."""
    from qwen36.tt_ops.cost_model import per_op_ms

    rows = []
    for region, (counts, times) in parts.items():
        for op, r in per_op_ms(counts).items():
            rows.append({"region": region, "op": op, "class": r["class"], "programs_per_step": r["programs"] * times,
                         "ms_per_step": r["ms"] * times})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def measure(device: str, cfg, precision: str, context: int, seed: int = 0, *, real_vocab: int | None = None,
            n_gdn: int | None = None, n_attn: int | None = None, real_cfg=None,
            decode_matmuls: str = "mcast_1d", batch: int = 1, dram_readers: int = 2,
            more_contexts: tuple[int, ...] = ()) -> dict:
    """Build the first GDN + first attention layer of ``cfg`` on ``device``, count one decode step of ``batch``
    users by region and extrapolate to ``n_gdn`` + ``n_attn`` layers (default: cfg's) and ``real_vocab`` (default:
    cfg's). ``more_contexts``: further contexts, each counted by one more eager step on the same bench (state sized
    for the longest) at its own position; their calibrated figures go to ``calibrated_by_context``."""
    from qwen36.tt_ops.cost_model import LABEL, ROOFLINE_LABEL, CalibratedP150aModel, P150aCostModel, decode_layout_bounds

    from qwen36.config import FULL
    from qwen36.tt.model.state import allocate_decode_inputs
    from qwen36.tt.runtime.trace import TracedStep

    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    bench = build_bench(device, cfg, precision, max((context,) + tuple(more_contexts)), seed,
                        decode_matmuls=decode_matmuls, slots=batch, dram_readers=dram_readers)
    bench.context = context  # the primary figure's context (the state holds the longest)
    try:
        ttnn, mesh, n, model, state, weights, args = (bench.ttnn, bench.mesh, bench.ctx.num_devices, bench.model,
                                                      bench.state, bench.weights, bench.args)
        ctx, regions = bench.ctx, bench.regions
        for layer in model.layers:
            if layer.layer_type != FULL:
                layer.mixer.prepare_batch(batch)
        inputs = allocate_decode_inputs(ttnn, mesh, batch=batch)
        pos = context - 1  # the step attends to `context` KV positions (every user)
        host = (model.prepare_decode_inputs_host([1], pos) if batch == 1
                else model.prepare_decode_inputs_host([1] * batch, [pos] * batch))
        model.copy_host_to_device(host, inputs)
        model.decode_forward(inputs, state)  # eager step: the counted one
        by_context = {}
        for extra in more_contexts:  # the same step at another position: only the KV read and its update move
            counted = dict(regions)
            p = extra - 1
            model.copy_host_to_device(model.prepare_decode_inputs_host([1], p) if batch == 1
                                      else model.prepare_decode_inputs_host([1] * batch, [p] * batch), inputs)
            regions.clear()
            model.decode_forward(inputs, state)
            by_context[extra] = dict(regions)
            regions.clear()
            regions.update(counted)
        model.region = lambda name: contextlib.nullcontext()
        # the trace records the same programs: capture and compare
        trace = TracedStep(ttnn, mesh, lambda: model.decode_forward(inputs, state), name="decode")
        trace.capture()
        with ctx.counters.scope("replay") as rep:
            trace.replay(blocking=True)
        trace.release()
        step_programs = sum(c.programs for c in regions.values())

        # ---- corrections (see module docstring) -----------------------------------------------------
        h = cfg.hidden_size
        embed = bench.corrected_embed(regions["embed"], batch)
        attn = regions["layer1"].copy("attention layer")
        kv_read = bench.kv_read_bytes()
        gdn = regions["layer0"].copy("GDN layer")
        moe, moe_corr = None, {}
        if cfg.is_moe:
            from qwen36.tt.model.model_config import TensorGroup

            real = real_cfg or cfg
            corr = router_correction(cfg, real, 1, bench.dtype_name(TensorGroup.MOE_ROUTER),
                                     bench.dtype_name(TensorGroup.MOE_ROUTING))
            gdn, attn = _moe_corrected(gdn, corr), _moe_corrected(attn, corr)
            mw = weights.layers[0].mlp
            group = (mw.experts_gate_up.bytes_per_device() + mw.experts_down.bytes_per_device()) // cfg.num_experts
            moe_corr = corr
            router = mw.router.bytes_per_device() // cfg.num_experts * real.num_experts
            moe = {"experts_built": cfg.num_experts, "experts_real": real.num_experts, "top_k": cfg.num_experts_per_tok,
                   "expert_bytes_per_device": group,
                   "routed_expert_bytes_read_per_layer": group * cfg.num_experts_per_tok,
                   "resident_expert_bytes_per_layer": group * real.num_experts,
                   "router_bytes_per_layer": router, "router_correction_per_layer": corr}
        ratio = (real_vocab or cfg.vocab_size) / cfg.vocab_size
        head = vocab_scaled_counts(regions["head"], "head (vocab-extrapolated)", ratio)

        n_gdn = len(cfg.gdn_layer_ids) if n_gdn is None else n_gdn
        n_attn = len(cfg.attention_layer_ids) if n_attn is None else n_attn
        token = token_counts(f"decode token ({n_gdn} GDN + {n_attn} attention layers, extrapolated)",
                             ((embed, 1), (gdn, n_gdn), (attn, n_attn), (head, 1)))

        lw_gdn, lw_attn = (tensor_bytes(weights.layers[i], read_by_decode=True) for i in (0, 1))
        if moe is not None:  # weights read per token: the k routed experts, not the resident stack
            adj = (moe["routed_expert_bytes_read_per_layer"] - group * cfg.num_experts
                   + sum(moe["router_correction_per_layer"].get(k, 0) for k in
                         (bench.dtype_name(TensorGroup.MOE_ROUTER),)))
            lw_gdn, lw_attn = lw_gdn + adj, lw_attn + adj
        lm_head = weights.lm_head.bytes_per_device() * ratio
        weight_bytes = n_gdn * lw_gdn + n_attn * lw_attn + lm_head + tensor_bytes(weights.final_norm) + h * 2
        cm = P150aCostModel()
        br = cm.breakdown(token)
        cal = calibrated_block(token, batch)
        parts = {"embed": (embed, 1), "gdn_layer": (gdn, n_gdn), "attention_layer": (attn, n_attn), "head": (head, 1)}
        cal["regions_ms"] = {name: CalibratedP150aModel().predict_ms(c) for name, (c, _) in parts.items()}
        cal["program_ranking"] = program_ranking(parts)
        by_ctx = {context: cal}
        for extra, reg in by_context.items():
            t = token_counts(f"decode token at context {extra}", (
                (bench.corrected_embed(reg["embed"], batch), 1), (_moe_corrected(reg["layer0"], moe_corr), n_gdn),
                (_moe_corrected(reg["layer1"], moe_corr), n_attn),
                (vocab_scaled_counts(reg["head"], "head (vocab-extrapolated)", ratio), 1)))
            by_ctx[extra] = calibrated_block(t, batch)
        calibrated_by_context = {str(c): {k: f[k] for k in ("ms", "ms_low", "ms_high", "tok_s", "tok_s_low",
                                                             "tok_s_high", "aggregate_tok_s")}
                                 | {"dram_interleaved_ms": f["breakdown"]["dram_interleaved_ms"]}
                                 for c, f in sorted(by_ctx.items())}
        # the same counts under the decode layouts tt_transformers uses (cost_model.decode_layout_bounds): weights
        # DRAM-sharded, activations in L1; KV and GDN state stay DRAM reads
        gdn_st = state.layers[0]
        resident = n_attn * kv_read * batch + n_gdn * (gdn_st.recurrent.bytes_per_device() + gdn_st.conv.bytes_per_device())
        layouts = {name: m.breakdown_split(token, int(weight_bytes), int(resident))
                   for name, m in decode_layout_bounds(cm).items()}
        return {
            "label": LABEL,
            "backend": ctx.label,
            "precision": precision,
            "decode_matmuls": decode_matmuls,
            "dram_readers": dram_readers,
            "tp": n,
            "layers": {"gdn": n_gdn, "attention": n_attn},
            "vocab": {"built": cfg.vocab_size, "extrapolated_to": int(cfg.vocab_size * ratio)},
            "context_tokens": context,
            "batch": batch,
            "programs": {"gdn_layer": gdn.programs, "attention_layer": attn.programs, "embed": embed.programs,
                         "head": head.programs, "per_token": token.programs},
            "programs_traced_step_check": {"regions_sum": step_programs, "trace_replay": rep.programs},
            "per_op": {"gdn_layer": dict(gdn.per_op), "attention_layer": dict(attn.per_op), "head": dict(head.per_op)},
            "collectives": {"gdn_layer": gdn.collectives, "attention_layer": attn.collectives,
                            "head": head.collectives, "per_token": token.collectives,
                            "bytes_per_device_per_token": token.collective_bytes},
            "weight_bytes_per_device": {"gdn_layer": lw_gdn, "attention_layer": lw_attn, "lm_head": int(lm_head),
                                        "per_token": int(weight_bytes)},
            "bytes_read_per_device_per_token": token.bytes_read_total,
            "kv_bytes_per_device_per_token_at_context": n_attn * kv_read,
            "kv_bytes_per_device_per_step_at_context": n_attn * kv_read * batch,
            "modelled_ms_per_step": br["total_ms"],
            "modelled_tok_s": 1e3 / br["total_ms"],
            "modelled_aggregate_tok_s": batch * 1e3 / br["total_ms"],
            "breakdown_ms": {k: br[k] for k in ("dram_ms", "dram_interleaved_ms", "dram_sharded_ms", "dispatch_ms",
                                                "collective_fixed_ms", "collective_bw_ms")},
            "bytes_read_by_placement": {k: br["inputs"][k] for k in ("bytes_read_dram_interleaved",
                                                                     "bytes_read_dram_sharded", "bytes_read_l1")},
            "weight_stream_floor_ms": weight_bytes / (cm.dram_bw_gbps * 1e9) * 1e3,
            "decode_layouts_ms": {name: {k: b[k] for k in ("total_ms", "weight_ms", "resident_ms", "activation_ms",
                                                           "dispatch_ms", "collective_fixed_ms", "collective_bw_ms")}
                                  | {"aggregate_tok_s": batch * 1e3 / b["total_ms"],
                                     "weight_bw_gbps": b["constants"]["weight_bw_gbps"] or cm.dram_bw_gbps,
                                     "activations_in_l1": b["constants"]["activations_in_l1"]}
                                  for name, b in layouts.items()},
            "cost_model_constants": br["constants"],
            "roofline_label": ROOFLINE_LABEL,
            "calibrated": cal,
            "calibrated_by_context": calibrated_by_context,
            **({"moe": moe} if moe is not None else {}),
        }
    finally:
        bench.close()


def run(args: argparse.Namespace) -> ProbeReport:
    device = args.device if args.device != "reference" else "emulated-p150x2"
    cfg, base = build_config(args.preset, args.vocab_sample)
    try:
        more = tuple(sorted({int(x) for x in args.contexts.split(",") if x.strip()} - {args.context}))
    except ValueError:
        raise UserError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    bad = [c for c in (args.context,) + more if not 1 <= c <= base.max_position_embeddings]
    if bad:
        raise UserError(f"contexts {bad} outside 1..{base.max_position_embeddings} (the model's positions)")
    fig = measure(device, cfg, args.precision, args.context, args.seed, real_vocab=base.vocab_size,
                  n_gdn=len(base.gdn_layer_ids), n_attn=len(base.attention_layer_ids), real_cfg=base,
                  decode_matmuls=args.decode_matmuls, batch=args.batch, dram_readers=args.dram_readers,
                  more_contexts=more)
    check = fig["programs_traced_step_check"]
    cells = [
        {"cell": "trace records the counted step", "pass": check["regions_sum"] == check["trace_replay"], **check},
        {"cell": "figures", "pass": fig["modelled_ms_per_step"] > 0},
    ]
    print(f"[{fig['label']}] decode-cost {args.preset} {args.precision} tp{fig['tp']} batch {fig['batch']} "
          f"on {fig['backend']} (decode matmuls {args.decode_matmuls}, {args.dram_readers} reader(s) per DRAM bank "
          "asked):")
    print(f"  programs: GDN layer {fig['programs']['gdn_layer']}, attention layer {fig['programs']['attention_layer']}, "
          f"per token {fig['programs']['per_token']}")
    print(f"  weight bytes/device/token {fig['weight_bytes_per_device']['per_token'] / 1e9:.3f} GB, "
          f"collectives/token {fig['collectives']['per_token']} "
          f"({fig['collectives']['bytes_per_device_per_token'] / 1e6:.2f} MB/device)")
    print(f"  [{fig['label']}] {fig['modelled_ms_per_step']:.2f} ms/step, {fig['modelled_tok_s']:.1f} tok/s per user, "
          f"{fig['modelled_aggregate_tok_s']:.1f} tok/s aggregate over {fig['batch']} users on P150a x{fig['tp']} "
          f"(weight-stream floor {fig['weight_stream_floor_ms']:.2f} ms)")
    cal = fig["calibrated"]
    print(f"  [{cal['label']}] {cal['ms']:.2f} ms/step (band {cal['ms_low']:.2f}-{cal['ms_high']:.2f}), "
          f"{cal['tok_s']:.1f} tok/s per user ({cal['tok_s_low']:.1f}-{cal['tok_s_high']:.1f}), "
          f"{cal['aggregate_tok_s']:.1f} aggregate; [{fig['roofline_label']}] {fig['modelled_ms_per_step']:.2f} ms")
    b = cal["breakdown"]
    print(f"  [{cal['label']}] launch {b['launch_ms']:.2f} + kernels {b['kernel_ms']:.2f} + DRAM interleaved "
          f"{b['dram_interleaved_ms']:.2f} + DRAM-sharded {b['dram_sharded_ms']:.2f} + collectives "
          f"{b['collective_fixed_ms']:.2f}+{b['collective_bw_ms']:.2f} ms; kernels by class: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(b["kernel_ms_by_class"].items(), key=lambda kv: -kv[1])))
    print(f"  [{cal['label']}] top programs per step: " + "; ".join(
        f"{r['region']} {r['op'].replace('ttnn.', '')} x{r['programs_per_step']} {r['ms_per_step']:.2f} ms"
        for r in cal["program_ranking"][:8]))
    for c, f in fig["calibrated_by_context"].items():
        print(f"  [{cal['label']}] context {int(c):>6}: {f['ms']:.2f} ms/step (band {f['ms_low']:.2f}-{f['ms_high']:.2f}), "
              f"{f['tok_s']:.2f} tok/s per user ({f['tok_s_low']:.2f}-{f['tok_s_high']:.2f}); DRAM interleaved "
              f"{f['dram_interleaved_ms']:.2f} ms")
    bd = fig["breakdown_ms"]
    print(f"  [{fig['label']}] DRAM {bd['dram_ms']:.2f} ms = interleaved {bd['dram_interleaved_ms']:.2f} + DRAM-sharded "
          f"{bd['dram_sharded_ms']:.2f}; dispatch {bd['dispatch_ms']:.2f}, collectives "
          f"{bd['collective_fixed_ms']:.2f} + {bd['collective_bw_ms']:.2f}")
    for name, lay in fig["decode_layouts_ms"].items():
        print(f"  [{fig['label']}] layout {name}: {lay['total_ms']:.2f} ms/step (weights {lay['weight_ms']:.2f} at "
              f"{lay['weight_bw_gbps']:.0f} GB/s, KV+state {lay['resident_ms']:.2f}, activations {lay['activation_ms']:.2f}"
              f"{' (L1)' if lay['activations_in_l1'] else ''}), {lay['aggregate_tok_s']:.1f} tok/s aggregate")
    return ProbeReport(probe=NAME, backend=fig["backend"],
                       config={"preset": args.preset, "precision": args.precision, "context": args.context,
                               "contexts": [args.context, *more], "decode_matmuls": args.decode_matmuls, "dram_readers": args.dram_readers,
                               "batch": args.batch,
                               "vocab_sample": cfg.vocab_size, "real_vocab": base.vocab_size,
                               "seed": args.seed},
                       cells=cells, counters={"programs": fig["programs"], "collectives": fig["collectives"]},
                       gate_complete=True, performance={"label": fig["label"], **{k: v for k, v in fig.items() if k != "label"}})
