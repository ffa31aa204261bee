"""Emulated mesh core: tensors, mappers/composers, quantisation, golden dispatch, API fidelity of calls."""

from __future__ import annotations

import pytest
import torch

ttnn_real = pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import EmulatorError, EmuTensor  # noqa: E402
from qwen36.tt_ops.emulator import ops_core  # noqa: E402


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["1x1", "1x2", "1x4"])
def ctx(request):
    name = {1: "emulated-p150", 2: "emulated-p150x2", 4: "emulated-p150x4"}[request.param]
    with open_mesh(name, trace_region_size=1_000_000) as c:
        yield c


@pytest.fixture(scope="module")
def ctx2():
    with open_mesh("emulated-p150x2", trace_region_size=1_000_000) as c:
        yield c


def bf16_ulp_close(a: torch.Tensor, b: torch.Tensor, ulps: int = 2) -> bool:
    """|a-b| <= ulps * bf16 ulp(|b|) elementwise (bf16 has 8 significant bits: ulp = 2^(e-7))."""
    a, b = a.float(), b.float()
    ulp = torch.pow(2.0, torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
    return bool(((a - b).abs() <= ulps * ulp + 1e-30).all())


# ---------------------------------------------------------------------------------------------
# labels, round trips
# ---------------------------------------------------------------------------------------------
def test_label_and_shape(ctx):
    n = ctx.num_devices
    assert ctx.is_emulated
    assert ctx.mesh_shape == (1, n)
    assert ctx.label.startswith("emulated-p150") and "ttnn goldens on CPU" in ctx.label
    assert "hardware" not in ctx.label
    assert list(ctx.mesh_device.shape) == [1, n]
    assert ctx.mesh_device.get_num_devices() == n


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("dim", [0, -1])
def test_shard_concat_round_trip(ctx, dtype_name, dim):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    dtype = getattr(ttnn, dtype_name)
    x = torch.randn(4 * n, 3, 64 * n)
    t = ttnn.from_torch(x, dtype=dtype, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=dim))
    shards = ttnn.get_device_tensors(t)
    assert len(shards) == n
    tdt = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    expect = torch.chunk(x, n, dim=dim)
    for s, e in zip(shards, expect):
        assert list(s.shape) == list(e.shape)
        assert torch.equal(ttnn.to_torch(s), e.to(tdt))
    back = ttnn.to_torch(t, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=dim))
    ref = x.to(torch.bfloat16 if dtype_name == "bfloat16" else torch.float32)
    assert back.dtype == ref.dtype
    assert torch.equal(back, ref)


def test_replicate_round_trip(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    x = torch.randn(2, 40, 70)
    t = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    assert list(t.shape) == [2, 40, 70]
    assert list(t.padded_shape) == [2, 64, 96]
    for s in ttnn.get_device_tensors(t):
        assert torch.equal(ttnn.to_torch(s), x.bfloat16())
    cat = ttnn.to_torch(t, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=0))
    assert list(cat.shape) == [2 * n, 40, 70]


def test_create_mesh_mapper_and_2d(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    x = torch.randn(8, 32 * n)
    mapper = ttnn.create_mesh_mapper(mesh, ttnn.MeshMapperConfig([ttnn.PlacementReplicate(), ttnn.PlacementShard(-1)]))
    t = ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh, mesh_mapper=mapper)
    assert [list(s.shape) for s in ttnn.get_device_tensors(t)] == [[8, 32]] * n
    t2 = ttnn.from_torch(x, dtype=ttnn.float32, device=mesh,
                         mesh_mapper=ttnn.ShardTensor2dMesh(mesh, mesh_shape=(1, n), dims=(None, 1)))
    back = ttnn.to_torch(t2, mesh_composer=ttnn.ConcatMesh2dToTensor(mesh, mesh_shape=(1, n), dims=(0, 1)))
    assert torch.equal(back, x)


