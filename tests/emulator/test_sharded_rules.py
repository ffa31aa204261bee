"""Sharded-layout rules the emulator enforces as the device ops do (tt-metal's validation, read for facts): RMSNorm
on width-sharded L1 inputs (the sharded program factory and its program config), RMSNorm writing a sharded output
from an interleaved input, and the programs a composite async all-reduce spends on a sharded input."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.numerics import comp_pcc  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import EmulatorError  # noqa: E402

H, CORES = 256, 4  # [32, 256] width-sharded over 4 cores (4 x 2 grid row-major: x 4, y 1): 64 columns, 2 tiles each


@pytest.fixture(scope="module")
def case():
    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        g = torch.Generator().manual_seed(0)
        xt = torch.randn(1, 1, 32, H, generator=g)
        wt = 1 + 0.1 * torch.randn(H, generator=g)
        x = ttnn.from_torch(xt, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            memory_config=ttnn.DRAM_MEMORY_CONFIG)
        w = ttnn.from_torch(wt.reshape(1, 1, H // 32, 32), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT,
                            device=mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        want = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-6) * wt
        yield ctx, x, w, want


def _width(ttnn, cores=CORES, width=H, rows=32, buffer=None):
    mc = ttnn.create_sharded_memory_config(shape=(rows, width // cores), core_grid=ttnn.CoreGrid(y=1, x=cores),
                                           strategy=ttnn.ShardStrategy.WIDTH,
                                           orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                           use_height_and_width_as_shard_shape=True)
    return mc


def _pc(ttnn, block_w=H // 32 // CORES, block_h=1, subblock_w=None, grid=(8, 8)):
    return ttnn.LayerNormShardedMultiCoreProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(*grid), subblock_w=subblock_w or block_w, block_h=block_h,
        block_w=block_w, inplace=False)


def _host(ctx, t):
    return ctx.ttnn.to_torch(ctx.ttnn.get_device_tensors(t)[0]).float()


def test_sharded_rms_norm_with_its_program_config(case):
    ctx, x, w, want = case
    ttnn = ctx.ttnn
    xs = ttnn.to_memory_config(x, _width(ttnn))
    y = ttnn.rms_norm(xs, epsilon=1e-6, weight=w, program_config=_pc(ttnn), memory_config=_width(ttnn))
    assert y.memory_config().is_sharded() and y.memory_config().buffer_type == ttnn.BufferType.L1
    ok, msg = comp_pcc(want, _host(ctx, y), 0.9999)
    assert ok, msg


def test_interleaved_rms_norm_writes_width_shards(case):
    """The decoder layer's post-attention norm writes the MLP's L1 input shards directly (one program, no reshard)."""
    ctx, x, w, want = case
    ttnn = ctx.ttnn
    with ctx.counters.scope("norm") as c:
        y = ttnn.rms_norm(x, epsilon=1e-6, weight=w, memory_config=_width(ttnn))
    assert c.programs == 1 and y.memory_config().is_sharded()
    ok, msg = comp_pcc(want, _host(ctx, y), 0.9999)
    assert ok, msg


@pytest.mark.parametrize("rule", ["no_program_config", "height_sharded", "interleaved_output", "dram_output",
                                  "block_w", "block_h", "subblock_w", "grid", "sharded_config_interleaved_input",
                                  "residual_interleaved"])
def test_sharded_rms_norm_rules(case, rule):
    """Each rule of the device op's validation broken once."""
    ctx, x, w, _ = case
    ttnn = ctx.ttnn
    xs = ttnn.to_memory_config(x, _width(ttnn))
    kw = dict(epsilon=1e-6, weight=w, program_config=_pc(ttnn), memory_config=_width(ttnn))
    inp, match = xs, None
    if rule == "no_program_config":
        kw.pop("program_config"); match = "LayerNormShardedMultiCoreProgramConfig"
    elif rule == "height_sharded":
        inp = ttnn.to_memory_config(x, ttnn.create_sharded_memory_config(
            shape=(32, H), core_grid=ttnn.CoreGrid(y=1, x=1), strategy=ttnn.ShardStrategy.HEIGHT,
            orientation=ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True))
        match = "HEIGHT_SHARDED"
    elif rule == "interleaved_output":
        kw["memory_config"] = ttnn.L1_MEMORY_CONFIG; match = "sharded"
    elif rule == "dram_output":
        kw["memory_config"] = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.DRAM,
                                                _width(ttnn).shard_spec)
        match = "buffer type"
    elif rule == "block_w":
        kw["program_config"] = _pc(ttnn, block_w=1); match = "block_w"
    elif rule == "block_h":
        kw["program_config"] = _pc(ttnn, block_h=2); match = "block_h"
    elif rule == "subblock_w":
        kw["program_config"] = _pc(ttnn, subblock_w=3); match = "subblock_w"
    elif rule == "grid":
        kw["program_config"] = _pc(ttnn, grid=(2, 1)); match = "compute_with_storage_grid_size"
    elif rule == "sharded_config_interleaved_input":
        inp = x; match = "needs a sharded input"
    else:
        kw["residual_input_tensor"] = x; match = "residual_input_tensor"
    with pytest.raises(EmulatorError, match=match):
        ttnn.rms_norm(inp, **kw)


