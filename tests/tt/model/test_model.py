"""Full TT model on the emulated mesh vs the reference: prefill logits, greedy tokens, per-step decode logits,
traced == untraced decode, TP widths 1/2/4, split errors, weight cache, CLI."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model
from qwen36.tiny import PRESETS
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.model.model_config import PrecisionSetting, TPSplitError, TTModelArgs
from qwen36.testing.pcc import PCC_GATES, comp_pcc
from qwen36.testing.tt import make_bf16_checkpoint, tp4_config

DECODE_STEPS = 32
# Random-weight tiny models have near-ties (reference top-2 gaps down to ~1e-3) that no bf16 arithmetic can
# order; exact-token gates run on prompts whose reference top-2 gap stays >= MIN_MARGIN at every step
# (asserted, not assumed). TT's max abs logit error on the CI checkpoint is ~0.1 (accuracy preset); the error of a
# top-2 *difference* is usually far smaller but reached 0.08 on one step of an earlier draw of the CI weights (teacher-forced: reference gap
# 0.096, TT gap 0.017 with fp32 matmul arithmetic, 0.008 with card arithmetic, where the fp32 GDN activations
# enter the FPU as TF32; the greedy continuation flips there under card arithmetic). Token equality over 32
# random-weight steps is a property of the arithmetic, not of the TT graph, so the exact-token test runs the
# graph with fp32 matmul arithmetic (numerics="exact", an A/B mode of the emulator); card-arithmetic decisions are
# gated by test_argmax_agrees_wherever_the_reference_decides (clear margins) and the PCC gates.
MIN_MARGIN = 0.02
# prompt length 16; reference min top-2 gap over 32 greedy steps 0.054 (of prompt seeds 0-39, only 2, 12, 13, 22 and
# 23 keep every gap >= 0.02)
GREEDY_PROMPT_SEED = 2


def prompt(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(8, 48, (1,), generator=g))
    return torch.randint(0, 512, (n,), generator=g)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-model-ci"), "ci", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)


def make_gen(ckpt, precision="accuracy", device="emulated-p150x2", **kw):
    return TTGenerator.from_checkpoint(ckpt, device, precision=precision, max_seq_len=256, progress=False,
                                       block_size=32, prefill_chunk=64, **kw)


@pytest.fixture(scope="module")
def gen_acc(ckpt):
    g = make_gen(ckpt, "accuracy")
    yield g
    g.close()


@pytest.fixture(scope="module")
def gen_perf(ckpt):
    g = make_gen(ckpt, "performance")
    yield g
    g.close()


def ref_greedy_with_margins(ref, ids, n):
    toks = generate(ref, [ids], n)[0].tokens
    full = torch.cat([ids, torch.tensor(toks)])
    lg = ref(full[None], ref.new_state(1, full.numel() + 1)).logits[0, ids.numel() - 1: ids.numel() - 1 + n]
    top2 = lg.topk(2, -1).values
    return toks, lg, (top2[:, 0] - top2[:, 1])


@pytest.mark.parametrize("preset", ["accuracy", "performance"])
def test_prefill_logits_pcc_chunked(request, ref, preset):
    """100-token prompt, prefill chunks of 64 (two chunks, the second partial and page-aligned)."""
    gen = request.getfixturevalue("gen_acc" if preset == "accuracy" else "gen_perf")
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(7))
    got = gen.teacher_forced_logits(ids)
    exp = ref(ids[None], ref.new_state(1, 128)).logits[0]
    ok, msg = comp_pcc(exp, got, PCC_GATES["model_prefill"])
    assert ok, f"prefill logits ({preset}): {msg}"


def test_prefill_logits_pcc_fused_gdn(tmp_path_factory):
    """The same 100-token prompt at the config whose GDN prefill runs ttnn's fused ops (GDN heads a tile wide), the
    accuracy preset: the fused prefill holds the model gate and argmax agrees with the reference on every row but
    near ties."""
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("tt-model-gdn32"), "ci-gdn32", seed=0)
    ref32 = Qwen36Model.from_checkpoint(ck, dtype=torch.float32)
    gen = make_gen(ck, "accuracy")
    try:
        gdn = [layer.mixer for layer in gen.model.layers if layer.layer_type != "full_attention"]
        assert {m.prefill_path for m in gdn} == {"fused"}
        ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(7))
        got = gen.teacher_forced_logits(ids)
    finally:
        gen.close()
    exp = ref32(ids[None], ref32.new_state(1, 128)).logits[0]
    ok, msg = comp_pcc(exp, got, PCC_GATES["model_prefill"])
    assert ok, f"fused-GDN prefill logits: {msg}"
    top2 = exp.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(exp.argmax(-1)[decided], got.argmax(-1)[decided])


@pytest.mark.slow
def test_greedy_32_tokens_exact_bf16(ckpt, ref):
    ids = prompt(GREEDY_PROMPT_SEED)
    exp, _, margins = ref_greedy_with_margins(ref, ids, DECODE_STEPS)
    assert margins.min() >= MIN_MARGIN, f"precondition: reference top-2 gap {margins.min():.4f} < {MIN_MARGIN}"
    gen = make_gen(ckpt, "accuracy", mesh_kw={"numerics": "exact"})
    try:
        got = gen.generate([ids.tolist()], DECODE_STEPS)[0].tokens
    finally:
        gen.close()
    assert got == exp, f"TT greedy diverges at step {next(i for i, (a, b) in enumerate(zip(got, exp)) if a != b)}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_argmax_agrees_wherever_the_reference_decides(gen_acc, ref, seed):
    """No prompt picking: over the reference's own 32-token greedy continuation, TT (teacher-forced) picks the
    reference's token at every row whose top-2 gap exceeds 0.25 (> 2x TT's max abs logit error)."""
    ids = prompt(seed)
    toks, lg, margins = ref_greedy_with_margins(ref, ids, DECODE_STEPS)
    got = gen_acc.teacher_forced_logits(torch.cat([ids, torch.tensor(toks)]))[ids.numel() - 1: ids.numel() - 1 + DECODE_STEPS]
    decided = margins > 0.25
    assert decided.sum() >= DECODE_STEPS // 4, "too few clear reference decisions to test"
    bad = (got.argmax(-1) != lg.argmax(-1)) & decided
    assert not bad.any(), f"rows {bad.nonzero().flatten().tolist()} disagree despite a clear reference decision"


@pytest.mark.slow
def test_decode_logits_pcc_every_step_bf8(gen_perf, ref):
    """Traced decode (performance preset) fed the reference's greedy tokens: logits PCC >= 0.98 at each step."""
    ids = prompt(GREEDY_PROMPT_SEED)
    toks, lg, _ = ref_greedy_with_margins(ref, ids, DECODE_STEPS)
    gen_perf.prefill(ids)
    worst = 1.0
    for i in range(DECODE_STEPS - 1):
        logits, _ = gen_perf.decode_step(toks[i])
        ok, msg = comp_pcc(lg[i + 1], logits, PCC_GATES["model_decode_bf8"])
        assert ok, f"decode step {i}: {msg}"
    assert gen_perf.decoder.trace_name in gen_perf.decoder.traces.steps, "decode ran untraced"


