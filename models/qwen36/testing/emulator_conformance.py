"""Conformance cases for the hand-emulated ops, written from Tenstorrent's own tests for those ops.

Each case restates, in our words and at CI-sized shapes, what a tt-metal test (or op docstring) asserts:
the call form, the parametrisation, the reference formula and the tolerance. ``run_cases(ctx)`` runs them on
an emulated mesh (the probe ``qwen36 probe emu-conformance`` and ``tests/emulator/test_conformance.py`` both
use it). A case the emulator cannot express is listed with the reason instead of being dropped. They are test
support, not part of the emulator: nothing at run time loads them (tests/test_layering.py).

Sources (tenstorrent/tt-metal, read for facts):

* ``tests/ttnn/unit_tests/operations/transformers/test_paged_cache_mask.py``: paged_update_cache on a 1x2 mesh
  with ``mesh_coords`` selecting the devices that update; bf16 cache ``[32, 1, 32, 128]``; exact equality.
* ``tests/ttnn/unit_tests/operations/transformers/repro_paged_fill_cache_pagetable_row_hang.py``: paged_fill_cache
  with ``batch_idx_tensor`` (one row per user), 8 KV heads, block 32, bf16 and bfloat8_b caches.
* ``tests/ttnn/unit_tests/operations/sdpa/test_sdpa_decode_spec_multi_pos.py`` (``spec_multi_pos_tiles``): T in
  {4, 7, 11} candidates, block 64, head_dim 256, one KV head, bounds ``p..p+T-1`` at tile edges (p % 32 in
  {0, 1, 30, 31}) and chunk edges; spec vs the batched B == T form bit-identical where that test asserts it
  (``test_spec_multi_pos_is_bit_exact``: p = 1024 at 2k, p = 5000 at 8k; the groups' bit-exact test at 2k), else
  its sweep's bar (PCC >= 0.9999, 0.999 when the bounds straddle a k-chunk, and allclose 2e-2); both forms vs an
  fp32 per-candidate reference at PCC >= 0.99; also B = 2 groups.
* ``tests/ttnn/unit_tests/operations/transformers/test_fused_recurrent_gdn_golden.py``: the recurrence equals
  FLA's naive form, GQA equals repeat_interleave of q/k, T = K+1 per-token states equal K+1 chained single-token
  calls and the last per-token state equals the final state; K = V = 128, 4 key / 12 value heads.
* ``tests/ttnn/unit_tests/operations/transformers/test_gdn_state_inplace.py``: chunk_gated_delta_rule's model
  call form (flat ``[1, T, H*D]`` q/k/v, in-kernel L2 norm, chunk 32, ``output_head_major``).
* ``tests/nightly/t3000/ccl/test_minimal_all_gather_async.py`` (and the tg variant): all_gather_async on a
  ``[1, 1, 128, 512]``-class bf16 tensor, dim 3, Linear topology, DRAM, with tracing; exact equality.
* ``tests/ttnn/unit_tests/operations/transformers/test_rotary_embedding_hf_decode_baseline.py``:
  rotary_embedding_hf decode mode, (batch, heads, head_dim) in {(1, 32, 128), (8, 8, 128), (8, 16, 64),
  (32, 8, 64), ...}, bf16 input height-sharded with heads padded to 32, bf16 cos/sin ``[1, B, 1, D]`` sharded one
  32-row shard per user, HiFi4 + fp32 dest; reference ``x * cos + rotate_half(x) * sin`` (that test's bar is PCC
  0.90 while its kernel is fixed; the emulator is held to 0.9999 against an fp32 reference). Prefill mode as
  Tenstorrent's model code calls it (``[1, nh, S, D]`` interleaved, cos/sin ``[1, 1, S, D]``); the device
  validation (``rotary_embedding_hf_device_operation.cpp``) rejects an interleaved decode input.
* ``tests/ttnn/unit_tests/operations/transformers/test_paged_fused_update_cache.py``: K and V caches updated by
  one paged_fused_update_cache, 8 users, 1 or 8 heads, head_dim 128, block 64, shuffled page table, update index
  ``idx + 17 i`` with user 4 at -1 (skipped) for one head; inputs height-sharded on two disjoint 8-core grids;
  bf16 cache exact, bfloat8_b PCC >= 0.9995 over the whole cache and the updated rows.
* ``tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul.py``: sparse_matmul with nnz, dense A ``[1, 4, 16, 128]``
  against 8 experts ``[1, E, 128, 512]`` (bfloat8_b) with a random sparsity ``[1, 1, 4, E]``, both-sparse batched
  ``[1, 32, 16, 128]``, sparse A; every active block at PCC >= 0.999 vs torch. The indexed (``indices``) mode is
  from the 0.81.1 docstring (compact group axis, slot i = group indices[i]).
* ``tests/ttnn/unit_tests/operations/transformers/test_nlp_create_qkv_heads_decode.py``: the fused decode head split
  of ``[1, 1, B, (nq + 2 nkv) D]`` rows, (nq, nkv, D, B) in {(8, 1, 128, 8), (16, 2, 64, 32), (8, 4, 96, 32), ...},
  input width-sharded in [32, 32] shards (``min_width_shard``) with and without ``overlap_qk_coregrid``, output
  height-sharded; each of q, k, v against the torch split at PCC 0.9999 (the emulator is held to exact equality:
  the op copies). The interleaved-input form and the validation rules are from the device op
  (``nlp_create_qkv_heads_decode_device_operation.cpp``).
* ``tests/ttnn/unit_tests/operations/transformers/test_indexed_fused_update_cache.py``: K and V rows written at
  physical rows (``page * rows_per_page + row``, no page table), caches ``(1, 2, 128, 64)`` and ``(4, 2, 64, 64)``,
  9 packed rows at ``[1, 3, 31, 32, 33, 63, 64, -1, total_rows]`` (several rows share a page; -1 and out of range
  are skipped), replicated over a 2-device mesh; exact equality with the reference (and the op's golden); its
  validation cases (bf8 cache, uint32 or TILE indices, fewer indices than rows, mismatched shapes, unaligned
  pages, more than 256 rows).
* ttnn's layernorm device op (``layernorm_device_operation.cpp``): rms_norm rejects a HEIGHT_SHARDED input.
* rotary_embedding_llama: op docstring (cos/sin ``[1, 1 or nh, S, dh]``, decode mode) and the per-user decode
  transformation matrix form (one 32x32 tile per user).
* ``qwen36.testing.conformance_tt_tests`` (cases named ``tt_file:...``): three files restated whole,
  ``test_rotary_embedding_hf.py`` (the ``out_sharded`` grid, fp32, padded cos/sin in decode),
  ``test_indexed_fused_update_cache.py`` and ``test_sparse_matmul_indexed.py``; that module lists its sources.
"""

from __future__ import annotations

import math
import traceback

import torch

from . import conformance_tt_tests
from .conformance_common import Case, _dev, _expect_rejected, _one, pcc  # noqa: F401  (re-exported)

SRC_PAGED_MASK = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_paged_cache_mask.py"
SRC_FILL = "tt-metal tests/ttnn/unit_tests/operations/transformers/repro_paged_fill_cache_pagetable_row_hang.py"
SRC_SPEC = "tt-metal tests/ttnn/unit_tests/operations/sdpa/test_sdpa_decode_spec_multi_pos.py"
SRC_GDN = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_fused_recurrent_gdn_golden.py"
SRC_CHUNK = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_gdn_state_inplace.py"
SRC_AG = "tt-metal tests/nightly/t3000/ccl/test_minimal_all_gather_async.py"
SRC_DOC = "ttnn 0.81.1 op docstring"
SRC_FUSED_UPDATE = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_paged_fused_update_cache.py"
SRC_ROPE_HF = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_rotary_embedding_hf_decode_baseline.py"
SRC_CREATE_HEADS = "tt-metal tests/tt_eager/python_api_testing/unit_testing/misc/test_nlp_create_qkv_heads_decode.py"
SRC_CREATE_HEADS_HOST = ("tt-metal ttnn/cpp/ttnn/operations/experimental/transformer/nlp_create_qkv_heads_decode/"
                         "nlp_create_qkv_heads_decode.cpp (host wrapper)")
SRC_INDEXED_UPDATE = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_indexed_fused_update_cache.py"
SRC_LAYERNORM_OP = "tt-metal ttnn/cpp/ttnn/operations/normalization/layernorm/device/layernorm_device_operation.cpp"
SRC_SPARSE = "tt-metal tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul.py"


# ---- paged caches -----------------------------------------------------------------------------------------
def _update_mesh_coords(ttnn, mesh):
    n = mesh.get_num_devices()
    bsz, nh, seq, dim = 16 * n, 1, 32, 128
    g = torch.Generator().manual_seed(0)
    inp = torch.ones(1, bsz, nh, dim)
    idx = torch.randint(0, seq, (bsz,), generator=g, dtype=torch.int32)
    cache = _dev(ttnn, mesh, torch.zeros(bsz, nh, seq, dim), mapper=ttnn.ShardTensorToMesh(mesh, 0))
    x = _dev(ttnn, mesh, inp, mapper=ttnn.ShardTensorToMesh(mesh, 1))
    pos = ttnn.from_torch(idx, dtype=ttnn.int32, device=mesh, mesh_mapper=ttnn.ShardTensorToMesh(mesh, 0))
    chosen = {ttnn.MeshCoordinate(0, n - 1)}  # only the last device updates
    ttnn.experimental.paged_update_cache(cache, x, update_idxs_tensor=pos, mesh_coords=chosen)
    got = ttnn.to_torch(cache, mesh_composer=ttnn.ConcatMeshToTensor(mesh, 0)).float()
    want = torch.zeros(bsz, nh, seq, dim)
    per = bsz // n
    for b in range((n - 1) * per, n * per):
        want[b, :, int(idx[b])] = inp[0, b]
    assert torch.equal(got, want), "cache differs from the reference (exact)"


