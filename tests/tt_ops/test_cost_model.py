"""Cost model: formula, named overridable constants, "modelled" label, counts from the emulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwen36.tt_ops.cost_model import (
    LABEL,
    P150A_DISPATCH_US_PER_PROGRAM,
    P150A_DRAM_BW_EFFECTIVE_GBPS,
    P150aCostModel,
)
from qwen36.tt_ops.emulator.counters import Counts


def test_formula_and_label():
    c = Counts("decode")
    c.programs = 100
    c.bytes_read["BFLOAT8_B"] = 10 * 10**9  # ~10 GB per card (27B at TP=2)
    c.collectives = 64
    c.collective_bytes = 64 * 10240
    m = P150aCostModel()
    b = m.breakdown(c)
    assert b["label"] == LABEL == "modelled"
    assert b["dram_ms"] == pytest.approx(10e9 / (P150A_DRAM_BW_EFFECTIVE_GBPS * 1e9) * 1e3)
    assert b["dram_ms"] == pytest.approx(24.69, abs=0.01)  # weight-stream floor ~24.6 ms at ~405 GB/s (tt_ops/cost_model.py)
    assert b["dispatch_ms"] == pytest.approx(100 * P150A_DISPATCH_US_PER_PROGRAM * 1e-3)  # the traced launch floor
    assert b["collective_fixed_ms"] == pytest.approx(64 * 10e-3)
    assert b["collective_bw_ms"] == pytest.approx(64 * 10240 / 84e9 * 1e3)
    assert b["total_ms"] == pytest.approx(b["dram_ms"] + b["dispatch_ms"] + b["collective_fixed_ms"]
                                          + b["collective_bw_ms"])
    assert "modelled" in m.describe(c)
    fast = P150aCostModel(dram_bw_gbps=512.0)
    assert fast.predict_ms(c) < m.predict_ms(c)
    assert dataclasses.replace(m, dispatch_us_per_program=0).breakdown(c)["dispatch_ms"] == 0


def test_counts_from_emulator_feed_the_model():
    pytest.importorskip("ttnn")
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        w = ttnn.from_torch(torch.randn(64, 256), dtype=ttnn.bfloat4_b, layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
        w8 = ttnn.from_torch(torch.randn(64, 256), dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh,
                             mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
        x = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        s = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)
        ctx.counters.reset()
        with ctx.counters.scope("step") as step:
            ttnn.linear(x, w)
            ttnn.linear(x, w8)
            ttnn.add(s, s)
        # per device: w shard [64, 128] = 2x4 tiles; x = 2 tiles; s = 2 fp32 tiles (read twice by add)
        assert step.bytes_read["BFLOAT4_B"] == 8 * 576
        assert step.bytes_read["BFLOAT8_B"] == 8 * 1088
        assert step.bytes_read["BFLOAT16"] == 2 * 2 * 2048
        assert step.bytes_read["FLOAT32"] == 2 * 2 * 4096
        assert step.programs == 3 and step.per_op["ttnn.linear"] == 2
        assert ctx.counters.total.programs == 3
        ms = P150aCostModel().predict_ms(step)
        assert ms > 0
        ctx.counters.reset()
        assert ctx.counters.total.programs == 0


def test_verify_cost_ratio_from_counts():
    m = P150aCostModel()
    decode, verify = Counts("decode"), Counts("verify")
    for c, rows in ((decode, 1), (verify, 8)):
        c.bytes_read["BFLOAT8_B"] = 10 * 10**9  # weights stream once per step either way
        c.bytes_read["BFLOAT16"] = rows * 5120 * 2 * 64 * 10  # activations scale with rows
        c.programs = 3000
        c.collectives = 128
        c.collective_bytes = 128 * rows * 5120 * 2
    r = m.verify_cost_ratio(verify, decode)
    assert 1.0 < r < 1.05  # weight-bound: K+1 rows cost barely more than one (modelled)


def test_split_charges_weights_state_and_activations_separately():
    from qwen36.tt_ops.cost_model import P150A_DRAM_BW_SPEC_GBPS, decode_layout_bounds

    c = Counts("decode")
    c.programs = 10
    c.bytes_read["BFLOAT8_B"] = 8 * 10**9  # weights
    c.bytes_read["BFLOAT16"] = 2 * 10**9  # 1.5 GB activations + 0.5 GB KV/state
    models = decode_layout_bounds()
    inter = models["interleaved"].breakdown_split(c, 8 * 10**9, 5 * 10**8)
    # the split leaves the default layout's total unchanged
    assert inter["total_ms"] == pytest.approx(models["interleaved"].predict_ms(c))
    assert inter["activation_ms"] == pytest.approx(1.5e9 / (P150A_DRAM_BW_EFFECTIVE_GBPS * 1e9) * 1e3)
    eff = models["dram_sharded_effective"].breakdown_split(c, 8 * 10**9, 5 * 10**8)
    assert eff["activation_ms"] == 0 and eff["weight_ms"] == pytest.approx(inter["weight_ms"])
    assert eff["total_ms"] == pytest.approx(inter["total_ms"] - inter["activation_ms"])
    peak = models["dram_sharded_peak"].breakdown_split(c, 8 * 10**9, 5 * 10**8)
    assert peak["weight_ms"] == pytest.approx(8e9 / (P150A_DRAM_BW_SPEC_GBPS * 1e9) * 1e3)
    assert peak["resident_ms"] == pytest.approx(eff["resident_ms"])  # state stays at the effective bandwidth
    assert peak["label"] == "modelled"
    with pytest.raises(ValueError, match="activation bytes"):
        models["interleaved"].breakdown_split(c, 9 * 10**9, 2 * 10**9)


# ---- DRAM-sharded decode matmuls: placement-aware charging, the plan, the device op's rules -------------------
def test_reads_are_charged_by_placement():
    from qwen36.tt_ops.cost_model import P150A_DRAM_SHARDED_BANK_GBPS, split_read_bytes

    c = Counts("decode")
    c.bytes_read["BFLOAT8_B@dram_sharded/8"] = 8 * 10**9
    c.bytes_read["BFLOAT8_B@dram_sharded/4"] = 10**9  # a weight over half the banks streams at half the rate
    c.bytes_read["BFLOAT16"] = 10**9
    c.bytes_read["BFLOAT16@l1"] = 5 * 10**9
    assert split_read_bytes(c.bytes_read) == (10**9, {8: 8 * 10**9, 4: 10**9}, 5 * 10**9)
    b = P150aCostModel().breakdown(c)
    assert P150A_DRAM_SHARDED_BANK_GBPS == pytest.approx(512 / 8 * 0.92)
    sharded = 8e9 / (8 * P150A_DRAM_SHARDED_BANK_GBPS * 1e9) * 1e3 + 1e9 / (4 * P150A_DRAM_SHARDED_BANK_GBPS * 1e9) * 1e3
    assert b["dram_sharded_ms"] == pytest.approx(sharded)
    assert b["dram_interleaved_ms"] == pytest.approx(1e9 / (P150A_DRAM_BW_EFFECTIVE_GBPS * 1e9) * 1e3)
    assert b["dram_ms"] == pytest.approx(b["dram_sharded_ms"] + b["dram_interleaved_ms"])  # L1 bytes not charged
    assert b["inputs"]["bytes_read_l1"] == 5 * 10**9 and b["inputs"]["bytes_read_per_device"] == 15 * 10**9


def _args(decode_matmuls="dram_sharded"):
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.model_config import PrecisionSetting, TTModelArgs

    return TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance(), decode_matmuls=decode_matmuls)


def test_decode_plan_at_27b_mlp_shapes():
    """27B per device at TP=2: gate/up [5120, 8704], down [8704, 5120]: 160 and 272 tiles share 16 cores, so the
    gate/up output shard (8704 / 16 wide) is exactly down's input shard; no bank padding (272 and 160 tiles over 8)."""
    pytest.importorskip("ttnn")
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan, dram_sharded_weight_memory_config
    from qwen36.tt.model.model_config import TensorGroup
    from qwen36.tt_ops.emulator.ttnn_import import ttnn

    args = _args()
    gu = decode_matmul_plan(ttnn, args, TensorGroup.MLP_GATE_UP, 1, 5120, 8704)
    dn = decode_matmul_plan(ttnn, args, TensorGroup.MLP_DOWN, 8, 8704, 5120)
    assert (gu.cores, gu.grid) == (dn.cores, dn.grid) == (16, (8, 2))
    assert isinstance(gu.program_config, ttnn.MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig)
    assert (gu.program_config.in0_block_w, gu.program_config.per_core_M, gu.program_config.per_core_N) == (10, 1, 17)
    assert (dn.program_config.in0_block_w, dn.program_config.per_core_N) == (17, 10)
    assert list(gu.output_memory_config.shard_spec.shape) == list(dn.input_memory_config.shard_spec.shape) == [32, 544]
    assert gu.input_memory_config.buffer_type == ttnn.BufferType.L1
    assert list(dram_sharded_weight_memory_config(ttnn, 5120, 8704, 8).shard_spec.shape) == [5120, 1088]
    # prefill rows, other groups and the interleaved layout take ttnn's default config
    assert decode_matmul_plan(ttnn, args, TensorGroup.MLP_GATE_UP, 33, 5120, 8704) is None
    assert decode_matmul_plan(ttnn, args, TensorGroup.ATTN_QKV, 1, 5120, 8704) is None
    assert decode_matmul_plan(ttnn, _args("interleaved"), TensorGroup.MLP_GATE_UP, 1, 5120, 8704) is None
    with pytest.raises(ValueError, match="decode_matmuls"):
        _args("l1")


