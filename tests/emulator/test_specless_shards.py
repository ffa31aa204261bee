"""A sharded ``memory_config`` without a shard spec (``MemoryConfig(HEIGHT_SHARDED, L1)``, as Tenstorrent's op tests
pass it) handed to an op's output: resolved per device-op family (tt_ops/emulator/shard_specs.py). rotary_embedding_hf
derives a spec as its compute_output_specs does; the tensor layer refuses a spec-less buffer with tt-metal's message;
ops that derive one in ways the emulator does not model, or refuse it themselves, say so by name. Each test failed on
the emulator before the fix ("L1 accounting: a sharded L1 tensor without a shard_spec", or a silently interleaved
DRAM tensor)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.numerics import pcc  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator.errors import EmulatorError, NotEmulatedError  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    with open_mesh("emulated-p150x2") as c:
        yield c


def _specless(ttnn, buffer_type=None):
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, buffer_type or ttnn.BufferType.L1)


def _tile(ttnn, mesh, x, dtype=None, mc=None):
    return ttnn.from_torch(x, dtype=dtype or ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh, memory_config=mc)


def _dev0(ttnn, t):
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _close(got, want):
    """bf16 rope: both products are rounded to bf16 before the add (ops_attention), so an element that cancels keeps
    up to about two bf16 half-ulps of its products (|products| < 16 here: 0.0625 each)."""
    assert pcc(got, want) >= 0.9999 and float((got - want).abs().max()) <= 0.125


def test_rotary_hf_spec_less_output_takes_the_input_spec(ctx):
    """test_rotary_embedding_hf.py, in_sharded and out_sharded: the output gets the input's shard spec (grid, shape,
    orientation) with the requested layout and buffer type, and is charged to L1 like the input."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 64, 64, generator=g).bfloat16().float()
    cos, sin = (torch.randn(1, 1, 128, 64, generator=g).bfloat16().float() for _ in range(2))
    spec = ttnn.ShardSpec(ttnn.num_cores_to_corerangeset(8, mesh.compute_with_storage_grid_size(), True), [32, 64],
                          ttnn.ShardOrientation.ROW_MAJOR)
    xs = _tile(ttnn, mesh, x, mc=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1, spec))
    before = mesh.l1_in_use()
    out = ttnn.experimental.rotary_embedding_hf(xs, _tile(ttnn, mesh, cos), _tile(ttnn, mesh, sin),
                                                is_decode_mode=False, memory_config=_specless(ttnn))
    mc = out.memory_config()
    assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED and mc.buffer_type == ttnn.BufferType.L1
    assert mc.shard_spec == spec
    assert [a - b for a, b in zip(mesh.l1_in_use(), before)] == [2 * 2048] * 2, "a [32, 64] bf16 shard per core"
    _close(_dev0(ttnn, out), _rope(x, cos[:, :, :64], sin[:, :, :64]))


@pytest.mark.parametrize("shape,cores,rows", [((1, 1, 128, 64), 4, 32), ((1, 71, 128, 64), 71, 128),
                                              ((1, 2272, 32, 64), 71, 1024)])
def test_rotary_hf_spec_less_output_of_an_interleaved_input_splits_its_rows(ctx, shape, cores, rows):
    """test_rotary_embedding_hf.py, out_sharded with an interleaved input: the device op splits the input's tile rows
    over the largest core count of the 11x10 grid that divides them (284 rows of [1, 71, 128, 64]: 71 cores of 4;
    2272 rows: 71 cores of 32 tiles), row-major from core (0, 0)."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).bfloat16().float()
    cos, sin = (torch.randn(1, 1, shape[2], 64, generator=g).bfloat16().float() for _ in range(2))
    out = ttnn.experimental.rotary_embedding_hf(_tile(ttnn, mesh, x), _tile(ttnn, mesh, cos), _tile(ttnn, mesh, sin),
                                                is_decode_mode=False, memory_config=_specless(ttnn))
    spec = out.memory_config().shard_spec
    assert spec.grid == ttnn.num_cores_to_corerangeset(cores, mesh.compute_with_storage_grid_size(), True)
    assert list(spec.shape) == [rows, 64] and spec.orientation == ttnn.ShardOrientation.ROW_MAJOR
    _close(_dev0(ttnn, out), _rope(x, cos, sin))


def test_the_tensor_layer_refuses_a_spec_less_sharded_buffer(ctx):
    """An op that hands the caller's config to its output as it is (rotary_embedding_llama's compute_output_specs)
    and a host-to-device transfer both need a shard spec: tt-metal's TensorLayout refuses the buffer, in L1 and in
    DRAM (the DRAM one was silently laid out as interleaved)."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    for bt in (ttnn.BufferType.L1, ttnn.BufferType.DRAM):
        with pytest.raises(EmulatorError, match="MemoryConfig must have Shard Spec specified for sharded memory"):
            _tile(ttnn, mesh, torch.zeros(1, 1, 32, 64), mc=_specless(ttnn, bt))
    x = _tile(ttnn, mesh, torch.randn(1, 1, 32, 64))
    cs = _tile(ttnn, mesh, torch.randn(1, 1, 32, 64))
    tm = _tile(ttnn, mesh, torch.eye(32).reshape(1, 1, 32, 32))
    with pytest.raises(EmulatorError, match="MemoryConfig must have Shard Spec specified"):
        ttnn.experimental.rotary_embedding_llama(x, cs, cs, tm, memory_config=_specless(ttnn))


def test_ops_that_derive_or_refuse_a_spec_say_so_by_name(ctx):
    """matmul derives the output's spec from its program config, unary ops synthesise one over the compute grid: the
    emulator does not model those derivations and refuses by name (NotEmulatedError), never with a guessed size;
    clone refuses with its device op's message."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    a, b = _tile(ttnn, mesh, torch.randn(1, 1, 32, 64)), _tile(ttnn, mesh, torch.randn(1, 1, 64, 32))
    with pytest.raises(NotEmulatedError, match="ttnn.matmul: .*from the program config"):
        ttnn.matmul(a, b, memory_config=_specless(ttnn))
    with pytest.raises(NotEmulatedError, match="ttnn.typecast: .*synthesised over the compute grid"):
        ttnn.typecast(a, ttnn.float32, memory_config=_specless(ttnn))
    with pytest.raises(NotEmulatedError, match="ttnn.neg: a sharded memory_config without a shard_spec"):
        ttnn.neg(a, memory_config=_specless(ttnn))
    with pytest.raises(EmulatorError, match="Clone: output memory config must have shard spec when sharded"):
        ttnn.clone(a, memory_config=_specless(ttnn))
    assert ttnn.neg(a).memory_config() == a.memory_config(), "no memory_config: the input's, as before"