def test_all_reduce_async_charges_its_internal_reshards(case):
    """The composite async all-reduce is a reduce-scatter plus an all-gather (2 programs, 2 collectives); it converts
    a sharded input to interleaved itself and its result back to the requested layout: a sharded input costs one
    program more, a sharded output one more again; values unchanged."""
    from qwen36.tt.model.ccl import ccl_for

    ctx, x, _, _ = case
    ttnn = ctx.ttnn
    ccl = ccl_for(ttnn, ctx.mesh_device)
    xs = ttnn.to_memory_config(x, _width(ttnn))
    counts, collectives = {}, {}
    outs = {}
    for name, inp, out_mc in (("interleaved", x, ttnn.DRAM_MEMORY_CONFIG), ("sharded_in", xs, ttnn.DRAM_MEMORY_CONFIG),
                              ("sharded_in_l1_out", xs, ttnn.L1_MEMORY_CONFIG), ("sharded_both", xs, _width(ttnn))):
        with ctx.counters.scope(name) as c:
            outs[name] = ccl.all_reduce(inp, memory_config=out_mc)
        counts[name], collectives[name] = c.programs, c.collectives
    assert counts == {"interleaved": 2, "sharded_in": 4, "sharded_in_l1_out": 3, "sharded_both": 4}
    assert set(collectives.values()) == {2}
    ref = _host(ctx, outs["interleaved"])
    for name in counts:
        torch.testing.assert_close(_host(ctx, outs[name]), ref, rtol=0, atol=0)


def test_interleaved_rms_norm_writes_height_shards(case):
    """The attention decode's q/k norms write the decode RoPE's height-sharded layout (one [32, D] shard per row
    core) from an interleaved input: accepted (height sharding is only refused for the input) and value-exact."""
    ctx, x, w, want = case
    ttnn = ctx.ttnn
    mc = ttnn.create_sharded_memory_config(shape=(32, H), core_grid=ttnn.CoreGrid(y=1, x=1),
                                           strategy=ttnn.ShardStrategy.HEIGHT,
                                           orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                           use_height_and_width_as_shard_shape=True)
    y = ttnn.rms_norm(x, epsilon=1e-6, weight=w, memory_config=mc)
    assert y.memory_config().memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED
    torch.testing.assert_close(_host(ctx, y), _host(ctx, ttnn.rms_norm(x, epsilon=1e-6, weight=w)), rtol=0, atol=0)
    ok, msg = comp_pcc(want, _host(ctx, y), 0.9999)
    assert ok, msg


