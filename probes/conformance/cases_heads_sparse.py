"""Conformance cases for rotary_embedding_hf, the decode head split (nlp_create_qkv_heads_decode), rms_norm's
sharding rule, indexed_fused_update_cache, the async collectives and sparse_matmul, one list per op group
(``cases.CASES`` puts them in order). The tt-metal tests they restate: ``cases``' module doc."""
from __future__ import annotations

import torch

from .common import (SRC_AG, SRC_CREATE_HEADS, SRC_CREATE_HEADS_HOST, SRC_DOC, SRC_INDEXED_UPDATE, SRC_LAYERNORM_OP,
                     SRC_ROPE_HF, SRC_SPARSE, Case, device0, expect_rejected, on_mesh, pcc)


# ---- rotary embedding hf (rotate_half over the whole head) -------------------------------------------------------
def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _hf_height_sharded(ttnn, rows_per_core, cores, dh):
    return ttnn.create_sharded_memory_config(shape=(rows_per_core, dh), core_grid=ttnn.CoreGrid(y=1, x=cores),
                                             strategy=ttnn.ShardStrategy.HEIGHT,
                                             orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                             use_height_and_width_as_shard_shape=True)


def _hf_ckc(ttnn):
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=True)


def _rope_hf_decode(b, nh, dh):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(b * 7919 + nh * 6247 + dh)
        x = torch.randn(1, b, nh, dh, generator=g).bfloat16().float()
        cos = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
        sin = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
        xs = ttnn.to_memory_config(on_mesh(ttnn, mesh, x), _hf_height_sharded(ttnn, -(-nh // 32) * 32, b, dh))
        cs = ttnn.to_memory_config(on_mesh(ttnn, mesh, cos), _hf_height_sharded(ttnn, 32, b, dh))
        ss = ttnn.to_memory_config(on_mesh(ttnn, mesh, sin), _hf_height_sharded(ttnn, 32, b, dh))
        out = ttnn.experimental.rotary_embedding_hf(xs, cs, ss, is_decode_mode=True, compute_kernel_config=_hf_ckc(ttnn))
        want = x * cos + _rotate_half(x) * sin
        got = device0(ttnn, mesh, out)
        assert list(got.shape) == [1, b, nh, dh], got.shape
        assert pcc(got, want) >= 0.9999, f"PCC {pcc(got, want):.6f}"
    return fn


def _rope_hf_prefill(ttnn, mesh):
    nh, s, dh = 4, 64, 128
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, nh, s, dh, generator=g).bfloat16().float()
    cos, sin = (torch.randn(1, 1, s, dh, generator=g).bfloat16().float() for _ in range(2))
    out = ttnn.experimental.rotary_embedding_hf(on_mesh(ttnn, mesh, x), on_mesh(ttnn, mesh, cos), on_mesh(ttnn, mesh, sin),
                                               is_decode_mode=False, compute_kernel_config=_hf_ckc(ttnn))
    want = x * cos + _rotate_half(x) * sin
    assert pcc(device0(ttnn, mesh, out), want) >= 0.9999


def _rope_hf_decode_cos_sin_via_interleaved_to_sharded(ttnn, mesh):
    """cos/sin built interleaved in DRAM and moved with ``ttnn.interleaved_to_sharded(t, mem_config)`` onto one
    [32, head_dim] shard per user core, as that test's ``_decode_hf_cos_sin_sharded`` does; the decode op must see
    them sharded. ``sharded_to_interleaved`` brings a tensor back (interleaved, same values)."""
    b, nh, dh = 8, 8, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, b, nh, dh, generator=g).bfloat16().float()
    cos = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
    sin = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
    xs = ttnn.to_memory_config(on_mesh(ttnn, mesh, x), _hf_height_sharded(ttnn, 32, b, dh))
    mc = _hf_height_sharded(ttnn, 32, b, dh)
    cs, ss = (ttnn.interleaved_to_sharded(on_mesh(ttnn, mesh, t), mc) for t in (cos, sin))
    assert cs.memory_config().memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, cs.memory_config()
    assert cs.memory_config().shard_spec == mc.shard_spec, cs.memory_config()
    out = ttnn.experimental.rotary_embedding_hf(xs, cs, ss, is_decode_mode=True, compute_kernel_config=_hf_ckc(ttnn))
    want = x * cos + _rotate_half(x) * sin
    assert pcc(device0(ttnn, mesh, out), want) >= 0.9999, f"PCC {pcc(device0(ttnn, mesh, out), want):.6f}"
    back = ttnn.sharded_to_interleaved(cs, ttnn.DRAM_MEMORY_CONFIG)
    assert not back.memory_config().is_sharded() and torch.equal(device0(ttnn, mesh, back), cos)


def _rope_hf_decode_needs_height_shard(ttnn, mesh):
    x = on_mesh(ttnn, mesh, torch.randn(1, 1, 8, 64))
    cs = ttnn.to_memory_config(on_mesh(ttnn, mesh, torch.randn(1, 1, 1, 64)), _hf_height_sharded(ttnn, 32, 1, 64))
    try:
        ttnn.experimental.rotary_embedding_hf(x, cs, cs, is_decode_mode=True)
    except Exception as e:  # noqa: BLE001 - the emulator's EmulatorError or a card's TT_FATAL
        assert "HEIGHT_SHARDED" in str(e), str(e)
    else:
        raise AssertionError("an interleaved decode-mode input was accepted (the device op rejects it)")


# ---- decode head split -----------------------------------------------------------------------------------------
def _height_grid(ttnn, cores):
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(7, max(0, (cores - 1) // 8)))})
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1,
                             ttnn.ShardSpec(grid, [32, 32], ttnn.ShardOrientation.ROW_MAJOR))


def _create_heads_case(nq, nkv, dh, b, sharded, overlap=True):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(nq * 131 + nkv * 17 + dh + b)
        x = torch.rand(1, 1, b, (nq + 2 * nkv) * dh, generator=g).bfloat16().float()
        t = on_mesh(ttnn, mesh, x)
        if sharded:  # min_width_shard: one [32, 32] shard per core, 8 cores a row
            cores = (nq + 2 * nkv) * dh // 32
            grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0),
                                                     ttnn.CoreCoord(min(cores, 8) - 1, max(1, cores // 8) - 1))})
            t = ttnn.to_memory_config(t, ttnn.MemoryConfig(
                ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                ttnn.ShardSpec(grid, [32, 32], ttnn.ShardOrientation.ROW_MAJOR)))
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            t, num_heads=nq, num_kv_heads=nkv, overlap_qk_coregrid=overlap,
            memory_config=_height_grid(ttnn, b if overlap else 2 * b + 1))
        heads = x.reshape(1, b, nq + 2 * nkv, dh)
        for name, out, want in (("q", q, heads[:, :, :nq]), ("k", k, heads[:, :, nq:nq + nkv]),
                                ("v", v, heads[:, :, nq + nkv:])):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, f"{name}: {mc}"
            assert list(mc.shard_spec.shape) == [-(-nq // 32) * 32, dh] and mc.shard_spec.grid.num_cores() == b, \
                f"{name}: shard spec {mc.shard_spec}"
            assert torch.equal(device0(ttnn, mesh, out), want), f"{name} differs from the torch split (exact copy)"
        q_cores = {(c.x, c.y) for c in ttnn.corerange_to_cores(q.memory_config().shard_spec.grid)}
        k_cores = {(c.x, c.y) for c in ttnn.corerange_to_cores(k.memory_config().shard_spec.grid)}
        assert (q_cores == k_cores) if overlap else not (q_cores & k_cores), (sorted(q_cores), sorted(k_cores))
    return fn


def _create_heads_rejects(ttnn, mesh):
    t = on_mesh(ttnn, mesh, torch.zeros(1, 1, 4, 12 * 64))
    split = ttnn.experimental.nlp_create_qkv_heads_decode
    expect_rejected(lambda: split(t, num_heads=7, num_kv_heads=2, memory_config=_height_grid(ttnn, 4)),
                     "heads")
    expect_rejected(lambda: split(t, num_heads=2, num_kv_heads=5, memory_config=_height_grid(ttnn, 4)),
                     "num_kv_heads")
    sharded = ttnn.to_memory_config(t, ttnn.MemoryConfig(  # [32, 96] shards of 64-wide heads: partial heads
        ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
        ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(7, 0))}), [32, 96],
                       ttnn.ShardOrientation.ROW_MAJOR)))
    expect_rejected(lambda: split(sharded, num_heads=8, num_kv_heads=2, overlap_qk_coregrid=False,
                                   memory_config=_height_grid(ttnn, 4)), "whole heads")