@pytest.mark.slow
def test_traced_decode_equals_untraced_bitwise(ckpt):
    """Same inputs through the eager step and through trace replays: identical logits bit for bit. Every
    replay gets a new token/position through the persistent input buffers, so a stale buffer shows up as a
    mismatch; after a new prompt (trace released, re-captured) results are again correct and bitwise equal."""
    feeds = [prompt(4).tolist(), [5, 9, 33, 7, 100, 200, 3, 77]]  # (prompt, teacher-forced decode tokens)
    feeds2 = [prompt(5).tolist(), [8, 8, 1, 400, 2]]

    def run(use_trace):
        g = make_gen(ckpt, "accuracy", use_trace=use_trace)
        outs = []
        for i, (p, toks) in enumerate((feeds, feeds2)):
            g.prefill(p)
            outs.append([g.decode_step(t)[0] for t in toks])
            if use_trace:  # captured once per prompt (the new prompt released the first trace)
                assert g.decoder.traces.captures[g.decoder.trace_name] == i + 1
        g.close()
        return outs

    eager, traced = run(False), run(True)
    for seq_e, seq_t in zip(eager, traced):
        for i, (a, b) in enumerate(zip(seq_e, seq_t)):
            assert torch.equal(a, b), f"step {i}: traced != untraced (max abs {(a - b).abs().max():.3e})"
        for a, b in zip(seq_t, seq_t[1:]):
            assert not torch.equal(a, b), "two replays with different inputs gave identical logits (stale inputs?)"


