"""The KDA chunk-recurrence pieces (``ops_kda_scan``): their semantics against independent formulations, the
single-rank chronology (actual_end, the last valid group's carry slot), the affine steps' FPU arithmetic and the
refusal of several sequence-parallel ranks. Tenstorrent's cases: ``qwen36.testing.conformance_kda_scan``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.testing.conformance_kda_scan import _prep_host, _prep_oracle, _protocol, _scan_ref  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator.errors import NotEmulatedError  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    with open_mesh("emulated-p150x2") as c:
        yield c


def _dev(ttnn, mesh, x, dt=None):
    dt = dt or (ttnn.bfloat16 if x.dtype == torch.bfloat16 else ttnn.float32)
    return ttnn.from_torch(x, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh)


def _scalar(ttnn, mesh, v):
    return ttnn.from_torch(torch.tensor([v]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)


def test_prepare_is_the_protocol_rounded_once(ctx):
    """Each of the seven terms is the fp64 protocol rounded once to its dtype (the kernel's own rounding sequence is
    a documented gap): equal to an independent formulation to fp32 rounding."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    host = _prep_host(2, 2, 32, 64, seed=9)
    with mesh.counters.scope("prep") as c:
        outs = ttnn.experimental.kda.prepare_chunk_recurrence(*(_dev(ttnn, mesh, x) for x in host), 2,
                                                              output_bf16_mask=0x1)
    assert c.programs == 1
    for j, (o, want) in enumerate(zip(outs, _prep_oracle(*host, 2))):
        got = ttnn.to_torch(ttnn.get_device_tensors(o)[1]).double()
        tol = 2 ** -8 if j == 0 else 2 ** -23  # v_beta is bf16 here
        assert ((got - want).abs() <= tol * want.abs() + 1e-30).all(), j


def test_scan_carries_the_last_valid_group_to_the_last_slot(ctx):
    """actual_end inside group 0 of 2: group 1 is padding, and the last valid group's state is copied to group G-1
    (the fixed carry slot, docstring)."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    proto = _protocol(2, 1, 32, 32)
    s0 = 0.04 * torch.randn(2, 32, 32)
    y, s = ttnn.experimental.kda.recurrent_chunk_scan(
        *(_dev(ttnn, mesh, x) for x in proto), _dev(ttnn, mesh, s0), actual_start=_scalar(ttnn, mesh, 0),
        actual_end=_scalar(ttnn, mesh, 20), tail_entry_states=_dev(ttnn, mesh, s0[:1]), groups_per_head=2)
    got = ttnn.to_torch(ttnn.get_device_tensors(s)[0])
    _, rs = _scan_ref(proto, s0)
    assert torch.equal(got[1], got[0])
    assert torch.allclose(got[0].double(), rs[0], rtol=1e-5, atol=1e-7)


def test_exclusive_scan_step_is_the_fpu_matmul_then_an_add(ctx):
    """Each entry is the previous one through a HiFi2 fp32-Dst matmul (a in SrcB, the fp32 state in SrcA) and an fp32
    add: the same bits as ttnn.matmul + ttnn.add on the emulated mesh."""
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    g_ = torch.Generator().manual_seed(3)
    a = 0.9 * torch.eye(32).expand(2, 32, 32) + 0.02 * torch.randn(2, 32, 32, generator=g_)
    b, s0 = 0.03 * torch.randn(2, 32, 64, generator=g_), 0.05 * torch.randn(1, 32, 64, generator=g_)
    a_tt, b_tt, s_tt = _dev(ttnn, mesh, a), _dev(ttnn, mesh, b), _dev(ttnn, mesh, s0)
    out = ttnn.experimental.kda.affine_exclusive_scan(a_tt, b_tt, s_tt, 2, actual_start=_scalar(ttnn, mesh, 0),
                                                      local_rows=64, tail_a=a_tt, tail_b=b_tt, tail_entry_states=s_tt)
    cfg = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi2,
                                                 math_approx_mode=False, fp32_dest_acc_en=True)
    step = ttnn.add(ttnn.matmul(_dev(ttnn, mesh, a[:1]), s_tt, dtype=ttnn.float32, compute_kernel_config=cfg),
                    _dev(ttnn, mesh, b[:1]))
    got = ttnn.to_torch(ttnn.get_device_tensors(out)[0])
    assert torch.equal(got[0], s0[0]) and torch.equal(got[1], ttnn.to_torch(ttnn.get_device_tensors(step)[0])[0])


def test_several_sequence_parallel_ranks_are_refused_by_name(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    proto = [_dev(ttnn, mesh, x) for x in _protocol(1, 1, 32, 32)]
    s0 = _dev(ttnn, mesh, torch.zeros(1, 32, 32))
    with pytest.raises(NotEmulatedError, match="sequence-parallel ranks"):
        ttnn.experimental.kda.recurrent_chunk_scan(*proto, s0, actual_start=_scalar(ttnn, mesh, 0),
                                                   tail_entry_states=s0, sequence_parallel_axis=1)
