"""Conformance cases for the KDA chunk-recurrence pieces of ttnn 0.81.1, restated from Tenstorrent's tests for them
(registered into ``emulator_conformance.CASES``). Those tests were written against earlier call forms (separate beta,
constant-tile inputs, wrap indicators); each case makes the 0.81.1 call (``actual_start`` / ``local_rows`` / tail
arguments on one sequence-parallel rank) and keeps the test's inputs, oracle and bar.

Sources (tenstorrent/tt-metal ``tests/ttnn/nightly/unit_tests/operations/experimental/kda/``, read for facts):

* ``test_prepare_chunk_recurrence.py``: (heads, chunks, K, V, bf16 mask) in {(2, 1, 32, 32, 0), (2, 3, 32, 32,
  0x26), (2, 4, 32, 64, 0x11), (3, 2, 64, 32, 0x37)}, q/k 0.3 randn, v 0.2 randn, g in (-0.051, -0.001), all bf16;
  its oracle (L2 norm + 1e-6, q times K^-0.5, per-key cumulative decay) at PCC >= 0.999; output dtypes follow the
  mask; trace replay bit-identical; inputs unchanged. 0.81.1 takes beta as pre-sigmoid logits read in place
  (``beta_logits_column_offset``); the case feeds logits whose sigmoid is the test's beta.
* ``recurrent_chunk_scan_test_utils.py`` / ``test_recurrent_chunk_scan.py`` / ``test_summarize_chunk_recurrence.py``:
  a finite stable seven-tensor protocol (t_inv the inverse of I + 0.015-scaled strictly lower), Y bf16 and S fp32
  against the recurrent oracle at PCC >= 0.999, bf16 allowed for v_beta/kd/q_decay/k_dec_t/final_decay; summaries A,
  B (bf16) reconstructing the scanned state from a third state at PCC >= 0.9999.
* ``test_affine_exclusive_scan.py``: (BH, G, K, V) in {(2, 1, 32, 32), (2, 3, 32, 32), (2, 4, 32, 32), (3, 2, 32,
  64)}, fp32 and bf16 summaries near 0.94 I with non-commuting neighbours; exclusive entries at PCC >= 0.999, the first
  entry the initial state.
* ``test_reduce_affine_transforms.py``: (2, 4, 32, 32) and (3, 2, 32, 64), fp32/bf16; composition in sequence order.
* ``test_chain_affine_transforms.py``: one rank (one step), bf16 transforms [A|B], fp32 state: entry = initial,
  final = A S + B at PCC >= 0.999 over its shape sweep, and bit-identical to the same chain composed of ordinary ttnn
  ops (typecast, HiFi2 fp32-Dst matmul, add); two ranks on the sequence-parallel axis from the docstring.
* ``select_final_carry``: from its docstring (one rank: prefix_final; a separated tail: the tail owner's state).
"""

from __future__ import annotations

import torch

from .conformance_common import Case, _dev, _expect_rejected, pcc

_DIR = "tt-metal tests/ttnn/nightly/unit_tests/operations/experimental/kda/"
SRC_PREP = _DIR + "test_prepare_chunk_recurrence.py"
SRC_SCAN = _DIR + "test_recurrent_chunk_scan.py (recurrent_chunk_scan_test_utils.py)"
SRC_SUMMARY = _DIR + "test_summarize_chunk_recurrence.py (recurrent_chunk_scan_test_utils.py)"
SRC_EXCL = _DIR + "test_affine_exclusive_scan.py"
SRC_REDUCE = _DIR + "test_reduce_affine_transforms.py"
SRC_CHAIN = _DIR + "test_chain_affine_transforms.py"
SRC_SELECT = "ttnn 0.81.1 docstring of experimental.kda.select_final_carry"
K = "experimental.kda."
C = 32


def _first(ttnn, t):
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0])


def _scalar(ttnn, mesh, value):
    return ttnn.from_torch(torch.tensor([value]), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))