def _fill_batch_idx(dtype_name):
    def run(ttnn, mesh):
        dtype = getattr(ttnn, dtype_name)
        users, nkv, bs, dh, chunk, total = 4, 8, 32, 64, 128, 24
        per_user = chunk // bs
        pt = (torch.arange(users * per_user, dtype=torch.int32) * 5 % total).reshape(users, per_user)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(users, nkv, chunk, dh, generator=g).bfloat16().float()
        cache = _dev(ttnn, mesh, torch.zeros(total, nkv, bs, dh), dtype)
        x_tt = _dev(ttnn, mesh, x, dtype)
        ttnn.experimental.paged_fill_cache(cache, x_tt, ttnn.from_torch(pt, dtype=ttnn.int32, device=mesh),
                                           batch_idx_tensor=ttnn.from_torch(torch.arange(users, dtype=torch.int32),
                                                                            dtype=ttnn.int32, device=mesh))
        xq = _one(ttnn, mesh, x_tt)  # the input as packed in the cache dtype (a fill is a raw tile copy)
        want = torch.zeros(total, nkv, bs, dh)
        for u in range(users):
            for t in range(chunk):
                want[int(pt[u, t // bs]), :, t % bs] = xq[u, :, t]
        assert torch.equal(_one(ttnn, mesh, cache), want), "filled cache differs (exact)"
    return run


def _fill_skips_negative(ttnn, mesh):
    bs, dh, total = 32, 64, 4
    x = torch.randn(1, 1, 3 * bs, dh).bfloat16().float()
    cache = _dev(ttnn, mesh, torch.zeros(total, 1, bs, dh))
    pt = ttnn.from_torch(torch.tensor([[2, -1, 0, -1]], dtype=torch.int32), dtype=ttnn.int32, device=mesh)
    ttnn.experimental.paged_fill_cache(cache, _dev(ttnn, mesh, x), pt, batch_idx=0)
    got = _one(ttnn, mesh, cache)
    assert torch.equal(got[2, 0], x[0, 0, :bs]) and torch.equal(got[0, 0], x[0, 0, 2 * bs:])
    assert torch.count_nonzero(got[[1, 3]]) == 0, "a -1 page-table entry must not write any block"


# ---- paged SDPA decode, spec_multi_pos_tiles ----------------------------------------------------------------
_SPEC_BS, _SPEC_DH, _SPEC_NQ, _TILE = 64, 256, 6, 32


def _spec_inputs(ttnn, mesh, groups, t, p, seq, seed):
    nblk = seq // _SPEC_BS
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(seq, _SPEC_DH, generator=g).bfloat16().float()
    v = torch.randn(seq, _SPEC_DH, generator=g).bfloat16().float()
    row = torch.randperm(nblk, generator=g).to(torch.int32)
    pk, pv = torch.zeros(nblk, 1, _SPEC_BS, _SPEC_DH), torch.zeros(nblk, 1, _SPEC_BS, _SPEC_DH)
    for vb in range(nblk):
        pk[int(row[vb]), 0] = k[vb * _SPEC_BS:(vb + 1) * _SPEC_BS]
        pv[int(row[vb]), 0] = v[vb * _SPEC_BS:(vb + 1) * _SPEC_BS]
    qh = torch.randn(groups * t, _SPEC_NQ, _SPEC_DH, generator=g).bfloat16().float()
    qb = torch.zeros(1, groups * t, _TILE, _SPEC_DH)
    qb[0, :, :_SPEC_NQ] = qh
    pos = torch.cat([torch.arange(p + 7 * gi, p + 7 * gi + t) for gi in range(groups)]).to(torch.int32)
    return dict(k=k, v=v, row=row, qh=qh, qb=qb, pos=pos, k_tt=_dev(ttnn, mesh, pk), v_tt=_dev(ttnn, mesh, pv),
                pos_tt=ttnn.from_torch(pos, dtype=ttnn.int32, device=mesh))


def _spec_torch(qh, k, v, pos):
    out = torch.zeros(qh.shape)
    for j in range(qh.shape[0]):
        b = int(pos[j])
        s = (qh[j] @ k[:b + 1].T) / math.sqrt(_SPEC_DH)
        out[j] = torch.softmax(s, -1) @ v[:b + 1]
    return out


# Tenstorrent's SPEC_CONFIG k-chunk width per T (the largest that fits Blackhole L1 at head_dim 256): whether the T
# bounds straddle a chunk boundary decides how tightly their test holds spec vs batched.
_SPEC_CHUNK = {4: 128, 7: 64, 11: 32}


def _spec_straddles(t, p, groups=1):
    chunk = _SPEC_CHUNK[t]
    bounds = [(p + 7 * g, p + 7 * g + t - 1) for g in range(groups)]
    return any(lo // chunk != hi // chunk for lo, hi in bounds)


def _spec_case(t, p, seq=2048, groups=1, bit_exact=False):
    """Spec (``spec_multi_pos_tiles``) vs batched paged SDPA decode, compared the way Tenstorrent's
    ``tests/ttnn/unit_tests/operations/sdpa/test_sdpa_decode_spec_multi_pos.py`` does:
    ``test_spec_multi_pos_is_bit_exact`` (p = 1024 at 2k and p = 5000 at 8k, bounds inside one k-chunk, matched
    reduction tree) and ``test_spec_multi_pos_groups_is_bit_exact`` assert bit-identical outputs (``bit_exact=True``
    here); the sweep (``test_spec_multi_pos_matches_batched``, ``_check``) asserts PCC >= 0.9999 (0.999 when the
    bounds straddle a k-chunk boundary) and ``allclose(rtol=2e-2, atol=2e-2)``. Both forms are also held to an fp32
    per-candidate reference at PCC >= 0.99."""
    def run(ttnn, mesh):
        d = _spec_inputs(ttnn, mesh, groups, t, p, seq, seed=t * 1000 + p)
        scale = 1.0 / math.sqrt(_SPEC_DH)
        op = ttnn.transformer.paged_scaled_dot_product_attention_decode
        ref = op(_dev(ttnn, mesh, d["qb"]), d["k_tt"], d["v_tt"],
                 page_table_tensor=ttnn.from_torch(d["row"].unsqueeze(0).repeat(groups * t, 1).contiguous(),
                                                   dtype=ttnn.int32, device=mesh),
                 cur_pos_tensor=d["pos_tt"], scale=scale)
        spec = op(_dev(ttnn, mesh, d["qb"].reshape(1, groups, t * _TILE, _SPEC_DH)), d["k_tt"], d["v_tt"],
                  page_table_tensor=ttnn.from_torch(d["row"].unsqueeze(0).repeat(groups, 1).contiguous(),
                                                    dtype=ttnn.int32, device=mesh),
                  cur_pos_tensor=d["pos_tt"], scale=scale, spec_multi_pos_tiles=t)
        r = _one(ttnn, mesh, ref)
        s = _one(ttnn, mesh, spec)
        assert list(s.shape) == [1, groups, t * _TILE, _SPEC_DH], f"spec output shape {list(s.shape)}"
        r = r[0, :, :_SPEC_NQ]
        s = s.reshape(groups * t, _TILE, _SPEC_DH)[:, :_SPEC_NQ]
        diff = (r - s).abs().max().item()
        if bit_exact:
            assert torch.equal(r, s), f"spec vs batched: not bit-identical, max abs diff {diff:.3g}"
        else:
            bar = 0.999 if _spec_straddles(t, p, groups) else 0.9999
            assert pcc(r, s) >= bar, f"spec vs batched PCC {pcc(r, s):.6f} < {bar}"
            assert torch.allclose(r, s, rtol=2e-2, atol=2e-2), f"spec vs batched max abs diff {diff:.3g}"
        want = _spec_torch(d["qh"], d["k"], d["v"], d["pos"])
        assert pcc(want, s) >= 0.99 and pcc(want, r) >= 0.99, f"PCC vs fp32 {pcc(want, s):.5f}"
    return run


# ---- fused recurrent GDN -----------------------------------------------------------------------------------
_GK = _GV = 128


def _gdn_inputs(b, t, hk, hv, seed, state=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, hk, _GK, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, hk, _GK, generator=g), dim=-1)
    v = torch.randn(b, t, hv, _GV, generator=g)
    gg = -torch.nn.functional.softplus(torch.randn(b, t, hv, generator=g))
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=g))
    s0 = 0.1 * torch.randn(b, hv, _GK, _GV, generator=g) if state else None
    return q, k, v, gg, beta, s0


def _naive_gdn(q, k, v, g, beta, s0):
    """FLA's naive recurrence, GQA by repeat_interleave: S = S*exp(g); S += k (beta (v - S^T k))^T; o = S^T q*scale."""
    b, t, hk, _ = q.shape
    hv = v.shape[2]
    s0 = torch.zeros(b, hv, _GK, _GV) if s0 is None else s0
    return _naive_gdn_dim(q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2), v, g, beta, s0, _GK)


def _gdn_vs_naive(b, t, hk, hv, state):
    def run(ttnn, mesh):
        q, k, v, g, beta, s0 = _gdn_inputs(b, t, hk, hv, seed=b * 10 + t, state=state)
        f = lambda x: _dev(ttnn, mesh, x, ttnn.float32)  # noqa: E731
        o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(
            f(q), f(k), f(v), f(g), f(beta), initial_state=None if s0 is None else f(s0), output_final_state=True)
        ro, rs = _naive_gdn(q, k, v, g, beta, s0)
        assert list(o.shape) == [b, t, hv, _GV] and list(st.shape) == [b, hv, _GK, _GV]
        assert torch.allclose(_one(ttnn, mesh, o), ro, rtol=1e-4, atol=1e-4), "o vs FLA naive"
        assert torch.allclose(_one(ttnn, mesh, st), rs[:, -1], rtol=1e-4, atol=1e-4), "state vs FLA naive"
    return run