def _create_heads_host_wrapper_configs(ttnn, mesh):
    """What the host wrapper makes of the arguments: an interleaved input runs with ``overlap_qk_coregrid`` forced
    to true (q and k share cores), and the outputs are L1 HEIGHT_SHARDED whatever ``memory_config`` says (its shard
    grid is used when it has one, else the whole compute grid)."""
    x = torch.rand(1, 1, 4, 12 * 64).bfloat16().float()
    t = on_mesh(ttnn, mesh, x)
    split = ttnn.experimental.nlp_create_qkv_heads_decode
    q, k, v = split(t, num_heads=8, num_kv_heads=2, overlap_qk_coregrid=False, memory_config=_height_grid(ttnn, 16))
    assert q.memory_config().shard_spec.grid == k.memory_config().shard_spec.grid, "interleaved: q and k share cores"
    for cfg in (ttnn.DRAM_MEMORY_CONFIG, None):
        q, k, v = split(t, num_heads=8, num_kv_heads=2, memory_config=cfg)
        for out in (q, k, v):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, mc
            assert mc.buffer_type == ttnn.BufferType.L1 and mc.shard_spec.grid.num_cores() == 4, mc
        assert torch.equal(device0(ttnn, mesh, q), x.reshape(1, 4, 12, 64)[:, :, :8]), "q differs (exact copy)"


