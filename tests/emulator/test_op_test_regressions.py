"""Regression tests for emulator bugs found by running Tenstorrent's own op tests (tenstorrent/tt-metal) against the
emulated mesh, and for the 0.81.1 features the emulator now implements or refuses by name. Each test restates, at small
shapes, the call form of the TT test named in its docstring; each failed on the emulator before the fix. (Spec-less
sharded output configs, which the rotary test found: test_specless_shards.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.numerics import pcc  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import EmulatorError  # noqa: E402
from qwen36.tt_ops.emulator.errors import NotEmulatedError  # noqa: E402


@pytest.fixture(scope="module")
def ctx2():
    with open_mesh("emulated-p150x2") as c:
        yield c


def _width_sharded_l1(ttnn, width):
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))})
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                             ttnn.ShardSpec(grid, [32, width], ttnn.ShardOrientation.ROW_MAJOR))


def _height_sharded_l1(ttnn, cores, width):
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(cores - 1, 0))})
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1,
                             ttnn.ShardSpec(grid, [32, width], ttnn.ShardOrientation.ROW_MAJOR))


# ---- 1. Tensor.to: the 0.81.1 overloads (device, mem_config=None, cq_id=None) and (target_layout) -------------------
def test_tensor_to_keeps_mem_config_in_every_spelling(ctx2):
    """test_nlp_create_qkv_heads_decode.py (tt_eager misc) moves its input with ``t.to(device=d, mem_config=c)``: that
    raised TypeError, and ``t.to(d, mem_config=c)`` silently gave an interleaved tensor."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    mc = _width_sharded_l1(ttnn, 64)
    host = ttnn.from_torch(torch.randn(1, 1, 8, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
    for dev in (host.to(device=mesh, mem_config=mc), host.to(mesh, mem_config=mc), host.to(mesh, mc)):
        assert dev.memory_config() == mc and dev.storage_type() == ttnn.StorageType.DEVICE
    assert not host.to(mesh).memory_config().is_sharded()  # no mem_config: the source tensor's
    with pytest.raises(TypeError, match="mem_config"):
        host.to(mesh, memory_config=mc)  # the keyword is mem_config; nanobind rejects others
    assert host.to(ttnn.ROW_MAJOR_LAYOUT).layout == ttnn.ROW_MAJOR_LAYOUT


# ---- 2. interleaved_to_sharded / sharded_to_interleaved record the target memory config --------------------------
def test_interleaved_to_sharded_marks_the_output_sharded(ctx2):
    """test_rotary_embedding_hf_decode_baseline.py shards cos/sin with ``ttnn.interleaved_to_sharded(t, mem_config)``;
    the output stayed INTERLEAVED and rotary_embedding_hf decode refused it ("needs sharded cos/sin")."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    x = torch.randn(1, 2, 1, 64).bfloat16().float()
    t = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    mc = _height_sharded_l1(ttnn, 2, 64)
    s = ttnn.interleaved_to_sharded(t, mc)
    assert s.memory_config() == mc
    g = ttnn.interleaved_to_sharded(t, ttnn.CoreCoord(2, 1), [32, 64], ttnn.TensorMemoryLayout.HEIGHT_SHARDED,
                                    ttnn.ShardOrientation.ROW_MAJOR)
    assert g.memory_config().shard_spec == mc.shard_spec and g.memory_config().buffer_type == ttnn.BufferType.L1
    xs = ttnn.interleaved_to_sharded(
        ttnn.from_torch(torch.randn(1, 2, 4, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh), mc)
    ttnn.experimental.rotary_embedding_hf(xs, s, s, is_decode_mode=True)  # accepted now
    back = ttnn.sharded_to_interleaved(s, ttnn.L1_MEMORY_CONFIG)
    assert back.memory_config() == ttnn.L1_MEMORY_CONFIG
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(back)[0]).float(), x)
    assert ttnn.sharded_to_interleaved(t) is t  # no shard spec: the input itself, as the host wrapper returns it
    with pytest.raises(EmulatorError, match="must be sharded"):
        ttnn.interleaved_to_sharded(t, ttnn.DRAM_MEMORY_CONFIG)


# ---- 3. nlp_create_qkv_heads_decode derives the output grid when the memory config has no shard spec -------------
def test_create_heads_decode_without_shard_spec_uses_the_compute_grid(ctx2):
    """test_nlp_create_qkv_heads_decode.py passes ``MemoryConfig(HEIGHT_SHARDED, L1)`` without a shard spec; the host
    wrapper (nlp_create_qkv_heads_decode.cpp) then takes the whole compute grid and the device op puts q/k/v on its
    first B cores. The emulator refused the call."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    nq, nkv, d, b = 8, 1, 64, 4
    x = torch.rand(1, 1, b, (nq + 2 * nkv) * d).bfloat16().float()
    t = ttnn.to_memory_config(ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh),
                              _width_sharded_l1(ttnn, (nq + 2 * nkv) * d))
    q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
        t, num_heads=nq, num_kv_heads=nkv,
        memory_config=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1))
    cores = {(c.x, c.y) for c in ttnn.corerange_to_cores(q.memory_config().shard_spec.grid)}
    assert cores == {(i, 0) for i in range(b)}
    assert list(q.memory_config().shard_spec.shape) == [32, d]
    heads = x.reshape(1, b, nq + 2 * nkv, d)
    for out, want in ((q, heads[:, :, :nq]), (k, heads[:, :, nq:nq + nkv]), (v, heads[:, :, nq + nkv:])):
        assert out.memory_config().buffer_type == ttnn.BufferType.L1
        assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(out)[0]).float(), want)


