"""Tenstorrent's ``test_rotary_embedding_hf.py`` restated (sources: ``qwen36.testing.conformance_tt_tests``)."""

from __future__ import annotations

import itertools

import torch

from .conformance_tt_base import TTCase, host0, pcc_at_least, randn


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_ckc(ttnn):
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=True)


def _rope_rows(w, z, y, x, token_idx, in_sharded, out_sharded, in_dt, sc_dt):
    """One prefill-mode case: token_idx None = the prefill test (cos/sin the cache's first Y rows), else the legacy
    decode test (every row the cache's row ``token_idx``; a sharded output is brought back interleaved). The file's
    ``ttnn.Tensor(x, dtype).to(TILE)`` host tensor is ``ttnn.from_torch(x, dtype, TILE)`` here; the input is sharded
    over the largest core count that divides its tile rows, as the file computes it."""
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(0 if token_idx is None else 1 + token_idx)
        xx = randn(g, w, z, y, x).bfloat16().float()
        cos_c, sin_c = (randn(g, 1, 1, 2048, x).bfloat16().float() for _ in range(2))
        if token_idx is None:
            cos, sin = cos_c, sin_c
            want = (xx * cos_c[:, :, :y] + _rotate_half(xx) * sin_c[:, :, :y])
        else:
            cos, sin = (c[:, :, token_idx:token_idx + 1].expand(1, 1, y, -1).contiguous() for c in (cos_c, sin_c))
            want = xx * cos[:, :, :1] + _rotate_half(xx) * sin[:, :, :1]
        dt = getattr(ttnn, in_dt)
        xt = ttnn.from_torch(xx.reshape(1, w * z, y, x), dtype=dt, layout=ttnn.TILE_LAYOUT)
        if in_sharded:
            blocks = w * z * y // 32
            grid = mesh.compute_with_storage_grid_size()
            cores = next(i for i in range(grid.x * grid.y, 0, -1) if blocks % i == 0)
            spec = ttnn.ShardSpec(ttnn.num_cores_to_corerangeset(cores, grid, True), [-(-blocks // cores) * 32, x],
                                  ttnn.ShardOrientation.ROW_MAJOR)
            xt = xt.to(mesh, ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1, spec))
        else:
            xt = xt.to(mesh)
        ct, st = (ttnn.from_torch(c, dtype=getattr(ttnn, sc_dt), layout=ttnn.TILE_LAYOUT).to(mesh)
                  for c in (cos, sin))
        out_mc = (ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1) if out_sharded
                  else ttnn.MemoryConfig())
        out = ttnn.experimental.rotary_embedding_hf(xt, ct, st, is_decode_mode=False, memory_config=out_mc,
                                                    compute_kernel_config=_rope_ckc(ttnn))
        if out_sharded and token_idx is not None:
            out = ttnn.sharded_to_interleaved(out)
        got = host0(ttnn, out).float().reshape(w, z, y, x)
        if token_idx is None:
            pcc_at_least(want[0], got[0], 0.99)
        else:
            pcc_at_least(want, got, 0.99)
    return fn


_PER_USER_POSITIONS = [0, 57, 113, 179, 241, 307, 367, 431, 499, 563, 641, 701, 769, 823, 887, 947, 1009, 1063,
                       1129, 1187, 1249, 1301, 1367, 1429, 1483, 1549, 1601, 1663, 1723, 1789, 1847, 2005]