def test_decode_plan_at_27b_lm_head_shapes():
    """27B LM head per device at TP=2: [5120, 124160] (160 x 3880 tiles): 40 cores (8 x 5), 4 K tiles and 97 N tiles
    each; two readers per DRAM bank on 486-tile bank shards (3880 / 8 = 485 does not split between two readers: the
    last bank's shard carries 8 tiles of padding), one reader on 485-tile shards. The interleaved layout keeps
    ttnn's default config."""
    pytest.importorskip("ttnn")
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.decode_matmuls import (decode_matmul_plan, dram_sharded_weight_memory_config,
                                                matrix_memory_config)
    from qwen36.tt.model.model_config import PrecisionSetting, TensorGroup, TTModelArgs
    from qwen36.tt_ops.emulator.ttnn_import import ttnn

    p = decode_matmul_plan(ttnn, _args(), TensorGroup.LM_HEAD, 1, 5120, 124160)
    assert (p.cores, p.grid) == (40, (8, 5))
    assert (p.program_config.in0_block_w, p.program_config.per_core_M, p.program_config.per_core_N) == (4, 1, 97)
    assert p.program_config.num_workers_per_dram_bank == 2
    assert list(p.output_memory_config.shard_spec.shape) == [32, 3104]
    assert list(dram_sharded_weight_memory_config(ttnn, 5120, 124160, 8).shard_spec.shape) == [5120, 15520]
    assert list(dram_sharded_weight_memory_config(ttnn, 5120, 124160, 8, 2).shard_spec.shape) == [5120, 15552]
    # the weight is placed for the readers its matmul asks for, at either reader setting
    assert list(matrix_memory_config(ttnn, _args(), TensorGroup.LM_HEAD, 5120, 124160, 8).shard_spec.shape) == \
        [5120, 15552]
    one = TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance(), dram_readers=1,
                                  decode_matmuls="dram_sharded")
    assert decode_matmul_plan(ttnn, one, TensorGroup.LM_HEAD, 1, 5120, 124160).program_config \
        .num_workers_per_dram_bank == 1
    assert list(matrix_memory_config(ttnn, one, TensorGroup.LM_HEAD, 5120, 124160, 8).shard_spec.shape) == \
        [5120, 15520]
    assert decode_matmul_plan(ttnn, _args(), TensorGroup.LM_HEAD, 33, 5120, 124160) is None
    assert decode_matmul_plan(ttnn, _args("interleaved"), TensorGroup.LM_HEAD, 1, 5120, 124160) is None


