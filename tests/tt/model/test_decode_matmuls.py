"""Decode matmul plans (tt/model/decode_matmuls.py) at the 27B's shapes; a 1D plan's matmul on the emulated mesh (the
device op's rules for its config: tests/emulator/test_matmul_1d.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")


def _args(layout="mcast_1d", preset="ci", n=2):
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.model_config import PrecisionSetting, TTModelArgs

    return TTModelArgs.from_config(PRESETS[preset], n, PrecisionSetting.performance(), decode_matmuls=layout)


def test_default_layout_is_mcast_1d():
    assert _args().decode_matmuls == "mcast_1d"
    from qwen36.tiny import PRESETS
    from qwen36.tt.model.model_config import PrecisionSetting, TTModelArgs

    assert TTModelArgs.from_config(PRESETS["ci"], 2, PrecisionSetting.performance()).decode_matmuls == "mcast_1d"
    with pytest.raises(ValueError, match="decode_matmuls"):
        _args("l1")


@pytest.mark.parametrize("tp,gu_n,dn_k,vocab_n", [(2, 8704, 8704, 124160), (4, 4352, 4352, 62080)])
def test_mcast_1d_plans_at_27b_shapes(tp, gu_n, dn_k, vocab_n):
    """27B per device: gate/up on an 11 x 4 grid (Tenstorrent's fastest measured gate/up grid), ceil(N / 44) tiles
    per core; down on 32 cores (8 x 4) of 5 tiles each, its output in whole [32, 160] L1 width shards for the
    single-op all-reduce; the LM head on the whole 11 x 10 grid, straight to DRAM. Every matmul streams the whole K
    in blocks of 8 tiles; the weights stay DRAM-interleaved; prefill rows and other groups take ttnn's default."""
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan, matrix_memory_config
    from qwen36.tt.model.model_config import TensorGroup
    from qwen36.tt_ops.emulator.ttnn_import import ttnn

    args, grid = _args(), ttnn.CoreCoord(11, 10)
    gu = decode_matmul_plan(ttnn, args, TensorGroup.MLP_GATE_UP, 1, 5120, gu_n, grid)
    dn = decode_matmul_plan(ttnn, args, TensorGroup.MLP_DOWN, 8, dn_k, 5120, grid)
    lm = decode_matmul_plan(ttnn, args, TensorGroup.LM_HEAD, 32, 5120, vocab_n, grid)
    for p in (gu, dn, lm):
        assert isinstance(p.program_config, ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig)
        assert p.program_config.mcast_in0 and p.program_config.per_core_M == 1 and p.program_config.in0_block_w == 8
        assert p.input_memory_config is None and p.layout == "mcast_1d"
        assert not matrix_memory_config(ttnn, args, TensorGroup.MLP_GATE_UP, p.k, p.n, 8).is_sharded()
    assert gu.grid == (11, 4) and gu.program_config.per_core_N == -(-gu_n // 32 // 44)
    assert gu.output_memory_config.buffer_type == ttnn.BufferType.L1 and not gu.output_memory_config.is_sharded()
    assert (dn.cores, dn.grid, dn.program_config.per_core_N) == (32, (8, 4), 5)
    assert list(dn.sharded_output_memory_config.shard_spec.shape) == [32, 160]
    assert dn.sharded_output_memory_config.shard_spec.grid.num_cores() == 32
    assert lm.grid == (11, 10) and lm.program_config.per_core_N == -(-vocab_n // 32 // 110)
    assert decode_matmul_plan(ttnn, args, TensorGroup.MLP_GATE_UP, 33, 5120, gu_n, grid) is None
    assert decode_matmul_plan(ttnn, args, TensorGroup.ATTN_QKV, 1, 5120, gu_n, grid) is None
    assert decode_matmul_plan(ttnn, _args("interleaved"), TensorGroup.LM_HEAD, 1, 5120, vocab_n, grid) is None
    # a MoE model keeps ttnn's defaults for its shared expert and its LM head
    assert decode_matmul_plan(ttnn, _args(preset="moe-ci"), TensorGroup.MLP_DOWN, 1, 32, 64, grid) is None


@pytest.fixture(scope="module")
def mm_case():
    from qwen36.tt.model.decode_matmuls import decode_matmul_plan
    from qwen36.tt.model.model_config import TensorGroup, compute_config_matmul
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        k, n = 256, 1024  # 8 and 32 tiles: down's plan splits N evenly over its cores
        plan = decode_matmul_plan(ttnn, _args(), TensorGroup.MLP_DOWN, 1, k, n, mesh.compute_with_storage_grid_size())
        g = torch.Generator().manual_seed(0)
        wt, xt = torch.randn(k, n, generator=g) / 16, torch.randn(1, 1, 1, k, generator=g)
        w = ttnn.from_torch(wt, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh)
        x = ttnn.from_torch(xt, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        yield ctx, plan, w, x, compute_config_matmul(ttnn, "bfloat8_b")


def test_mcast_1d_matmul_runs_like_the_default(mm_case):
    """The plan's 1D matmul writes its L1 width shards and computes the default matmul's bits; the weight is read as
    DRAM-interleaved bfloat8_b, the activation from DRAM."""
    ctx, plan, w, x, cfg = mm_case
    ttnn = ctx.ttnn
    with ctx.counters.scope("mm") as c:
        y = ttnn.linear(x, w, program_config=plan.program_config, memory_config=plan.sharded_output_memory_config,
                        dtype=ttnn.bfloat16, compute_kernel_config=cfg)
    assert y.memory_config().is_sharded() and y.memory_config().buffer_type == ttnn.BufferType.L1
    ref = ttnn.linear(x, w, dtype=ttnn.bfloat16, compute_kernel_config=cfg)
    one = lambda t: ttnn.to_torch(ttnn.get_device_tensors(t)[0])  # noqa: E731
    assert torch.equal(one(y), one(ref))
    assert c.bytes_read["BFLOAT8_B"] == 8 * 32 * 1088 and c.bytes_read["BFLOAT16"] == 8 * 2048
