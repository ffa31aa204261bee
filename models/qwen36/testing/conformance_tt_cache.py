"""Tenstorrent's ``test_indexed_fused_update_cache.py`` restated (sources: ``qwen36.testing.conformance_tt_tests``)."""

from __future__ import annotations

import torch

from .conformance_tt_base import TTCase, host0, raises, randn, two_devices


def _idx_ref(cache, packed, positions):
    out, bs = cache.clone(), cache.shape[2]
    for src, row in enumerate(positions):
        if 0 <= row < cache.shape[0] * bs:
            out[row // bs, :, row % bs, :] = packed[0, :, src, :]
    return out


def _dev(ttnn, mesh, t, dtype=None, layout=None, tile=None, mapper=None):
    kw = {"tile": tile} if tile is not None else {}
    return ttnn.from_torch(t, device=mesh, dtype=dtype or ttnn.bfloat16, layout=layout or ttnn.TILE_LAYOUT,
                           memory_config=ttnn.DRAM_MEMORY_CONFIG, mesh_mapper=mapper, **kw)


def _pos(ttnn, mesh, positions, dtype=None, layout=None, mapper=None):
    return _dev(ttnn, mesh, torch.tensor([positions], dtype=torch.int32), dtype or ttnn.int32,
                layout or ttnn.ROW_MAJOR_LAYOUT, mapper=mapper)


def _idx_scatter(cache_shape):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(17)
        c1, c2 = torch.zeros(cache_shape, dtype=torch.bfloat16), torch.zeros(cache_shape, dtype=torch.bfloat16)
        shape = (1, cache_shape[1], 9, cache_shape[3])
        i1, i2 = randn(g, shape, dtype=torch.bfloat16), randn(g, shape, dtype=torch.bfloat16)
        positions = [1, 3, 31, 32, 33, 63, 64, -1, cache_shape[0] * cache_shape[2]]
        t1, t2 = _dev(ttnn, mesh, c1), _dev(ttnn, mesh, c2)
        o1, o2 = ttnn.experimental.indexed_fused_update_cache(t1, _dev(ttnn, mesh, i1), t2, _dev(ttnn, mesh, i2),
                                                              _pos(ttnn, mesh, positions))
        assert o1.buffer_address() == t1.buffer_address() and o2.buffer_address() == t2.buffer_address()
        assert torch.equal(host0(ttnn, o1), _idx_ref(c1, i1, positions))
        assert torch.equal(host0(ttnn, o2), _idx_ref(c2, i2, positions))
    return fn


def _restore_program_cache(mesh):
    """Leave the shared mesh as it was opened (program cache on, empty): the cases after this one in the suite must
    not run without it."""
    mesh.clear_program_cache()
    mesh.enable_program_cache()


def _idx_program_cache(ttnn, mesh):
    g = torch.Generator().manual_seed(23)
    shape, ishape = (3, 1, 64, 128), (1, 1, 4, 128)
    mesh.enable_program_cache()
    mesh.clear_program_cache()
    try:
        c1, c2 = (_dev(ttnn, mesh, torch.zeros(shape, dtype=torch.bfloat16)) for _ in range(2))
        first = [randn(g, ishape, dtype=torch.bfloat16) for _ in range(2)]
        ttnn.experimental.indexed_fused_update_cache(c1, _dev(ttnn, mesh, first[0]), c2, _dev(ttnn, mesh, first[1]),
                                                     _pos(ttnn, mesh, [0, 1, 64, 65]))
        entries = mesh.num_program_cache_entries()
        second = [randn(g, ishape, dtype=torch.bfloat16) for _ in range(2)]
        o1, o2 = ttnn.experimental.indexed_fused_update_cache(c1, _dev(ttnn, mesh, second[0]), c2,
                                                              _dev(ttnn, mesh, second[1]),
                                                              _pos(ttnn, mesh, [2, 3, 128, -1]))
        assert entries > 0 and mesh.num_program_cache_entries() == entries
        for o, a, b in ((o1, first[0], second[0]), (o2, first[1], second[1])):
            want = _idx_ref(_idx_ref(torch.zeros(shape, dtype=torch.bfloat16), a, [0, 1, 64, 65]), b, [2, 3, 128, -1])
            assert torch.equal(host0(ttnn, o), want)
    finally:
        _restore_program_cache(mesh)


def _idx_trace_replay(ttnn, mesh):
    g = torch.Generator().manual_seed(27)
    shape, ishape = (2, 2, 64, 64), (1, 2, 5, 64)
    bufs = [_dev(ttnn, mesh, torch.zeros(s, dtype=torch.bfloat16)) for s in (shape, shape, ishape, ishape)]
    pos = _pos(ttnn, mesh, [0] * ishape[2])
    ttnn.experimental.indexed_fused_update_cache(bufs[0], bufs[2], bufs[1], bufs[3], pos)
    tid = ttnn.begin_trace_capture(mesh, cq_id=0)
    o1, o2 = ttnn.experimental.indexed_fused_update_cache(bufs[0], bufs[2], bufs[1], bufs[3], pos)
    ttnn.end_trace_capture(mesh, tid, cq_id=0)
    try:
        for positions in ([0, 31, 32, -1, 128], [2, 63, 64, 65, 66]):
            host = [torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16),
                    randn(g, ishape, dtype=torch.bfloat16), randn(g, ishape, dtype=torch.bfloat16)]
            rep = ttnn.ReplicateTensorToMesh(mesh)  # a host tensor shaped like the buffer (one shard per device)
            for h, d in zip(host, bufs):
                ttnn.copy_host_to_device_tensor(ttnn.from_torch(h, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                                                mesh_mapper=rep), d)
            ttnn.copy_host_to_device_tensor(ttnn.from_torch(torch.tensor([positions], dtype=torch.int32),
                                                            dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                                                            mesh_mapper=rep), pos)
            ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)
            assert o1.buffer_address() == bufs[0].buffer_address() and o2.buffer_address() == bufs[1].buffer_address()
            assert torch.equal(host0(ttnn, o1), _idx_ref(host[0], host[2], positions))
            assert torch.equal(host0(ttnn, o2), _idx_ref(host[1], host[3], positions))
    finally:
        ttnn.release_trace(mesh, tid)


