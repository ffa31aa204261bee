"""The KDA convolution and gated norm (``ops_kda``) against independent torch formulations of their kernels' rounding
sequences, their chronology, accounting and refusals. Tenstorrent's own cases for them are in
``qwen36.testing.conformance_kda`` (run by tests/emulator/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator.errors import EmulatorError, NotEmulatedError  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    with open_mesh("emulated-p150x2") as c:
        yield c


def _bf(x):
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def _host(seed, t=64, c=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, t, c, generator=g).bfloat16()
    hist = torch.randn(1, 3, c, generator=g).bfloat16()
    taps = [torch.randn(1, 1, c, generator=g).bfloat16() for _ in range(4)]
    return x, hist, taps


def _conv(ttnn, mesh, x, hist, taps, widths, *, x_layout=None, pred=None, **kw):
    dev = lambda t, layout=ttnn.TILE_LAYOUT: ttnn.from_torch(t, dtype=ttnn.bfloat16, layout=layout, device=mesh)  # noqa
    h = dev(hist, ttnn.ROW_MAJOR_LAYOUT)
    start = ttnn.from_torch(torch.tensor([0]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    return ttnn.experimental.kda.qkv_causal_conv1d_silu(
        dev(x, x_layout or ttnn.TILE_LAYOUT), h, *[dev(t) for t in taps], *widths, actual_start=start,
        predecessor_carry=h if pred is None else dev(pred, ttnn.ROW_MAJOR_LAYOUT),
        program_config=ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=sum(widths)), **kw)


def _kernel_conv(x, hist, taps, fp32_dest=False):
    """The kernel's sequence: Dst accumulates the four tap products (tap 0 = token t-3 first), rounded to the Dst
    format after each; SiLU on the Dst value, written back to Dst; packed to bf16."""
    rnd = (lambda v: v.to(torch.float32).to(torch.float64)) if fp32_dest else _bf
    win = torch.cat([hist, x], 1).to(torch.float64)
    t = x.shape[1]
    acc = None
    for i in range(4):
        p = win[:, i:i + t] * taps[i].to(torch.float64)  # bf16 x bf16: exact in fp64
        acc = rnd(p if acc is None else acc + p)
    return _bf(rnd(acc * torch.sigmoid(acc)))


@pytest.mark.parametrize("fp32_dest", [False, True])
def test_conv_is_the_kernels_rounding_sequence(ctx, fp32_dest):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x, hist, taps = _host(0)
    kw = {}
    if fp32_dest:
        kw["compute_kernel_config"] = ttnn.init_device_compute_kernel_config(
            mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False, fp32_dest_acc_en=True)
    q, k, v = _conv(ttnn, mesh, x, hist, taps, (32, 32, 64), **kw)
    for d in range(2):
        got = torch.cat([ttnn.to_torch(ttnn.get_device_tensors(z)[d]).double() for z in (q, k, v)], -1)
        assert torch.equal(got, _kernel_conv(x, hist, taps, fp32_dest))
    # the bf16 Dst is what makes the default differ from an fp32-accumulated convolution
    assert not torch.equal(_kernel_conv(x, hist, taps, False), _kernel_conv(x, hist, taps, True))


def test_conv_sequence_parallel_rank_reads_the_predecessor_carry(ctx):
    """On the mesh axis that partitions the sequence, rank 0 holds the start (history), rank 1 continues from
    ``predecessor_carry`` (chronology.hpp ``derive``); on the default axis 0 (size 1) every device reads history."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x, hist, taps = _host(1)
    pred = torch.randn(1, 3, 128).bfloat16()
    for axis, want1 in ((0, hist), (1, pred)):
        q, k, v = _conv(ttnn, mesh, x, hist, taps, (32, 32, 64), pred=pred, sequence_parallel_axis=axis)
        dev = [torch.cat([ttnn.to_torch(ttnn.get_device_tensors(z)[d]).double() for z in (q, k, v)], -1)
               for d in range(2)]
        assert torch.equal(dev[0], _kernel_conv(x, hist, taps))
        assert torch.equal(dev[1], _kernel_conv(x, want1, taps))
    with pytest.raises(EmulatorError, match="invalid sequence_parallel_axis"):
        _conv(ttnn, mesh, x, hist, taps, (32, 32, 64), sequence_parallel_axis=2)