def _create_heads_tt_form(nq, nkv, dh, b, width):
    """The call exactly as Tenstorrent's test makes it: the host tensor moved to the device with
    ``Tensor.to(device=..., mem_config=WIDTH_SHARDED L1)`` (``max_width_shard``: one core holds every row and the whole
    width; ``min_width_shard``: [32, 32] shards over 8-wide rows of cores) and the output config
    ``MemoryConfig(HEIGHT_SHARDED, L1)`` without a shard spec (the op derives the grid: B cores from (0, 0))."""
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(nq * 7 + nkv * 3 + dh + b)
        x = torch.rand(1, 1, b, (nq + 2 * nkv) * dh, generator=g).bfloat16().float()
        if width == "max":
            grid, shard = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}), \
                [-(-b // 32) * 32, x.shape[-1]]
        else:
            cores = x.shape[-1] // 32
            cx = min(cores, 8)
            grid, shard = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0),
                                                            ttnn.CoreCoord(cx - 1, max(1, cores // cx) - 1))}), [32, 32]
        in_mc = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                                  ttnn.ShardSpec(grid, shard, ttnn.ShardOrientation.ROW_MAJOR))
        host = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
        t = host.to(device=mesh, mem_config=in_mc)
        assert t.memory_config().memory_layout == ttnn.TensorMemoryLayout.WIDTH_SHARDED, "Tensor.to dropped mem_config"
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            t, num_heads=nq, num_kv_heads=nkv,
            memory_config=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1))
        heads = x.reshape(1, b, nq + 2 * nkv, dh)
        for name, out, want in (("q", q, heads[:, :, :nq]), ("k", k, heads[:, :, nq:nq + nkv]),
                                ("v", v, heads[:, :, nq + nkv:])):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED and mc.buffer_type == ttnn.BufferType.L1
            assert mc.shard_spec.grid.num_cores() == b, f"{name}: {mc.shard_spec}"
            got = device0(ttnn, mesh, out)
            assert pcc(got, want) >= 0.9999 and torch.equal(got, want), f"{name} differs from the torch split"
    return fn


def _rms_norm_rejects_height_sharded(ttnn, mesh):
    x = ttnn.to_memory_config(on_mesh(ttnn, mesh, torch.randn(1, 1, 8, 64)), _hf_height_sharded(ttnn, 32, 1, 64))
    expect_rejected(lambda: ttnn.rms_norm(x, epsilon=1e-6), "HEIGHT_SHARDED")