def _gdn_multi_token_equals_chained(kd):
    def run(ttnn, mesh):
        t = kd + 1
        q, k, v, g, beta, s0 = _gdn_inputs(2, t, 4, 12, seed=4)
        f = lambda x: _dev(ttnn, mesh, x, ttnn.float32)  # noqa: E731
        op = ttnn.transformer.fused_recurrent_gated_delta_rule
        o, per = op(f(q), f(k), f(v), f(g), f(beta), initial_state=f(s0), output_per_token_state=True)
        _, fin = op(f(q), f(k), f(v), f(g), f(beta), initial_state=f(s0), output_final_state=True)
        assert list(per.shape) == [2, t, 12, _GK, _GV]
        st, oc = s0, []
        for i in range(t):
            sl = lambda x: x[:, i:i + 1].contiguous()  # noqa: E731
            oi, si = op(f(sl(q)), f(sl(k)), f(sl(v)), f(sl(g)), f(sl(beta)), initial_state=f(st),
                        output_final_state=True)
            oc.append(_one(ttnn, mesh, oi))
            st = _one(ttnn, mesh, si)
            assert torch.equal(_one(ttnn, mesh, per)[:, i], st), f"per-token state {i} != chained state"
        assert torch.equal(_one(ttnn, mesh, o), torch.cat(oc, 1)), "multi-token o != chained o"
        assert torch.equal(_one(ttnn, mesh, per)[:, -1], _one(ttnn, mesh, fin)), "last per-token state != final"
    return run


def _gdn_state_selection(ttnn, mesh):
    q, k, v, g, beta, _ = _gdn_inputs(1, 2, 4, 12, seed=5, state=False)
    f = lambda x: _dev(ttnn, mesh, x, ttnn.float32)  # noqa: E731
    op = ttnn.transformer.fused_recurrent_gated_delta_rule
    args = tuple(f(x) for x in (q, k, v, g, beta))
    assert op(*args)[1] is None
    assert list(op(*args, output_final_state=True)[1].shape) == [1, 12, _GK, _GV]
    assert list(op(*args, output_per_token_state=True)[1].shape) == [1, 2, 12, _GK, _GV]
    assert list(op(*args, output_final_state=True, output_per_token_state=True)[1].shape) == [1, 2, 12, _GK, _GV]


def _gdn_ring(ttnn, mesh):
    """Ring mode (op docstring): head h starts from ring block idx[h]; the state after token t lands in block
    t*BH + h, in place; the returned state is the ring itself."""
    b, t, hk, hv = 1, 3, 2, 4
    bh = b * hv
    q, k, v, g, beta, _ = _gdn_inputs(b, t, hk, hv, seed=8, state=False)
    ring0 = 0.1 * torch.randn(t * bh, _GK, _GV)
    idx = torch.tensor([2 * bh + h for h in range(bh)], dtype=torch.int32)  # every head starts from slot 2
    f = lambda x: _dev(ttnn, mesh, x, ttnn.float32)  # noqa: E731
    ring = f(ring0)
    o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(
        f(q), f(k), f(v), f(g), f(beta), initial_state=ring, output_per_token_state=True,
        initial_state_block_idx=ttnn.from_torch(idx, dtype=ttnn.int32, device=mesh))
    assert st is ring, "ring mode returns the ring buffer itself"
    ro, rs = _naive_gdn(q, k, v, g, beta, ring0[idx.long()].reshape(b, hv, _GK, _GV))
    got = _one(ttnn, mesh, ring)
    assert torch.allclose(_one(ttnn, mesh, o), ro, atol=1e-4)
    assert torch.allclose(got, rs.permute(1, 0, 2, 3, 4).reshape(t * bh, _GK, _GV), atol=1e-4)


# ---- chunk GDN ----------------------------------------------------------------------------------------------
def _chunk_flat_head_major(ttnn, mesh):
    hk = hv = 2
    d, t = 64, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, t, hk * d, generator=g).bfloat16().float()
    k = torch.randn(1, t, hk * d, generator=g).bfloat16().float()
    v = (0.5 * torch.randn(1, t, hv * d, generator=g)).bfloat16().float()
    gg = -torch.nn.functional.softplus(torch.randn(1, t, hv, generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(1, t, hv, generator=g))
    s0 = 0.05 * torch.randn(1, hv, d, d, generator=g)
    o, fs = ttnn.transformer.chunk_gated_delta_rule(
        _dev(ttnn, mesh, q), _dev(ttnn, mesh, k), _dev(ttnn, mesh, v), _dev(ttnn, mesh, gg, ttnn.float32),
        _dev(ttnn, mesh, beta, ttnn.float32), initial_state=_dev(ttnn, mesh, s0, ttnn.float32),
        output_final_state=True, chunk_size=32, output_head_major=True)
    assert list(o.shape) == [hv, t, d] and o.layout == ttnn.TILE_LAYOUT and o.dtype == ttnn.float32
    assert list(fs.shape) == [1, hv, d, d] and fs.dtype == ttnn.float32
    qn = torch.nn.functional.normalize(q.reshape(1, t, hk, d), dim=-1, eps=1e-6)
    kn = torch.nn.functional.normalize(k.reshape(1, t, hk, d), dim=-1, eps=1e-6)
    ro, rs = _naive_gdn_dim(qn, kn, v.reshape(1, t, hv, d), gg, beta, s0, d)
    assert pcc(ro[0].permute(1, 0, 2), _one(ttnn, mesh, o)) > 0.9999
    assert pcc(rs[:, -1], _one(ttnn, mesh, fs)) > 0.9999


def _naive_gdn_dim(q, k, v, g, beta, s0, d):
    b, t, h, _ = q.shape
    q = q * d ** -0.5
    s = s0.clone()
    outs, states = [], []
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        u = beta[:, i][..., None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", s, k[:, i]))
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], u)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
        states.append(s.clone())
    return torch.stack(outs, 1), torch.stack(states, 1)


# ---- rotary embedding llama ------------------------------------------------------------------------------------
def _rope_tables(n, dh, seed):
    ang = torch.randn(n, dh // 2, generator=torch.Generator().manual_seed(seed))
    return torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1), ang


def _trans_mat():
    tm = torch.zeros(32, 32)
    tm[torch.arange(0, 32, 2), torch.arange(1, 32, 2)] = 1.0
    tm[torch.arange(1, 32, 2), torch.arange(0, 32, 2)] = -1.0
    return tm


def _rotate_pairs(x, ang):
    xr = x.reshape(*x.shape[:-1], -1, 2)
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([xr[..., 0] * c - xr[..., 1] * s, xr[..., 1] * c + xr[..., 0] * s], -1).reshape(x.shape)


def _rope_prefill(ttnn, mesh):
    nh, s, dh = 4, 64, 64
    cos, sin, ang = _rope_tables(s, dh, 1)
    x = torch.randn(1, nh, s, dh)
    f = lambda y: _dev(ttnn, mesh, y, ttnn.float32)  # noqa: E731
    out = ttnn.experimental.rotary_embedding_llama(f(x), f(cos.reshape(1, 1, s, dh)), f(sin.reshape(1, 1, s, dh)),
                                                   f(_trans_mat().reshape(1, 1, 32, 32)))
    want = _rotate_pairs(x, ang.reshape(1, 1, s, dh // 2))
    assert torch.allclose(_one(ttnn, mesh, out), want, atol=1e-5)


def _rope_decode_per_user(ttnn, mesh):
    b, nh, dh = 4, 8, 64
    cos, sin, ang = _rope_tables(b, dh, 2)
    x = torch.randn(1, b, nh, dh)
    f = lambda y: _dev(ttnn, mesh, y, ttnn.float32)  # noqa: E731
    c = cos.reshape(1, b, 1, dh).expand(1, b, 32, dh).contiguous()
    s = sin.reshape(1, b, 1, dh).expand(1, b, 32, dh).contiguous()
    out = ttnn.experimental.rotary_embedding_llama(f(x), f(c), f(s), f(_trans_mat().repeat(b, 1).reshape(1, 1, b * 32, 32)),
                                                   is_decode_mode=True)
    want = _rotate_pairs(x, ang.reshape(1, b, 1, dh // 2))
    assert torch.allclose(_one(ttnn, mesh, out), want, atol=1e-5)


# ---- paged fused update (K and V in one op) --------------------------------------------------------------------
def _row_shard(ttnn, cores, row, rows_per_core, dh):
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, row), ttnn.CoreCoord(cores - 1, row))})
    return ttnn.create_sharded_memory_config(shape=(rows_per_core, dh), core_grid=grid,
                                             strategy=ttnn.ShardStrategy.HEIGHT,
                                             orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                             use_height_and_width_as_shard_shape=True)