@pytest.mark.slow
def test_decode_matmul_layouts_same_logits_bitwise(ckpt):
    """The decode layouts of the MLP and LM-head matmuls (mcast_1d, dram_sharded, interleaved) move where weights and
    activations live and which program config runs, not the arithmetic: prefill logits and traced decode logits are
    the same bits in all three (performance preset, bf8 weights)."""
    ids, toks = prompt(4).tolist(), [5, 9, 33, 7, 100]
    runs = {}
    for layout in ("mcast_1d", "dram_sharded", "interleaved"):
        g = make_gen(ckpt, "performance", decode_matmuls=layout)
        runs[layout] = [g.prefill(ids)] + [g.decode_step(t)[0] for t in toks]
        g.close()
    for layout in ("dram_sharded", "interleaved"):
        for i, (a, b) in enumerate(zip(runs["mcast_1d"], runs[layout])):
            assert torch.equal(a, b), f"{layout} step {i}: max abs {(a - b).abs().max():.3e}"


@pytest.fixture(scope="module")
def tp4_ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-tp4"), tp4_config(), seed=1)


@pytest.mark.slow  # three TP widths
def test_widths_1_2_4_same_tokens(tp4_ckpt):
    ref = Qwen36Model.from_checkpoint(tp4_ckpt, dtype=torch.float32)
    ids = None
    for seed in range(20):  # first prompt whose reference decisions are all clear (asserted below)
        cand = prompt(seed)
        exp, _, margins = ref_greedy_with_margins(ref, cand, 16)
        if margins.min() >= MIN_MARGIN:
            ids = cand
            break
    assert ids is not None, "no prompt with a clear reference decision at every step"
    results = {}
    for dev in ("emulated-p150", "emulated-p150x2", "emulated-p150x4"):
        g = make_gen(tp4_ckpt, "accuracy", device=dev)
        results[dev] = g.generate([ids.tolist()], 16)[0].tokens
        g.close()
    assert len({tuple(v) for v in results.values()}) == 1, f"widths disagree: {results}"
    assert results["emulated-p150x2"] == exp


def test_split_error_names_the_field():
    with pytest.raises(TPSplitError, match="num_key_value_heads' = 2 cannot be split over 4 devices"):
        TTModelArgs.from_config(PRESETS["ci"], 4, PrecisionSetting.accuracy())
    from dataclasses import replace

    attn_ok = replace(PRESETS["ci"], num_attention_heads=8, num_key_value_heads=4)
    with pytest.raises(TPSplitError, match="'linear_num_key_heads' = 2 cannot be split over 4 devices"):
        TTModelArgs.from_config(attn_ok, 4, PrecisionSetting.accuracy())


def test_precision_presets_validate():
    p = PrecisionSetting.performance()
    assert p.dtypes[next(g for g in p.dtypes if g.value == "mlp_gate_up")] == "bfloat8_b"
    with pytest.raises(ValueError, match="gdn_state' must be float32"):
        PrecisionSetting.accuracy().with_group(next(g for g in p.dtypes if g.value == "gdn_state"), "bfloat16")
    with pytest.raises(ValueError, match="bfloat4_b is only allowed"):
        PrecisionSetting.accuracy().with_group(next(g for g in p.dtypes if g.value == "lm_head"), "bfloat4_b")


