"""Chunked prefill SDPA on the emulated mesh (tt_ops/emulator/ops_sdpa_prefill.py): the blockwise fp64 attention
gives the bf16 outputs of ttnn's own golden function, the op reads only the K/V pages up to the chunk's end, the
documented start rule (a multiple of the program config's q and k chunk sizes) is enforced, and pages after the
chunk are never read (a deep chunk costs memory and time in its context only)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator.errors import EmulatorError  # noqa: E402
from qwen36.tt_ops.emulator.ops_sdpa_prefill import attend  # noqa: E402

SDPA = "ttnn.transformer.chunked_scaled_dot_product_attention"


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 2, 64, 32), (12, 2, 256, 64), (6, 1, 128, 32)])
def test_blockwise_attention_equals_the_golden(hq, hkv, d, bs):
    import ttnn

    golden = ttnn.get_golden_function(ttnn.transformer.chunked_scaled_dot_product_attention)
    gen = torch.Generator().manual_seed(hq * d)
    for rows, start in ((32, 0), (64, bs), (96, 3 * bs), (32, 5 * bs)):
        pages = (start + rows) // bs + 3
        q = torch.randn(1, hq, rows, d, generator=gen).to(torch.bfloat16).double()
        k, v = (torch.randn(pages, hkv, bs, d, generator=gen).to(torch.bfloat16).double() for _ in range(2))
        pt = torch.randperm(pages, generator=gen)[None].int()
        want = golden(q, k, v, pt, start, scale=d ** -0.5).to(torch.bfloat16)[0]
        n = -(-(start + rows) // bs)
        keys, vals = (c[pt[0, :n].long()].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :start + rows] for c in (k, v))
        for key_block in (8192, 40):  # one block, and blocks that cut the keys anywhere
            got = attend(q[0], keys, vals, start, d ** -0.5, key_block=key_block).to(torch.bfloat16)
            assert torch.equal(got, want), f"rows {rows} start {start} key_block {key_block}"


def _case(ttnn, mesh, start: int, rows: int = 64, pages: int = 16, bs: int = 32, hq: int = 4, hkv: int = 2,
          d: int = 64, poison_after: bool = False):
    gen = torch.Generator().manual_seed(start + rows)
    q = torch.randn(1, hq, rows, d, generator=gen)
    k, v = (torch.randn(pages, hkv, bs, d, generator=gen) for _ in range(2))
    pt = torch.randperm(pages, generator=gen)[None].int()
    if poison_after:  # pages after the chunk's last row hold NaN: a read of them would show
        for c in (k, v):
            c[pt[0, -(-(start + rows) // bs):].long()] = float("nan")
    put = lambda x, dt: ttnn.from_torch(x, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh,  # noqa: E731
                                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    ptd = ttnn.from_torch(pt, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
                          mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    return put(q, ttnn.bfloat16), put(k, ttnn.bfloat16), put(v, ttnn.bfloat16), ptd


def _config(ttnn, mesh, size: int):
    return ttnn.SDPAProgramConfig(compute_with_storage_grid_size=mesh.compute_with_storage_grid_size(),
                                  q_chunk_size=size, k_chunk_size=size, exp_approx_mode=False)


def test_reads_pages_up_to_the_chunk_and_never_past_it():
    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        q, k, v, pt = _case(ttnn, mesh, start=192, poison_after=True)
        with ctx.counters.scope("sdpa") as c:
            o = ttnn.transformer.chunked_scaled_dot_product_attention(q, k, v, pt, 192,
                                                                      program_config=_config(ttnn, mesh, 64))
        assert bool(torch.isfinite(ttnn.to_torch(ttnn.get_device_tensors(o)[0]).float()).all())
        page = 2 * 32 * 64 * 2  # [1, 2 heads, 32 rows, 64] bf16
        want = q.bytes_per_device() + pt.bytes_per_device() + 2 * (256 // 32) * page
        assert c.bytes_read_per_op[SDPA]["BFLOAT16"] + c.bytes_read_per_op[SDPA].get("INT32", 0) == want


def test_chunk_start_must_be_a_multiple_of_the_chunk_sizes():
    with open_mesh("emulated-p150x2") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        q, k, v, pt = _case(ttnn, mesh, start=96)
        with pytest.raises(EmulatorError, match=r"chunk_start_idx 96 must be a multiple of program_config"
                                                 r"\.q_chunk_size \(64\)"):
            ttnn.transformer.chunked_scaled_dot_product_attention(q, k, v, pt, 96, program_config=_config(ttnn, mesh, 64))
        ttnn.transformer.chunked_scaled_dot_product_attention(q, k, v, pt, 96, program_config=_config(ttnn, mesh, 32))