@pytest.mark.parametrize("shape,dtype,programs,collectives", [
    ((1, 1, 1, 64), "bfloat16", 2, 2),     # 2 tiles wide: one per device -> reduce-scatter + all-gather
    ((1, 1, 32, 32), "bfloat16", 2, 1),    # 1 tile: nothing splits -> all-gather + moreh_sum
    ((1, 1, 32, 32), "float32", 3, 1),     # fp32 local sum: transpose + sum
    ((1, 1, 32, 32), "bfloat8_b", 4, 1),   # moreh_sum needs bf16: typecast in and out
    ((1, 1, 32, 96), "bfloat16", 2, 1),    # 3 tiles do not split over 2; 1 row tile neither
    ((1, 2, 32, 96), "bfloat16", 2, 2),    # ... but dim 1 does: reduce-scatter + all-gather over it
])
def test_all_reduce_async_program_plan_follows_the_scatter_dim(shape, dtype, programs, collectives):
    """How ``experimental.all_reduce_async`` is built on cards (tt-metal ``all_reduce_async.cpp``): the last dim
    whose tile count splits over the devices is scattered (reduce-scatter + all-gather: 2 programs, 2 collectives);
    when none does, or the scattered extent would pad a tile, it all-gathers and sums locally (1 collective, the
    sum's programs by dtype). Values are the sum either way."""
    from qwen36.tt.model.ccl import ccl_for
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        parts = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        x = ttnn.from_torch(torch.cat(parts, 0), dtype=getattr(ttnn, dtype), layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=0))
        with ctx.counters.scope("ar") as c:
            out = ccl_for(ttnn, mesh).all_reduce(x, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        assert (c.programs, c.collectives) == (programs, collectives), dict(c.programs_per_op)
        got = ttnn.to_torch(ttnn.get_device_tensors(out)[0])
        torch.testing.assert_close(got.float(), (parts[0] + parts[1]).float(), rtol=0.05, atol=0.05)


def test_single_op_all_reduce_is_one_program_and_refuses_what_the_device_refuses(case):
    """``experimental.all_reduce_async``'s single-op form (persistent buffer tensor, one semaphore; TTCCL
    .all_reduce_sharded, the form Tenstorrent's Llama-3 70B Galaxy decode uses): 1 program, 1 collective, the same sum
    as the composite form. Its 0.81.1 device op validation, each broken once: a DRAM input on Blackhole, a layout other
    than WIDTH_SHARDED (input, output), a buffer shard too small for N copies of the output shard, a buffer on other
    cores than the output; and the wrapper refuses a result layout whose buffer was not allocated before."""
    from qwen36.tt.model.ccl import ccl_for

    ctx, x, _, _ = case
    ttnn = ctx.ttnn
    ccl = ccl_for(ttnn, ctx.mesh_device)
    mc = _width(ttnn)
    xs = ttnn.to_memory_config(x, mc)
    with pytest.raises(RuntimeError, match="prepare_reduce_buffer"):
        ccl.all_reduce_sharded(xs, mc)
    ccl.prepare_reduce_buffer(mc, ttnn.bfloat16)
    with ctx.counters.scope("single") as c:
        out = ccl.all_reduce_sharded(xs, mc)
    assert (c.programs, c.collectives) == (1, 1), dict(c.programs_per_op)
    assert c.collective_bytes == 32 * H * 2  # each device sends its whole [32, 256] bf16 input to the other
    assert out.memory_config() == mc
    ref = ccl.all_reduce(x, memory_config=ttnn.DRAM_MEMORY_CONFIG)
    torch.testing.assert_close(_host(ctx, out), _host(ctx, ref), rtol=0, atol=0)

    key = ccl._buffer_key(mc, ttnn.bfloat16)
    buf = ccl._reduce_buffers[key]
    sem = ccl._ar1[0]

    def call(inp, buffer, out_mc):
        return ttnn.experimental.all_reduce_async(inp, buffer, cluster_axis=1, mesh_device=ctx.mesh_device,
                                                  multi_device_global_semaphore=sem, memory_config=out_mc,
                                                  topology=ttnn.Topology.Linear)

    with pytest.raises(EmulatorError, match="does not support blackhole dram"):
        call(x, buf, mc)
    with pytest.raises(EmulatorError, match="memory layout for input tensor"):
        call(ttnn.to_memory_config(x, ttnn.L1_MEMORY_CONFIG), buf, mc)
    with pytest.raises(EmulatorError, match="memory layout for output tensor"):
        call(xs, buf, ttnn.L1_MEMORY_CONFIG)
    small = ttnn.from_torch(torch.zeros(1, 1, 32, H), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=ctx.mesh_device, memory_config=mc)
    with pytest.raises(EmulatorError, match="large enough to hold the intermediate tensor"):
        call(xs, small, mc)
    other = _width(ttnn, cores=2, width=2 * H)  # buffer on cores (0..1, 0): the output's 4 cores are not inside
    wide = ttnn.from_torch(torch.zeros(1, 1, 32, 2 * H), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                           device=ctx.mesh_device, memory_config=other)
    with pytest.raises(EmulatorError, match="subset of the cores of the buffer tensor"):
        call(xs, wide, mc)
