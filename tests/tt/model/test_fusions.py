"""Attention / MLP fusions: the RoPE head-dim permutation is exact, and the per-layer program counts they buy stay
bought (bounds that the unfused code fails: attention decode mixer 25 programs, MLP 7 at CI size; fused: 15, 5; the
head split by slices and reshapes instead of nlp_create_qkv_heads_decode: 21).

The numerics of the fused layers are gated in tests/tt/model/test_layers.py (per layer) and tests/tt/model/test_model.py."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.layers import apply_partial_rope, rope_cos_sin
from qwen36.tt.model.weights import rope_head_permutation, rope_tables


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


@pytest.mark.parametrize("head_dim,rotary_dim", [(256, 64), (32, 8), (128, 128), (64, 32)])
def test_full_width_rotate_half_in_permuted_order_is_partial_rope(head_dim, rotary_dim):
    """rotary_embedding_hf's full-width rotate_half on the permuted head == the reference's partial NeoX RoPE,
    permuted; and q.k products do not see the permutation."""
    g = torch.Generator().manual_seed(0)
    t = 7
    pos = torch.tensor([0, 1, 5, 31, 32, 200, 4095])
    x = torch.randn(1, 3, t, head_dim, generator=g, dtype=torch.float64)
    cos_r, sin_r = rope_cos_sin(pos, rotary_dim, 1e7, torch.float64)
    want = apply_partial_rope(x, cos_r[None], sin_r[None])
    perm = rope_head_permutation(head_dim, rotary_dim)
    assert sorted(perm.tolist()) == list(range(head_dim))
    cos, sin = rope_tables(4096, head_dim, rotary_dim, 1e7)
    cos, sin = cos[pos].double(), sin[pos].double()
    xp = x[..., perm]
    got = xp * cos + _rotate_half(xp) * sin
    torch.testing.assert_close(got, want[..., perm], rtol=0, atol=1e-6)  # fp32 tables vs fp64 reference
    y = torch.randn(1, 3, t, head_dim, generator=g, dtype=torch.float64)
    torch.testing.assert_close(xp @ y[..., perm].transpose(-1, -2), x @ y.transpose(-1, -2))


def test_rope_head_permutation_rejects_odd_dims():
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_head_permutation(32, 7)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from qwen36.tt.model.model_config import PrecisionSetting
    from qwen36.tt_ops.device import open_mesh
    from qwen36.tiny import make_bf16_checkpoint
    from support.tt import LayerHarness

    ckpt = make_bf16_checkpoint(tmp_path_factory.mktemp("tt-fusions"), "ci", seed=0)
    with open_mesh("emulated-p150x2") as ctx:
        h = LayerHarness(ckpt, ctx, PrecisionSetting.named("performance"), 3)  # the CI config's attention layer
        h.decoder_layer(torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(1)), "prefill")
        yield ctx, h


def _count(ctx, name, fn):
    with ctx.counters.scope(name) as c:
        fn()
    return c


def test_attention_decode_programs(harness):
    ctx, h = harness
    actx = h._ctx("decode", 1)
    x = h.to_device(torch.randn(1, 1, 64))
    c = _count(ctx, "attention mixer", lambda: h.layer.mixer.forward(x, h.state.layers[0], actx))
    ops = dict(c.per_op)
    # RoPE: one program each for q and k (was matmul + 2 multiply + add each); no separate sigmoid
    assert ops.get("ttnn.experimental.rotary_embedding_hf") == 2, ops
    assert "ttnn.matmul" not in ops and "ttnn.sigmoid" not in ops and "ttnn.add" not in ops, ops
    assert ops.get("ttnn.multiply") == 1, ops
    # ONE head split (no slices, no reshapes before the norms): [q | k | v] and the gate are two matmuls
    assert ops.get("ttnn.experimental.nlp_create_qkv_heads_decode") == 1, ops
    assert "ttnn.slice" not in ops and ops.get("ttnn.linear") == 3, ops
    # K and V rows in one cache update; resharding: q and k to interleaved for their norms, which write the RoPE's
    # height-sharded layout themselves; v stays where the head split put it (cores apart from the rotated k)
    assert ops.get("ttnn.experimental.paged_fused_update_cache") == 1, ops
    assert "ttnn.experimental.paged_update_cache" not in ops, ops
    assert ops.get("ttnn.to_memory_config") == 2, ops
    # the all-reduce is 2 programs (reduce-scatter + all-gather); the figures in the message count it as 1
    assert c.programs <= 16, f"attention decode mixer: {c.programs} programs (unfused: 25, slices + reshapes: 21, " \
                             f"reshards after the q/k norms: 17) {dict(c.programs_per_op)}"
    h.pos += 1


def test_mlp_programs(harness):
    """Prefill (and the interleaved layout's decode): 6 programs (gate, up, multiply, down, the composite all-reduce's
    reduce-scatter and all-gather: 2 collectives), no slices or silu. Decode in the default mcast_1d layout: gate and
    up read x where it is, multiply, down writes its L1 width shards, the single-op all-reduce on them (1 program,
    1 collective), the reshard of its sum to DRAM: 6 programs, 1 collective, the weights read DRAM-interleaved."""
    ctx, h = harness
    assert h.args.decode_matmuls == "mcast_1d"
    for rows, want, reshards, collectives in ((40, 6, 0, 2), (1, 6, 1, 1)):
        x = h.to_device(torch.randn(1, rows, 64))
        c = _count(ctx, "mlp", lambda: h.layer.mlp.forward(x))
        ops = dict(c.per_op)
        assert c.programs == want, f"MLP, {rows} rows: {c.programs} programs (fused gate_up + slices + silu: 8) {ops}"
        assert c.collectives == collectives, (rows, c.collectives, ops)
        assert "ttnn.slice" not in ops and "ttnn.silu" not in ops, ops
        assert ops.get("ttnn.to_memory_config", 0) == reshards, ops
    assert c.bytes_read["BFLOAT8_B"] > 0 and not any("dram_sharded" in k for k in c.bytes_read), dict(c.bytes_read)


def test_mlp_programs_dram_sharded_decode(tmp_path):
    """DRAM-sharded decode: gate, up, multiply, down, the single-op all-reduce on the down output's L1 width shards,
    the reshard of its sum to DRAM, plus the reshard of x into L1 width shards when x arrives interleaved: 7 programs,
    1 collective, the weights read from their DRAM banks."""
    from qwen36.tiny import make_bf16_checkpoint
    from support.tt import LayerHarness
    from qwen36.tt.model.model_config import PrecisionSetting
    from qwen36.tt_ops.device import open_mesh

    ckpt = make_bf16_checkpoint(tmp_path / "ckpt", "ci", seed=0)
    with open_mesh("emulated-p150x2") as ctx:
        h = LayerHarness(ckpt, ctx, PrecisionSetting.named("performance"), 1, decode_matmuls="dram_sharded")
        x = h.to_device(torch.randn(1, 1, 64))
        c = _count(ctx, "mlp", lambda: h.layer.mlp.forward(x))
        ops = dict(c.per_op)
        assert c.programs == 7 and c.collectives == 1 and ops.get("ttnn.to_memory_config") == 2, ops
        assert any(k.startswith("BFLOAT8_B@dram_sharded/8") for k in c.bytes_read), dict(c.bytes_read)


def test_mlp_single_op_all_reduce_matches_the_composite(harness):
    """The decode MLP's single-op all-reduce on the L1 down output gives exactly the composite all-reduce of the same
    partials (the emulated reduction is the same fp32 sum rounded once; cards sum two bf16 partials in one rounding
    either way)."""
    from qwen36.tt.model.ccl import all_reduce

    ctx, h = harness
    mlp = h.layer.mlp
    x = h.to_device(torch.randn(1, 1, 64))
    got = h.model.to_host(mlp.forward(x))
    want = h.model.to_host(all_reduce(ctx.ttnn, mlp.partial(x), h.model.args.num_devices))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decoder_layer_norm_writes_the_mlp_input(harness):
    """Decode rows: the post-attention RMSNorm writes x where the gate/up matmuls read it (mcast_1d: L1, read for
    free), so the MLP inside the layer is 6 programs (one reshard: the reduced down output back to DRAM); prefill
    rows keep DRAM. The result equals the MLP of the same x from DRAM, bit for bit."""
    ctx, h = harness
    mlp = h.layer.mlp
    assert mlp.input_memory_config(40) is None
    mc = mlp.input_memory_config(1)
    assert not mc.is_sharded() and mc.buffer_type == ctx.ttnn.BufferType.L1
    x = h.to_device(torch.randn(1, 1, 64))
    xs = ctx.ttnn.rms_norm(x, epsilon=1e-6, weight=h.layer.w.post_norm, memory_config=mc)
    c = _count(ctx, "mlp", lambda: mlp.forward(xs))
    assert c.programs == 6 and dict(c.per_op).get("ttnn.to_memory_config") == 1, dict(c.per_op)
    assert dict(c.bytes_read_per_op["ttnn.linear"]).get("BFLOAT16", 0) == 0, dict(c.bytes_read_per_op["ttnn.linear"])
    torch.testing.assert_close(h.model.to_host(mlp.forward(xs)), h.model.to_host(mlp.forward(
        ctx.ttnn.rms_norm(x, epsilon=1e-6, weight=h.layer.w.post_norm))), rtol=0, atol=0)


def test_mlp_programs_interleaved_decode(tmp_path):
    """decode_matmuls="interleaved" keeps the six-program decode MLP (the all-reduce is two) on DRAM-interleaved weights."""
    from qwen36.tiny import make_bf16_checkpoint
    from support.tt import LayerHarness
    from qwen36.tt.model.model_config import PrecisionSetting
    from qwen36.tt_ops.device import open_mesh

    ckpt = make_bf16_checkpoint(tmp_path / "ckpt", "ci", seed=0)
    with open_mesh("emulated-p150x2") as ctx:
        h = LayerHarness(ckpt, ctx, PrecisionSetting.named("performance"), 1, decode_matmuls="interleaved")
        x = h.to_device(torch.randn(1, 1, 64))
        c = _count(ctx, "mlp", lambda: h.layer.mlp.forward(x))
        assert c.programs == 6 and "ttnn.to_memory_config" not in c.per_op, dict(c.per_op)
        assert not any("@" in k for k in c.bytes_read), dict(c.bytes_read)


def test_lm_head_decode_layouts(tmp_path):
    """The LM head (target and MTP share ``lm_head_logits``), for <= 32 rows: mcast_1d is one 1D matmul on the
    interleaved weight writing the logits to DRAM; dram_sharded a DRAM-sharded matmul on weights placed over the 8
    banks, bracketed by two reshards; interleaved ttnn's default. The logits are the same bits in every layout (same
    bf8 weight, same contraction); prefill-size row counts take the default matmul on the same weight."""
    from qwen36.tiny import make_bf16_checkpoint
    from support.tt import LayerHarness
    from qwen36.tt.model.model import lm_head_logits
    from qwen36.tt.model.model_config import PrecisionSetting
    from qwen36.tt_ops.device import open_mesh

    ckpt = make_bf16_checkpoint(tmp_path / "ckpt", "ci", seed=0)
    got = {}
    with open_mesh("emulated-p150x2") as ctx:
        for layout in ("mcast_1d", "dram_sharded", "interleaved"):
            h = LayerHarness(ckpt, ctx, PrecisionSetting.named("performance"), 0, decode_matmuls=layout)
            ttnn = ctx.ttnn
            assert h.model.w.lm_head.memory_config().is_sharded() == (layout == "dram_sharded")
            for rows in (1, 3, 40):
                x = h.to_device(torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(rows)))
                c = _count(ctx, "lm head", lambda: lm_head_logits(ttnn, h.args, h.model.w.lm_head, x, ttnn.float32))
                out = lm_head_logits(ttnn, h.args, h.model.w.lm_head, x, ttnn.float32)
                assert not out.memory_config().is_sharded()  # DRAM-interleaved for the all_gather
                assert out.memory_config().buffer_type == ttnn.BufferType.DRAM
                got[layout, rows] = h.model.to_host(out).float()
                sharded = layout == "dram_sharded" and rows <= 32
                assert c.programs == (3 if sharded else 1), dict(c.per_op)
                assert dict(c.per_op).get("ttnn.to_memory_config", 0) == (2 if sharded else 0), dict(c.per_op)
                placed = any(k.startswith("BFLOAT8_B@dram_sharded/8") for k in c.bytes_read)
                assert placed == (layout == "dram_sharded"), dict(c.bytes_read)
    for rows in (1, 3, 40):
        for layout in ("dram_sharded", "interleaved"):
            torch.testing.assert_close(got[layout, rows], got["mcast_1d", rows], rtol=0, atol=0)


def test_rope_rows_layouts(harness):
    """decode cos/sin are height-sharded [1, T, 1, D] (what the decode-mode op validates), prefill [1, 1, T, D]."""
    ctx, h = harness
    ttnn, d = ctx.ttnn, h.cfg.head_dim
    idx = ttnn.from_torch(torch.arange(3, dtype=torch.int32)[None], dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT,
                          device=ctx.mesh_device)
    cos, _ = h.model.rope_rows(idx)
    assert list(cos.shape) == [1, 3, 1, d] and cos.memory_config().is_sharded()
    cos, _ = h.model.rope_rows(idx, mode="prefill")
    assert list(cos.shape) == [1, 1, 3, d] and not cos.memory_config().is_sharded()
    with pytest.raises(ValueError, match="mode"):
        h.model.rope_rows(idx, mode="verify")