# ---- prepare_chunk_recurrence -----------------------------------------------------------------------------------
def _prep_host(h, n, kd, vd, seed=1731):
    g_ = torch.Generator().manual_seed(seed)
    t = n * C
    q = (0.3 * torch.randn(1, t, h * kd, generator=g_)).bfloat16()
    k = (0.3 * torch.randn(1, t, h * kd, generator=g_)).bfloat16()
    v = (0.2 * torch.randn(1, t, h * vd, generator=g_)).bfloat16()
    g = (-0.001 - 0.05 * torch.rand(1, t, h * kd, generator=g_)).bfloat16()
    logits = torch.randn(1, t, h, generator=g_).bfloat16()
    return q, k, v, g, logits


def _prep_oracle(q, k, v, g, logits, h):
    t, kd, vd = q.shape[1], q.shape[2] // h, v.shape[2] // h
    n = t // C
    hf = lambda x, d: x.double().reshape(n * C, h, d).permute(1, 0, 2).reshape(h, n, C, d)  # noqa: E731
    q, k, v, g = hf(q, kd), hf(k, kd), hf(v, vd), hf(g, kd)
    beta = torch.sigmoid(logits.double()).reshape(n * C, h).T.reshape(h, n, C, 1)
    q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6) * kd ** -0.5
    k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    cg = torch.cumsum(g, 2)
    decay, inv, last = torch.exp(cg), torch.exp(-cg), cg[:, :, -1]
    kd_ = beta * k * decay
    qd = q * decay
    akk = kd_ @ (k * inv).transpose(-1, -2)
    eye = torch.eye(C, dtype=torch.float64)
    return (beta * v, kd_, qd, (qd @ (k * inv).transpose(-1, -2)).tril(),
            (k * torch.exp(last.unsqueeze(2) - cg)).transpose(-1, -2), torch.exp(last).unsqueeze(-1),
            torch.linalg.inv(eye + torch.tril(akk, diagonal=-1)))


def _prep_contract(h, n, kd, vd, mask, l1):
    def run(ttnn, mesh):
        host = _prep_host(h, n, kd, vd)
        ins = [_dev(ttnn, mesh, x) for x in host]
        before = [_first(ttnn, x).clone() for x in ins]
        mc = ttnn.L1_MEMORY_CONFIG if l1 else ttnn.DRAM_MEMORY_CONFIG
        start = _scalar(ttnn, mesh, 0)
        call = lambda: ttnn.experimental.kda.prepare_chunk_recurrence(  # noqa: E731
            *ins, h, output_bf16_mask=mask, memory_config=mc, actual_start=start)
        outs = call()
        shapes = ([h, n, C, vd], [h, n, C, kd], [h, n, C, kd], [h, n, C, C], [h, n, kd, C], [h, n, kd, 1], [h, n, C, C])
        for j, (o, shape, want) in enumerate(zip(outs, shapes, _prep_oracle(*host, h))):
            assert list(o.shape) == shape and o.layout == ttnn.TILE_LAYOUT and o.memory_config() == mc
            assert o.dtype == (ttnn.bfloat16 if mask & (1 << j) else ttnn.float32)
            assert pcc(want, _first(ttnn, o).float()) >= 0.999, j
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        traced = call()
        ttnn.end_trace_capture(mesh, tid, cq_id=0)
        for _ in range(2):
            ttnn.execute_trace(mesh, tid, cq_id=0, blocking=False)
        ttnn.synchronize_device(mesh)
        assert all(torch.equal(_first(ttnn, a), _first(ttnn, b)) for a, b in zip(outs, traced))
        assert all(torch.equal(b, _first(ttnn, x)) for b, x in zip(before, ins))
        ttnn.release_trace(mesh, tid)
    return run


