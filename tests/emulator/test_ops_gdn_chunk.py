"""The chunk-32 GDN kernel model (``ops_gdn_chunk``): its algebra is the recurrence, its roundings are the card's,
the flat rank-3 path's contract and counts, and ``gated_delta_attn_seq``. Tenstorrent's own cases for the chunk op
are in ``qwen36.testing.conformance_kda``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import numerics  # noqa: E402
from qwen36.tt_ops.emulator import ops_gdn_chunk as M  # noqa: E402
from qwen36.tt_ops.emulator.errors import EmulatorError  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    with open_mesh("emulated-p150") as c:
        yield c


def _recurrence(q, k, v, g, beta, s0):
    """[BH, T, D] token-by-token reference in fp64 (q already scaled)."""
    s, outs = s0.double().clone(), []
    for t in range(q.shape[1]):
        s = s * torch.exp(g[:, t].double())[:, None, None]
        delta = (v[:, t].double() - torch.einsum("hk,hkv->hv", k[:, t].double(), s)) * beta[:, t].double()[:, None]
        s = s + torch.einsum("hk,hv->hkv", k[:, t].double(), delta)
        outs.append(torch.einsum("hk,hkv->hv", q[:, t].double(), s))
    return torch.stack(outs, 1), s


def _inputs(bh=3, t=96, dk=64, dv=32, seed=1):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(bh, t, dk, generator=g_).bfloat16()
    k = torch.randn(bh, t, dk, generator=g_).bfloat16()
    v = torch.randn(bh, t, dv, generator=g_).bfloat16()
    g = -torch.rand(bh, t, generator=g_)
    beta = torch.rand(bh, t, generator=g_)
    s0 = 0.1 * torch.randn(bh, dk, dv, generator=g_)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("qk_norm", [False, True])
def test_kernel_algebra_is_the_recurrence_without_its_roundings(monkeypatch, qk_norm):
    """With the Src-register truncations and fp32 roundings switched off, the chunked WY form (masks, forward
    substitution, the dl*I state decay, the accumulation order) is the token-by-token recurrence to fp64 ulps."""
    for name in ("_a", "_b", "_f32"):
        monkeypatch.setattr(M, name, numerics.wide)
    q, k, v, g, beta, s0 = _inputs()
    if not qk_norm:  # the delta rule needs unit-norm keys to stay bounded
        q, k = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))
    o, s = M.chunk32_kernel(q, k, v, g, beta, s0, 0.375 if qk_norm else None)
    if qk_norm:
        eps = float(torch.tensor(1e-6))  # the kernel's epsilon, an fp32 constant
        qr = q.double() / torch.sqrt((q.double() ** 2).sum(-1, keepdim=True) + eps) * 0.375
        kr = k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + eps)
    else:
        qr, kr = q, k
    ro, rs = _recurrence(qr, kr, v, g, beta, s0)
    assert float((o - ro).abs().max() / ro.abs().max()) < 1e-12
    assert float((s - rs).abs().max() / rs.abs().max()) < 1e-12


def test_kernel_roundings_give_the_cards_relative_floor():
    """With them on: Tenstorrent measures a ~5e-3 relative floor of the chunk op against the recurrence
    (test_chunk_gated_delta_rule.py, PCC 0.99999); the TF32 operands put the model there too, not at fp32's 1e-7."""
    q, k, v, g, beta, s0 = _inputs(bh=4, t=128, dk=128, dv=128, seed=2)
    q, k = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))
    o, s = M.chunk32_kernel(q, k, v, g, beta, s0, None)
    ro, rs = _recurrence(q.double() * 128 ** -0.5, k, v, g, beta, s0)
    o2, _ = M.chunk32_kernel((q.float() * 128 ** -0.5).bfloat16(), k, v, g, beta, s0, None)
    rel = float((o2 - ro).norm() / ro.norm())
    assert 1e-4 < rel < 1e-2
    assert float((s - rs).norm() / rs.norm()) < 1e-2
    assert torch.equal(o, o.float().double()) and torch.equal(s, s.float().double())  # fp32 values out