@pytest.fixture(scope="module")
def dram_sharded_case():
    pytest.importorskip("ttnn")
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan, dram_sharded_weight_memory_config
    from qwen36.tt.model.model_config import TensorGroup
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        k, n = 256, 512
        plan = decode_matmul_plan(ttnn, _args(), TensorGroup.MLP_GATE_UP, 1, k, n)
        wt = torch.randn(k, n) / 16
        w = ttnn.from_torch(wt, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh,
                            memory_config=dram_sharded_weight_memory_config(ttnn, k, n, 8))
        w_inter = ttnn.from_torch(wt, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh,
                                  memory_config=ttnn.DRAM_MEMORY_CONFIG)
        xt = torch.randn(1, 1, 1, k)
        x = ttnn.from_torch(xt, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            memory_config=ttnn.DRAM_MEMORY_CONFIG)
        yield ctx, plan, w, w_inter, x, xt @ wt


def test_dram_sharded_matmul_runs_and_counts_bank_bytes(dram_sharded_case):
    from qwen36.testing.pcc import comp_pcc

    ctx, plan, w, _, x, want = dram_sharded_case
    ttnn = ctx.ttnn
    with ctx.counters.scope("mm") as c:
        xs = ttnn.to_memory_config(x, plan.input_memory_config)
        y = ttnn.linear(xs, w, program_config=plan.program_config, memory_config=plan.output_memory_config,
                        dtype=ttnn.bfloat16)
    assert y.memory_config().is_sharded() and y.memory_config().buffer_type == ttnn.BufferType.L1
    got = ttnn.to_torch(y, mesh_composer=ttnn.ConcatMeshToTensor(ctx.mesh_device, dim=0))[:1]
    ok, msg = comp_pcc(want, got, 0.999)
    assert ok, msg
    # the weight: 8 banks x [256, 64] bf8 shards = 8 x 16 tiles, streamed by two readers per bank (the plan's
    # default where the 2-tile bank shards split evenly); the activation read from L1 by the matmul
    assert plan.program_config.num_workers_per_dram_bank == 2
    assert c.bytes_read["BFLOAT8_B@dram_sharded/8x2"] == 8 * 16 * 1088
    assert c.bytes_read["BFLOAT16@l1"] == 8 * 2048 and c.bytes_read["BFLOAT16"] == 8 * 2048