# ---- indexed fused cache update -----------------------------------------------------------------------------------
def _indexed_ref(cache, packed, positions):
    want = cache.clone()
    bs = cache.shape[2]
    for r, p in enumerate(positions):
        if 0 <= p < cache.shape[0] * bs:
            want[p // bs, :, p % bs, :] = packed[0, :, r, :]
    return want


def _indexed_dev(ttnn, mesh, x, dtype=None, layout=None):
    return on_mesh(ttnn, mesh, x, dtype, layout, mapper=ttnn.ReplicateTensorToMesh(mesh))


def _indexed_update_case(cache_shape):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(17 + cache_shape[0])
        total = cache_shape[0] * cache_shape[2]
        positions = [1, 3, 31, 32, 33, 63, 64, -1, total]
        caches = [torch.zeros(cache_shape).bfloat16().float() for _ in range(2)]
        ins = [torch.randn(1, cache_shape[1], 9, cache_shape[3], generator=g).bfloat16().float() for _ in range(2)]
        dc = [_indexed_dev(ttnn, mesh, c) for c in caches]
        idx = _indexed_dev(ttnn, mesh, torch.tensor([positions], dtype=torch.int32), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
        o1, o2 = ttnn.experimental.indexed_fused_update_cache(dc[0], _indexed_dev(ttnn, mesh, ins[0]), dc[1],
                                                              _indexed_dev(ttnn, mesh, ins[1]), idx)
        assert o1 is dc[0] and o2 is dc[1], "the op updates the caches in place and returns them"
        import ttnn as real

        golden = real.get_golden_function(real.experimental.indexed_fused_update_cache)(
            caches[0], ins[0], caches[1], ins[1], torch.tensor([positions], dtype=torch.int32))
        for j in range(2):
            want = _indexed_ref(caches[j], ins[j], positions)
            assert torch.equal(golden[j], want), "the op's golden disagrees with the test's reference"
            for sh in ttnn.get_device_tensors(dc[j]):
                assert torch.equal(ttnn.to_torch(sh).float(), want), f"cache {j + 1} differs (exact)"
    return fn


def _indexed_update_rejects(ttnn, mesh):
    def call(c1=None, i1=None, c2=None, i2=None, idx=None):
        z = lambda shape, dt=None: _indexed_dev(ttnn, mesh, torch.zeros(shape), dt)  # noqa: E731
        pos = _indexed_dev(ttnn, mesh, torch.arange(4, dtype=torch.int32).reshape(1, -1), ttnn.int32,
                           ttnn.ROW_MAJOR_LAYOUT)
        return lambda: ttnn.experimental.indexed_fused_update_cache(
            c1 or z((2, 2, 64, 64)), i1 or z((1, 2, 4, 64)), c2 or z((2, 2, 64, 64)), i2 or z((1, 2, 4, 64)),
            idx or pos)
    z = lambda shape, dt=None, layout=None: _indexed_dev(ttnn, mesh, torch.zeros(shape), dt, layout)  # noqa: E731
    ar = lambda n: torch.arange(n, dtype=torch.int32).reshape(1, -1)  # noqa: E731
    expect_rejected(call(c1=z((2, 2, 64, 64), ttnn.bfloat8_b)), "BFLOAT16")
    expect_rejected(call(idx=z((1, 4), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)), "INT32")
    expect_rejected(call(idx=_indexed_dev(ttnn, mesh, ar(4), ttnn.int32, ttnn.TILE_LAYOUT)), "ROW_MAJOR")
    expect_rejected(call(idx=_indexed_dev(ttnn, mesh, ar(3), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)), "fewer entries")
    expect_rejected(call(c2=z((3, 2, 64, 64))), "identical shapes")
    expect_rejected(call(i2=z((1, 2, 5, 64))), "identical shapes")
    expect_rejected(call(c1=z((2, 2, 33, 64)), c2=z((2, 2, 33, 64))), "tile aligned")
    expect_rejected(call(i1=z((1, 2, 257, 64)), i2=z((1, 2, 257, 64)),
                          idx=_indexed_dev(ttnn, mesh, ar(257), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)), "256")
    if mesh.get_num_devices() > 1:
        sharded = on_mesh(ttnn, mesh, torch.arange(8, dtype=torch.int32).reshape(1, -1), ttnn.int32,
                       ttnn.ROW_MAJOR_LAYOUT, mapper=ttnn.ShardTensorToMesh(mesh, dim=1))
        expect_rejected(call(idx=sharded), "replicated")


def _indexed_mapped(ttnn, mesh, x, dim, dtype=None, layout=None):
    mapper = ttnn.ReplicateTensorToMesh(mesh) if dim is None else ttnn.ShardTensorToMesh(mesh, dim=dim)
    return on_mesh(ttnn, mesh, x, dtype, layout, mapper=mapper)


def _indexed_tensor_parallel(dim, cache_shape):
    """test_indexed_fused_update_cache_tensor_parallel_mesh: caches and inputs sharded over heads (dim 1) or head_dim
    (dim 3), indices replicated; exact against the reference, and the caches keep their mesh topology."""
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(37 + dim)
        positions = [0, 31, 32, 63, 64, -1]
        caches = [torch.zeros(cache_shape) for _ in range(2)]
        ins = [torch.randn(1, cache_shape[1], 6, cache_shape[3], generator=g).bfloat16().float() for _ in range(2)]
        dc = [_indexed_mapped(ttnn, mesh, c, dim) for c in caches]
        topo = [c.tensor_topology() for c in dc]
        idx = _indexed_mapped(ttnn, mesh, torch.tensor([positions], dtype=torch.int32), None, ttnn.int32,
                              ttnn.ROW_MAJOR_LAYOUT)
        outs = ttnn.experimental.indexed_fused_update_cache(dc[0], _indexed_mapped(ttnn, mesh, ins[0], dim), dc[1],
                                                            _indexed_mapped(ttnn, mesh, ins[1], dim), idx)
        for j in range(2):
            assert outs[j].tensor_topology() == topo[j], "the cache's mesh topology changed"
            got = ttnn.to_torch(outs[j], mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=dim)).float()
            assert torch.equal(got, _indexed_ref(caches[j], ins[j], positions)), f"cache {j + 1} differs (exact)"
    return fn


def _indexed_mesh_rejects(ttnn, mesh):
    """test_indexed_fused_update_cache_rejects_mesh_row_sharding / _rejects_mismatched_data_topology, plus page
    sharding (dim 0; the docstring: "Cache page/row sharding ... not supported")."""
    rep = _indexed_mapped(ttnn, mesh, torch.arange(8, dtype=torch.int32).reshape(1, -1), None, ttnn.int32,
                          ttnn.ROW_MAJOR_LAYOUT)
    op = ttnn.experimental.indexed_fused_update_cache
    z = lambda shape, dim: _indexed_mapped(ttnn, mesh, torch.zeros(shape), dim)  # noqa: E731
    for dim, cache in ((2, (2, 2, 128, 64)), (0, (2, 2, 64, 64))):
        inp = (1, 2, 8, 64)
        expect_rejected(lambda: op(z(cache, dim), z(inp, 2 if dim == 2 else None), z(cache, dim),
                                    z(inp, 2 if dim == 2 else None), rep), "cache page/row sharding")
    expect_rejected(lambda: op(z((2, 4, 64, 128), 1), z((1, 4, 8, 128), 3), z((2, 4, 64, 128), 1),
                                z((1, 4, 8, 128), 3), rep), "identical mesh topology")


def _indexed_tile_and_alias_rejects(ttnn, mesh):
    """test_indexed_fused_update_cache_validation's custom/transposed tile cases and
    test_indexed_fused_update_cache_rejects_bound_tensor_alias_before_cache_insert."""
    op = ttnn.experimental.indexed_fused_update_cache
    dev = lambda shape, tile=None: ttnn.from_torch(torch.zeros(shape), dtype=ttnn.bfloat16,  # noqa: E731
                                                   layout=ttnn.TILE_LAYOUT, device=mesh, tile=tile)
    pos = on_mesh(ttnn, mesh, torch.arange(4, dtype=torch.int32).reshape(1, -1), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
    c, i = (2, 2, 64, 64), (1, 2, 4, 64)
    expect_rejected(lambda: op(dev(c, ttnn.Tile((16, 32))), dev(i), dev(c), dev(i), pos),
                     "cache_tensor1 must use the default non-transposed 32x32 tile")
    expect_rejected(lambda: op(dev(c), dev(i), dev(c), dev(i, ttnn.Tile((32, 32), transpose_tile=True)), pos),
                     "input_tensor2 must use the default non-transposed 32x32 tile")
    c1, i1 = dev(c), dev(i)
    expect_rejected(lambda: op(c1, i1, c1, dev(i), pos), "cache_tensor1 and cache_tensor2 must not alias")
    expect_rejected(lambda: op(c1, i1, dev(c), i1, pos), "input_tensor1 and input_tensor2 must not alias")


# ---- collectives ---------------------------------------------------------------------------------------------
def _sems(ttnn, mesh, n):
    cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))})
    return [ttnn.create_global_semaphore(mesh, cores, 0) for _ in range(n)]