def _idx_many_workers(ttnn, mesh):
    g = torch.Generator().manual_seed(29)
    shape, rows = (3, 8, 64, 512), 96
    c1, c2 = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    i1, i2 = (randn(g, 1, 8, rows, 512, dtype=torch.bfloat16) for _ in range(2))
    positions = list(range(60, 60 + rows))
    positions[32] = positions[64] = positions[31]  # one target at both source-tile edges: the last source row wins
    o1, o2 = ttnn.experimental.indexed_fused_update_cache(_dev(ttnn, mesh, c1), _dev(ttnn, mesh, i1),
                                                          _dev(ttnn, mesh, c2), _dev(ttnn, mesh, i2),
                                                          _pos(ttnn, mesh, positions))
    assert torch.equal(host0(ttnn, o1), _idx_ref(c1, i1, positions))
    assert torch.equal(host0(ttnn, o2), _idx_ref(c2, i2, positions))


# the validation cases of that test -> the device op's message it matches
VALIDATION_MESSAGES = {
    "cache_dtype": "cache_tensor1 must use BFLOAT16",
    "positions_dtype": "physical_update_idxs_tensor must use INT32",
    "positions_layout": "physical_update_idxs_tensor must use ROW_MAJOR layout",
    "positions_too_short": "physical_update_idxs_tensor has fewer entries",
    "cache_shape_mismatch": "cache_tensor1 and cache_tensor2 must have identical shapes",
    "input_shape_mismatch": "input_tensor1 and input_tensor2 must have identical shapes",
    "cache_requires_padding": "cache_tensor1 rows per physical page must be tile aligned",
    "too_many_source_rows": "input_tensor1 supports at most 256 source rows",
    "cache1_custom_tile": "cache_tensor1 must use the default non-transposed 32x32 tile",
    "cache2_custom_tile": "cache_tensor2 must use the default non-transposed 32x32 tile",
    "input1_custom_tile": "input_tensor1 must use the default non-transposed 32x32 tile",
    "input2_transposed_tile": "input_tensor2 must use the default non-transposed 32x32 tile",
    "positions_too_wide": "physical_update_idxs_tensor supports at most 256 entries",
}


# what each validation case replaces in the valid call (caches [2, 2, 64, 64], inputs [1, 2, 4, 64], 4 positions):
# tensor slot -> (shape, dtype name, layout name, tile) or, for "p", (positions, dtype name, layout name)
_VALIDATION_CALLS = {
    "cache_dtype": {"c1": ((2, 2, 64, 64), "bfloat8_b")},
    "positions_dtype": {"p": (range(4), "uint32")},
    "positions_layout": {"p": (range(4), "int32", "TILE_LAYOUT")},
    "positions_too_short": {"p": (range(3),)},
    "cache_shape_mismatch": {"c2": ((3, 2, 64, 64),)},
    "input_shape_mismatch": {"i2": ((1, 2, 5, 64),)},
    "cache_requires_padding": {"c1": ((2, 2, 33, 64),), "c2": ((2, 2, 33, 64),)},
    "too_many_source_rows": {"i1": ((1, 2, 257, 64),), "i2": ((1, 2, 257, 64),), "p": (range(257),)},
    "cache1_custom_tile": {"c1": ((2, 2, 64, 64), None, None, (16, 32))},
    "cache2_custom_tile": {"c2": ((2, 2, 64, 64), None, None, (16, 32))},
    "input1_custom_tile": {"i1": ((1, 2, 4, 64), None, None, (16, 32))},
    "input2_transposed_tile": {"i2": ((1, 2, 4, 64), None, None, "transposed")},
    "positions_too_wide": {"p": (range(257),)},
}


