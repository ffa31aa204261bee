"""Cost model: formula, named overridable constants, "modelled" label, counts from the emulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwen36.tt_ops.cost_model import (
    LABEL,
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
    assert b["dispatch_ms"] == pytest.approx(100 * 4e-3)
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