def test_conv_counts_a_tilize_program_for_a_row_major_input(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x, hist, taps = _host(2)
    counts = {}
    for layout in (ttnn.TILE_LAYOUT, ttnn.ROW_MAJOR_LAYOUT):
        with mesh.counters.scope("conv") as c:
            _conv(ttnn, mesh, x, hist, taps, (32, 32, 64), x_layout=layout)
        counts[layout.name] = (c.programs, dict(c.bytes_read), dict(c.bytes_written))
    window = 64 * 128 * 2 + 3 * 128 * 2 + 4 * 4 * 1024  # the input window, history, the taps' top faces
    assert counts["TILE"] == (1, {"BFLOAT16": window}, {"BFLOAT16": 64 * 128 * 2})
    # the tilize program reads the row-major input and writes it tiled
    assert counts["ROW_MAJOR"] == (2, {"BFLOAT16": window + 64 * 128 * 2}, {"BFLOAT16": 2 * 64 * 128 * 2})


def test_conv_refuses_unaligned_start_and_with_carry_over_several_ranks(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x, hist, taps = _host(3, t=32)
    h = ttnn.from_torch(hist, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    dev = lambda t: ttnn.from_torch(t, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    bad = ttnn.from_torch(torch.tensor([16]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    cfg = ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=128)
    with pytest.raises(EmulatorError, match="32-aligned"):
        ttnn.experimental.kda.qkv_causal_conv1d_silu(dev(x), h, *[dev(t) for t in taps], 32, 32, 64,
                                                     actual_start=bad, predecessor_carry=h, program_config=cfg)
    zero = ttnn.from_torch(torch.tensor([0]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    buf = ttnn.from_torch(torch.zeros(1, 12, 128), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    sems = [object(), object(), object()]
    with pytest.raises(NotEmulatedError, match="fabric history exchange"):
        ttnn.experimental.kda.qkv_causal_conv1d_silu_with_carry(
            dev(x), h, *[dev(t) for t in taps], 32, 32, 64, actual_start=zero, exchange_buffer=buf,
            exchange_semaphores=sems, program_config=cfg, sequence_parallel_axis=1)
    with pytest.raises(EmulatorError, match="pass 3 exchange_semaphores"):
        ttnn.experimental.kda.qkv_causal_conv1d_silu_with_carry(
            dev(x), h, *[dev(t) for t in taps], 32, 32, 64, actual_start=zero, exchange_buffer=buf,
            exchange_semaphores=sems[:2], program_config=cfg)


def _tf32(x, bits=10):
    x = x.to(torch.float32).contiguous()
    mask = ~((1 << (23 - bits)) - 1) & 0xFFFFFFFF
    return (x.view(torch.int32) & (mask - (1 << 32))).view(torch.float32).double()


def _kernel_norm(x, gate, w, eps=1e-5):
    """sigmoid_gated_rms_norm.cpp with its defaults (HiFi4, fp32 Dst): every FLOAT32 buffer read back through a Src
    register as TF32 (the SrcA operand of a product also drops the TF32 LSB), products exact, Dst fp32."""
    f32 = lambda v: v.to(torch.float32).double()  # noqa: E731
    a, b = _tf32(x, 9), _tf32(x, 10)
    sq = f32(a * b)
    v = x.shape[-1]
    acc = None
    for k0 in range(0, v, 32):
        part = (_tf32(sq, 9)[..., k0:k0 + 32] * (1.0 / v)).sum(-1, keepdim=True)
        acc = f32(part if acc is None else acc + part)
    eps_b = torch.tensor(eps).to(torch.float32).to(torch.bfloat16).double()
    inv = f32(1.0 / torch.sqrt(f32(_tf32(acc, 9) + eps_b)))
    norm = f32(a * _tf32(inv, 10))
    tmp = f32(_tf32(norm, 9) * w.double())
    sig = f32(torch.sigmoid(gate.double()))
    return f32(_tf32(tmp, 9) * _tf32(sig, 10))


def test_norm_is_the_kernels_sequence_and_reads_fp32_input_as_tf32(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    g = torch.Generator().manual_seed(4)
    h, t, v = 3, 32, 64
    x = torch.randn(h, t, v, generator=g)
    gate = torch.randn(1, t, h * v, generator=g).bfloat16()
    w = torch.randn(v, generator=g).bfloat16()
    dev = lambda z, d: ttnn.from_torch(z, dtype=d, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    y = ttnn.experimental.kda.sigmoid_gated_rms_norm(dev(x, ttnn.float32), dev(gate, ttnn.bfloat16),
                                                     dev(w, ttnn.bfloat16), h)
    got = ttnn.to_torch(ttnn.get_device_tensors(y)[1]).double()
    want = _kernel_norm(x, gate.reshape(1, t, h, v).permute(0, 2, 1, 3)[0], w).permute(1, 0, 2).reshape(1, t, h * v)
    assert torch.equal(got, want)
    # the low 13 mantissa bits of an fp32 input never reach the FPU
    x2 = (x.view(torch.int32) ^ 0x7).view(torch.float32)
    y2 = ttnn.experimental.kda.sigmoid_gated_rms_norm(dev(x2, ttnn.float32), dev(gate, ttnn.bfloat16),
                                                      dev(w, ttnn.bfloat16), h)
    assert torch.equal(ttnn.to_torch(ttnn.get_device_tensors(y2)[0]), ttnn.to_torch(ttnn.get_device_tensors(y)[0]))
    # a 16-bit Dst leaves bf16-precision values in the FLOAT32 output
    cfg = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4,
                                                 fp32_dest_acc_en=False)
    y3 = ttnn.to_torch(ttnn.get_device_tensors(ttnn.experimental.kda.sigmoid_gated_rms_norm(
        dev(x, ttnn.float32), dev(gate, ttnn.bfloat16), dev(w, ttnn.bfloat16), h, compute_kernel_config=cfg))[0])
    assert torch.equal(y3, y3.bfloat16().float())
    ref = x.double().permute(1, 0, 2) * torch.rsqrt(x.double().permute(1, 0, 2).pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = (ref * w.double() * torch.sigmoid(gate.double().reshape(t, h, v))).reshape(1, t, h * v)
    # six truncating TF32 reads on the way (the SrcA ones keep 9 bits: at most 2^-9 relative each)
    assert float(((got - ref).abs() / ref.abs().clamp_min(1e-3)).max()) < 6 * 2.0 ** -9


def test_norm_accounting_reads_only_the_gate_columns_it_uses(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    h, t, v = 2, 32, 64
    dev = lambda z, d: ttnn.from_torch(z, dtype=d, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    x = dev(torch.randn(h, t, v), ttnn.float32)
    fused = dev(torch.randn(1, t, 4 * h * v), ttnn.bfloat16)
    w = dev(torch.randn(v), ttnn.bfloat16)
    with mesh.counters.scope("norm") as c:
        ttnn.experimental.kda.sigmoid_gated_rms_norm(x, fused, w, h, gate_column_offset=h * v)
    delta = c.bytes_read
    assert c.programs == 1
    assert delta["FLOAT32"] == h * t * v * 4
    assert delta["BFLOAT16"] == h * t * v * 2 + 32 * 64 * 2  # the used gate columns + the weight's tile row
