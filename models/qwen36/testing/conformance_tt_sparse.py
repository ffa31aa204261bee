"""Tenstorrent's ``test_sparse_matmul_indexed.py`` restated (sources: ``qwen36.testing.conformance_tt_tests``)."""

from __future__ import annotations

import itertools

import torch

from .conformance_tt_base import TTCase, host0, pcc_at_least, raises, randn


def _sparse_pc(ttnn, m, n):
    nt = -(-n // 32)
    cx, cy = 1, 1
    for d in range(min(10, nt), 0, -1):
        if nt % d == 0 and nt // d <= 10:
            cx, cy = nt // d, d
            break
    return ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(cx, cy), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=max(32, m) // 32, per_core_N=1, fuse_batch=False,
        fused_activation=None, mcast_in0=True)


def _ids(ttnn, mesh, ids, shape=None):
    t = torch.tensor(ids, dtype=torch.int32).reshape(shape or (1, 1, 1, len(ids)))
    return ttnn.from_torch(t, dtype=ttnn.uint16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)


def _mask(ttnn, mesh, ids, groups):
    s = torch.zeros(1, 1, 1, groups)
    s[0, 0, 0, ids] = 1.0
    return ttnn.from_torch(s.to(torch.bfloat16), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)


def _metrics(ref, got, k):
    """The file's assert_numeric_metrics(atol=0.05k, rtol=10k, frobenius 0.01k, PCC 0.99)."""
    assert torch.allclose(ref, got, atol=0.05 * k, rtol=10.0 * k), f"max abs {float((ref - got).abs().max()):.3e}"
    assert float((ref - got).norm() / ref.norm()) <= 0.01 * k
    pcc_at_least(ref, got, 0.99)


def _tile(ttnn, mesh, t, dtype=None):
    return ttnn.from_torch(t, dtype=dtype or ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)