@pytest.mark.parametrize("case", ["in0_interleaved", "out_interleaved", "rows_over_a_tile", "in0_block_w",
                                  "in1_interleaved", "per_core_N"])
def test_dram_sharded_matmul_rules(dram_sharded_case, case):
    """The device op's validation of the DRAM-sharded program config, each rule broken once."""
    from qwen36.tt_ops.emulator.errors import EmulatorError

    ctx, plan, w, w_inter, x, _ = dram_sharded_case
    ttnn = ctx.ttnn
    pc, in_mc, out_mc, weight = plan.program_config, plan.input_memory_config, plan.output_memory_config, w
    kw = dict(in0_block_w=pc.in0_block_w, per_core_M=1, per_core_N=pc.per_core_N, fused_activation=None)
    a = ttnn.to_memory_config(x, in_mc)
    match = {"in0_interleaved": "WIDTH_SHARDED", "out_interleaved": "sharded", "rows_over_a_tile": "per_core_M",
             "in0_block_w": "in0_block_w", "in1_interleaved": "input_tensor_b", "per_core_N": "per_core_N"}[case]
    if case == "in0_interleaved":
        a = x
    elif case == "out_interleaved":
        out_mc = ttnn.DRAM_MEMORY_CONFIG
    elif case == "rows_over_a_tile":
        big = ttnn.from_torch(torch.randn(1, 1, 40, 256), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                              device=ctx.mesh_device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        a = ttnn.to_memory_config(big, ttnn.create_sharded_memory_config(
            shape=(64, 256 // plan.cores), core_grid=ttnn.CoreGrid(y=plan.grid[1], x=plan.grid[0]),
            strategy=ttnn.ShardStrategy.WIDTH, orientation=ttnn.ShardOrientation.ROW_MAJOR,
            use_height_and_width_as_shard_shape=True))
    elif case == "in0_block_w":
        kw["in0_block_w"] = 3
    elif case == "in1_interleaved":
        weight = w_inter
    else:
        kw["per_core_N"] = pc.per_core_N - 1
    bad = ttnn.MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig(**kw)
    with pytest.raises(EmulatorError, match=match):
        ttnn.linear(a, weight, program_config=bad, memory_config=out_mc, dtype=ttnn.bfloat16)


def test_moe_shared_expert_stays_interleaved():
    """A MoE model's shared expert is too small for the two reshards to pay: no DRAM-sharded plan, no sharded weight."""
    pytest.importorskip("ttnn")
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan, uses_dram_sharded_weights
    from qwen36.tt.model.model_config import PrecisionSetting, TensorGroup, TTModelArgs
    from qwen36.tt_ops.emulator.ttnn_import import ttnn

    args = TTModelArgs.from_config(PRESETS["moe-ci"], 2, PrecisionSetting.performance())
    assert not uses_dram_sharded_weights(args, TensorGroup.MLP_GATE_UP, 64, 32)
    assert decode_matmul_plan(ttnn, args, TensorGroup.MLP_DOWN, 1, 32, 64) is None
    assert uses_dram_sharded_weights(_args(), TensorGroup.MLP_GATE_UP, 64, 32)


def test_decode_plan_readers_per_bank_at_27b_shapes():
    """Two readers per DRAM bank for the 27B MLP (34- and 20-tile shards split evenly at TP=2) and the LM head (its
    shards laid out 486 tiles wide for two readers); dram_readers=1 asks one everywhere; out of range is refused."""
    pytest.importorskip("ttnn")
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan, decode_readers_per_bank, dram_bank_shard_tiles
    from qwen36.tt.model.model_config import PrecisionSetting, TensorGroup, TTModelArgs
    from qwen36.tt_ops.emulator.ttnn_import import ttnn

    args = _args()
    assert args.dram_readers == 2
    readers = {g: decode_matmul_plan(ttnn, args, g, 1, k, n).program_config.num_workers_per_dram_bank
               for g, k, n in ((TensorGroup.MLP_GATE_UP, 5120, 8704), (TensorGroup.MLP_DOWN, 8704, 5120),
                               (TensorGroup.LM_HEAD, 5120, 124160))}
    assert readers == {TensorGroup.MLP_GATE_UP: 2, TensorGroup.MLP_DOWN: 2, TensorGroup.LM_HEAD: 2}
    # regression: the probes build a cut vocabulary (4096 -> 2048 columns per device) and scale the LM head's bytes
    # to the real one: the head's reader count must not depend on the built vocabulary (once the cut head got two
    # readers where the real one had one, and the probe charged 1.48 instead of 2.42 ms per step). Both get two now,
    # the real one through its 486-tile shards; a vocabulary whose shards cannot be laid out for two keeps one.
    assert decode_readers_per_bank(args, 2048, group=TensorGroup.LM_HEAD) == 2
    assert decode_readers_per_bank(args, 124160, group=TensorGroup.LM_HEAD) == 2
    assert decode_readers_per_bank(args, 2048, group=TensorGroup.MLP_GATE_UP) == 2
    assert decode_readers_per_bank(args, 2048, group=TensorGroup.ATTN_QKV) == 1
    one = TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance(), dram_readers=1)
    assert decode_readers_per_bank(one, 8704) == 1 and decode_readers_per_bank(args, 8704) == 2
    # 27B gate/up at TP=4: 136 tiles are 17 per bank, which two readers cannot split; laid out 18 wide they can
    assert dram_bank_shard_tiles(136, 8, 2) == 18 and decode_readers_per_bank(args, 4352) == 2
    three = TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance(), dram_readers=3)
    assert [decode_readers_per_bank(three, n, group=g) for n, g in ((8704, TensorGroup.MLP_GATE_UP),
            (5120, TensorGroup.MLP_DOWN), (124160, TensorGroup.LM_HEAD))] == [3, 3, 3]  # 36-, 21-, 486-tile shards
    with pytest.raises(ValueError, match="dram_readers"):
        TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance(), dram_readers=4)