def _prep_bounds_and_rejects(ttnn, mesh):
    """actual_end inside the last chunk: the rows past it are identity steps (zero gate, beta-logit, key, value), so
    the outputs equal those of inputs zeroed there (docstring); and the refusals."""
    h, n, kd, vd = 2, 2, 32, 32
    host = _prep_host(h, n, kd, vd, seed=5)
    ins = [_dev(ttnn, mesh, x) for x in host]
    zeroed = [x.clone() for x in host]
    for j in (1, 2, 3, 4):  # k, v, g, logits
        zeroed[j][:, 40:] = 0
    run = lambda xs, **kw: ttnn.experimental.kda.prepare_chunk_recurrence(*xs, h, **kw)  # noqa: E731
    bounded = run(ins, actual_start=_scalar(ttnn, mesh, 0), actual_end=_scalar(ttnn, mesh, 40))
    plain = run([_dev(ttnn, mesh, x) for x in zeroed])
    assert all(torch.equal(_first(ttnn, a), _first(ttnn, b)) for a, b in zip(bounded, plain))
    _expect_rejected(lambda: run(ins, output_bf16_mask=0x8), "unsupported KDA prep BF16 mask 0x8")
    _expect_rejected(lambda: run(ins, actual_end=_scalar(ttnn, mesh, 40)), "actual_end requires actual_start")
    l1acc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, packer_l1_acc=True)
    _expect_rejected(lambda: run(ins, compute_kernel_config=l1acc), "packer_l1_acc=true is unsupported")
    _expect_rejected(lambda: run(ins[:4] + [_dev(ttnn, mesh, host[4][:, :, :1])]),
                     "beta logits must be token-major [1, num_chunks * 32, columns]")


# ---- recurrent_chunk_scan / summarize_chunk_recurrence -----------------------------------------------------------
_BF16_OK = ("v_beta", "kd", "q_decay", "k_dec_t", "final_decay")
_NAMES = ("v_beta", "kd", "q_decay", "intra", "k_dec_t", "final_decay", "t_inv")


def _protocol(bh, n, kd, vd, bf16=(), seed=1731):
    g_ = torch.Generator().manual_seed(seed)
    base = (bh, n)
    vals = (0.08 * torch.randn(*base, C, vd, generator=g_), 0.025 * torch.randn(*base, C, kd, generator=g_),
            0.06 * torch.randn(*base, C, kd, generator=g_), torch.tril(0.025 * torch.randn(*base, C, C, generator=g_)),
            0.025 * torch.randn(*base, kd, C, generator=g_), 0.86 + 0.08 * torch.rand(*base, kd, 1, generator=g_))
    strict = torch.tril(0.015 * torch.randn(*base, C, C, generator=g_), diagonal=-1)
    vals = vals + (torch.linalg.inv(torch.eye(C) + strict),)
    return tuple(x.bfloat16() if name in bf16 else x.float() for name, x in zip(_NAMES, vals))


def _scan_ref(proto, s):
    v_beta, kd, q_decay, intra, k_dec_t, final_decay, t_inv = (x.double() for x in proto)
    s, ys = s.double(), []
    for c in range(v_beta.shape[1]):
        u = t_inv[:, c] @ (v_beta[:, c] - kd[:, c] @ s)
        ys.append(q_decay[:, c] @ s + intra[:, c] @ u)
        s = s * final_decay[:, c] + k_dec_t[:, c] @ u
    return torch.stack(ys, 1), s


def _proto_dev(ttnn, mesh, proto):
    return [_dev(ttnn, mesh, x, ttnn.bfloat16 if x.dtype == torch.bfloat16 else ttnn.float32) for x in proto]


def _scan_case(bh, n, kd, vd, bf16=(), groups=1):
    def run(ttnn, mesh):
        proto = _protocol(bh * groups, n, kd, vd, bf16)
        s0 = 0.04 * torch.randn(bh * groups, kd, vd, generator=torch.Generator().manual_seed(2718))
        y, s = ttnn.experimental.kda.recurrent_chunk_scan(
            *_proto_dev(ttnn, mesh, proto), _dev(ttnn, mesh, s0, ttnn.float32), actual_start=_scalar(ttnn, mesh, 0),
            tail_entry_states=_dev(ttnn, mesh, s0[::groups], ttnn.float32), groups_per_head=groups)
        ry, rs = _scan_ref(proto, s0)
        assert y.dtype == ttnn.bfloat16 and list(y.shape) == [bh * groups, n, C, vd]
        assert s.dtype == ttnn.float32 and list(s.shape) == [bh * groups, kd, vd]
        assert pcc(ry, _first(ttnn, y).float()) >= 0.999 and pcc(rs, _first(ttnn, s)) >= 0.999
    return run