def _fused_update_case(heads, cache_idx, cache_dtype):
    def fn(ttnn, mesh):
        users, dh, bs, seq = 8, 128, 64, 2048
        g = torch.Generator().manual_seed(cache_idx * 31 + heads)
        nb_user = seq // bs
        perm = torch.randperm(users * nb_user, generator=g)
        page_table = torch.argsort(perm).reshape(users, nb_user).int()
        dt = getattr(ttnn, cache_dtype)
        caches, paged, xs = [], [], []
        for _ in range(2):
            c = torch.randn(users, heads, seq, dh, generator=g).bfloat16().float()
            p = c.reshape(users, heads, nb_user, bs, dh).transpose(1, 2).reshape(users * nb_user, heads, bs, dh)[perm]
            caches.append(c)
            paged.append(_dev(ttnn, mesh, p, dt))
            xs.append(torch.randn(1, users, heads, dh, generator=g).bfloat16().float())
        idxs = [cache_idx + 17 * i for i in range(users)]
        if heads == 1:
            idxs[users // 2] = -1
        rm = ttnn.ROW_MAJOR_LAYOUT
        pos = _dev(ttnn, mesh, torch.tensor(idxs, dtype=torch.int32), ttnn.int32, rm)
        pt = _dev(ttnn, mesh, page_table, ttnn.int32, rm)
        ins = [ttnn.to_memory_config(_dev(ttnn, mesh, torch.nn.functional.pad(x, (0, 0, 0, 32 - heads))),
                                     _row_shard(ttnn, users, row, 32, dh)) for row, x in enumerate(xs)]
        ttnn.experimental.paged_fused_update_cache(paged[0], ins[0], paged[1], ins[1], update_idxs_tensor=pos,
                                                   page_table=pt)
        for j in range(2):
            want = caches[j].clone()
            for u, p in enumerate(idxs):
                if p >= 0:
                    want[u, :, p] = xs[j][0, u]
            got = _one(ttnn, mesh, paged[j])[torch.argsort(perm)]
            got = got.reshape(users, nb_user, heads, bs, dh).transpose(1, 2).reshape(users, heads, seq, dh)
            if cache_dtype == "bfloat16":
                assert torch.equal(got, want), f"cache {j + 1} differs"
            else:
                assert pcc(got, want) >= 0.9995, f"cache {j + 1}: PCC {pcc(got, want):.6f}"
    return fn


def _fused_update_rejects_overlap(ttnn, mesh):
    c = _dev(ttnn, mesh, torch.zeros(4, 1, 64, 64))
    x = ttnn.to_memory_config(_dev(ttnn, mesh, torch.zeros(1, 1, 32, 64)), _row_shard(ttnn, 1, 0, 32, 64))
    pos = _dev(ttnn, mesh, torch.tensor([3], dtype=torch.int32), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
    pt = _dev(ttnn, mesh, torch.arange(4, dtype=torch.int32)[None], ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
    try:
        ttnn.experimental.paged_fused_update_cache(c, x, c, x, update_idxs_tensor=pos, page_table=pt)
    except Exception as e:  # noqa: BLE001 - the emulator's EmulatorError or a card's TT_FATAL
        assert "cores" in str(e), str(e)
    else:
        raise AssertionError("K and V inputs on the same cores were accepted (the device op rejects them)")


# ---- rotary embedding hf (rotate_half over the whole head) -------------------------------------------------------
def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _hf_height_sharded(ttnn, rows_per_core, cores, dh):
    return ttnn.create_sharded_memory_config(shape=(rows_per_core, dh), core_grid=ttnn.CoreGrid(y=1, x=cores),
                                             strategy=ttnn.ShardStrategy.HEIGHT,
                                             orientation=ttnn.ShardOrientation.ROW_MAJOR,
                                             use_height_and_width_as_shard_shape=True)


def _hf_ckc(ttnn):
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=True)


def _rope_hf_decode(b, nh, dh):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(b * 7919 + nh * 6247 + dh)
        x = torch.randn(1, b, nh, dh, generator=g).bfloat16().float()
        cos = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
        sin = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
        xs = ttnn.to_memory_config(_dev(ttnn, mesh, x), _hf_height_sharded(ttnn, -(-nh // 32) * 32, b, dh))
        cs = ttnn.to_memory_config(_dev(ttnn, mesh, cos), _hf_height_sharded(ttnn, 32, b, dh))
        ss = ttnn.to_memory_config(_dev(ttnn, mesh, sin), _hf_height_sharded(ttnn, 32, b, dh))
        out = ttnn.experimental.rotary_embedding_hf(xs, cs, ss, is_decode_mode=True, compute_kernel_config=_hf_ckc(ttnn))
        want = x * cos + _rotate_half(x) * sin
        got = _one(ttnn, mesh, out)
        assert list(got.shape) == [1, b, nh, dh], got.shape
        assert pcc(got, want) >= 0.9999, f"PCC {pcc(got, want):.6f}"
    return fn


def _rope_hf_prefill(ttnn, mesh):
    nh, s, dh = 4, 64, 128
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, nh, s, dh, generator=g).bfloat16().float()
    cos, sin = (torch.randn(1, 1, s, dh, generator=g).bfloat16().float() for _ in range(2))
    out = ttnn.experimental.rotary_embedding_hf(_dev(ttnn, mesh, x), _dev(ttnn, mesh, cos), _dev(ttnn, mesh, sin),
                                               is_decode_mode=False, compute_kernel_config=_hf_ckc(ttnn))
    want = x * cos + _rotate_half(x) * sin
    assert pcc(_one(ttnn, mesh, out), want) >= 0.9999


def _rope_hf_decode_cos_sin_via_interleaved_to_sharded(ttnn, mesh):
    """cos/sin built interleaved in DRAM and moved with ``ttnn.interleaved_to_sharded(t, mem_config)`` onto one
    [32, head_dim] shard per user core, as that test's ``_decode_hf_cos_sin_sharded`` does; the decode op must see
    them sharded. ``sharded_to_interleaved`` brings a tensor back (interleaved, same values)."""
    b, nh, dh = 8, 8, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, b, nh, dh, generator=g).bfloat16().float()
    cos = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
    sin = torch.randn(1, b, 1, dh, generator=g).bfloat16().float()
    xs = ttnn.to_memory_config(_dev(ttnn, mesh, x), _hf_height_sharded(ttnn, 32, b, dh))
    mc = _hf_height_sharded(ttnn, 32, b, dh)
    cs, ss = (ttnn.interleaved_to_sharded(_dev(ttnn, mesh, t), mc) for t in (cos, sin))
    assert cs.memory_config().memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, cs.memory_config()
    assert cs.memory_config().shard_spec == mc.shard_spec, cs.memory_config()
    out = ttnn.experimental.rotary_embedding_hf(xs, cs, ss, is_decode_mode=True, compute_kernel_config=_hf_ckc(ttnn))
    want = x * cos + _rotate_half(x) * sin
    assert pcc(_one(ttnn, mesh, out), want) >= 0.9999, f"PCC {pcc(_one(ttnn, mesh, out), want):.6f}"
    back = ttnn.sharded_to_interleaved(cs, ttnn.DRAM_MEMORY_CONFIG)
    assert not back.memory_config().is_sharded() and torch.equal(_one(ttnn, mesh, back), cos)


def _rope_hf_decode_needs_height_shard(ttnn, mesh):
    x = _dev(ttnn, mesh, torch.randn(1, 1, 8, 64))
    cs = ttnn.to_memory_config(_dev(ttnn, mesh, torch.randn(1, 1, 1, 64)), _hf_height_sharded(ttnn, 32, 1, 64))
    try:
        ttnn.experimental.rotary_embedding_hf(x, cs, cs, is_decode_mode=True)
    except Exception as e:  # noqa: BLE001 - the emulator's EmulatorError or a card's TT_FATAL
        assert "HEIGHT_SHARDED" in str(e), str(e)
    else:
        raise AssertionError("an interleaved decode-mode input was accepted (the device op rejects it)")


# ---- decode head split -----------------------------------------------------------------------------------------
def _height_grid(ttnn, cores):
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(7, max(0, (cores - 1) // 8)))})
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1,
                             ttnn.ShardSpec(grid, [32, 32], ttnn.ShardOrientation.ROW_MAJOR))


def _create_heads_case(nq, nkv, dh, b, sharded, overlap=True):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(nq * 131 + nkv * 17 + dh + b)
        x = torch.rand(1, 1, b, (nq + 2 * nkv) * dh, generator=g).bfloat16().float()
        t = _dev(ttnn, mesh, x)
        if sharded:  # min_width_shard: one [32, 32] shard per core, 8 cores a row
            cores = (nq + 2 * nkv) * dh // 32
            grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0),
                                                     ttnn.CoreCoord(min(cores, 8) - 1, max(1, cores // 8) - 1))})
            t = ttnn.to_memory_config(t, ttnn.MemoryConfig(
                ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                ttnn.ShardSpec(grid, [32, 32], ttnn.ShardOrientation.ROW_MAJOR)))
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            t, num_heads=nq, num_kv_heads=nkv, overlap_qk_coregrid=overlap,
            memory_config=_height_grid(ttnn, b if overlap else 2 * b + 1))
        heads = x.reshape(1, b, nq + 2 * nkv, dh)
        for name, out, want in (("q", q, heads[:, :, :nq]), ("k", k, heads[:, :, nq:nq + nkv]),
                                ("v", v, heads[:, :, nq + nkv:])):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, f"{name}: {mc}"
            assert list(mc.shard_spec.shape) == [-(-nq // 32) * 32, dh] and mc.shard_spec.grid.num_cores() == b, \
                f"{name}: shard spec {mc.shard_spec}"
            assert torch.equal(_one(ttnn, mesh, out), want), f"{name} differs from the torch split (exact copy)"
        q_cores = {(c.x, c.y) for c in ttnn.corerange_to_cores(q.memory_config().shard_spec.grid)}
        k_cores = {(c.x, c.y) for c in ttnn.corerange_to_cores(k.memory_config().shard_spec.grid)}
        assert (q_cores == k_cores) if overlap else not (q_cores & k_cores), (sorted(q_cores), sorted(k_cores))
    return fn


def _create_heads_rejects(ttnn, mesh):
    t = _dev(ttnn, mesh, torch.zeros(1, 1, 4, 12 * 64))
    split = ttnn.experimental.nlp_create_qkv_heads_decode
    _expect_rejected(lambda: split(t, num_heads=7, num_kv_heads=2, memory_config=_height_grid(ttnn, 4)),
                     "heads")
    _expect_rejected(lambda: split(t, num_heads=2, num_kv_heads=5, memory_config=_height_grid(ttnn, 4)),
                     "num_kv_heads")
    sharded = ttnn.to_memory_config(t, ttnn.MemoryConfig(  # [32, 96] shards of 64-wide heads: partial heads
        ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
        ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(7, 0))}), [32, 96],
                       ttnn.ShardOrientation.ROW_MAJOR)))
    _expect_rejected(lambda: split(sharded, num_heads=8, num_kv_heads=2, overlap_qk_coregrid=False,
                                   memory_config=_height_grid(ttnn, 4)), "whole heads")


def _create_heads_host_wrapper_configs(ttnn, mesh):
    """What the host wrapper makes of the arguments: an interleaved input runs with ``overlap_qk_coregrid`` forced
    to true (q and k share cores), and the outputs are L1 HEIGHT_SHARDED whatever ``memory_config`` says (its shard
    grid is used when it has one, else the whole compute grid)."""
    x = torch.rand(1, 1, 4, 12 * 64).bfloat16().float()
    t = _dev(ttnn, mesh, x)
    split = ttnn.experimental.nlp_create_qkv_heads_decode
    q, k, v = split(t, num_heads=8, num_kv_heads=2, overlap_qk_coregrid=False, memory_config=_height_grid(ttnn, 16))
    assert q.memory_config().shard_spec.grid == k.memory_config().shard_spec.grid, "interleaved: q and k share cores"
    for cfg in (ttnn.DRAM_MEMORY_CONFIG, None):
        q, k, v = split(t, num_heads=8, num_kv_heads=2, memory_config=cfg)
        for out in (q, k, v):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED, mc
            assert mc.buffer_type == ttnn.BufferType.L1 and mc.shard_spec.grid.num_cores() == 4, mc
        assert torch.equal(_one(ttnn, mesh, q), x.reshape(1, 4, 12, 64)[:, :, :8]), "q differs (exact copy)"


def _create_heads_tt_form(nq, nkv, dh, b, width):
    """The call exactly as Tenstorrent's test makes it: the host tensor moved to the device with
    ``Tensor.to(device=..., mem_config=WIDTH_SHARDED L1)`` (``max_width_shard``: one core holds every row and the whole
    width; ``min_width_shard``: [32, 32] shards over 8-wide rows of cores) and the output config
    ``MemoryConfig(HEIGHT_SHARDED, L1)`` without a shard spec (the op derives the grid: B cores from (0, 0))."""
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(nq * 7 + nkv * 3 + dh + b)
        x = torch.rand(1, 1, b, (nq + 2 * nkv) * dh, generator=g).bfloat16().float()
        if width == "max":
            grid, shard = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}), \
                [-(-b // 32) * 32, x.shape[-1]]
        else:
            cores = x.shape[-1] // 32
            cx = min(cores, 8)
            grid, shard = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0),
                                                            ttnn.CoreCoord(cx - 1, max(1, cores // cx) - 1))}), [32, 32]
        in_mc = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.L1,
                                  ttnn.ShardSpec(grid, shard, ttnn.ShardOrientation.ROW_MAJOR))
        host = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
        t = host.to(device=mesh, mem_config=in_mc)
        assert t.memory_config().memory_layout == ttnn.TensorMemoryLayout.WIDTH_SHARDED, "Tensor.to dropped mem_config"
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            t, num_heads=nq, num_kv_heads=nkv,
            memory_config=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1))
        heads = x.reshape(1, b, nq + 2 * nkv, dh)
        for name, out, want in (("q", q, heads[:, :, :nq]), ("k", k, heads[:, :, nq:nq + nkv]),
                                ("v", v, heads[:, :, nq + nkv:])):
            mc = out.memory_config()
            assert mc.memory_layout == ttnn.TensorMemoryLayout.HEIGHT_SHARDED and mc.buffer_type == ttnn.BufferType.L1
            assert mc.shard_spec.grid.num_cores() == b, f"{name}: {mc.shard_spec}"
            got = _one(ttnn, mesh, out)
            assert pcc(got, want) >= 0.9999 and torch.equal(got, want), f"{name} differs from the torch split"
    return fn