def test_precision_names_parse_modifiers_and_round_trip():
    """``named`` reads the names ``with_group`` / ``with_mtp`` give; ``+mtp=`` sets only the MTP head's own matrices
    (fc + its layer), never the shared LM head, and the target's dtypes stay the base preset's."""
    from qwen36.tt.model.model_config import MTP_HEAD_GROUPS, PRESET_NAMES, TensorGroup as G

    perf, acc, bf4 = (PrecisionSetting.named(n) for n in ("performance", "accuracy", "performance-bf4"))
    assert sorted(PRESET_NAMES) == sorted(p.name for p in (perf, acc, bf4))
    s = PrecisionSetting.named("performance+mtp=accuracy")
    assert (s.name, s.mtp, s.dtypes) == ("performance+mtp=accuracy", "accuracy", perf.dtypes)
    head = s.for_mtp_head().dtypes
    assert {g: head[g] for g in MTP_HEAD_GROUPS} == {g: "bfloat16" for g in MTP_HEAD_GROUPS}
    assert head[G.LM_HEAD] == "bfloat8_b" and head[G.GDN_IN] == "bfloat8_b"
    assert {g: d for g, d in head.items() if g not in MTP_HEAD_GROUPS} == \
        {g: d for g, d in perf.dtypes.items() if g not in MTP_HEAD_GROUPS}
    both = PrecisionSetting.named("performance+lm_head=bfloat16+mtp=performance-bf4")
    assert both == perf.with_group(G.LM_HEAD, "bfloat16").with_mtp("performance-bf4")
    assert PrecisionSetting.named(both.name) == both
    assert both.dtypes[G.LM_HEAD] == "bfloat16" and both.dtypes[G.MLP_GATE_UP] == "bfloat8_b"
    hb = both.for_mtp_head().dtypes
    assert (hb[G.LM_HEAD], hb[G.MLP_GATE_UP], hb[G.MLP_DOWN], hb[G.ATTN_QKV]) == \
        ("bfloat16", "bfloat4_b", "bfloat8_b", "bfloat8_b")
    assert perf.for_mtp_head() is perf  # no head preset: the target's setting itself
    for bad, msg in (("performance+mtp=fast", "MTP head preset 'fast'"),
                     ("performance+mtp=accuracy+mtp", "is not KEY=VALUE"),
                     ("performance+lmhead=bfloat16", "'lmhead' is neither 'mtp' nor a tensor group"),
                     ("performance+lm_head=bfloat4_b", "bfloat4_b is only allowed"),
                     ("fast+mtp=accuracy", "unknown precision preset 'fast'")):
        with pytest.raises(ValueError, match=msg):
            PrecisionSetting.named(bad)


def test_mtp_head_args_only_change_the_precision():
    from qwen36.tt.model.model_config import TensorGroup, mtp_head_args

    a = TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.named("performance+mtp=accuracy"), max_seq_len=128)
    h = mtp_head_args(a)
    assert h.precision.dtypes == a.precision.for_mtp_head().dtypes and h.precision.mtp is None
    assert a.dtype_name(TensorGroup.MLP_DOWN) == "bfloat8_b" and h.dtype_name(TensorGroup.MLP_DOWN) == "bfloat16"
    assert (h.cfg, h.num_devices, h.max_seq_len, h.block_size) == (a.cfg, a.num_devices, a.max_seq_len, a.block_size)
    plain = TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.named("performance"))
    assert mtp_head_args(plain) is plain


def test_weight_cache_second_load_skips_conversion(ckpt, tmp_path):
    from qwen36.tt_ops.device import open_mesh
    from qwen36.tt_ops.emulator import ops_core

    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.model.weights import WeightLoader

    reader = load_checkpoint(ckpt)
    with open_mesh("emulated-p150x2") as ctx:
        args = TTModelArgs.from_config(reader.config, 2, PrecisionSetting.performance(), max_seq_len=64)
        before = dict(ops_core.STATS)
        w1 = WeightLoader(reader, args, ctx.ttnn, ctx.mesh_device, tmp_path, progress=False).load(layers=[0])
        mid = dict(ops_core.STATS)
        w2 = WeightLoader(reader, args, ctx.ttnn, ctx.mesh_device, tmp_path, progress=False).load(layers=[0])
        after = dict(ops_core.STATS)
        n = mid["as_tensor_conversions"] - before["as_tensor_conversions"]
        assert n > 0 and after["as_tensor_conversions"] == mid["as_tensor_conversions"], "second load converted again"
        assert after["as_tensor_cache_loads"] - mid["as_tensor_cache_loads"] == n
        comp = ctx.ttnn.ConcatMeshToTensor(ctx.mesh_device, dim=-1)
        a = ctx.ttnn.to_torch(w1.layers[0].mixer.in_proj, mesh_composer=comp)
        b = ctx.ttnn.to_torch(w2.layers[0].mixer.in_proj, mesh_composer=comp)
        assert torch.equal(a, b)