def validation_case(case):
    def fn(ttnn, mesh):
        def tensor(shape, dtype=None, layout=None, tile=None):
            if tile is not None:
                tile = ttnn.Tile((32, 32), transpose_tile=True) if tile == "transposed" else ttnn.Tile(tile)
            return _dev(ttnn, mesh, torch.zeros(shape, dtype=torch.bfloat16), dtype and getattr(ttnn, dtype),
                        layout and getattr(ttnn, layout), tile=tile)

        def positions(values, dtype=None, layout=None):
            return _pos(ttnn, mesh, list(values), dtype and getattr(ttnn, dtype), layout and getattr(ttnn, layout))

        args = {"c1": ((2, 2, 64, 64),), "i1": ((1, 2, 4, 64),), "c2": ((2, 2, 64, 64),), "i2": ((1, 2, 4, 64),),
                "p": (range(4),)}
        args.update(_VALIDATION_CALLS[case])
        c1, i1, c2, i2 = (tensor(*args[k]) for k in ("c1", "i1", "c2", "i2"))
        p = positions(*args["p"])
        raises(lambda: ttnn.experimental.indexed_fused_update_cache(c1, i1, c2, i2, p), VALIDATION_MESSAGES[case])
    return fn


def _golden_function(ttnn, mesh):
    """The op's host-side torch reference, through ``ttnn.get_golden_function`` (no device involved)."""
    c1 = torch.zeros((2, 2, 32, 64), dtype=torch.bfloat16)
    c2 = torch.zeros_like(c1)
    i1 = torch.arange(2 * 4 * 64, dtype=torch.float32).reshape(1, 2, 4, 64).to(torch.bfloat16)
    positions = torch.tensor([[0, 33, -1, 64]], dtype=torch.int32)
    golden = ttnn.get_golden_function(ttnn.experimental.indexed_fused_update_cache)
    o1, o2 = golden(c1, i1, c2, -i1, positions)
    assert torch.equal(o1, _idx_ref(c1, i1, positions.reshape(-1).tolist()))
    assert torch.equal(o2, _idx_ref(c2, -i1, positions.reshape(-1).tolist()))
    assert torch.count_nonzero(c1) == 0 and torch.count_nonzero(c2) == 0


def _idx_replicated(ttnn, mesh):
    two_devices(mesh)
    g = torch.Generator().manual_seed(31)
    rep = ttnn.ReplicateTensorToMesh(mesh)
    c1, c2 = torch.zeros(2, 2, 64, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 64, 64, dtype=torch.bfloat16)
    i1, i2 = (randn(g, 1, 2, 6, 64, dtype=torch.bfloat16) for _ in range(2))
    positions = [0, 31, 32, 63, 64, -1]
    o1, o2 = ttnn.experimental.indexed_fused_update_cache(
        _dev(ttnn, mesh, c1, mapper=rep), _dev(ttnn, mesh, i1, mapper=rep), _dev(ttnn, mesh, c2, mapper=rep),
        _dev(ttnn, mesh, i2, mapper=rep), _pos(ttnn, mesh, positions, mapper=rep))
    for o, c, i in ((o1, c1, i1), (o2, c2, i2)):
        for shard in ttnn.get_device_tensors(o.cpu()):
            assert torch.equal(ttnn.to_torch(shard), _idx_ref(c, i, positions))