def _rms_norm_rejects_height_sharded(ttnn, mesh):
    x = ttnn.to_memory_config(_dev(ttnn, mesh, torch.randn(1, 1, 8, 64)), _hf_height_sharded(ttnn, 32, 1, 64))
    _expect_rejected(lambda: ttnn.rms_norm(x, epsilon=1e-6), "HEIGHT_SHARDED")


# ---- indexed fused cache update -----------------------------------------------------------------------------------
def _indexed_ref(cache, packed, positions):
    want = cache.clone()
    bs = cache.shape[2]
    for r, p in enumerate(positions):
        if 0 <= p < cache.shape[0] * bs:
            want[p // bs, :, p % bs, :] = packed[0, :, r, :]
    return want


def _indexed_dev(ttnn, mesh, x, dtype=None, layout=None):
    return _dev(ttnn, mesh, x, dtype, layout, mapper=ttnn.ReplicateTensorToMesh(mesh))


def _indexed_update_case(cache_shape):
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(17 + cache_shape[0])
        total = cache_shape[0] * cache_shape[2]
        positions = [1, 3, 31, 32, 33, 63, 64, -1, total]
        caches = [torch.zeros(cache_shape).bfloat16().float() for _ in range(2)]
        ins = [torch.randn(1, cache_shape[1], 9, cache_shape[3], generator=g).bfloat16().float() for _ in range(2)]
        dc = [_indexed_dev(ttnn, mesh, c) for c in caches]
        idx = _indexed_dev(ttnn, mesh, torch.tensor([positions], dtype=torch.int32), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
        o1, o2 = ttnn.experimental.indexed_fused_update_cache(dc[0], _indexed_dev(ttnn, mesh, ins[0]), dc[1],
                                                              _indexed_dev(ttnn, mesh, ins[1]), idx)
        assert o1 is dc[0] and o2 is dc[1], "the op updates the caches in place and returns them"
        import ttnn as real

        golden = real.get_golden_function(real.experimental.indexed_fused_update_cache)(
            caches[0], ins[0], caches[1], ins[1], torch.tensor([positions], dtype=torch.int32))
        for j in range(2):
            want = _indexed_ref(caches[j], ins[j], positions)
            assert torch.equal(golden[j], want), "the op's golden disagrees with the test's reference"
            for sh in ttnn.get_device_tensors(dc[j]):
                assert torch.equal(ttnn.to_torch(sh).float(), want), f"cache {j + 1} differs (exact)"
    return fn


def _indexed_update_rejects(ttnn, mesh):
    def call(c1=None, i1=None, c2=None, i2=None, idx=None):
        z = lambda shape, dt=None: _indexed_dev(ttnn, mesh, torch.zeros(shape), dt)  # noqa: E731
        pos = _indexed_dev(ttnn, mesh, torch.arange(4, dtype=torch.int32).reshape(1, -1), ttnn.int32,
                           ttnn.ROW_MAJOR_LAYOUT)
        return lambda: ttnn.experimental.indexed_fused_update_cache(
            c1 or z((2, 2, 64, 64)), i1 or z((1, 2, 4, 64)), c2 or z((2, 2, 64, 64)), i2 or z((1, 2, 4, 64)),
            idx or pos)
    z = lambda shape, dt=None, layout=None: _indexed_dev(ttnn, mesh, torch.zeros(shape), dt, layout)  # noqa: E731
    ar = lambda n: torch.arange(n, dtype=torch.int32).reshape(1, -1)  # noqa: E731
    _expect_rejected(call(c1=z((2, 2, 64, 64), ttnn.bfloat8_b)), "BFLOAT16")
    _expect_rejected(call(idx=z((1, 4), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)), "INT32")
    _expect_rejected(call(idx=_indexed_dev(ttnn, mesh, ar(4), ttnn.int32, ttnn.TILE_LAYOUT)), "ROW_MAJOR")
    _expect_rejected(call(idx=_indexed_dev(ttnn, mesh, ar(3), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)), "fewer entries")
    _expect_rejected(call(c2=z((3, 2, 64, 64))), "identical shapes")
    _expect_rejected(call(i2=z((1, 2, 5, 64))), "identical shapes")
    _expect_rejected(call(c1=z((2, 2, 33, 64)), c2=z((2, 2, 33, 64))), "tile aligned")
    _expect_rejected(call(i1=z((1, 2, 257, 64)), i2=z((1, 2, 257, 64)),
                          idx=_indexed_dev(ttnn, mesh, ar(257), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)), "256")
    if mesh.get_num_devices() > 1:
        sharded = _dev(ttnn, mesh, torch.arange(8, dtype=torch.int32).reshape(1, -1), ttnn.int32,
                       ttnn.ROW_MAJOR_LAYOUT, mapper=ttnn.ShardTensorToMesh(mesh, dim=1))
        _expect_rejected(call(idx=sharded), "replicated")


def _indexed_mapped(ttnn, mesh, x, dim, dtype=None, layout=None):
    mapper = ttnn.ReplicateTensorToMesh(mesh) if dim is None else ttnn.ShardTensorToMesh(mesh, dim=dim)
    return _dev(ttnn, mesh, x, dtype, layout, mapper=mapper)


def _indexed_tensor_parallel(dim, cache_shape):
    """test_indexed_fused_update_cache_tensor_parallel_mesh: caches and inputs sharded over heads (dim 1) or head_dim
    (dim 3), indices replicated; exact against the reference, and the caches keep their mesh topology."""
    def fn(ttnn, mesh):
        g = torch.Generator().manual_seed(37 + dim)
        positions = [0, 31, 32, 63, 64, -1]
        caches = [torch.zeros(cache_shape) for _ in range(2)]
        ins = [torch.randn(1, cache_shape[1], 6, cache_shape[3], generator=g).bfloat16().float() for _ in range(2)]
        dc = [_indexed_mapped(ttnn, mesh, c, dim) for c in caches]
        topo = [c.tensor_topology() for c in dc]
        idx = _indexed_mapped(ttnn, mesh, torch.tensor([positions], dtype=torch.int32), None, ttnn.int32,
                              ttnn.ROW_MAJOR_LAYOUT)
        outs = ttnn.experimental.indexed_fused_update_cache(dc[0], _indexed_mapped(ttnn, mesh, ins[0], dim), dc[1],
                                                            _indexed_mapped(ttnn, mesh, ins[1], dim), idx)
        for j in range(2):
            assert outs[j].tensor_topology() == topo[j], "the cache's mesh topology changed"
            got = ttnn.to_torch(outs[j], mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=dim)).float()
            assert torch.equal(got, _indexed_ref(caches[j], ins[j], positions)), f"cache {j + 1} differs (exact)"
    return fn


def _indexed_mesh_rejects(ttnn, mesh):
    """test_indexed_fused_update_cache_rejects_mesh_row_sharding / _rejects_mismatched_data_topology, plus page
    sharding (dim 0; the docstring: "Cache page/row sharding ... not supported")."""
    rep = _indexed_mapped(ttnn, mesh, torch.arange(8, dtype=torch.int32).reshape(1, -1), None, ttnn.int32,
                          ttnn.ROW_MAJOR_LAYOUT)
    op = ttnn.experimental.indexed_fused_update_cache
    z = lambda shape, dim: _indexed_mapped(ttnn, mesh, torch.zeros(shape), dim)  # noqa: E731
    for dim, cache in ((2, (2, 2, 128, 64)), (0, (2, 2, 64, 64))):
        inp = (1, 2, 8, 64)
        _expect_rejected(lambda: op(z(cache, dim), z(inp, 2 if dim == 2 else None), z(cache, dim),
                                    z(inp, 2 if dim == 2 else None), rep), "cache page/row sharding")
    _expect_rejected(lambda: op(z((2, 4, 64, 128), 1), z((1, 4, 8, 128), 3), z((2, 4, 64, 128), 1),
                                z((1, 4, 8, 128), 3), rep), "identical mesh topology")


def _indexed_tile_and_alias_rejects(ttnn, mesh):
    """test_indexed_fused_update_cache_validation's custom/transposed tile cases and
    test_indexed_fused_update_cache_rejects_bound_tensor_alias_before_cache_insert."""
    op = ttnn.experimental.indexed_fused_update_cache
    dev = lambda shape, tile=None: ttnn.from_torch(torch.zeros(shape), dtype=ttnn.bfloat16,  # noqa: E731
                                                   layout=ttnn.TILE_LAYOUT, device=mesh, tile=tile)
    pos = _dev(ttnn, mesh, torch.arange(4, dtype=torch.int32).reshape(1, -1), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
    c, i = (2, 2, 64, 64), (1, 2, 4, 64)
    _expect_rejected(lambda: op(dev(c, ttnn.Tile((16, 32))), dev(i), dev(c), dev(i), pos),
                     "cache_tensor1 must use the default non-transposed 32x32 tile")
    _expect_rejected(lambda: op(dev(c), dev(i), dev(c), dev(i, ttnn.Tile((32, 32), transpose_tile=True)), pos),
                     "input_tensor2 must use the default non-transposed 32x32 tile")
    c1, i1 = dev(c), dev(i)
    _expect_rejected(lambda: op(c1, i1, c1, dev(i), pos), "cache_tensor1 and cache_tensor2 must not alias")
    _expect_rejected(lambda: op(c1, i1, dev(c), i1, pos), "input_tensor1 and input_tensor2 must not alias")


# ---- collectives ---------------------------------------------------------------------------------------------
def _sems(ttnn, mesh, n):
    cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))})
    return [ttnn.create_global_semaphore(mesh, cores, 0) for _ in range(n)]