def _dev(ttnn, mesh, x, dt):
    return ttnn.from_torch(x, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh)


def _flat_call(ttnn, mesh, t=32, h=2, hv=6, d=128, q_dtype=None, **kw):
    g_ = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, t, h * d, generator=g_) for _ in range(2))
    v = torch.randn(1, t, hv * d, generator=g_)
    g, beta = -torch.rand(1, t, hv, generator=g_), torch.rand(1, t, hv, generator=g_)
    qd = q_dtype or ttnn.bfloat16
    args = [_dev(ttnn, mesh, q, qd), _dev(ttnn, mesh, k, ttnn.bfloat16), _dev(ttnn, mesh, v, ttnn.bfloat16),
            _dev(ttnn, mesh, g, ttnn.float32), _dev(ttnn, mesh, beta, ttnn.float32)]
    with mesh.counters.scope("chunk") as c:
        out = ttnn.transformer.chunk_gated_delta_rule(*args, chunk_size=32, **kw)
    return out, c, (q, k, v, g, beta)


def test_flat_path_maps_value_heads_to_key_heads_by_group(ctx):
    """Value head hv reads key head hv // (HV / H) (reader_chunk_gdn_prep.cpp): the op equals the kernel on
    repeat_interleave'd heads, bit for bit."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    (o, s), _, (q, k, v, g, beta) = _flat_call(ttnn, mesh, output_final_state=True, output_head_major=True)
    hf = lambda x, n: x.bfloat16().reshape(1, 32, n, 128).repeat_interleave(6 // n, 2)[0].transpose(0, 1)  # noqa: E731
    ko, ks = M.chunk32_kernel(hf(q, 2), hf(k, 2), hf(v, 6), g[0].T, beta[0].T, torch.zeros(6, 128, 128), 128 ** -0.5)
    assert torch.equal(ttnn.to_torch(o).double(), ko) and torch.equal(ttnn.to_torch(s).double()[0], ks)


def test_flat_path_counts(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    state = 6 * 128 * 128 * 4
    st = _dev(ttnn, mesh, torch.zeros(1, 6, 128, 128), ttnn.float32)
    # the fused program alone: bf16 q/k/v, an fp32 state given, head-major output
    _, c, _ = _flat_call(ttnn, mesh, initial_state=st, output_final_state=True, output_head_major=True)
    o = 6 * 32 * 128 * 4
    assert c.programs == 1
    assert c.bytes_read["BFLOAT16"] == 3 * 6 * 32 * 128 * 2  # each value head's q, k and v rows
    assert c.bytes_read["FLOAT32"] == 2 * 6 * 4096 + state + 4 * 4096  # g/beta tiles, state, constant tiles
    assert c.bytes_written == {"FLOAT32": o + state}
    # + an fp32 q cast, a zero state, the token-major relayout (untilize + permute)
    _, c, _ = _flat_call(ttnn, mesh, q_dtype=ttnn.float32)
    assert c.programs == 1 + 1 + 1 + 2
    # the phased path: prep + scan, the seven fp32 intermediates through DRAM
    _, c, _ = _flat_call(ttnn, mesh, initial_state=st, output_head_major=True,
                         program_config=ttnn.ChunkGdnPhasedProgramConfig())
    inter = 6 * 1 * (3 * 32 * 128 + 128 * 32 + 3 * 32 * 32) * 4
    assert c.programs == 2 and c.bytes_written["FLOAT32"] == o + inter


def test_flat_path_refusals(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    with pytest.raises(EmulatorError, match="needs T a multiple of 32"):
        _flat_call(ttnn, mesh, t=48)
    with pytest.raises(EmulatorError, match="mono program takes head-major"):
        _flat_call(ttnn, mesh, program_config=ttnn.ChunkGdnMonoProgramConfig())
    cfg = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi2, fp32_dest_acc_en=True,
                                           math_approx_mode=False)
    with pytest.raises(EmulatorError, match="runs HiFi4 with fp32 destination accumulation"):
        _flat_call(ttnn, mesh, compute_kernel_config=cfg)


def _seq_inputs(bh=1, nc=2, c=128, d=128, seed=42):
    g_ = torch.Generator().manual_seed(seed)
    eye_blocks = torch.block_diag(*[torch.eye(32)] * (c // 32))
    return dict(L_unit=eye_blocks.expand(bh, nc, c, c).clone(), v_beta_sc=torch.randn(bh, nc, c, d, generator=g_) * 0.3,
                k_bd_sc=torch.randn(bh, nc, c, d, generator=g_) * 0.1,
                intra_attn=torch.randn(bh, nc, c, c, generator=g_) * 0.01,
                q_decay=torch.randn(bh, nc, c, d, generator=g_) * 0.1,
                k_decay_t=torch.randn(bh, nc, d, c, generator=g_) * 0.1, dl_exp=torch.full((bh, nc, 1, 1), 0.95),
                L_inv=torch.eye(32).repeat(c // 32, 1).expand(bh, nc, c, 32).clone())


def test_gated_delta_attn_seq_fidelity_and_validation(ctx):
    """HiFi2 (its default) keeps 7 significant bits of in0 in every product; HiFi4 is exact on TF32 operands: both
    near the fp64 reference of Tenstorrent's smoke test, HiFi2 visibly further."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    x = _seq_inputs()
    dev = {k_: _dev(ttnn, mesh, v_, ttnn.float32) for k_, v_ in x.items()}
    order = ("L_unit", "v_beta_sc", "k_bd_sc", "intra_attn", "q_decay", "k_decay_t", "dl_exp", "L_inv")
    o2, s2 = ttnn.transformer.gated_delta_attn_seq(*(dev[n] for n in order))
    hifi4 = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, fp32_dest_acc_en=True)
    o4, s4 = ttnn.transformer.gated_delta_attn_seq(*(dev[n] for n in order), compute_kernel_config=hifi4)
    s = torch.zeros(1, 128, 128, dtype=torch.float64)
    outs = []
    for n in range(2):
        v_new = x["v_beta_sc"][:, n].double() - x["k_bd_sc"][:, n].double() @ s
        outs.append(x["q_decay"][:, n].double() @ s + x["intra_attn"][:, n].double() @ v_new)
        s = s * 0.95 + x["k_decay_t"][:, n].double() @ v_new
    ref = torch.stack(outs, 1)
    e2 = float((ttnn.to_torch(o2).double() - ref).norm() / ref.norm())
    e4 = float((ttnn.to_torch(o4).double() - ref).norm() / ref.norm())
    assert e4 < 5e-3 and e4 < e2 < 5e-2, (e4, e2)  # TF32 operands (~2^-10 each); HiFi2: 7-bit in0
    assert float((ttnn.to_torch(s4).double() - s).norm() / s.norm()) < 5e-3
    assert list(o2.shape) == [1, 2, 128, 128] and o2.dtype == ttnn.float32 and list(s2.shape) == [1, 128, 128]
    bad = dict(dev, dl_exp=_dev(ttnn, mesh, x["dl_exp"], ttnn.bfloat16))
    with pytest.raises(EmulatorError, match="dl_exp must be float32, got DataType::BFLOAT16"):
        ttnn.transformer.gated_delta_attn_seq(*(bad[n] for n in order))
    small = {k_: _dev(ttnn, mesh, v_, ttnn.float32) for k_, v_ in _seq_inputs(c=64).items() if k_ != "L_unit"}
    with pytest.raises(EmulatorError, match="chunk_size must be exactly 128, got 64"):
        ttnn.transformer.gated_delta_attn_seq(_dev(ttnn, mesh, torch.zeros(1, 2, 64, 64), ttnn.float32),
                                              *(small[n] for n in order[1:]))