def _ag_async_traced(ttnn, mesh):
    n = mesh.get_num_devices()
    full = torch.randn(1, 1, 128, 512).bfloat16().float()
    x = on_mesh(ttnn, mesh, full, mapper=ttnn.ShardTensorToMesh(mesh, 3))
    sems = _sems(ttnn, mesh, 2)
    tid = ttnn.begin_trace_capture(mesh, cq_id=0)
    out = ttnn.experimental.all_gather_async(x, dim=3, cluster_axis=1, mesh_device=mesh, topology=ttnn.Topology.Linear,
                                             multi_device_global_semaphore=sems)
    ttnn.end_trace_capture(mesh, tid, cq_id=0)
    for _ in range(3):
        ttnn.execute_trace(mesh, tid, cq_id=0)
        for i, d in enumerate(ttnn.get_device_tensors(out)):
            assert torch.equal(ttnn.to_torch(d).float(), full), f"device {i} of {n} differs after replay"
    ttnn.release_trace(mesh, tid)


def _rs_async(ttnn, mesh):
    n = mesh.get_num_devices()
    parts = torch.randn(n, 1, 64, 256).bfloat16().float()
    x = on_mesh(ttnn, mesh, parts, mapper=ttnn.ShardTensorToMesh(mesh, 0))
    out = ttnn.experimental.reduce_scatter_minimal_async(x, dim=3, multi_device_global_semaphore=_sems(ttnn, mesh, 3),
                                                         cluster_axis=1, topology=ttnn.Topology.Linear)
    total = parts.sum(0, keepdim=True)
    chunks = torch.chunk(total, n, dim=3)
    for i, d in enumerate(ttnn.get_device_tensors(out)):
        assert pcc(ttnn.to_torch(d).float(), chunks[i]) > 0.9999, f"device {i} reduce-scatter chunk"


# ---- sparse_matmul ----------------------------------------------------------------------------------------
def _sparse_pc(ttnn):
    # the program config the Tenstorrent test passes (1D multicast, mcast_in0); the emulator only checks its kind
    return ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(4, 4), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=1, per_core_N=1, fuse_batch=False, fused_activation=None,
        mcast_in0=True)


def _sparsity(g, shape):
    s = torch.rand(shape, generator=g) + 0.1
    zero = torch.randperm(s.numel(), generator=g)[: int(torch.randint(0, s.numel(), (1,), generator=g))]
    s.view(-1)[zero] = 0.0
    return s.to(torch.bfloat16)