def _ag_async_traced(ttnn, mesh):
    n = mesh.get_num_devices()
    full = torch.randn(1, 1, 128, 512).bfloat16().float()
    x = _dev(ttnn, mesh, full, mapper=ttnn.ShardTensorToMesh(mesh, 3))
    sems = _sems(ttnn, mesh, 2)
    tid = ttnn.begin_trace_capture(mesh, cq_id=0)
    out = ttnn.experimental.all_gather_async(x, dim=3, cluster_axis=1, mesh_device=mesh, topology=ttnn.Topology.Linear,
                                             multi_device_global_semaphore=sems)
    ttnn.end_trace_capture(mesh, tid, cq_id=0)
    for _ in range(3):
        ttnn.execute_trace(mesh, tid, cq_id=0)
        for i, d in enumerate(ttnn.get_device_tensors(out)):
            assert torch.equal(ttnn.to_torch(d).float(), full), f"device {i} of {n} differs after replay"
    ttnn.release_trace(mesh, tid)


def _rs_async(ttnn, mesh):
    n = mesh.get_num_devices()
    parts = torch.randn(n, 1, 64, 256).bfloat16().float()
    x = _dev(ttnn, mesh, parts, mapper=ttnn.ShardTensorToMesh(mesh, 0))
    out = ttnn.experimental.reduce_scatter_minimal_async(x, dim=3, multi_device_global_semaphore=_sems(ttnn, mesh, 3),
                                                         cluster_axis=1, topology=ttnn.Topology.Linear)
    total = parts.sum(0, keepdim=True)
    chunks = torch.chunk(total, n, dim=3)
    for i, d in enumerate(ttnn.get_device_tensors(out)):
        assert pcc(ttnn.to_torch(d).float(), chunks[i]) > 0.9999, f"device {i} reduce-scatter chunk"


# ---- sparse_matmul ----------------------------------------------------------------------------------------
def _sparse_pc(ttnn):
    # the program config the Tenstorrent test passes (1D multicast, mcast_in0); the emulator only checks its kind
    return ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(4, 4), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=1, per_core_N=1, fuse_batch=False, fused_activation=None,
        mcast_in0=True)


def _sparsity(g, shape):
    s = torch.rand(shape, generator=g) + 0.1
    zero = torch.randperm(s.numel(), generator=g)[: int(torch.randint(0, s.numel(), (1,), generator=g))]
    s.view(-1)[zero] = 0.0
    return s.to(torch.bfloat16)


def _sparse_dense_a(ttnn, mesh):
    g = torch.Generator().manual_seed(0)
    m, k, n, e, b, s = 16, 128, 512, 8, 1, 4
    in0, in1 = torch.randn(b, s, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, b, s, e))
    nnz = int((sp != 0).sum())
    out = ttnn.sparse_matmul(_dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1, ttnn.bfloat8_b),
                             sparsity=_dev(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=nnz,
                             is_input_a_sparse=False, is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = _one(ttnn, mesh, out)
    assert list(y.shape) == [b, s, 1, e, m, n]
    for si in range(s):
        for ei in range(e):
            if sp[0, 0, si, ei] == 0:
                assert not y[0, si, 0, ei].any(), "a skipped block must be zero-filled"
            else:
                assert pcc(y[0, si, 0, ei], in0[0, si] @ in1[0, ei]) >= 0.999, f"block ({si}, {ei})"


def _sparse_both(ttnn, mesh):
    g = torch.Generator().manual_seed(1)
    m, k, n, e = 16, 128, 512, 32
    in0, in1 = torch.randn(1, e, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, 1, e))
    out = ttnn.sparse_matmul(_dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1, ttnn.bfloat8_b),
                             sparsity=_dev(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=int((sp != 0).sum()),
                             is_input_a_sparse=True, is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = _one(ttnn, mesh, out)
    for ei in range(e):
        if sp[0, 0, 0, ei] != 0:
            assert pcc(y[0, ei], in0[0, ei] @ in1[0, ei]) >= 0.999, f"expert {ei}"


def _sparse_indexed(ttnn, mesh):
    g = torch.Generator().manual_seed(2)
    m, k, n, e = 4, 128, 256, 16
    in0, in1 = torch.randn(1, 1, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    ids = torch.tensor([[[[11, 3, 3, 0, 15]]]], dtype=torch.int32)  # unsorted, with a repeat
    counts = mesh.counters.total if hasattr(mesh, "counters") else None
    before = None if counts is None else counts.bytes_read_total
    out = ttnn.sparse_matmul(_dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1),
                             sparsity=_dev(ttnn, mesh, torch.ones(1, 1, 1, e), layout=ttnn.ROW_MAJOR_LAYOUT),
                             indices=_dev(ttnn, mesh, ids, ttnn.uint16, ttnn.ROW_MAJOR_LAYOUT),
                             is_input_b_sparse=True, program_config=_sparse_pc(ttnn))
    y = _one(ttnn, mesh, out)
    assert list(y.shape) == [1, 1, 1, 5, m, n]
    for slot, ei in enumerate(ids.reshape(-1).tolist()):
        assert pcc(y[0, 0, 0, slot], in0[0, 0] @ in1[0, ei]) >= 0.999, f"slot {slot} (group {ei})"
    if counts is not None:  # the reader fetches the 5 listed groups of b, not all 16
        got = counts.bytes_read_total - before
        assert 5 * k * n * 2 <= got < 5 * k * n * 2 + 32 * k * 2 + 1024, f"indexed mode read {got} bytes"


def _sparse_a_docstring_form(ttnn, mesh):
    """Sparse A / dense B as the modes table gives it: a [A, E, M, K], b [1, E, K, N], sparsity [1, 1, A, E],
    output [A, E, M, N], block (a, e) computed where sparsity[0, 0, a, e] != 0 and zero-filled elsewhere (every
    active block at PCC >= 0.999, the test's bar). Tenstorrent's test_sparse_matmul_inputA_with_nnz calls another
    form (a [B, S, M, K] with S != E, output [B, S, 1, E, M, N]) that contradicts the table: refused by name."""
    g = torch.Generator().manual_seed(3)
    a_n, e, m, k, n = 2, 4, 32, 64, 64
    in0, in1 = torch.randn(a_n, e, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, a_n, e))
    out = ttnn.sparse_matmul(_dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1),
                             sparsity=_dev(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT), nnz=int((sp != 0).sum()),
                             is_input_a_sparse=True, is_input_b_sparse=False, program_config=_sparse_pc(ttnn))
    y = _one(ttnn, mesh, out)
    assert list(y.shape) == [a_n, e, m, n], y.shape
    for ai in range(a_n):
        for ei in range(e):
            if sp[0, 0, ai, ei] == 0:
                assert not y[ai, ei].any(), "a skipped block must be zero-filled"
            else:
                assert pcc(y[ai, ei], in0[ai, ei] @ in1[0, ei]) >= 0.999, f"block ({ai}, {ei})"
    tt_form = _dev(ttnn, mesh, torch.randn(1, 3, m, k, generator=g))  # S = 3 != E = 4
    _expect_rejected(lambda: ttnn.sparse_matmul(
        tt_form, _dev(ttnn, mesh, in1), sparsity=_dev(ttnn, mesh, torch.ones(1, 1, 1, 3), layout=ttnn.ROW_MAJOR_LAYOUT),
        nnz=3 * e, is_input_a_sparse=True, is_input_b_sparse=False, program_config=_sparse_pc(ttnn)),
        "input_tensor_a must be")


