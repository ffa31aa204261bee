"""The emulated device op's validation of the 1D multicast matmul config (tt_ops/emulator/matmul_1d.py): a valid
config runs, and each rule broken once is refused with the device op's words."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")


@pytest.fixture(scope="module")
def mm_case():
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        g = torch.Generator().manual_seed(0)
        w = ttnn.from_torch(torch.randn(256, 1024, generator=g) / 16, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT,
                            device=mesh)
        x = ttnn.from_torch(torch.randn(1, 1, 1, 256, generator=g), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=mesh)
        cfg = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi2, math_approx_mode=False,
                                               fp32_dest_acc_en=True, packer_l1_acc=True)
        # 32 N tiles as 8 x 4 cores of 1 tile each, the output in [32, 32] L1 width shards on those cores
        pc = ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
            compute_with_storage_grid_size=ttnn.CoreCoord(8, 4), in0_block_w=8, out_subblock_h=1, out_subblock_w=1,
            per_core_M=1, per_core_N=1, fuse_batch=True, fused_activation=None, mcast_in0=True)
        out = ttnn.create_sharded_memory_config(shape=(32, 32), core_grid=ttnn.CoreGrid(y=4, x=8),
                                                strategy=ttnn.ShardStrategy.WIDTH,
                                                use_height_and_width_as_shard_shape=True)
        yield ctx, pc, out, w, x, cfg


def test_valid_config_runs(mm_case):
    ctx, pc, out, w, x, cfg = mm_case
    ttnn = ctx.ttnn
    y = ttnn.linear(x, w, program_config=pc, memory_config=out, dtype=ttnn.bfloat16, compute_kernel_config=cfg)
    ref = ttnn.linear(x, w, dtype=ttnn.bfloat16, compute_kernel_config=cfg)
    one = lambda t: ttnn.to_torch(ttnn.get_device_tensors(t)[0])  # noqa: E731
    assert y.memory_config() == out and torch.equal(one(y), one(ref))


@pytest.mark.parametrize("case", ["in0_block_w", "subblock_dest", "grid_outside", "blocks_over_cores",
                                  "m_over_block", "out_height_sharded", "out_subblock_w", "mcast_in1", "gather_in0",
                                  "in0_height_sharded"])
def test_mcast_1d_matmul_rules(mm_case, case):
    """The device op's validation of the 1D multicast config (tt_ops/emulator/matmul_1d.py), each rule broken once."""
    from qwen36.tt_ops.emulator.errors import EmulatorError, NotEmulatedError

    ctx, pc, out, w, x, cfg = mm_case
    ttnn = ctx.ttnn
    kw = dict(compute_with_storage_grid_size=pc.compute_with_storage_grid_size, in0_block_w=pc.in0_block_w,
              out_subblock_h=1, out_subblock_w=pc.out_subblock_w, per_core_M=1, per_core_N=pc.per_core_N,
              fuse_batch=True, fused_activation=None, mcast_in0=True)
    a, out_mc, err = x, out, EmulatorError
    match = {"in0_block_w": "in0_block_w", "subblock_dest": "fit in hardware", "grid_outside": "device grid",
             "blocks_over_cores": "exceeds number of cores", "m_over_block": "single per_core_M block",
             "out_height_sharded": "WIDTH_SHARDED or BLOCK_SHARDED", "out_subblock_w": "out_subblock_h",
             "mcast_in1": "mcast_in0=False", "gather_in0": "gather_in0", "in0_height_sharded": "WIDTH_SHARDED"}[case]
    if case == "in0_block_w":
        kw["in0_block_w"] = 3
    elif case == "subblock_dest":  # fp32 Dst holds 4 tiles: a 1 x 8 subblock does not fit
        kw.update(per_core_N=8, out_subblock_w=8, compute_with_storage_grid_size=ttnn.CoreCoord(4, 1))
        out_mc = ttnn.L1_MEMORY_CONFIG
    elif case == "grid_outside":
        kw["compute_with_storage_grid_size"] = ttnn.CoreCoord(12, 1)
    elif case == "blocks_over_cores":
        kw["compute_with_storage_grid_size"] = ttnn.CoreCoord(2, 1)
        out_mc = ttnn.L1_MEMORY_CONFIG
    elif case == "m_over_block":  # two row tiles in per_core_M = 1 on enough cores for both
        kw["compute_with_storage_grid_size"] = ttnn.CoreCoord(11, 10)
        a = ttnn.from_torch(torch.randn(1, 1, 64, 256), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=ctx.mesh_device)
        out_mc = ttnn.L1_MEMORY_CONFIG
    elif case == "out_height_sharded":
        out_mc = ttnn.create_sharded_memory_config(shape=(32, 1024), core_grid=ttnn.CoreGrid(y=1, x=1),
                                                   strategy=ttnn.ShardStrategy.HEIGHT,
                                                   use_height_and_width_as_shard_shape=True)
    elif case == "out_subblock_w":
        kw.update(per_core_N=4, out_subblock_w=2, out_subblock_h=2, per_core_M=2, out_block_h=2)
        a = ttnn.from_torch(torch.randn(1, 1, 64, 256), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=ctx.mesh_device)
        out_mc = ttnn.create_sharded_memory_config(shape=(64, 128), core_grid=ttnn.CoreGrid(y=1, x=8),
                                                   strategy=ttnn.ShardStrategy.WIDTH,
                                                   use_height_and_width_as_shard_shape=True)
        kw["compute_with_storage_grid_size"] = ttnn.CoreCoord(8, 1)
    elif case == "mcast_in1":
        kw["mcast_in0"], err = False, NotEmulatedError
    elif case == "gather_in0":
        kw.update(mcast_in0=False, gather_in0=True)
        err = NotEmulatedError
    else:
        a = ttnn.to_memory_config(x, ttnn.create_sharded_memory_config(
            shape=(32, 256), core_grid=ttnn.CoreGrid(y=1, x=1), strategy=ttnn.ShardStrategy.HEIGHT,
            use_height_and_width_as_shard_shape=True))
    bad = ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(**kw)
    with pytest.raises(err, match=match):
        ttnn.linear(a, w, program_config=bad, memory_config=out_mc, dtype=ttnn.bfloat16, compute_kernel_config=cfg)