def _rope_decode_per_user(ttnn, mesh):
    """Decode mode, one cache position per user; cos/sin padded with zero rows to a whole tile per user."""
    g = torch.Generator().manual_seed(0)
    b, nh, d = 32, 8, 128
    cos_full, sin_full = randn(g, 1, 1, 2048, d), randn(g, 1, 1, 2048, d)
    cos = torch.stack([cos_full[0, 0, p] for p in _PER_USER_POSITIONS]).reshape(1, b, 1, d)
    sin = torch.stack([sin_full[0, 0, p] for p in _PER_USER_POSITIONS]).reshape(1, b, 1, d)
    x = randn(g, 1, b, nh, d)
    want = x * cos + _rotate_half(x) * sin
    x_mc = ttnn.create_sharded_memory_config(shape=(32, d), core_grid=ttnn.CoreGrid(y=4, x=8),
                                             strategy=ttnn.ShardStrategy.HEIGHT,
                                             orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                             use_height_and_width_as_shard_shape=True)
    xt = ttnn.from_torch(torch.cat([x, torch.zeros(1, b, 32 - nh, d)], dim=2).bfloat16(), dtype=ttnn.bfloat16,
                         layout=ttnn.TILE_LAYOUT, device=mesh, memory_config=x_mc)
    grid = mesh.compute_with_storage_grid_size()
    cs_mc = ttnn.create_sharded_memory_config(shape=(32, d), core_grid=ttnn.num_cores_to_corerangeset(b, grid, True),
                                              strategy=ttnn.ShardStrategy.HEIGHT,
                                              orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                              use_height_and_width_as_shard_shape=True)
    padded = [torch.cat([c.bfloat16(), torch.zeros(1, b, 31, d, dtype=torch.bfloat16)], dim=2) for c in (cos, sin)]
    ct, st = (ttnn.interleaved_to_sharded(ttnn.from_torch(c, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                                           device=mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG), cs_mc)
              for c in padded)
    out = ttnn.experimental.rotary_embedding_hf(xt, ct, st, is_decode_mode=True, compute_kernel_config=_rope_ckc(ttnn))
    pcc_at_least(want, host0(ttnn, out).float()[:, :, :nh], 0.99)
    for t in (out, xt, ct, st):
        ttnn.deallocate(t)


def rope_cases() -> list[TTCase]:
    """The file's grid. The suite carries every ``out_sharded`` case (a spec-less HEIGHT_SHARDED L1 output), the fp32
    and per-user decode cases, and one interleaved-output case per shape (sharded input, bf16, first token)."""
    op, out, bf = "experimental.rotary_embedding_hf", [], ("bfloat16", "bfloat8_b")
    prefill = ((1, 1, 128, 64), (1, 71, 128, 64), (32, 1, 32, 64), (32, 71, 32, 64))
    for (w, z, y, x), ins, outs, idt, sdt in itertools.product(prefill, (True, False), (True, False), bf, bf):
        plain = idt == sdt == "bfloat16"
        out.append(TTCase(op, f"prefill_{w}x{z}x{y}x{x}_in{int(ins)}_out{int(outs)}_{idt}_{sdt}",
                          _rope_rows(w, z, y, x, None, ins, outs, idt, sdt), suite=outs or (ins and plain),
                          ci=outs and (w, z) == (1, 1) and plain))
    decode = ((1, 1, 32, 64), (1, 71, 32, 64), (1, 1, 64, 64), (1, 71, 64, 64), (1, 32, 32, 64), (1, 2, 32, 64))
    tokens = (0, 128, 129, 1024, 1025)
    for (w, z, y, x), tok, ins, outs, idt, sdt in itertools.product(decode, tokens, (True, False), (True, False), bf,
                                                                    bf):
        out.append(TTCase(op, f"decode_{w}x{z}x{y}x{x}_tok{tok}_in{int(ins)}_out{int(outs)}_{idt}_{sdt}",
                          _rope_rows(w, z, y, x, tok, ins, outs, idt, sdt),
                          suite=outs or (tok == 0 and ins and idt == sdt == "bfloat16"),
                          ci=outs and not ins and (w, z, y, tok) == (1, 2, 32, 129) and idt == sdt == "bfloat8_b"))
    fp32 = ("float32", "float32")
    out.append(TTCase(op, "prefill_fp32_1x1x128x64", _rope_rows(1, 1, 128, 64, None, True, True, *fp32), ci=True))
    out += [TTCase(op, f"decode_fp32_1x1x32x64_tok{tok}", _rope_rows(1, 1, 32, 64, tok, True, True, *fp32))
            for tok in (0, 128)]
    out.append(TTCase(op, "decode_per_user_position_cos_sin_padded_to_a_tile", _rope_decode_per_user, ci=True))
    out.append(TTCase(op, "row_major", None, suite=False, skip="Tenstorrent's file skips it itself (row-major "
                                                               "inputs are refused by the device op's validation)"))
    return out