# ---- 4. indexed_fused_update_cache refuses a cache sharded over the mesh by pages or rows -------------------------
def test_indexed_update_refuses_cache_row_sharding_over_the_mesh(ctx2):
    """test_indexed_fused_update_cache.py::test_indexed_fused_update_cache_rejects_mesh_row_sharding: caches and inputs
    sharded over the mesh on dim 2 must fail ("cache page/row sharding requires physical-index remapping"); the
    emulator wrote each device's rows at unmapped physical indices."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device

    def sh(shape, dim):
        return ttnn.from_torch(torch.zeros(shape), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                               mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=dim))

    pos = ttnn.from_torch(torch.arange(8, dtype=torch.int32).reshape(1, -1), dtype=ttnn.int32, device=mesh,
                          mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    with pytest.raises(EmulatorError, match="cache page/row sharding requires physical-index remapping"):
        ttnn.experimental.indexed_fused_update_cache(sh((2, 2, 128, 64), 2), sh((1, 2, 8, 64), 2),
                                                     sh((2, 2, 128, 64), 2), sh((1, 2, 8, 64), 2), pos)
    with pytest.raises(EmulatorError, match="must use identical mesh topology"):
        ttnn.experimental.indexed_fused_update_cache(sh((2, 4, 64, 128), 1), sh((1, 4, 8, 128), 3),
                                                     sh((2, 4, 64, 128), 1), sh((1, 4, 8, 128), 3), pos)


# ---- 5. from_torch(tile=...) is recorded; ops refuse non-default tiles ---------------------------------------------
def test_transposed_tile_is_recorded_and_refused(ctx2):
    """test_indexed_fused_update_cache.py::test_indexed_fused_update_cache_validation ("input2_transposed_tile"): a
    ``Tile((32, 32), transpose_tile=True)`` tensor must be refused ("must use the default non-transposed 32x32 tile");
    the emulator treated it as a plain tile. Ops that do not validate tiles refuse any non-default tile by name."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    tile = ttnn.Tile((32, 32), transpose_tile=True)
    t = ttnn.from_torch(torch.zeros(1, 2, 4, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        tile=tile)
    assert t.tile.transpose_of_faces and list(t.get_tile().tile_shape) == [32, 32]
    assert not ttnn.from_torch(torch.zeros(32, 32), layout=ttnn.TILE_LAYOUT).tile.transpose_of_faces
    dev = lambda shape: ttnn.from_torch(torch.zeros(shape), dtype=ttnn.bfloat16,  # noqa: E731
                                        layout=ttnn.TILE_LAYOUT, device=mesh)
    pos = ttnn.from_torch(torch.arange(4, dtype=torch.int32).reshape(1, -1), dtype=ttnn.int32, device=mesh)
    with pytest.raises(EmulatorError, match="input_tensor2 must use the default non-transposed 32x32 tile"):
        ttnn.experimental.indexed_fused_update_cache(dev((2, 2, 64, 64)), dev((1, 2, 4, 64)), dev((2, 2, 64, 64)),
                                                     t, pos)
    with pytest.raises(NotEmulatedError, match="ttnn.add: .*32x32 transposed tile"):
        ttnn.add(t, t)
    half = ttnn.from_torch(torch.zeros(1, 1, 16, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                           tile=ttnn.Tile((16, 32)))
    with pytest.raises(NotEmulatedError, match="16x32 tile"):
        ttnn.multiply(half, half)


# ---- the documented features: implemented or refused by name --------------------------------------------------------
def test_tensor_topology_is_known_for_mapped_tensors_and_refused_for_op_outputs(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    a = ttnn.from_torch(torch.zeros(2, 4, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=1))
    b = ttnn.from_torch(torch.zeros(2, 4, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=1))
    r = ttnn.from_torch(torch.zeros(2, 4, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    assert isinstance(a.tensor_topology(), ttnn.TensorTopology)
    assert a.tensor_topology() == b.tensor_topology() and a.tensor_topology() != r.tensor_topology()
    assert ttnn.from_device(a).tensor_topology() == a.tensor_topology()
    with pytest.raises(NotEmulatedError, match="tensor_topology"):
        ttnn.add(a, b).tensor_topology()


def _pc(ttnn):  # the only program-config kind sparse_matmul takes (1-D multicast, mcast_in0)
    return ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(4, 4), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=1, per_core_N=1, fuse_batch=False, fused_activation=None,
        mcast_in0=True)


def test_sparse_matmul_sparse_a_shape_mismatch_is_a_named_error(ctx2):
    """test_sparse_matmul.py::test_sparse_matmul_inputA_with_nnz's shapes (a [1, S, M, K] with S != E) used to die in
    a torch broadcast ("The size of tensor a ... must match")."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    dev = lambda x, layout=ttnn.TILE_LAYOUT: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=layout,  # noqa: E731
                                                             device=mesh)
    with pytest.raises(EmulatorError, match="input_tensor_a must be \\[A, 4, M, K\\]"):
        ttnn.sparse_matmul(dev(torch.randn(1, 3, 32, 64)), dev(torch.randn(1, 4, 64, 32)),
                           sparsity=dev(torch.ones(1, 1, 1, 3), ttnn.ROW_MAJOR_LAYOUT), nnz=12,
                           is_input_a_sparse=True, is_input_b_sparse=False, program_config=_pc(ttnn))
    with pytest.raises(EmulatorError, match="sparsity must be \\[1, 1, 1, 4\\]"):
        ttnn.sparse_matmul(dev(torch.randn(1, 4, 32, 64)), dev(torch.randn(1, 4, 64, 32)),
                           sparsity=dev(torch.ones(1, 1, 2, 4), ttnn.ROW_MAJOR_LAYOUT), nnz=4,
                           is_input_a_sparse=True, is_input_b_sparse=True, program_config=_pc(ttnn))
    with pytest.raises(NotEmulatedError, match="output_tile 16x32 tile"):
        ttnn.sparse_matmul(dev(torch.randn(1, 4, 32, 64)), dev(torch.randn(1, 4, 64, 32)),
                           sparsity=dev(torch.ones(1, 1, 1, 4), ttnn.ROW_MAJOR_LAYOUT), nnz=4,
                           is_input_a_sparse=True, output_tile=ttnn.Tile([16, 32]), program_config=_pc(ttnn))


def test_sparse_matmul_compact_output_refuses_a_wrong_nnz(ctx2):
    """The compact ``[1, nnz, M, N]`` form needs nnz == count_nonzero(sparsity) (the docstring: the card hangs
    otherwise): the emulator says so instead of packing a wrong count."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    dev = lambda x, layout=ttnn.TILE_LAYOUT: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=layout,  # noqa: E731
                                                             device=mesh)
    sp = torch.tensor([[[[1.0, 0.0, 1.0, 0.0]]]])
    out = dev(torch.zeros(1, 3, 32, 32))
    with pytest.raises(EmulatorError, match="nnz=3 but the sparsity has"):
        ttnn.sparse_matmul(dev(torch.randn(1, 1, 32, 64)), dev(torch.randn(1, 4, 64, 32)),
                           sparsity=dev(sp, ttnn.ROW_MAJOR_LAYOUT), nnz=3, optional_output_tensor=out,
                           program_config=_pc(ttnn))


# ---- rotary_embedding_hf decode with cos/sin padded to a tile row; refusals in the device op's words -------------
def _tile(ttnn, mesh, x, dtype=None, mc=None):
    return ttnn.from_torch(x, dtype=dtype or ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh, memory_config=mc)


def _dev0(ttnn, t):
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()


def test_rotary_hf_decode_takes_cos_sin_padded_to_a_tile_row_per_user(ctx2):
    """test_rotary_embedding_hf.py::test_rotary_embedding_hf_decode_per_batch_position pads cos/sin [1, B, 1, D] with
    zero rows to [1, B, 32, D]; the device op checks only the batch dim and its kernel multiplies with row 0 of each
    user's tile broadcast over the heads (the same tiles either way). The emulator refused anything but [1, B, 1, D].
    Rows 1..31 are never read (here: random, not zero); more than one tile row per user is refused by name."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    b, nh, d = 4, 32, 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, b, nh, d, generator=g).bfloat16().float()
    cos1, sin1 = (torch.randn(1, b, 1, d, generator=g).bfloat16().float() for _ in range(2))
    grid = ttnn.num_cores_to_corerangeset(b, mesh.compute_with_storage_grid_size(), True)
    mc = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1,
                           ttnn.ShardSpec(grid, [32, d], ttnn.ShardOrientation.ROW_MAJOR))
    xs = _tile(ttnn, mesh, x, mc=mc)
    outs = []
    for rows in (1, 32):
        fill = [torch.randn(1, b, rows - 1, d, generator=g) for _ in range(2)]
        cs, ss = (_tile(ttnn, mesh, torch.cat([t, f], dim=2), mc=mc) for t, f in zip((cos1, sin1), fill))
        outs.append(_dev0(ttnn, ttnn.experimental.rotary_embedding_hf(xs, cs, ss, is_decode_mode=True)))
    assert torch.equal(outs[0], outs[1])
    h = d // 2
    want = x * cos1 + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin1
    assert pcc(outs[0], want) >= 0.9999
    two = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1,
                            ttnn.ShardSpec(grid, [64, d], ttnn.ShardOrientation.ROW_MAJOR))
    c64 = _tile(ttnn, mesh, torch.zeros(1, b, 64, d), mc=two)
    with pytest.raises(NotEmulatedError, match="one tile row per user"):
        ttnn.experimental.rotary_embedding_hf(xs, c64, c64, is_decode_mode=True)


@pytest.mark.parametrize("case", ["positions_dtype", "positions_layout", "positions_too_short",
                                  "cache_requires_padding", "too_many_source_rows", "positions_too_wide"])
def test_indexed_update_refuses_in_the_device_ops_words(ctx2, case):
    """test_indexed_fused_update_cache.py::test_indexed_fused_update_cache_validation matches on the device op's
    message (strings of 0.81.1's library); the emulator's own wording failed these six."""
    from qwen36.testing.conformance_tt_cache import VALIDATION_MESSAGES, validation_case

    assert VALIDATION_MESSAGES[case].startswith(("physical_update_idxs_tensor", "cache_tensor1", "input_tensor1"))
    validation_case(case)(ctx2.ttnn, ctx2.mesh_device)


def test_sparse_matmul_indexed_contract_in_the_device_ops_words(ctx2):
    """test_sparse_matmul_indexed.py's contract tests match on the device op's messages (0.81.1's strings)."""
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    a = _tile(ttnn, mesh, torch.randn(1, 1, 32, 64))
    w = _tile(ttnn, mesh, torch.randn(1, 4, 64, 32), ttnn.bfloat8_b)
    sp = ttnn.from_torch(torch.ones(1, 1, 1, 4), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    ids = lambda v, shape=None, dt=None: ttnn.from_torch(  # noqa: E731
        torch.tensor(v, dtype=torch.int32).reshape(shape or (1, 1, 1, len(v))), dtype=dt or ttnn.uint16,
        layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    pc = ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(1, 1), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=1, per_core_N=1, fuse_batch=False, fused_activation=None,
        mcast_in0=True)
    call = lambda ix, **kw: ttnn.sparse_matmul(a, w, sparsity=sp, indices=ix, program_config=pc, **kw)  # noqa: E731
    for ix, kw, needle in (
            (ids([0, 1], (1, 1, 2, 1)), {}, "indices must occupy a single ROW_MAJOR stick"),
            (ids([0, 1], dt=ttnn.uint32), {}, "indices must be UINT16 dtype"),
            (ids([0, 1, 2, 3, 0]), {}, "must be <= the number of sparse groups in input B"),
            (ids([0, 1]), {"nnz": 2}, "nnz \\(2\\) must not be supplied together with indices"),
            (ids([0, 1]), {"is_input_a_sparse": True, "is_input_b_sparse": False}, "requires is_input_b_sparse=true"),
            (None, {"bias": _tile(ttnn, mesh, torch.zeros(4, 1, 32))}, "bias requires indices"),
            (ids([0, 1]), {"bias": _tile(ttnn, mesh, torch.zeros(4, 1, 32), ttnn.bfloat8_b)}, "bias must be BFLOAT16"),
            (ids([0, 1]), {"bias": _tile(ttnn, mesh, torch.zeros(3, 1, 32))}, "bias must have padded shape")):
        with pytest.raises(EmulatorError, match=needle):
            call(ix, **kw)
    host = ttnn.from_torch(torch.tensor([[[[0, 1]]]], dtype=torch.int32), dtype=ttnn.uint16,
                           layout=ttnn.ROW_MAJOR_LAYOUT)
    with pytest.raises(EmulatorError, match="Device Operations expect device tensors as inputs"):
        call(host)