def _sparse_compact_output(ttnn, mesh):
    """The docstring's compact optional_output_tensor [1, nnz, M, N]: the nnz computed blocks packed in sparsity scan
    order, skipped ones omitted (dense A / sparse B)."""
    g = torch.Generator().manual_seed(4)
    m, k, n, e, s = 32, 64, 64, 4, 3
    in0, in1 = torch.randn(1, s, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    sp = _sparsity(g, (1, 1, s, e))
    nnz = int((sp != 0).sum())
    a_t, b_t = _dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1)
    sp_t = _dev(ttnn, mesh, sp, layout=ttnn.ROW_MAJOR_LAYOUT)
    full = _one(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, sparsity=sp_t, nnz=nnz, program_config=_sparse_pc(ttnn)))
    out = _dev(ttnn, mesh, torch.zeros(1, nnz, m, n))
    ttnn.sparse_matmul(a_t, b_t, sparsity=sp_t, nnz=nnz, program_config=_sparse_pc(ttnn), optional_output_tensor=out)
    want = full.reshape(-1, m, n)[(sp.reshape(-1) != 0)]
    assert torch.equal(_one(ttnn, mesh, out)[0], want), "compact output != the active blocks in scan order"


def _sparse_indexed_bias(ttnn, mesh):
    """The docstring's indexed-mode ``bias``: a BFLOAT16 TILE [E, 32, N] tensor, row 0 of group indices[i]'s tile
    row added to slot i before packing (bf16 precision)."""
    g = torch.Generator().manual_seed(6)
    m, k, n, e = 4, 64, 64, 6
    in0, in1 = torch.randn(1, 1, m, k, generator=g), torch.randn(1, e, k, n, generator=g)
    bias = torch.randn(e, 32, n, generator=g).bfloat16().float()
    ids = torch.tensor([[[[5, 0, 2]]]], dtype=torch.int32)
    kw = dict(sparsity=_dev(ttnn, mesh, torch.ones(1, 1, 1, e), layout=ttnn.ROW_MAJOR_LAYOUT),
              indices=_dev(ttnn, mesh, ids, ttnn.uint16, ttnn.ROW_MAJOR_LAYOUT), program_config=_sparse_pc(ttnn))
    a_t, b_t = _dev(ttnn, mesh, in0), _dev(ttnn, mesh, in1)
    y = _one(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, bias=_dev(ttnn, mesh, bias), **kw))
    y0 = _one(ttnn, mesh, ttnn.sparse_matmul(a_t, b_t, **kw))
    for slot, ei in enumerate(ids.reshape(-1).tolist()):
        assert pcc(y[0, 0, 0, slot], in0[0, 0] @ in1[0, ei] + bias[ei, 0]) >= 0.999, f"slot {slot}"
        assert (y[0, 0, 0, slot] - y0[0, 0, 0, slot] - bias[ei, 0]).abs().max() <= 0.0625, "bias not added"
    _expect_rejected(lambda: ttnn.sparse_matmul(a_t, b_t, sparsity=kw["sparsity"], nnz=e, program_config=_sparse_pc(
        ttnn), bias=_dev(ttnn, mesh, bias)), "bias requires indices")


CASES: list[Case] = [
    Case("sparse_matmul", "dense_a_nnz_8experts_bf8", SRC_SPARSE, _sparse_dense_a),
    Case("sparse_matmul", "both_sparse_batched_32experts_bf8", SRC_SPARSE, _sparse_both),
    Case("sparse_matmul", "indexed_gather_compact_unsorted_repeat", SRC_DOC, _sparse_indexed),
    Case("sparse_matmul", "sparse_a_docstring_form_and_named_shape_check", SRC_SPARSE, _sparse_a_docstring_form),
    Case("sparse_matmul", "compact_nnz_output", SRC_DOC, _sparse_compact_output),
    Case("sparse_matmul", "indexed_bias", SRC_DOC, _sparse_indexed_bias),
    Case("sparse_matmul", "tile_16x32_inputs_and_output_tile", SRC_SPARSE,
         skip="the test runs 16x32 in0/output tiles; the emulator computes 32x32 tiles only and refuses other tiles "
              "by name (from_torch(tile=...) is recorded, sparse_matmul(output_tile=...) refused)"),
    Case("sparse_matmul", "without_nnz_blackhole", SRC_SPARSE,
         skip="the Tenstorrent test skips it on Blackhole (sparsity broadcast semaphores); same numerics as the nnz "
              "case here"),
    Case("experimental.paged_update_cache", "mesh_coords_subset_bf16_32x1x32x128", SRC_PAGED_MASK, _update_mesh_coords),
    Case("experimental.paged_fill_cache", "batch_idx_tensor_8kv_bf16", SRC_FILL, _fill_batch_idx("bfloat16")),
    Case("experimental.paged_fill_cache", "batch_idx_tensor_8kv_bfloat8_b", SRC_FILL, _fill_batch_idx("bfloat8_b")),
    Case("experimental.paged_fill_cache", "negative_page_table_entry_skipped",
         "vLLM pads page tables with -1; the fill must skip such entries (kernel contract)", _fill_skips_negative),
    Case("experimental.paged_fill_cache", "wide_page_table_row_hang",
         SRC_FILL, skip="a device hang on a 16 KB page-table row with bfloat8_b is a kernel timing fault; the "
                        "emulator has no NOC reads to wedge"),
    Case("experimental.paged_update_cache", "height_sharded_input_core_grid", SRC_PAGED_MASK,
         skip="sharding specs (height-sharded input over B cores) are recorded, not validated"),
]
for _t in (4, 7, 11):
    for _p in (1024, 1025, 1054, 1055, 1023, 1021):
        CASES.append(Case("transformer.paged_scaled_dot_product_attention_decode",
                          f"spec_T{_t}_s2k_p{_p}{'_bit_exact' if _p == 1024 else ''}", SRC_SPEC,
                          _spec_case(_t, _p, bit_exact=_p == 1024), ci=(_t, _p) in ((4, 1021), (11, 1024))))
    CASES.append(Case("transformer.paged_scaled_dot_product_attention_decode", f"spec_T{_t}_s8k_p5000_bit_exact",
                      SRC_SPEC, _spec_case(_t, 5000, seq=8192, bit_exact=True), ci=False))
CASES += [
    Case("transformer.paged_scaled_dot_product_attention_decode", "spec_T4_two_groups_s2k_p1024_bit_exact", SRC_SPEC,
         _spec_case(4, 1024, groups=2, bit_exact=True), ci=False),
    Case("transformer.paged_scaled_dot_product_attention_decode", "spec_wide_reduction_split_and_dynamic_chunk",
         SRC_SPEC,
         skip="those tests give spec and batched different flash-decode reduction trees (max_cores_per_head_batch=64, "
              "k_chunk_size=0) and check that spec is no less accurate; the emulator has no reduction tree (one "
              "softmax per row), so the two forms cannot differ the way they do on cards"),
    Case("transformer.paged_scaled_dot_product_attention_decode", "spec_32k_context", SRC_SPEC,
         skip="same semantics as the 2k cases; 32k KV at head_dim 256 is kept out of CI for time"),
]
for _b, _t in ((1, 1), (2, 4)):
    for _st in (True, False):
        CASES.append(Case("transformer.fused_recurrent_gated_delta_rule",
                          f"vs_fla_naive_B{_b}_T{_t}_{'state' if _st else 'nostate'}_hk4_hv12", SRC_GDN,
                          _gdn_vs_naive(_b, _t, 4, 12, _st), ci=_b == 1))