def _sparse_dense_a(ttnn, mesh):
    g = torch.Generator().manual_seed(0)
    m, k, n, e, b, s = 16, 128, 512, 8, 1, 4
    in0, in1 = torch.randn(b, s, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, b, s, e))
    nnz = int((sp != 0).sum())
    out = ttnn.sparse_matmul(on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1, ttnn.bfloat8_b),
                             sparsity=on_mesh(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=nnz,
                             is_input_a_sparse=False, is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = device0(ttnn, mesh, out)
    assert list(y.shape) == [b, s, 1, e, m, n]
    for si in range(s):
        for ei in range(e):
            if sp[0, 0, si, ei] == 0:
                assert not y[0, si, 0, ei].any(), "a skipped block must be zero-filled"
            else:
                assert pcc(y[0, si, 0, ei], in0[0, si] @ in1[0, ei]) >= 0.999, f"block ({si}, {ei})"


def _sparse_both(ttnn, mesh):
    g = torch.Generator().manual_seed(1)
    m, k, n, e = 16, 128, 512, 32
    in0, in1 = torch.randn(1, e, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, 1, e))
    out = ttnn.sparse_matmul(on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1, ttnn.bfloat8_b),
                             sparsity=on_mesh(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=int((sp != 0).sum()),
                             is_input_a_sparse=True, is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = device0(ttnn, mesh, out)
    for ei in range(e):
        if sp[0, 0, 0, ei] != 0:
            assert pcc(y[0, ei], in0[0, ei] @ in1[0, ei]) >= 0.999, f"expert {ei}"


def _sparse_indexed(ttnn, mesh):
    g = torch.Generator().manual_seed(2)
    m, k, n, e = 4, 128, 256, 16
    in0, in1 = torch.randn(1, 1, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    ids = torch.tensor([[[[11, 3, 3, 0, 15]]]], dtype=torch.int32)  # unsorted, with a repeat
    counts = mesh.counters.total if hasattr(mesh, "counters") else None
    before = None if counts is None else counts.bytes_read_total
    out = ttnn.sparse_matmul(on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1),
                             sparsity=on_mesh(ttnn, mesh, torch.ones(1, 1, 1, e), layout=ttnn.ROW_MAJOR_LAYOUT),
                             indices=on_mesh(ttnn, mesh, ids, ttnn.uint16, ttnn.ROW_MAJOR_LAYOUT),
                             is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = device0(ttnn, mesh, out)
    assert list(y.shape) == [1, 1, 1, 5, m, n]
    for slot, ei in enumerate(ids.reshape(-1).tolist()):
        assert pcc(y[0, 0, 0, slot], in0[0, 0] @ in1[0, ei]) >= 0.999, f"slot {slot} (group {ei})"
    if counts is not None:  # the reader fetches the 5 listed groups of b, not all 16
        got = counts.bytes_read_total - before
        assert 5 * k * n * 2 <= got < 5 * k * n * 2 + 32 * k * 2 + 1024, f"indexed mode read {got} bytes"


def _sparse_a_docstring_form(ttnn, mesh):
    """Sparse A / dense B as the modes table gives it: a [A, E, M, K], b [1, E, K, N], sparsity [1, 1, A, E],
    output [A, E, M, N], block (a, e) computed where sparsity[0, 0, a, e] != 0 and zero-filled elsewhere (every
    active block at PCC >= 0.999, the test's bar). Tenstorrent's test_sparse_matmul_inputA_with_nnz calls another
    form (a [B, S, M, K] with S != E, output [B, S, 1, E, M, N]) that contradicts the table: refused by name."""
    g = torch.Generator().manual_seed(3)
    a_n, e, m, k, n = 2, 4, 32, 64, 64
    in0, in1 = torch.randn(a_n, e, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, a_n, e))
    out = ttnn.sparse_matmul(on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1),
                             sparsity=on_mesh(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=int((sp != 0).sum()),
                             is_input_a_sparse=True, is_input_b_sparse=False, program_config=_sparse_pc(ttnn))
    y = device0(ttnn, mesh, out)
    assert list(y.shape) == [a_n, e, m, n], y.shape
    for ai in range(a_n):
        for ei in range(e):
            if sp[0, 0, ai, ei] == 0:
                assert not y[ai, ei].any(), "a skipped block must be zero-filled"
            else:
                assert pcc(y[ai, ei], in0[ai, ei] @ in1[0, ei]) >= 0.999, f"block ({ai}, {ei})"
    tt_form = on_mesh(ttnn, mesh, torch.randn(1, 3, m, k, generator=g))  # S = 3 != E = 4
    expect_rejected(lambda: ttnn.sparse_matmul(
        tt_form, on_mesh(ttnn, mesh, in1), sparsity=on_mesh(ttnn, mesh, torch.ones(1, 1, 1, 3), layout=ttnn.ROW_MAJOR_LAYOUT),
        nnz=3 * e, is_input_a_sparse=True, is_input_b_sparse=False, program_config=_sparse_pc(ttnn)),
        "input_tensor_a must be")


def _sparse_compact_output(ttnn, mesh):
    """The docstring's compact optional_output_tensor [1, nnz, M, N]: the nnz computed blocks packed in sparsity scan
    order, skipped ones omitted (dense A / sparse B)."""
    g = torch.Generator().manual_seed(4)
    m, k, n, e, s = 32, 64, 64, 4, 3
    in0, in1 = torch.randn(1, s, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, s, e))
    nnz = int((sp != 0).sum())
    a_t, b_t = on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1)
    sp_t = on_mesh(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT)
    full = device0(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, sparsity=sp_t, nnz=nnz, program_config=_sparse_pc(ttnn)))
    out = on_mesh(ttnn, mesh, torch.zeros(1, nnz, m, n))
    ttnn.sparse_matmul(a_t, b_t, sparsity=sp_t, nnz=nnz, program_config=_sparse_pc(ttnn), optional_output_tensor=out)
    want = full.reshape(-1, m, n)[(sp.reshape(-1) != 0)]
    assert torch.equal(device0(ttnn, mesh, out)[0], want), "compact output != the active blocks in scan order"