def _idx_tensor_parallel(dim, cache_shape):
    def fn(ttnn, mesh):
        two_devices(mesh)
        g = torch.Generator().manual_seed(37 + dim)
        shard, rep = ttnn.ShardTensorToMesh(mesh, dim=dim), ttnn.ReplicateTensorToMesh(mesh)
        ishape = (1, cache_shape[1], 6, cache_shape[3])
        c1, c2 = torch.zeros(cache_shape, dtype=torch.bfloat16), torch.zeros(cache_shape, dtype=torch.bfloat16)
        t1, t2 = _dev(ttnn, mesh, c1, mapper=shard), _dev(ttnn, mesh, c2, mapper=shard)
        compose = ttnn.ConcatMeshToTensor(mesh, dim=dim)
        mesh.enable_program_cache()
        mesh.clear_program_cache()
        try:
            steps, entries = ([0, 31, 32, 63, 64, -1], [2, 3, 65, 95, -1, cache_shape[0] * cache_shape[2]]), None
            want1, want2 = c1, c2
            for positions in steps:
                i1, i2 = (randn(g, ishape, dtype=torch.bfloat16) for _ in range(2))
                o1, o2 = ttnn.experimental.indexed_fused_update_cache(
                    t1, _dev(ttnn, mesh, i1, mapper=shard), t2, _dev(ttnn, mesh, i2, mapper=shard),
                    _pos(ttnn, mesh, positions, mapper=rep))
                if entries is None:
                    entries = mesh.num_program_cache_entries()
                else:
                    assert entries > 0 and mesh.num_program_cache_entries() == entries
                want1, want2 = _idx_ref(want1, i1, positions), _idx_ref(want2, i2, positions)
                assert o1.tensor_topology() == t1.tensor_topology() and o2.tensor_topology() == t2.tensor_topology()
                assert torch.equal(ttnn.to_torch(o1, mesh_composer=compose), want1)
                assert torch.equal(ttnn.to_torch(o2, mesh_composer=compose), want2)
        finally:
            _restore_program_cache(mesh)
    return fn


# refusal -> (cache shape, input shape, mesh dim of the four data tensors (per tensor), of the indices, needle)
_MESH_REFUSALS = {
    "sharded_positions": ((2, 2, 64, 64), (1, 2, 4, 64), (None, None), 1,
                          "physical_update_idxs_tensor must be replicated across mesh axes"),
    "page_rows": ((2, 2, 128, 64), (1, 2, 8, 64), (2, 2), None, "cache page/row sharding requires physical-index "
                                                                  "remapping"),
    "topology": ((2, 4, 64, 128), (1, 4, 4, 128), (1, 3), None, "must use identical mesh topology"),
}


def _idx_mesh_refusal(kind):
    def fn(ttnn, mesh):
        two_devices(mesh)
        cache_shape, input_shape, (cache_dim, input_dim), pos_dim, needle = _MESH_REFUSALS[kind]

        def mapped(shape, dim):
            return _dev(ttnn, mesh, torch.zeros(shape, dtype=torch.bfloat16),
                        mapper=ttnn.ReplicateTensorToMesh(mesh) if dim is None else ttnn.ShardTensorToMesh(mesh, dim))

        c1, i1, c2, i2 = (mapped(cache_shape, cache_dim), mapped(input_shape, input_dim),
                          mapped(cache_shape, cache_dim), mapped(input_shape, input_dim))
        pos_mapper = ttnn.ReplicateTensorToMesh(mesh) if pos_dim is None else ttnn.ShardTensorToMesh(mesh, pos_dim)
        pos = _pos(ttnn, mesh, list(range(input_shape[2])), mapper=pos_mapper)
        raises(lambda: ttnn.experimental.indexed_fused_update_cache(c1, i1, c2, i2, pos), needle)
    return fn


def indexed_cases() -> list[TTCase]:
    op = "experimental.indexed_fused_update_cache"
    out = [TTCase(op, f"scatter_rows_{'x'.join(map(str, s))}", _idx_scatter(s), ci=s == (4, 2, 64, 64))
           for s in ((1, 2, 128, 64), (4, 2, 64, 64))]
    out += [TTCase(op, "program_cache_reuses_runtime_positions", _idx_program_cache),
            TTCase(op, "trace_replay", _idx_trace_replay, trace_region=200_000),
            TTCase(op, "multi_tile_rows_and_worker_stride", _idx_many_workers),
            TTCase(op, "golden_function", _golden_function)]
    out += [TTCase(op, f"validation_{k}", validation_case(k), ci=True) for k in VALIDATION_MESSAGES]
    out += [TTCase(op, "replicated_mesh", _idx_replicated, mesh="mesh2"),
            TTCase(op, "tensor_parallel_mesh_heads", _idx_tensor_parallel(1, (2, 4, 64, 64)), mesh="mesh2"),
            TTCase(op, "tensor_parallel_mesh_head_dim", _idx_tensor_parallel(3, (2, 2, 64, 128)), mesh="mesh2"),
            TTCase(op, "2d_tensor_parallel_mesh_2x2", None, mesh="mesh2",
                   skip="a 2x2 mesh: the emulator opens 1xN meshes only (emulated-p150x2 / -p150x4)"),
            TTCase(op, "rejects_sharded_positions", _idx_mesh_refusal("sharded_positions"), mesh="mesh2"),
            TTCase(op, "rejects_mesh_row_sharding", _idx_mesh_refusal("page_rows"), mesh="mesh2"),
            TTCase(op, "rejects_mismatched_data_topology", _idx_mesh_refusal("topology"), mesh="mesh2")]
    return out