def _scan_rejects(ttnn, mesh):
    proto = _proto_dev(ttnn, mesh, _protocol(2, 1, 32, 32))
    s0 = _dev(ttnn, mesh, torch.zeros(2, 32, 32), ttnn.float32)
    start = _scalar(ttnn, mesh, 0)
    bad = list(proto)
    bad[3] = _dev(ttnn, mesh, _protocol(2, 1, 32, 32)[3], ttnn.bfloat16)
    _expect_rejected(lambda: ttnn.experimental.kda.recurrent_chunk_scan(
        *bad, s0, actual_start=start, tail_entry_states=s0), "intra must be FLOAT32")
    _expect_rejected(lambda: ttnn.experimental.kda.recurrent_chunk_scan(
        *proto, s0, actual_start=start, tail_entry_states=s0, groups_per_head=3),
        "groups_per_head 3 must divide the folded leading dimension 2")


def _summary_case(bh, n, d, bf16=()):
    def run(ttnn, mesh):
        proto = _protocol(bh, n, d, d, bf16)
        outs = ttnn.experimental.kda.summarize_chunk_recurrence(*_proto_dev(ttnn, mesh, proto),
                                                                actual_start=_scalar(ttnn, mesh, 0))
        assert len(outs) == 4 and all(o.dtype == ttnn.bfloat16 for o in outs)
        a, b = _first(ttnn, outs[0]).double(), _first(ttnn, outs[1]).double()
        s = 0.04 * torch.randn(bh, d, d, generator=torch.Generator().manual_seed(3141))
        assert pcc(_scan_ref(proto, s)[1], a @ s.double() + b) >= 0.9999
        packed = ttnn.experimental.kda.summarize_chunk_recurrence(
            *_proto_dev(ttnn, mesh, proto), actual_start=_scalar(ttnn, mesh, 0), packed_head=True)
        assert len(packed) == 1 and list(packed[0].shape) == [1, bh, d, 2 * d]
        assert torch.equal(_first(ttnn, packed[0])[0], torch.cat([_first(ttnn, outs[0]), _first(ttnn, outs[1])], -1))
        _expect_rejected(lambda: ttnn.experimental.kda.summarize_chunk_recurrence(
            *_proto_dev(ttnn, mesh, _protocol(bh, n, d, 2 * d)), actual_start=_scalar(ttnn, mesh, 0)),
            "K must equal V")
    return run


# ---- affine-transform scans -------------------------------------------------------------------------------------
def _affine_host(bh, groups, kd, vd, seed=621):
    g_ = torch.Generator().manual_seed(seed)
    lead = bh * groups
    a = (0.94 * torch.eye(kd)).expand(lead, kd, kd).clone() + 0.0125 * torch.randn(lead, kd, kd, generator=g_)
    b = 0.025 * torch.randn(lead, kd, vd, generator=g_)
    s0 = 0.05 * torch.randn(bh, kd, vd, generator=g_)
    for h in range(bh):  # adjacent summaries that do not commute
        if groups > 1:
            a[h * groups, 0, 1] += 0.25
            a[h * groups + 1, 1, 0] -= 0.20
    return a, b, s0