def _gather(groups, wdt, compact_a):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(1 if compact_a else 0)
        m, k, n = 32, 128, 256
        if compact_a:
            ids = [groups - 1, 3, groups - 2, 9, 2, groups // 2, 11, 0][:min(8, groups)]
        else:
            ids = [groups - 1, 5, groups - 2, 12, 1, groups // 2, 7, 0][:min(8, groups)]
        a = randn(g, (1, len(ids) if compact_a else 1, m, k), dtype=torch.bfloat16)
        b = randn(g, (1, groups, k, n), dtype=torch.bfloat16)
        out = ttnn.sparse_matmul(_tile(ttnn, mesh, a), _tile(ttnn, mesh, b, getattr(ttnn, wdt)),
                                 sparsity=_mask(ttnn, mesh, ids, groups), indices=_ids(ttnn, mesh, ids),
                                 is_input_a_sparse=compact_a, is_input_b_sparse=True,
                                 memory_config=ttnn.DRAM_MEMORY_CONFIG, program_config=_sparse_pc(ttnn, m, n))
        got = host0(ttnn, out).float().reshape(len(ids), m, n)
        for i, e in enumerate(ids):
            _metrics(a[0, i if compact_a else 0].float() @ b[0, e].float(), got[i], k)
    return fn


def _gather_cache_reuse(ttnn, mesh):
    g = torch.Generator().manual_seed(3)
    m, k, n, groups = 32, 128, 256, 16
    id_sets = ([15, 2, 9, 0, 13, 4, 7, 11], [1, 14, 6, 12, 3, 10, 5, 8])
    a = randn(g, (1, 1, m, k), dtype=torch.bfloat16)
    b = randn(g, (1, groups, k, n), dtype=torch.bfloat16)
    at, bt, pc = _tile(ttnn, mesh, a), _tile(ttnn, mesh, b, ttnn.bfloat8_b), _sparse_pc(ttnn, m, n)
    made = [(_mask(ttnn, mesh, ids, groups), _ids(ttnn, mesh, ids)) for ids in id_sets]
    assert made[0][1].buffer_address() != made[1][1].buffer_address()
    outs, counts = [], []
    for sp, ix in made:
        o = ttnn.sparse_matmul(at, bt, sparsity=sp, indices=ix, is_input_a_sparse=False, is_input_b_sparse=True,
                               memory_config=ttnn.DRAM_MEMORY_CONFIG, program_config=pc)
        outs.append(host0(ttnn, o).float().reshape(8, m, n))
        counts.append(mesh.num_program_cache_entries())
    assert counts[0] == counts[1], "the second indexed call must reuse the cached program"
    for got, ids in zip(outs, id_sets):
        for i, e in enumerate(ids):
            _metrics(a[0, 0].float() @ b[0, e].float(), got[i], k)


def _no_indices(ttnn, mesh):
    g = torch.Generator().manual_seed(2)
    m, k, n, groups, ids = 32, 128, 256, 16, [3, 7, 11, 0]
    a = randn(g, (1, 1, m, k), dtype=torch.bfloat16)
    b = randn(g, (1, groups, k, n), dtype=torch.bfloat16)
    out = ttnn.sparse_matmul(_tile(ttnn, mesh, a), _tile(ttnn, mesh, b, ttnn.bfloat8_b),
                             sparsity=_mask(ttnn, mesh, ids, groups), nnz=len(ids), is_input_b_sparse=True,
                             memory_config=ttnn.DRAM_MEMORY_CONFIG, program_config=_sparse_pc(ttnn, m, n))
    assert out.shape[-3] == groups, f"expected the dense group axis, got {tuple(out.shape)}"
    got = host0(ttnn, out).float().reshape(groups, m, n)
    for e in range(groups):
        if e in ids:
            _metrics(a[0, 0].float() @ b[0, e].float(), got[e], k)
        else:
            assert torch.count_nonzero(got[e]) == 0, f"inactive slot {e} must stay zero-filled"


def _contract(ttnn, mesh):
    g = torch.Generator().manual_seed(4)
    a = _tile(ttnn, mesh, randn(g, (1, 1, 32, 128), dtype=torch.bfloat16))
    b = _tile(ttnn, mesh, randn(g, (1, 16, 128, 256), dtype=torch.bfloat16), ttnn.bfloat8_b)
    ids = [3, 7, 11, 0]
    return a, b, _mask(ttnn, mesh, ids, 16), ids, _sparse_pc(ttnn, 32, 256)


def _run_indexed(ttnn, a, b, sp, ix, pc, **kw):
    return ttnn.sparse_matmul(a, b, sparsity=sp, indices=ix, is_input_a_sparse=False, is_input_b_sparse=True,
                              memory_config=ttnn.DRAM_MEMORY_CONFIG, program_config=pc, **kw)


# contract case -> the device op's message the file matches
CONTRACT_MESSAGES = {
    "multi_stick_shape": "single ROW_MAJOR stick",
    "host_tensor": "Device Operations expect device tensors as inputs",
    "wrong_dtype": "indices must be UINT16 dtype",
    "more_than_num_groups": "must be <= the number of sparse groups",
    "nnz": "must not be supplied together with indices",
    "requires_input_b_sparse": "requires is_input_b_sparse",
    "mismatched_optional_output": "must match the indexed output shape",
}


def _b_sparse_required(ttnn, mesh):
    """An A-sparse-only call ([1, 1, M, K] x [1, 1, K, N], sparsity [1, 1, 1, 1]) with indices."""
    g = torch.Generator().manual_seed(6)
    a = _tile(ttnn, mesh, randn(g, (1, 1, 32, 128), dtype=torch.bfloat16))
    b = _tile(ttnn, mesh, randn(g, (1, 1, 128, 256), dtype=torch.bfloat16), ttnn.bfloat8_b)
    sp = ttnn.from_torch(torch.ones((1, 1, 1, 1), dtype=torch.bfloat16), dtype=ttnn.bfloat16,
                         layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    return lambda: ttnn.sparse_matmul(a, b, sparsity=sp, indices=_ids(ttnn, mesh, [0]), is_input_a_sparse=True,
                                      is_input_b_sparse=False, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                                      program_config=_sparse_pc(ttnn, 32, 256))


def _contract_case(kind):
    def fn(ttnn, mesh):
        if kind == "requires_input_b_sparse":
            raises(_b_sparse_required(ttnn, mesh), CONTRACT_MESSAGES[kind])
            return
        a, b, sp, ids, pc = _contract(ttnn, mesh)
        stick = torch.tensor(ids, dtype=torch.int32).reshape(1, 1, 1, -1)
        kw = {}
        if kind == "multi_stick_shape":
            ix = _ids(ttnn, mesh, ids, (1, 1, len(ids), 1))
        elif kind == "host_tensor":
            ix = ttnn.from_torch(stick, dtype=ttnn.uint16, layout=ttnn.ROW_MAJOR_LAYOUT)
        elif kind == "wrong_dtype":
            ix = ttnn.from_torch(stick, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
        elif kind == "more_than_num_groups":
            ix = _ids(ttnn, mesh, list(range(16)) + [0])
        elif kind == "nnz":
            ix, kw = _ids(ttnn, mesh, ids), {"nnz": len(ids)}
        else:  # a preallocated output with the full group axis
            full = _tile(ttnn, mesh, torch.zeros((1, 1, 1, 16, 32, 256), dtype=torch.bfloat16))
            ix, kw = _ids(ttnn, mesh, ids), {"optional_output_tensor": full}
        raises(lambda: _run_indexed(ttnn, a, b, sp, ix, pc, **kw), CONTRACT_MESSAGES[kind])
    return fn


def _indexed_optional_output(ttnn, mesh):
    g = torch.Generator().manual_seed(5)
    m, k, n, groups, ids = 32, 128, 256, 16, [13, 1, 8, 4]
    a = randn(g, (1, 1, m, k), dtype=torch.bfloat16)
    b = randn(g, (1, groups, k, n), dtype=torch.bfloat16)
    pre = _tile(ttnn, mesh, torch.full((1, 1, 1, len(ids), m, n), 99.0, dtype=torch.bfloat16))
    out = _run_indexed(ttnn, _tile(ttnn, mesh, a), _tile(ttnn, mesh, b, ttnn.bfloat8_b), _mask(ttnn, mesh, ids, groups),
                       _ids(ttnn, mesh, ids), _sparse_pc(ttnn, m, n), optional_output_tensor=pre)
    got = host0(ttnn, out).float().reshape(len(ids), m, n)
    for i, e in enumerate(ids):
        _metrics(a[0, 0].float() @ b[0, e].float(), got[i], k)


def _bias_rebinding(compact_a, wdt, n, grid, per_core_n, out_block_w, fp32_acc, l1_acc):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(81)
        groups, active, m, k = 8, 3, 64, 128
        a = randn(g, 1, active if compact_a else 1, m, k, dtype=torch.bfloat16)
        b = randn(g, 1, groups, k, n, dtype=torch.bfloat16)
        at, bt = _tile(ttnn, mesh, a), _tile(ttnn, mesh, b, getattr(ttnn, wdt))
        bq = host0(ttnn, bt).float()
        pc = ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
            compute_with_storage_grid_size=ttnn.CoreCoord(*grid), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
            out_block_h=1, out_block_w=out_block_w, per_core_M=m // 32, per_core_N=per_core_n, fuse_batch=False,
            fused_activation=None, mcast_in0=True)
        ckc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                               fp32_dest_acc_en=fp32_acc, packer_l1_acc=l1_acc)
        calls = []
        for ids, sign in (([7, 1, 5], 1), ([4, 6, 0], -1)):
            bias = (randn(g, groups, 1, n) * 4 + sign * 8).to(torch.bfloat16)
            calls.append((ids, bias, _tile(ttnn, mesh, bias), _ids(ttnn, mesh, ids), _mask(ttnn, mesh, ids, groups)))
        assert calls[0][2].buffer_address() != calls[1][2].buffer_address()
        entries = None
        for ids, bias, bias_t, ix, sp in calls:
            res = ttnn.sparse_matmul(at, bt, sparsity=sp, indices=ix, bias=bias_t, is_input_a_sparse=compact_a,
                                     is_input_b_sparse=True, program_config=pc, compute_kernel_config=ckc)
            got = host0(ttnn, res).float().reshape(active, m, n)
            if entries is None:
                entries = mesh.num_program_cache_entries()
            else:
                assert mesh.num_program_cache_entries() == entries
            for slot, e in enumerate(ids):
                want = a[0, slot if compact_a else 0].float() @ bq[0, e] + bias[e].float()
                torch.testing.assert_close(got[slot], want, atol=0.3, rtol=0.03)
    return fn


_BIAS_INVALID = {"no_indices": "bias requires indices", "dtype": "bias must be BFLOAT16", "layout": "bias must be TILE",
                 "groups": "bias must have padded shape", "width": "bias must have padded shape"}


def _bias_contract(kind):
    def fn(ttnn, mesh):
        a, b, sp, ids, pc = _contract(ttnn, mesh)
        shape = (15 if kind == "groups" else 16, 1, 256 + 32 if kind == "width" else 256)
        bias = ttnn.from_torch(torch.zeros(shape, dtype=torch.bfloat16),
                               dtype=ttnn.bfloat8_b if kind == "dtype" else ttnn.bfloat16,
                               layout=ttnn.ROW_MAJOR_LAYOUT if kind == "layout" else ttnn.TILE_LAYOUT, device=mesh)
        ix = None if kind == "no_indices" else _ids(ttnn, mesh, ids)
        raises(lambda: _run_indexed(ttnn, a, b, sp, ix, pc, bias=bias), _BIAS_INVALID[kind])
    return fn


def sparse_cases() -> list[TTCase]:
    op, out = "sparse_matmul", []
    for (compact_a, stem), groups, wdt in itertools.product(((False, "gate_up"), (True, "down")), (16, 256),
                                                            ("bfloat8_b", "bfloat4_b")):
        out.append(TTCase(op, f"gather_{stem}_{groups}_{wdt}", _gather(groups, wdt, compact_a),
                          ci=groups == 16 and wdt == "bfloat4_b"))
    out += [TTCase(op, "gather_program_cache_reuses_with_new_indices", _gather_cache_reuse),
            TTCase(op, "indices_absent_is_unchanged", _no_indices)]
    out += [TTCase(op, f"indices_rejects_{k}", _contract_case(k), ci=True) for k in CONTRACT_MESSAGES]
    out.append(TTCase(op, "indexed_optional_output", _indexed_optional_output))
    blocks = ((32, (1, 1), 1, 1), (96, (2, 1), 2, 2), (128, (1, 1), 4, 2))
    accs = ((True, False), (False, False), (True, True))
    for compact_a, wdt, (n, grid, pcn, obw), (fp32_acc, l1_acc) in itertools.product(
            (False, True), ("bfloat8_b", "bfloat4_b"), blocks, accs):
        name = f"indexed_bias_{'compact' if compact_a else 'broadcast'}_a_{wdt}_n{n}_acc{int(fp32_acc)}{int(l1_acc)}"
        out.append(TTCase(op, name, _bias_rebinding(compact_a, wdt, n, grid, pcn, obw, fp32_acc, l1_acc)))
    out += [TTCase(op, f"indexed_bias_contract_{k}", _bias_contract(k), ci=True) for k in _BIAS_INVALID]
    return out