def test_gdn_and_attention_row_layouts():
    """Host rearrangement: device d gets [q_d | k_d | v_d] of the GDN rows, [q_d | k_d | v_d] and gate_d of the
    attention rows."""
    from qwen36.tt.model.weights import attention_qkv_rows, gdn_qkv_rows

    hk, dk, hv, dv, n, h = 4, 2, 12, 3, 2, 5
    qkv = torch.arange((2 * hk * dk + hv * dv) * h, dtype=torch.float32).reshape(-1, h)
    rows = gdn_qkv_rows(qkv, hk, dk, hv, dv, n).chunk(n)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv])
    for d in range(n):
        want = torch.cat([q.chunk(n)[d], k.chunk(n)[d], v.chunk(n)[d]])
        assert torch.equal(rows[d], want)
    hq, hkv, hd = 4, 2, 3
    qp = torch.arange(2 * hq * hd * h, dtype=torch.float32).reshape(-1, h)
    kp, vp = -torch.ones(hkv * hd, h), -2 * torch.ones(hkv * hd, h)
    rows, gate = attention_qkv_rows(qp, kp, vp, hq, hd, n)
    rows, gate = rows.chunk(n), gate.chunk(n)
    per_head = qp.reshape(hq, 2, hd, h)
    for d in range(n):
        heads = per_head[d * hq // n:(d + 1) * hq // n]
        assert torch.equal(rows[d], torch.cat([heads[:, 0].reshape(-1, h), kp.chunk(n)[d], vp.chunk(n)[d]]))
        assert torch.equal(gate[d], heads[:, 1].reshape(-1, h))


@pytest.mark.slow
def test_cli_generate_and_logits_on_emulated_mesh(ckpt, ref, gen_perf, tmp_path, capsys, monkeypatch):
    """``qwen36 generate|logits --device emulated-p150x2`` run the TT model (performance preset): same tokens as
    the generator API, logits within the prefill gate of the reference; the second command loads the weight
    cache the first one wrote (default cache dir under $HOME, redirected here)."""
    from safetensors.torch import load_file
    from qwen36.tt_ops.emulator import ops_core

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from qwen36.cli import main

    ids = prompt(GREEDY_PROMPT_SEED).tolist()
    assert main(["generate", "-c", str(ckpt), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "6",
                 "--device", "emulated-p150x2"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ids:"))
    assert [int(x) for x in line[4:].split(",")] == gen_perf.generate([ids], 6)[0].tokens
    out = tmp_path / "l.safetensors"
    loads = ops_core.STATS["as_tensor_cache_loads"]
    conversions = ops_core.STATS["as_tensor_conversions"]
    assert main(["logits", "-c", str(ckpt), "--ids", ",".join(map(str, ids)), "--out", str(out),
                 "--device", "emulated-p150x2"]) == 0
    assert ops_core.STATS["as_tensor_conversions"] == conversions and ops_core.STATS["as_tensor_cache_loads"] > loads
    ok, msg = comp_pcc(ref(torch.tensor([ids]), ref.new_state(1, 64)).logits[0], load_file(out)["logits"],
                       PCC_GATES["model_prefill"])
    assert ok, msg


def test_weight_cache_names_carry_the_bank_shard_width(ckpt, tmp_path):
    """ttnn.as_tensor (0.81.1) loads a cached tensor with the memory config it was stored with, so a DRAM-sharded
    weight whose bank shards change width (readers per bank: 1 -> 2 makes the CI LM head's shards 1 -> 2 tiles) must
    not load an old file: the width is in the file name, and the second loader converts the head again."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.model.weights import WeightLoader
    from qwen36.tt_ops.device import open_mesh

    reader = load_checkpoint(ckpt)
    with open_mesh("emulated-p150x2") as ctx:
        for readers in (1, 2):
            args = TTModelArgs.from_config(reader.config, 2, PrecisionSetting.performance(), max_seq_len=64,
                                           dram_readers=readers, decode_matmuls="dram_sharded")
            w = WeightLoader(reader, args, ctx.ttnn, ctx.mesh_device, tmp_path, progress=False).load(layers=[])
            assert list(w.lm_head.memory_config().shard_spec.shape) == [64, 32 * readers]
    names = sorted(p.name.split("_dtype_")[0] for p in (tmp_path / "tp2").iterdir() if p.name.startswith("lm_head"))
    assert names == ["lm_head_bankw32", "lm_head_bankw64"], names