def _excl_case(bh, groups, kd, vd, bf16):
    def run(ttnn, mesh):
        a, b, s0 = _affine_host(bh, groups, kd, vd)
        dt = ttnn.bfloat16 if bf16 else ttnn.float32
        a_tt, b_tt, s_tt = _dev(ttnn, mesh, a, dt), _dev(ttnn, mesh, b, dt), _dev(ttnn, mesh, s0, ttnn.float32)
        out = ttnn.experimental.kda.affine_exclusive_scan(
            a_tt, b_tt, s_tt, groups, actual_start=_scalar(ttnn, mesh, 0), local_rows=groups * C, tail_a=a_tt,
            tail_b=b_tt, tail_entry_states=s_tt)
        aa = _first(ttnn, a_tt).double().reshape(bh, groups, kd, kd)
        bb = _first(ttnn, b_tt).double().reshape(bh, groups, kd, vd)
        want = []
        for h in range(bh):
            s = s0[h].double()
            for g in range(groups):
                want.append(s)
                s = aa[h, g] @ s + bb[h, g]
        got = _first(ttnn, out)
        assert out.dtype == ttnn.float32 and list(out.shape) == [bh * groups, kd, vd]
        assert pcc(torch.stack(want), got) >= 0.999
        assert pcc(s0, got.reshape(bh, groups, kd, vd)[:, 0]) >= 0.999
    return run


def _reduce_case(bh, groups, kd, vd, bf16):
    def run(ttnn, mesh):
        a, b, _ = _affine_host(bh, groups, kd, vd)
        dt = ttnn.bfloat16 if bf16 else ttnn.float32
        a_tt, b_tt = _dev(ttnn, mesh, a, dt), _dev(ttnn, mesh, b, dt)
        ta, tb = ttnn.experimental.kda.reduce_affine_transforms(a_tt, b_tt, groups, actual_start=_scalar(ttnn, mesh, 0),
                                                                local_rows=groups * C)
        aa = _first(ttnn, a_tt).double().reshape(bh, groups, kd, kd)
        bb = _first(ttnn, b_tt).double().reshape(bh, groups, kd, vd)
        wa, wb = aa[:, 0], bb[:, 0]
        for g in range(1, groups):
            wa, wb = aa[:, g] @ wa, aa[:, g] @ wb + bb[:, g]
        assert ta.dtype == ttnn.float32 and list(ta.shape) == [bh, kd, kd] and list(tb.shape) == [bh, kd, vd]
        assert pcc(wa, _first(ttnn, ta)) >= 0.999 and pcc(wb, _first(ttnn, tb)) >= 0.999
    return run


def _chain_host(bh, kd, vd, steps=1, seed=914):
    g_ = torch.Generator().manual_seed(seed)
    a = (0.94 * torch.eye(kd)).expand(steps, bh, kd, kd).clone() + 0.0125 * torch.randn(steps, bh, kd, kd, generator=g_)
    b = 0.025 * torch.randn(steps, bh, kd, vd, generator=g_)
    return a.bfloat16().float(), b.bfloat16().float(), 0.1 * torch.randn(bh, kd, vd, generator=g_)


def _chain_case(bh, kd, vd):
    def run(ttnn, mesh):
        a, b, s0 = _chain_host(bh, kd, vd)
        entry, final = ttnn.experimental.kda.chain_affine_transforms(
            _dev(ttnn, mesh, torch.cat([a, b], -1)), _dev(ttnn, mesh, s0, ttnn.float32),
            actual_start=_scalar(ttnn, mesh, 0), local_rows=C)
        assert pcc(s0, _first(ttnn, entry)) >= 0.999
        assert pcc(a[0].double() @ s0.double() + b[0].double(), _first(ttnn, final)) >= 0.999
    return run


def _chain_matches_composed_ops(ttnn, mesh):
    """The fused chain equals typecast + matmul (HiFi2, fp32 Dst) + add bit for bit (Tenstorrent's test)."""
    a, b, s0 = _chain_host(3, 64, 96, seed=117)
    cfg = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi2,
                                                 math_approx_mode=False, fp32_dest_acc_en=True, packer_l1_acc=False)
    _, final = ttnn.experimental.kda.chain_affine_transforms(
        _dev(ttnn, mesh, torch.cat([a, b], -1)), _dev(ttnn, mesh, s0, ttnn.float32),
        actual_start=_scalar(ttnn, mesh, 0), local_rows=C, compute_kernel_config=cfg)
    ta = ttnn.typecast(_dev(ttnn, mesh, a), ttnn.float32)
    tb = ttnn.typecast(_dev(ttnn, mesh, b), ttnn.float32)
    composed = ttnn.add(ttnn.matmul(ta, _dev(ttnn, mesh, s0.unsqueeze(0), ttnn.float32), dtype=ttnn.float32,
                                    compute_kernel_config=cfg), tb)
    assert torch.equal(_first(ttnn, composed)[0], _first(ttnn, final))
    l1acc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi2, fp32_dest_acc_en=True,
                                             packer_l1_acc=True)
    _expect_rejected(lambda: ttnn.experimental.kda.chain_affine_transforms(
        _dev(ttnn, mesh, torch.cat([a, b], -1)), _dev(ttnn, mesh, s0, ttnn.float32),
        actual_start=_scalar(ttnn, mesh, 0), local_rows=C, compute_kernel_config=l1acc),
        "packer_l1_acc=true is unsupported")