CASES += [
    Case("transformer.fused_recurrent_gated_delta_rule", "multi_token_equals_chained_K3", SRC_GDN,
         _gdn_multi_token_equals_chained(3)),
    Case("transformer.fused_recurrent_gated_delta_rule", "state_output_selection", SRC_GDN, _gdn_state_selection),
    Case("transformer.fused_recurrent_gated_delta_rule", "ring_mode_block_idx_in_place", SRC_DOC, _gdn_ring),
    Case("transformer.fused_recurrent_gated_delta_rule", "per_key_decay_rank4_g", SRC_GDN,
         skip="per-key decay (rank-4 g) is exercised on the golden in that test; whether the 0.81.1 device op "
              "accepts it was not established, and the model passes g [B, T, HV]"),
    Case("transformer.chunk_gated_delta_rule", "flat_qkv_inkernel_l2norm_head_major", SRC_CHUNK,
         _chunk_flat_head_major),
    Case("transformer.chunk_gated_delta_rule", "final_state_output_in_place", SRC_CHUNK,
         skip="final_state_output is not a keyword of the 0.81.1 op (newer tt-metal)"),
    Case("transformer.chunk_gated_delta_rule", "program_config_paths_fused_phased_mono", SRC_CHUNK,
         skip="program configs select device paths whose arithmetic differs only in accumulation order; the "
              "emulator computes one fp32 result for all (mono's bf16 output dtype is modelled)"),
    Case("experimental.rotary_embedding_llama", "prefill_shared_cos_sin", SRC_DOC, _rope_prefill),
    Case("experimental.rotary_embedding_hf", "prefill_4h_64s_128d_interleaved", SRC_ROPE_HF, _rope_hf_prefill),
    Case("experimental.rotary_embedding_hf", "decode_rejects_interleaved_input", SRC_ROPE_HF,
         _rope_hf_decode_needs_height_shard),
    Case("experimental.rotary_embedding_llama", "decode_per_user_trans_mat", SRC_DOC, _rope_decode_per_user),
    Case("experimental.all_gather_async", "traced_1x1x128x512_dim3_linear", SRC_AG, _ag_async_traced),
    Case("experimental.reduce_scatter_minimal_async", "dim3_linear", SRC_AG, _rs_async),
    Case("experimental.all_gather_async", "num_links_chunks_per_sync_perf_knobs", SRC_AG,
         skip="links/workers/buffers per channel change timing only; no link model beyond the cost model"),
]

for _h, _idx, _cdt in ((1, 0, "bfloat16"), (8, 1057, "bfloat16"), (1, 127, "bfloat8_b"), (8, 1, "bfloat8_b")):
    CASES.append(Case("experimental.paged_fused_update_cache", f"paged_8u_{_h}h_idx{_idx}_{_cdt}", SRC_FUSED_UPDATE,
                      _fused_update_case(_h, _idx, _cdt), ci=(_h, _idx) in ((1, 0), (8, 1))))
CASES.append(Case("experimental.paged_fused_update_cache", "rejects_overlapping_input_cores", SRC_FUSED_UPDATE,
                  _fused_update_rejects_overlap))
for _b, _nh, _dh in ((1, 32, 128), (8, 8, 128), (32, 8, 128), (1, 32, 64), (8, 16, 64), (32, 8, 64), (4, 12, 256)):
    CASES.append(Case("experimental.rotary_embedding_hf", f"decode_b{_b}_h{_nh}_d{_dh}",
                      SRC_ROPE_HF if _dh != 256 else f"{SRC_ROPE_HF} (form; head_dim 256 is this model's)",
                      _rope_hf_decode(_b, _nh, _dh), ci=(_b, _nh, _dh) in ((8, 8, 128), (4, 12, 256))))
for _nq, _nkv, _dh, _b, _sh, _ov in ((8, 1, 128, 8, True, True), (8, 1, 128, 8, True, False),
                                     (16, 2, 64, 32, True, True), (8, 4, 96, 32, True, True),
                                     (12, 2, 256, 1, False, True), (12, 2, 256, 8, False, True)):
    CASES.append(Case("experimental.nlp_create_qkv_heads_decode",
                      f"{'min_width_shard' if _sh else 'interleaved'}_q{_nq}_kv{_nkv}_d{_dh}_b{_b}"
                      f"{'' if _ov else '_no_overlap'}",
                      SRC_CREATE_HEADS if _sh else f"{SRC_CREATE_HEADS} (interleaved input: the device op's factory)",
                      _create_heads_case(_nq, _nkv, _dh, _b, _sh, _ov),
                      ci=(_nq, _b, _ov) in ((8, 8, False), (12, 1, True))))
for _nq, _nkv, _dh, _b in ((8, 1, 128, 32), (8, 4, 96, 32), (16, 2, 64, 32), (8, 1, 128, 16), (8, 1, 128, 8)):
    CASES.append(Case("experimental.nlp_create_qkv_heads_decode", f"max_width_shard_q{_nq}_kv{_nkv}_d{_dh}_b{_b}",
                      SRC_CREATE_HEADS, _create_heads_tt_form(_nq, _nkv, _dh, _b, "max"),
                      ci=(_nq, _nkv, _b) == (8, 1, 8)))
for _nq, _nkv, _dh in ((8, 1, 128), (8, 4, 96), (16, 2, 64)):
    CASES.append(Case("experimental.nlp_create_qkv_heads_decode",
                      f"min_width_shard_unspecified_grid_q{_nq}_kv{_nkv}_d{_dh}", SRC_CREATE_HEADS,
                      _create_heads_tt_form(_nq, _nkv, _dh, 32, "min"), ci=_dh == 96))
CASES += [
    Case("experimental.nlp_create_qkv_heads_decode", "rejects_bad_heads_and_partial_head_shards", SRC_CREATE_HEADS,
         _create_heads_rejects),
    Case("experimental.nlp_create_qkv_heads_decode", "host_wrapper_forces_overlap_and_l1_height_output",
         SRC_CREATE_HEADS_HOST, _create_heads_host_wrapper_configs),
    Case("experimental.nlp_create_qkv_heads_decode", "batch_offset_slice_size_subcoregrids", SRC_CREATE_HEADS,
         skip="batch_offset / slice_size and sub-core-grid inputs select users of a larger batch; the model splits "
              "its own rows, so these forms are not emulated (they fail fast)"),
    Case("rms_norm", "rejects_height_sharded_input", SRC_LAYERNORM_OP, _rms_norm_rejects_height_sharded),
]
for _shape in ((1, 2, 128, 64), (4, 2, 64, 64)):
    CASES.append(Case("experimental.indexed_fused_update_cache", f"scatter_rows_{'x'.join(map(str, _shape))}",
                      SRC_INDEXED_UPDATE, _indexed_update_case(_shape)))
CASES.append(Case("experimental.indexed_fused_update_cache", "validation", SRC_INDEXED_UPDATE,
                  _indexed_update_rejects))
for _dim, _shape in ((1, (2, 4, 64, 64)), (3, (2, 2, 64, 128))):
    CASES.append(Case("experimental.indexed_fused_update_cache", f"tensor_parallel_mesh_dim{_dim}", SRC_INDEXED_UPDATE,
                      _indexed_tensor_parallel(_dim, _shape), ci=_dim == 1))
CASES += [
    Case("experimental.indexed_fused_update_cache", "rejects_cache_page_row_mesh_sharding_and_mixed_topology",
         SRC_INDEXED_UPDATE, _indexed_mesh_rejects),
    Case("experimental.indexed_fused_update_cache", "rejects_custom_transposed_tiles_and_aliasing", SRC_INDEXED_UPDATE,
         _indexed_tile_and_alias_rejects),
    Case("experimental.rotary_embedding_hf", "decode_cos_sin_via_interleaved_to_sharded", SRC_ROPE_HF,
         _rope_hf_decode_cos_sin_via_interleaved_to_sharded),
]
# Tenstorrent's op test files restated case by case, in their own modules (qwen36.testing.conformance_tt_tests)
CASES += conformance_tt_tests.cases(Case)

# the KDA convolution / gated norm and the fused GDN ops live in their own module
from .conformance_kda import CASES as _KDA_CASES  # noqa: E402
from .conformance_gdn_chunk import CASES as _GDN_CHUNK_CASES  # noqa: E402
from .conformance_kda_scan import CASES as _KDA_SCAN_CASES  # noqa: E402

CASES += _KDA_CASES + _GDN_CHUNK_CASES + _KDA_SCAN_CASES


def run_cases(ctx, only_ops: set[str] | None = None, ci_only: bool = False) -> list[dict]:
    """Run the cases on ``ctx`` (an emulated MeshContext); one result dict per case."""
    if not getattr(ctx, "is_emulated", False):
        raise RuntimeError("the conformance cases check the emulator; open an emulated-* device")
    out = []
    for c in CASES:
        if (only_ops and c.op not in only_ops) or (ci_only and not c.ci):
            continue
        r = {"op": c.op, "case": c.name, "source": c.source}
        if c.skip:
            r.update(status="skipped", reason=c.skip)
        else:
            try:
                c.fn(ctx.ttnn, ctx.mesh_device)
                r["status"] = "passed"
            except Exception as e:  # a failing case is a finding: record it, keep going
                r.update(status="failed", reason=f"{type(e).__name__}: {e}",
                         where=traceback.format_exc(limit=3).splitlines()[-3:])
        out.append(r)
    return out


def summarize(results: list[dict]) -> dict:
    per: dict[str, dict] = {}
    for r in results:
        d = per.setdefault(r["op"], {"passed": 0, "failed": 0, "skipped": 0})
        d[r["status"]] += 1
    return per