def _sparse_indexed_bias(ttnn, mesh):
    """The docstring's indexed-mode ``bias``: a BFLOAT16 TILE [E, 32, N] tensor, row 0 of group indices[i]'s tile
    row added to slot i before packing (bf16 precision)."""
    g = torch.Generator().manual_seed(6)
    m, k, n, e = 4, 64, 64, 6
    in0, in1 = torch.randn(1, 1, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    bias = torch.randn(e, 32, n, generator=g).bfloat16().float()
    ids = torch.tensor([[[[5, 0, 2]]]], dtype=torch.int32)
    kw = dict(sparsity=on_mesh(ttnn, mesh, torch.ones(1, 1, 1, e), layout=ttnn.ROW_MAJOR_LAYOUT),
              indices=on_mesh(ttnn, mesh, ids, ttnn.uint16, ttnn.ROW_MAJOR_LAYOUT), program_config=_sparse_pc(ttnn))
    a_t, b_t = on_mesh(ttnn, mesh, in0), on_mesh(ttnn, mesh, in1)
    y = device0(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, bias=on_mesh(ttnn, mesh, bias), **kw))
    y0 = device0(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, **kw))
    for slot, ei in enumerate(ids.reshape(-1).tolist()):
        assert pcc(y[0, 0, 0, slot], in0[0, 0] @ in1[0, ei] + bias[ei, 0]) >= 0.999, f"slot {slot}"
        assert (y[0, 0, 0, slot] - y0[0, 0, 0, slot] - bias[ei, 0]).abs().max() <= 0.0625, "bias not added"
    expect_rejected(lambda: ttnn.sparse_matmul(a_t, b_t, sparsity=kw["sparsity"], nnz=e, program_config=_sparse_pc(
        ttnn), bias=on_mesh(ttnn, mesh, bias)), "bias requires indices")


SPARSE: list[Case] = [
    Case("sparse_matmul", "dense_a_nnz_8experts_bf8", SRC_SPARSE, _sparse_dense_a),
    Case("sparse_matmul", "both_sparse_batched_32experts_bf8", SRC_SPARSE, _sparse_both),
    Case("sparse_matmul", "indexed_gather_compact_unsorted_repeat", SRC_DOC, _sparse_indexed),
    Case("sparse_matmul", "sparse_a_docstring_form_and_named_shape_check", SRC_SPARSE, _sparse_a_docstring_form),
    Case("sparse_matmul", "compact_nnz_output", SRC_DOC, _sparse_compact_output),
    Case("sparse_matmul", "indexed_bias", SRC_DOC, _sparse_indexed_bias),
    Case("sparse_matmul", "tile_16x32_inputs_and_output_tile", SRC_SPARSE,
         skip="the test runs 16x32 in0/output tiles; the emulator computes 32x32 tiles only and refuses other tiles "
              "by name (from_torch(tile=...) is recorded, sparse_matmul(output_tile=...) refused)"),
    Case("sparse_matmul", "without_nnz_blackhole", SRC_SPARSE,
         skip="the Tenstorrent test skips it on Blackhole (sparsity broadcast semaphores); same numerics as the nnz "
              "case here"),
]
ROPE_HF_PREFILL: list[Case] = [
    Case("experimental.rotary_embedding_hf", "prefill_4h_64s_128d_interleaved", SRC_ROPE_HF, _rope_hf_prefill),
    Case("experimental.rotary_embedding_hf", "decode_rejects_interleaved_input", SRC_ROPE_HF,
         _rope_hf_decode_needs_height_shard),
]
COLLECTIVES: list[Case] = [
    Case("experimental.all_gather_async", "traced_1x1x128x512_dim3_linear", SRC_AG, _ag_async_traced),
    Case("experimental.reduce_scatter_minimal_async", "dim3_linear", SRC_AG, _rs_async),
    Case("experimental.all_gather_async", "num_links_chunks_per_sync_perf_knobs", SRC_AG,
         skip="links/workers/buffers per channel change timing only; no link model beyond the cost model"),
]
ROPE_HF_DECODE: list[Case] = []
for _b, _nh, _dh in ((1, 32, 128), (8, 8, 128), (32, 8, 128), (1, 32, 64), (8, 16, 64), (32, 8, 64), (4, 12, 256)):
    ROPE_HF_DECODE.append(Case("experimental.rotary_embedding_hf", f"decode_b{_b}_h{_nh}_d{_dh}",
                      SRC_ROPE_HF if _dh != 256 else f"{SRC_ROPE_HF} (form; head_dim 256 is this model's)",
                      _rope_hf_decode(_b, _nh, _dh), ci=(_b, _nh, _dh) in ((8, 8, 128), (4, 12, 256))))