def _chain_two_ranks(ttnn, mesh):
    """Two ranks along mesh axis 1, the sequence starting on rank 1 (actual_start = local_rows): chronological order
    is rank 1 then rank 0; rank 1's entry is the initial state, rank 0's the state after rank 1 (docstring)."""
    if mesh.get_num_devices() != 2:
        return
    a, b, s0 = _chain_host(2, 32, 32, steps=2, seed=7)
    entry, final = ttnn.experimental.kda.chain_affine_transforms(
        _dev(ttnn, mesh, torch.cat([a, b], -1)), _dev(ttnn, mesh, s0, ttnn.float32),
        actual_start=_scalar(ttnn, mesh, C), local_rows=C, sequence_parallel_axis=1)
    dev = [ttnn.to_torch(t) for t in ttnn.get_device_tensors(entry)]
    after1 = a[1].double() @ s0.double() + b[1].double()
    assert pcc(s0, dev[1]) >= 0.999 and pcc(after1, dev[0]) >= 0.999
    fin = [ttnn.to_torch(t) for t in ttnn.get_device_tensors(final)]
    assert torch.equal(fin[0], fin[1]) and pcc(a[0].double() @ after1 + b[0].double(), fin[0]) >= 0.999


def _select_final_carry(ttnn, mesh):
    rank_final = torch.randn(2, 32, 32)
    prefix = torch.randn(2, 32, 32)
    out = ttnn.experimental.kda.select_final_carry(_dev(ttnn, mesh, rank_final, ttnn.float32),
                                                   _dev(ttnn, mesh, prefix, ttnn.float32),
                                                   actual_start=_scalar(ttnn, mesh, 0), local_rows=C)
    assert torch.equal(_first(ttnn, out), prefix), "one rank: the replicated prefix carry"
    if mesh.get_num_devices() == 2:
        # 2 ranks of 64 rows, the interval [32, 152): rank 0 holds rows 32..63 (head) and, after rank 1's 64, the
        # separated tail 128..151, so the carry is rank 0's final state on both ranks
        per_dev = ttnn.from_torch(torch.stack([rank_final, rank_final + 1.0]), dtype=ttnn.float32,
                                  layout=ttnn.TILE_LAYOUT, device=mesh, mesh_mapper=ttnn.ShardTensorToMesh(mesh, 0))
        out = ttnn.experimental.kda.select_final_carry(
            ttnn.reshape(per_dev, [2, 32, 32]), _dev(ttnn, mesh, prefix, ttnn.float32),
            actual_start=_scalar(ttnn, mesh, 32), actual_end=_scalar(ttnn, mesh, 152), local_rows=64,
            sequence_parallel_axis=1)
        got = [ttnn.to_torch(t) for t in ttnn.get_device_tensors(out)]
        assert torch.equal(got[0], rank_final) and torch.equal(got[1], rank_final)


