"""The strict emulator (default ``numerics="strict"``): every rule bites on a known-bad call and leaves the fixed
call exact; ``numerics="exact"`` keeps the old arithmetic for A/B runs. Rules and sources: docs/emulator_ops.md."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import numerics  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    with open_mesh("emulated-p150") as c:
        yield c


@pytest.fixture(scope="module")
def ctx_exact():
    with open_mesh("emulated-p150", numerics="exact") as c:
        yield c


def dev(ctx, x, dtype=None, layout=None):
    t = ctx.ttnn
    return t.from_torch(x, dtype=dtype or t.float32, layout=layout or t.TILE_LAYOUT, device=ctx.mesh_device)


def host(ctx, t):
    return ctx.ttnn.to_torch(t).float()


def ckc(ctx, fidelity="HiFi4", fp32_dest=True):
    t = ctx.ttnn
    return t.WormholeComputeKernelConfig(math_fidelity=getattr(t.MathFidelity, fidelity), math_approx_mode=False,
                                         fp32_dest_acc_en=fp32_dest, packer_l1_acc=False)


def test_default_is_strict_and_exact_is_selectable(ctx, ctx_exact):
    assert ctx.mesh_device.numerics == "strict" and ctx.describe()["emulator_numerics"] == "strict"
    assert ctx_exact.mesh_device.numerics == "exact"
    with pytest.raises(Exception, match="numerics"):
        open_mesh("emulated-p150", numerics="fast")


# ---- unit rules --------------------------------------------------------------------------------------------
def test_tf32_truncates_13_mantissa_bits():
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, 2049.0, 4097.0, -3.0000002])
    y = numerics.to_tf32(x)
    assert y.tolist() == [1.0 + 2.0 ** -10, 1.0, 2048.0, 4096.0, -3.0]


def test_fidelity_phases_match_the_isa_table():
    """in0 (SrcB) keeps 1+6 bits in phase 0/1, in1 (SrcA) 1+4 bits in phases 0/2 (bf16 operands)."""
    a = torch.tensor([[1.0 + 2.0 ** -7]])  # bf16: last mantissa bit set (only phases 2/3 see it in SrcB)
    b = torch.tensor([[1.0 + 2.0 ** -5]])  # bf16: 5th mantissa bit (only phases 1/3 see it in SrcA)
    exact = float(a * b)
    got = {f: float(numerics.fpu_matmul(a, b, "BFLOAT16", "BFLOAT16", numerics.KernelConfig(p, True, False, False, True)))
           for f, p in (("LoFi", 1), ("HiFi2", 2), ("HiFi3", 3), ("HiFi4", 4))}
    assert got["LoFi"] == 1.0  # hi * hi
    assert got["HiFi2"] == 1.0 + 2.0 ** -5  # a_hi * b
    assert got["HiFi3"] == 1.0 + 2.0 ** -5 + 2.0 ** -7  # + a_lo * b_hi
    assert got["HiFi4"] == exact


def test_bf16_dest_accumulation_loses_small_addends():
    a = torch.ones(1, 64)
    b = torch.full((64, 1), 2.0 ** -9)
    b[0, 0] = 1.0
    off = numerics.fpu_matmul(a, b, "BFLOAT16", "BFLOAT16", numerics.KernelConfig(4, False, False, False, True))
    on = numerics.fpu_matmul(a, b, "BFLOAT16", "BFLOAT16", numerics.KernelConfig(4, True, False, False, True))
    assert float(on) == 1.0 + 63 * 2.0 ** -9
    assert float(off) != float(on) and abs(float(off) - float(on)) <= 2.0 ** -7 * 2


# ---- sum over fp32 token ids (the commit's pending-token read) --------------------------------------------
def _ids_onehot(ctx):
    ids = torch.tensor([[[[5.0, 2049.0, 151643.0, 7.0]]]])
    pick = torch.tensor([[[[0.0, 0.0, 1.0, 0.0]]]])
    return ids, ttnpick(ctx, ids, pick)


def ttnpick(ctx, ids, pick):
    return ctx.ttnn.multiply(dev(ctx, ids), dev(ctx, pick))


def test_fp32_sum_without_fp32_dest_truncates_token_ids(ctx, ctx_exact):
    """Known-bad: ttnn.sum over fp32 ids with no config takes the FPU path (TF32): 151643 -> 151552."""
    _, prod = _ids_onehot(ctx)
    bad = host(ctx, ctx.ttnn.sum(prod, dim=3, keepdim=True))
    assert float(bad) == float(numerics.to_tf32(torch.tensor(151643.0))) == 151552.0
    good = host(ctx, ctx.ttnn.sum(prod, dim=3, keepdim=True, compute_kernel_config=ckc(ctx)))
    assert float(good) == 151643.0
    # fast_and_approximate_mode forces the FPU path even with fp32 dest
    fast = host(ctx, ctx.ttnn.sum(prod, dim=3, keepdim=True, compute_kernel_config=ckc(ctx),
                                  fast_and_approximate_mode=True))
    assert float(fast) == 151552.0
    _, prod_x = _ids_onehot(ctx_exact)
    assert float(host(ctx_exact, ctx_exact.ttnn.sum(prod_x, dim=3, keepdim=True))) == 151643.0


def test_mean_masks_tile_padding(ctx):
    """Reductions mask the padding (Tenstorrent's ttnn.mean test fills it with 42 and expects the logical mean)."""
    x = torch.randn(1, 1, 5, 40)
    t = ctx.ttnn.fill_implicit_tile_padding(dev(ctx, x), 42.0)
    got = host(ctx, ctx.ttnn.mean(t, dim=3, keepdim=True, compute_kernel_config=ckc(ctx)))
    assert torch.allclose(got, x.mean(dim=3, keepdim=True), atol=1e-6)


# ---- matmul: TF32 operands and garbage tile padding (the conv-window select) ----------------------------------
def _conv_select(ctx, a: int, kc=4, t=4, cd=64, cfg=True):
    """The old commit: sel = (c_conv_sel == a) [Kc-1, Kc-1+T] one-hot, conv = sel @ window (fp32, K = Kc-1+T)."""
    ttnn = ctx.ttnn
    g = torch.Generator().manual_seed(3)
    window = torch.randn(1, 1, kc - 1 + t, cd, generator=g) * 3
    cols = torch.arange(kc - 1 + t, dtype=torch.float32).reshape(1, -1)
    rows = torch.arange(kc - 1, dtype=torch.float32).reshape(-1, 1)
    c_sel = dev(ctx, (cols - rows - 1).reshape(1, 1, kc - 1, kc - 1 + t))
    win = ttnn.add(dev(ctx, window), 0.0)  # an op output: its tile padding is garbage, as the verify's concat's
    sel = ttnn.eq(c_sel, dev(ctx, torch.full((1, 1, 1, 1), float(a))))
    out = ttnn.matmul(sel, win, dtype=ttnn.float32, compute_kernel_config=ckc(ctx) if cfg else None)
    return window, host(ctx, out)


def test_onehot_matmul_reads_garbage_padding(ctx, ctx_exact):
    """Known-bad: K = Kc-1+T = 7 is not a multiple of 32 and both operands' padding is garbage -> garbage (NaN)."""
    window, got = _conv_select(ctx, a=1)
    assert torch.isnan(got).all()
    window, got_x = _conv_select(ctx_exact, a=1)
    assert torch.equal(got_x[0, 0], window[0, 0, 2:5])


def test_onehot_matmul_with_zero_padding_still_truncates_fp32_to_tf32(ctx):
    """Even with the selector's padding zeroed, the FPU reads the fp32 window as TF32 (SrcA: 9 mantissa bits)."""
    ttnn = ctx.ttnn
    window = torch.randn(1, 1, 7, 64, generator=torch.Generator().manual_seed(4))
    sel = torch.zeros(1, 1, 3, 7)
    sel[0, 0, torch.arange(3), torch.arange(3) + 2] = 1.0
    out = host(ctx, ttnn.matmul(dev(ctx, sel), ttnn.add(dev(ctx, window), 0.0), dtype=ttnn.float32,
                                compute_kernel_config=ckc(ctx)))
    assert not torch.isnan(out).any()
    exp = window[0, 0, 2:5]
    assert not torch.equal(out[0, 0], exp)
    assert torch.equal(out[0, 0], numerics._keep_mantissa_bits(exp, 9))


def test_embedding_gather_is_exact(ctx):
    """The fix used by the commit: ttnn.embedding gathers fp32 rows exactly (a data movement, no FPU)."""
    ttnn = ctx.ttnn
    window = torch.randn(1, 1, 7, 64, generator=torch.Generator().manual_seed(5))
    idx = ttnn.typecast(ttnn.add(dev(ctx, torch.arange(1, 4, dtype=torch.float32).reshape(1, 1, 1, 3)),
                                 dev(ctx, torch.full((1, 1, 1, 1), 1.0))), ttnn.uint32)
    idx = ttnn.reshape(ttnn.to_layout(idx, ttnn.ROW_MAJOR_LAYOUT), [1, 3])
    table = ttnn.reshape(ttnn.to_layout(ttnn.add(dev(ctx, window), 0.0), ttnn.ROW_MAJOR_LAYOUT), [7, 64])
    out = host(ctx, ttnn.embedding(idx, table, layout=ttnn.TILE_LAYOUT, dtype=ttnn.float32))
    assert torch.equal(out.reshape(3, 64), window[0, 0, 2:5])


def test_weight_times_activation_with_unaligned_k_is_clean(ctx):
    """Host-tilized weights have zero padding: 0 x garbage = 0, so ordinary linears with K % 32 != 0 stay right."""
    ttnn = ctx.ttnn
    x = torch.randn(1, 1, 5, 40)
    w = torch.randn(40, 64)
    xt = ttnn.add(dev(ctx, x, ttnn.bfloat16), 0.0)  # garbage padding
    wt = dev(ctx, w, ttnn.bfloat16)
    y = host(ctx, ttnn.linear(xt, wt, compute_kernel_config=ckc(ctx), dtype=ttnn.float32))
    assert torch.allclose(y, x.bfloat16().float() @ w.bfloat16().float(), atol=1e-4)


# ---- program counts -----------------------------------------------------------------------------------------
def test_program_counts_views_and_unaligned_data_movement(ctx):
    ttnn = ctx.ttnn
    x = dev(ctx, torch.randn(1, 1, 64, 96))
    with ctx.counters.scope("view") as c:
        ttnn.reshape(x, [1, 64, 96])  # last dim kept, -2 dim kept -> view
        ttnn.reshape(x, [1, 2, 32, 96])  # -2 dims both tile multiples -> view
    assert c.programs == 0 and c.bytes_read_total == 0 and sum(c.per_op.values()) == 2
    with ctx.counters.scope("moves") as c:
        ttnn.reshape(x, [1, 1, 96, 64])  # last dim changes: one program
    assert c.programs == 1
    with ctx.counters.scope("slices") as c:
        ttnn.slice(x, [0, 0, 0, 0], [1, 1, 32, 96])  # aligned: 1
        ttnn.slice(x, [0, 0, 0, 0], [1, 1, 64, 40])  # unaligned end on the last dim: untilize + slice + tilize
    assert c.programs == 1 + 3
    y = dev(ctx, torch.randn(1, 1, 64, 40))
    with ctx.counters.scope("concat") as c:
        ttnn.concat([y, x], dim=3)  # 40 is not a tile multiple: 2 untilize + concat + tilize
        ttnn.concat([x, y], dim=3)  # 96 is: one program
    assert c.programs == 4 + 1


def test_rotate_half_matmul_needs_hifi4(ctx):
    """Known-bad: a +-1 permutation matmul with no config (LoFi, bf16 dest by the struct defaults) drops the last
    mantissa bit of bf16 inputs; HiFi4 (model_config.compute_config_exact_select) moves them exactly."""
    from qwen36.tt.model.model_config import compute_config_exact_select

    ttnn = ctx.ttnn
    x = (torch.randn(1, 1, 32, 64, generator=torch.Generator().manual_seed(6))).bfloat16().float()
    perm = torch.zeros(64, 64)
    perm[torch.arange(32) + 32, torch.arange(32)] = -1.0
    perm[torch.arange(32), torch.arange(32) + 32] = 1.0
    exp = x @ perm
    xt, pt = dev(ctx, x, ttnn.bfloat16), dev(ctx, perm, ttnn.bfloat16)
    bad = host(ctx, ttnn.matmul(xt, pt))
    good = host(ctx, ttnn.matmul(xt, pt, compute_kernel_config=compute_config_exact_select(ttnn)))
    assert not torch.equal(bad, exp)
    assert torch.equal(good, exp)