def test_to_torch_multi_shard_needs_composer(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    t = ttnn.from_torch(torch.randn(4, 64), dtype=ttnn.bfloat16, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
    with pytest.raises(EmulatorError, match="mesh composer"):
        ttnn.to_torch(t)


def test_uneven_shard_rejected(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    with pytest.raises(EmulatorError, match="does not divide"):
        ttnn.from_torch(torch.randn(3, 5), dtype=ttnn.float32, device=mesh, mesh_mapper=ttnn.ShardTensorToMesh(mesh, 1))


# ---------------------------------------------------------------------------------------------
# block-float quantisation = ttnn's own host conversion
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qdtype", ["bfloat8_b", "bfloat4_b"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_block_float_error_matches_ttnn_host_conversion(ctx, qdtype, src):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    torch.manual_seed(0)
    x = torch.randn(64, 96 * n).to(src)
    dt = getattr(ttnn_real, qdtype)
    t = ttnn.from_torch(x, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
    assert t.dtype == dt
    for i, s in enumerate(ttnn.get_device_tensors(t)):
        piece = torch.chunk(x, n, dim=-1)[i].contiguous()
        real = ttnn_real.to_torch(ttnn_real.from_torch(piece, dtype=dt, layout=ttnn_real.TILE_LAYOUT))
        got = ttnn.to_torch(s)
        assert got.dtype == real.dtype == torch.float32
        assert torch.equal(got, real), "emulated quantisation must be bit-identical to ttnn's host packer"
    err = (ttnn.to_torch(t, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=-1)) - x.float()).abs().max().item()
    assert err > 0  # quantisation really happened
    assert err < (0.1 if qdtype == "bfloat8_b" else 1.0)


def test_block_float_requires_tile(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    with pytest.raises(EmulatorError, match="TILE"):
        ttnn.from_torch(torch.randn(32, 32), dtype=ttnn.bfloat8_b, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    t = ttnn.from_torch(torch.randn(32, 32), dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh)
    with pytest.raises(EmulatorError, match="TILE"):
        ttnn.to_layout(t, ttnn.ROW_MAJOR_LAYOUT)


def test_tile_bytes_match_ttnn():
    from qwen36.tt_ops.emulator.tensor import TILE_BYTES

    for name, b in TILE_BYTES.items():
        assert ttnn_real.tile_size(getattr(ttnn_real, name.lower())) == b


# ---------------------------------------------------------------------------------------------
# as_tensor weight cache
# ---------------------------------------------------------------------------------------------
def test_as_tensor_cache_write_once_reload_skips_conversion(ctx2, tmp_path):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    w = torch.randn(64, 128)
    kw = dict(dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG,
              mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1), cache_file_name=str(tmp_path / "w"))
    before = dict(ops_core.STATS)
    a = ttnn.as_tensor(w, **kw)
    assert ops_core.STATS["as_tensor_conversions"] == before["as_tensor_conversions"] + 1
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and "dtype_BFLOAT8_B_layout_TILE" in files[0].name
    b = ttnn.as_tensor(w, **kw)
    assert ops_core.STATS["as_tensor_conversions"] == before["as_tensor_conversions"] + 1  # no re-conversion
    assert ops_core.STATS["as_tensor_cache_loads"] == before["as_tensor_cache_loads"] + 1
    comp = ttnn.ConcatMeshToTensor(mesh, dim=-1)
    assert torch.equal(ttnn.to_torch(a, mesh_composer=comp), ttnn.to_torch(b, mesh_composer=comp))
    # same file, different sharding: refused instead of silently loading the wrong layout
    kw["mesh_mapper"] = ttnn.ShardTensorToMesh(mesh, dim=0)
    with pytest.raises(EmulatorError, match="does not match"):
        ttnn.as_tensor(w, **kw)
    with pytest.raises(EmulatorError, match="memory_config must be specified"):
        ttnn.as_tensor(w, dtype=ttnn.bfloat16, device=mesh)


# ---------------------------------------------------------------------------------------------
# dispatch: API fidelity and golden ops
# ---------------------------------------------------------------------------------------------
def test_unknown_op_and_kwarg_rejected(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    x = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    with pytest.raises(AttributeError):
        ttnn.fused_rms_norm_that_does_not_exist  # noqa: B018
    with pytest.raises(AttributeError):
        ttnn.BlackholeComputeKernelConfig  # noqa: B018  (not in 0.81.1)
    with pytest.raises(TypeError, match="rms_norm.*'eps'"):
        ttnn.rms_norm(x, eps=1e-6)
    with pytest.raises(TypeError, match="positional"):
        ttnn.rms_norm(x, 1e-6)  # epsilon is keyword-only
    with pytest.raises(TypeError, match="linear.*'bogus_kwarg'"):
        ttnn.linear(x, x, bogus_kwarg=1)


def test_dtype_layout_table_enforced(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    x = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    with pytest.raises(EmulatorError, match="rms_norm: input_tensor is BFLOAT16 in ROW_MAJOR"):
        ttnn.rms_norm(x, epsilon=1e-6)


def test_host_tensor_rejected_by_device_op(ctx2):
    ttnn = ctx2.ttnn
    x = ttnn.from_torch(torch.randn(32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
    with pytest.raises(EmulatorError, match="on host"):
        ttnn.silu(x)


def _shard_pair(ttnn, mesh, shape, dtype=None, dim=-1, layout=None, scale=1.0):
    x = torch.randn(*shape) * scale
    t = ttnn.from_torch(x, dtype=dtype or ttnn.bfloat16, layout=layout or ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=dim))
    return x, t


def test_linear_matches_torch(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    torch.manual_seed(1)
    x = torch.randn(1, 1, 32, 128).bfloat16()
    w = torch.randn(128, 64 * n).bfloat16()
    b = torch.randn(64 * n).bfloat16()
    xt = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    wt = ttnn.from_torch(w, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                         mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
    bt = ttnn.from_torch(b, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                         mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
    cfg = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, fp32_dest_acc_en=True)
    y = ttnn.linear(xt, wt, bias=bt, memory_config=ttnn.DRAM_MEMORY_CONFIG, program_config=None,
                    compute_kernel_config=cfg, activation="silu")
    got = ttnn.to_torch(y, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=-1))
    ref = torch.nn.functional.silu(x.double() @ w.double() + b.double())
    assert got.dtype == torch.bfloat16
    assert bf16_ulp_close(got, ref, ulps=1)
    # fp32 output when asked (HiFi4 + fp32 dest: exact bf16 products, fp32 accumulation, as on cards)
    y32 = ttnn.matmul(xt, wt, dtype=ttnn.float32, compute_kernel_config=cfg)
    assert y32.dtype == ttnn.float32
    got32 = ttnn.to_torch(y32, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=-1))
    assert torch.allclose(got32.double(), x.double() @ w.double(), rtol=1e-5, atol=1e-4)


def test_elementwise_and_norm_goldens(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    torch.manual_seed(2)
    x, xt = _shard_pair(ttnn, mesh, (1, 1, 32, 128))
    xb = x.bfloat16().double()
    comp = ttnn.ConcatMeshToTensor(mesh, dim=-1)
    cases = {
        "sigmoid": (ttnn.sigmoid(xt), torch.sigmoid(xb)),
        "silu": (ttnn.silu(xt), torch.nn.functional.silu(xb)),
        "exp": (ttnn.exp(xt), torch.exp(xb)),
        "neg": (ttnn.neg(xt), -xb),
        "softplus": (ttnn.softplus(xt), torch.nn.functional.softplus(xb)),
        "add": (ttnn.add(xt, xt), xb + xb),
        "mul": (ttnn.mul(xt, xt), xb * xb),
        "multiply": (ttnn.multiply(xt, 0.5), xb * 0.5),
    }
    for name, (t, ref) in cases.items():
        assert t.dtype == ttnn.bfloat16, name
        assert bf16_ulp_close(ttnn.to_torch(t, mesh_composer=comp), ref, ulps=2), name
    # rms_norm over the full (replicated) hidden dim, with weight and explicit epsilon
    h = torch.randn(1, 1, 32, 64)
    w = torch.rand(64) + 0.5
    ht = ttnn.from_torch(h, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    wt = ttnn.from_torch(w.reshape(1, 1, 64 // 32, 32), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    wt_tile = ttnn.from_torch(w, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    out = ttnn.rms_norm(ht, epsilon=1e-6, weight=wt_tile)
    hb = h.bfloat16().double()
    ref = hb * torch.rsqrt(hb.pow(2).mean(-1, keepdim=True) + 1e-6) * w.bfloat16().double()
    got = ttnn.get_device_tensors(out)[0]
    assert out.dtype == ttnn.bfloat16
    assert bf16_ulp_close(ttnn.to_torch(got), ref, ulps=2)
    del wt


def test_data_movement_goldens(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    x = torch.randn(1, 2, 32, 64)
    t = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    one = lambda tt: ttnn.to_torch(ttnn.get_device_tensors(tt)[1])  # noqa: E731
    xb = x.bfloat16()
    assert torch.equal(one(ttnn.reshape(t, (1, 64, 64))), xb.reshape(1, 64, 64))
    assert torch.equal(one(ttnn.reshape(t, ttnn.Shape([2, 32, 64]))), xb.reshape(2, 32, 64))
    assert torch.equal(one(ttnn.permute(t, (0, 2, 1, 3))), xb.permute(0, 2, 1, 3))
    assert torch.equal(one(ttnn.transpose(t, -2, -1)), xb.transpose(-2, -1))
    assert torch.equal(one(ttnn.concat([t, t], dim=1)), torch.cat([xb, xb], dim=1))
    assert torch.equal(one(ttnn.slice(t, [0, 1, 0, 0], [1, 2, 16, 64])), xb[:, 1:2, :16, :])
    f = ttnn.typecast(t, ttnn.float32)
    assert f.dtype == ttnn.float32 and torch.equal(one(f), xb.float())
    rm = ttnn.to_layout(t, ttnn.ROW_MAJOR_LAYOUT)
    assert rm.layout == ttnn.ROW_MAJOR_LAYOUT and torch.equal(one(rm), xb)
    sm = ttnn.softmax(t, dim=-1)
    assert bf16_ulp_close(one(sm), torch.softmax(xb.double(), -1), ulps=2)


def test_embedding_argmax_topk(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    torch.manual_seed(3)
    table = torch.randn(100, 64)
    ids = torch.tensor([[3, 7, 99, 0]], dtype=torch.int32)
    tt_table = ttnn.from_torch(table, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    tt_ids = ttnn.from_torch(ids, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    e = ttnn.embedding(tt_ids, tt_table)
    assert e.dtype == ttnn.bfloat16
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(e)[0]), table.bfloat16()[ids.long()])
    logits = torch.randn(1, 1, 32, 256)
    lt = ttnn.from_torch(logits, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    am = ttnn.argmax(lt, dim=-1)
    got = ttnn.to_torch(ttnn.get_device_tensors(am)[0])
    assert torch.equal(got.long().reshape(-1), logits.bfloat16().argmax(-1).reshape(-1))
    vals, idx = ttnn.topk(lt, k=4, dim=-1)
    rv, ri = torch.topk(logits.bfloat16(), 4, dim=-1)
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(vals)[0]), rv)
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(idx)[0]).long(), ri)


def test_copy_in_place(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    a_t, a = _shard_pair(ttnn, mesh, (1, 1, 32, 64))
    b_t, b = _shard_pair(ttnn, mesh, (1, 1, 32, 64), dtype=ttnn.float32)
    out = ttnn.copy(a, b)
    assert out is b and b.dtype == ttnn.float32
    comp = ttnn.ConcatMeshToTensor(mesh, dim=-1)
    assert torch.equal(ttnn.to_torch(b, mesh_composer=comp), a_t.bfloat16().float())


def test_deallocate(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    _, t = _shard_pair(ttnn, mesh, (1, 1, 32, 64))
    ttnn.deallocate(t)
    assert not t.is_allocated()
    with pytest.raises(EmulatorError, match="deallocated"):
        ttnn.silu(t)


def test_forwarded_classes_and_constants(ctx2):
    ttnn = ctx2.ttnn
    assert ttnn.bfloat16 is ttnn_real.bfloat16
    assert ttnn.TILE_LAYOUT == ttnn_real.TILE_LAYOUT
    assert ttnn.DRAM_MEMORY_CONFIG == ttnn_real.DRAM_MEMORY_CONFIG
    assert ttnn.WormholeComputeKernelConfig is ttnn_real.WormholeComputeKernelConfig
    assert ttnn.MathFidelity.HiFi4 == ttnn_real.MathFidelity.HiFi4
    assert isinstance(ttnn.from_torch(torch.zeros(2)), EmuTensor)
    with pytest.raises(Exception, match="emulated mesh"):
        ttnn.open_mesh_device(ttnn.MeshShape(1, 2))


def test_op_table_policy():
    """sigmoid documents BFLOAT16 only: default policy logs an unlisted dtype, 'strict' raises; layouts raise."""
    with open_mesh("emulated-p150") as c:
        x32 = c.ttnn.from_torch(torch.randn(32, 32), dtype=c.ttnn.float32, layout=c.ttnn.TILE_LAYOUT,
                                device=c.mesh_device)
        c.ttnn.sigmoid(x32)  # warned, not raised
    with open_mesh("emulated-p150", op_table_policy="strict") as c:
        x32 = c.ttnn.from_torch(torch.randn(32, 32), dtype=c.ttnn.float32, layout=c.ttnn.TILE_LAYOUT,
                                device=c.mesh_device)
        with pytest.raises(EmulatorError, match="sigmoid: input_tensor is FLOAT32"):
            c.ttnn.sigmoid(x32)
    with open_mesh("emulated-p150", op_table_policy="off") as c:
        xr = c.ttnn.from_torch(torch.randn(32, 32), dtype=c.ttnn.bfloat16, layout=c.ttnn.ROW_MAJOR_LAYOUT,
                               device=c.mesh_device)
        c.ttnn.softmax(xr)  # TILE-only op, but checks are off


def test_isinstance_shims(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    t = ttnn.from_torch(torch.randn(2, 2), dtype=ttnn.float32, device=mesh)
    assert isinstance(t, ttnn.Tensor)
    assert isinstance(mesh, ttnn.MeshDevice)
    assert not isinstance(torch.zeros(1), ttnn.Tensor)
    with pytest.raises(Exception, match="from_torch"):
        ttnn.Tensor(torch.zeros(2), ttnn.bfloat16)


def test_override_parameter_names_match_real_signatures():
    """Keyword calls with the real parameter names must reach every override (regression: typecast/reshape)."""
    import inspect

    from qwen36.tt_ops.emulator import registry
    from qwen36.tt_ops.emulator.signatures import signature_of

    registry.load_all()
    problems = []
    for name, spec in registry.OVERRIDES.items():
        real = ttnn_real
        try:
            for part in name.split(".")[1:]:
                real = getattr(real, part)
        except AttributeError:
            problems.append(f"{name}: override for a name the installed ttnn lacks")
            continue
        sig = signature_of(name, real)
        if sig.source == "unknown":
            continue
        params = inspect.signature(spec.fn).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            continue
        names = set(params)
        for o in sig.overloads:
            missing = [n for n in list(o.positional) + list(o.keyword_only) if n not in names]
            if spec.kind == "op" and missing:
                problems.append(f"{name}: real parameter(s) {missing} not accepted by the emulation")
    assert not problems, "\n".join(problems)


def test_tensor_methods(ctx2):
    ttnn, mesh = ctx2.ttnn, ctx2.mesh_device
    h = ttnn.from_torch(torch.randn(32, 32), dtype=ttnn.bfloat16, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    d = h.to(mesh, ttnn.DRAM_MEMORY_CONFIG)
    assert d.storage_type() == ttnn.StorageType.DEVICE and d.device() is mesh
    t = d.to(ttnn.TILE_LAYOUT)
    assert t.layout == ttnn.TILE_LAYOUT
    back = t.cpu()
    assert back.storage_type() == ttnn.StorageType.HOST
    assert torch.equal(back.to_torch(mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=0))[:32], ttnn.to_torch(
        ttnn.get_device_tensors(h)[0]))
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(ttnn.typecast(input_tensor=t, dtype=ttnn.float32))[0]),
                       ttnn.to_torch(ttnn.get_device_tensors(h)[0]).float())
    assert list(ttnn.reshape(input_tensor=t, shape=[1, 32, 32]).shape) == [1, 32, 32]


def test_from_torch_does_not_alias_caller_tensor(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    t = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    h = ttnn.from_torch(x, dtype=ttnn.bfloat16)
    x.fill_(7)
    assert torch.all(ttnn.to_torch(ttnn.get_device_tensors(t)[0]) == 0)
    assert torch.all(ttnn.to_torch(h) == 0)
    out = ttnn.to_torch(h)
    out.fill_(3)
    assert torch.all(ttnn.to_torch(h) == 0)


# ---------------------------------------------------------------------------------------------
# reshape views share the device buffer
# ---------------------------------------------------------------------------------------------
def test_reshape_view_shares_the_buffer(ctx2):
    """A 0-cost reshape view (last two dims kept) aliases its base as on cards: an in-place write through the view
    reaches the base, and the view reads later writes to the base. A reshape that moves data does not alias."""
    ttnn = ctx2.ttnn
    rep = ttnn.ReplicateTensorToMesh(ctx2.mesh_device)
    dev = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=ctx2.mesh_device,  # noqa: E731
                                    mesh_mapper=rep)
    host = lambda t: ttnn.to_torch(ttnn.get_device_tensors(t)[0])  # noqa: E731
    base = dev(torch.zeros(1, 3, 32, 32))
    view = ttnn.reshape(base, [3, 32, 32])
    ttnn.copy(dev(torch.ones(3, 32, 32)), view)  # write through the view
    assert torch.equal(host(base), torch.ones(1, 3, 32, 32))
    ttnn.copy(dev(torch.full((1, 3, 32, 32), 2.0)), base)  # the view sees the base's new contents
    assert torch.equal(host(view), torch.full((3, 32, 32), 2.0))
    moved = ttnn.reshape(base, [1, 3, 1024, 1])  # last dim changes: a program that writes a new buffer
    ttnn.copy(dev(torch.zeros(1, 3, 1024, 1)), moved)
    assert torch.equal(host(base), torch.full((1, 3, 32, 32), 2.0))