CASES: list[Case] = [
    Case(K + "prepare_chunk_recurrence", "contract_h2_n1_k32_v32_mask0", SRC_PREP, _prep_contract(2, 1, 32, 32, 0, False)),
    Case(K + "prepare_chunk_recurrence", "contract_h2_n3_k32_v32_mask26_l1", SRC_PREP,
         _prep_contract(2, 3, 32, 32, 0x26, True), ci=False),
    Case(K + "prepare_chunk_recurrence", "contract_h2_n4_k32_v64_mask11", SRC_PREP,
         _prep_contract(2, 4, 32, 64, 0x11, False), ci=False),
    Case(K + "prepare_chunk_recurrence", "contract_h3_n2_k64_v32_mask37_l1", SRC_PREP,
         _prep_contract(3, 2, 64, 32, 0x37, True), ci=False),
    Case(K + "prepare_chunk_recurrence", "actual_end_identity_rows_and_refusals", SRC_PREP, _prep_bounds_and_rejects),
    Case(K + "prepare_chunk_recurrence", "production_performance", SRC_PREP,
         skip="a real-time-profiler duration band on a P150b; the emulator has no device clock"),
    Case(K + "recurrent_chunk_scan", "scan_bh2_n3_k32_v64_fp32", SRC_SCAN, _scan_case(2, 3, 32, 64)),
    Case(K + "recurrent_chunk_scan", "scan_bh2_n3_k32_v64_bf16_protocol", SRC_SCAN,
         _scan_case(2, 3, 32, 64, _BF16_OK), ci=False),
    Case(K + "recurrent_chunk_scan", "scan_bh2_n2_k64_v32_two_groups", SRC_SCAN, _scan_case(2, 2, 64, 32, groups=2),
         ci=False),
    Case(K + "recurrent_chunk_scan", "rejects_bf16_intra_and_bad_groups", SRC_SCAN, _scan_rejects),
    Case(K + "summarize_chunk_recurrence", "summary_reconstructs_state_bh2_n3_d32", SRC_SUMMARY, _summary_case(2, 3, 32)),
    Case(K + "summarize_chunk_recurrence", "summary_reconstructs_state_bf16_protocol_d64", SRC_SUMMARY,
         _summary_case(2, 2, 64, _BF16_OK), ci=False),
    Case(K + "recurrent_chunk_scan", "split_head_tail_and_wrap", SRC_SCAN,
         skip="head/tail splits need several sequence-parallel ranks (their fabric collectives are not emulated)"),
]
for _shape in ((2, 1, 32, 32), (2, 3, 32, 32), (2, 4, 32, 32), (3, 2, 32, 64)):
    for _bf in (False, True):
        CASES.append(Case(K + "affine_exclusive_scan", f"contract_{'x'.join(map(str, _shape))}_{'bf16' if _bf else 'fp32'}",
                          SRC_EXCL, _excl_case(*_shape, _bf), ci=_shape == (2, 4, 32, 32)))
for _shape in ((2, 4, 32, 32), (3, 2, 32, 64)):
    for _bf in (False, True):
        CASES.append(Case(K + "reduce_affine_transforms",
                          f"contract_{'x'.join(map(str, _shape))}_{'bf16' if _bf else 'fp32'}", SRC_REDUCE,
                          _reduce_case(*_shape, _bf), ci=_shape == (2, 4, 32, 32) and not _bf))
for _shape in ((1, 32, 32), (3, 32, 64), (2, 64, 32), (2, 160, 32), (2, 32, 160), (24, 128, 128)):
    CASES.append(Case(K + "chain_affine_transforms", f"shape_accuracy_bh{_shape[0]}_k{_shape[1]}_v{_shape[2]}",
                      SRC_CHAIN, _chain_case(*_shape), ci=_shape == (3, 32, 64)))
CASES += [
    Case(K + "chain_affine_transforms", "matches_composed_ttnn_ops_bit_exact", SRC_CHAIN, _chain_matches_composed_ops),
    Case(K + "chain_affine_transforms", "two_ranks_chronological_order", SRC_CHAIN, _chain_two_ranks),
    Case(K + "affine_exclusive_scan", "height_sharded_inputs", SRC_EXCL,
         skip="the height-sharded-L1 variants exercise the op's L1 reader; sharding is recorded, not modelled, so they "
              "repeat the interleaved cases' arithmetic"),
    Case(K + "select_final_carry", "one_rank_prefix_and_separated_tail_owner", SRC_SELECT, _select_final_carry),
]