HEADS_AND_NORM: list[Case] = []
for _nq, _nkv, _dh, _b, _sh, _ov in ((8, 1, 128, 8, True, True), (8, 1, 128, 8, True, False),
                                     (16, 2, 64, 32, True, True), (8, 4, 96, 32, True, True),
                                     (12, 2, 256, 1, False, True), (12, 2, 256, 8, False, True)):
    HEADS_AND_NORM.append(Case("experimental.nlp_create_qkv_heads_decode",
                      f"{'min_width_shard' if _sh else 'interleaved'}_q{_nq}_kv{_nkv}_d{_dh}_b{_b}"
                      f"{'' if _ov else '_no_overlap'}",
                      SRC_CREATE_HEADS if _sh else f"{SRC_CREATE_HEADS} (interleaved input: the device op's factory)",
                      _create_heads_case(_nq, _nkv, _dh, _b, _sh, _ov),
                      ci=(_nq, _b, _ov) in ((8, 8, False), (12, 1, True))))
for _nq, _nkv, _dh, _b in ((8, 1, 128, 32), (8, 4, 96, 32), (16, 2, 64, 32), (8, 1, 128, 16), (8, 1, 128, 8)):
    HEADS_AND_NORM.append(Case("experimental.nlp_create_qkv_heads_decode", f"max_width_shard_q{_nq}_kv{_nkv}_d{_dh}_b{_b}",
                      SRC_CREATE_HEADS, _create_heads_tt_form(_nq, _nkv, _dh, _b, "max"),
                      ci=(_nq, _nkv, _b) == (8, 1, 8)))
for _nq, _nkv, _dh in ((8, 1, 128), (8, 4, 96), (16, 2, 64)):
    HEADS_AND_NORM.append(Case("experimental.nlp_create_qkv_heads_decode",
                      f"min_width_shard_unspecified_grid_q{_nq}_kv{_nkv}_d{_dh}", SRC_CREATE_HEADS,
                      _create_heads_tt_form(_nq, _nkv, _dh, 32, "min"), ci=_dh == 96))
HEADS_AND_NORM += [
    Case("experimental.nlp_create_qkv_heads_decode", "rejects_bad_heads_and_partial_head_shards", SRC_CREATE_HEADS,
         _create_heads_rejects),
    Case("experimental.nlp_create_qkv_heads_decode", "host_wrapper_forces_overlap_and_l1_height_output",
         SRC_CREATE_HEADS_HOST, _create_heads_host_wrapper_configs),
    Case("experimental.nlp_create_qkv_heads_decode", "batch_offset_slice_size_subcoregrids", SRC_CREATE_HEADS,
         skip="batch_offset / slice_size and sub-core-grid inputs select users of a larger batch; the model splits "
              "its own rows, so these forms are not emulated (they fail fast)"),
    Case("rms_norm", "rejects_height_sharded_input", SRC_LAYERNORM_OP, _rms_norm_rejects_height_sharded),
]
INDEXED: list[Case] = []
for _shape in ((1, 2, 128, 64), (4, 2, 64, 64)):
    INDEXED.append(Case("experimental.indexed_fused_update_cache", f"scatter_rows_{'x'.join(map(str, _shape))}",
                      SRC_INDEXED_UPDATE, _indexed_update_case(_shape)))
INDEXED.append(Case("experimental.indexed_fused_update_cache", "validation", SRC_INDEXED_UPDATE,
                  _indexed_update_rejects))
for _dim, _shape in ((1, (2, 4, 64, 64)), (3, (2, 2, 64, 128))):
    INDEXED.append(Case("experimental.indexed_fused_update_cache", f"tensor_parallel_mesh_dim{_dim}", SRC_INDEXED_UPDATE,
                      _indexed_tensor_parallel(_dim, _shape), ci=_dim == 1))
INDEXED += [
    Case("experimental.indexed_fused_update_cache", "rejects_cache_page_row_mesh_sharding_and_mixed_topology",
         SRC_INDEXED_UPDATE, _indexed_mesh_rejects),
    Case("experimental.indexed_fused_update_cache", "rejects_custom_transposed_tiles_and_aliasing", SRC_INDEXED_UPDATE,
         _indexed_tile_and_alias_rejects),
]
ROPE_HF_I2S: list[Case] = [
    Case("experimental.rotary_embedding_hf", "decode_cos_sin_via_interleaved_to_sharded", SRC_ROPE_HF,
         _rope_hf_decode_cos_sin_via_interleaved_to_sharded),
]
