"""Hand-emulated ops vs independent torch formulations (collectives, caches, decode SDPA incl. spec
multi-position, rotary llama, ring-mode GDN)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import EmulatorError  # noqa: E402


@pytest.fixture(scope="module", params=[2, 4], ids=["1x2", "1x4"])
def ctx(request):
    name = {2: "emulated-p150x2", 4: "emulated-p150x4"}[request.param]
    with open_mesh(name, trace_region_size=1_000_000) as c:
        yield c


@pytest.fixture(scope="module")
def ctx1():
    with open_mesh("emulated-p150", trace_region_size=1_000_000) as c:
        yield c


def _per_device(ttnn, t):
    return [ttnn.to_torch(s) for s in ttnn.get_device_tensors(t)]


def _dev_tensor(ttnn, mesh, shards, dtype, layout=None):
    """Device tensor whose device i holds shards[i] (built via ShardTensorToMesh on a stacked tensor)."""
    return ttnn.from_torch(torch.cat(list(shards), dim=0), dtype=dtype, layout=layout or ttnn.TILE_LAYOUT,
                           device=mesh, mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=0))


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def test_collectives_match_torch(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    torch.manual_seed(0)
    parts = [torch.randn(1, 1, 32, 64) for _ in range(n)]
    x = _dev_tensor(ttnn, mesh, parts, ttnn.float32)
    # all_gather along the last dim: every device gets cat(parts)
    ag = ttnn.all_gather(x, dim=3)
    for d in _per_device(ttnn, ag):
        assert torch.equal(d, torch.cat(parts, dim=3))
    # all_reduce: sum on every device
    ar = ttnn.all_reduce(x)
    total = sum(p.double() for p in parts)
    for d in _per_device(ttnn, ar):
        assert torch.allclose(d.double(), total, atol=1e-5)
    # reduce_scatter over dim 3: device i keeps chunk i of the sum
    rs = ttnn.reduce_scatter(x, dim=3)
    for i, d in enumerate(_per_device(ttnn, rs)):
        assert torch.allclose(d.double(), torch.chunk(total, n, dim=3)[i], atol=1e-5)
    # cluster_axis=0 on a (1, N) mesh: groups of one device -> identity
    same = ttnn.all_gather(x, dim=3, cluster_axis=0)
    for i, d in enumerate(_per_device(ttnn, same)):
        assert torch.equal(d, parts[i])


def test_async_collectives_match_sync(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    parts = [torch.randn(1, 1, 32, 32 * n) for _ in range(n)]
    x = _dev_tensor(ttnn, mesh, parts, ttnn.bfloat16)
    cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(1, 1))})
    sems = [ttnn.create_global_semaphore(mesh, cores, 0) for _ in range(3)]
    ag = ttnn.experimental.all_gather_async(x, dim=3, multi_device_global_semaphore=sems[:2],
                                            topology=ttnn.Topology.Linear, num_links=1)
    ref = ttnn.all_gather(x, dim=3)
    for a, b in zip(_per_device(ttnn, ag), _per_device(ttnn, ref)):
        assert torch.equal(a, b)
    rs = ttnn.experimental.reduce_scatter_minimal_async(x, persistent_output_buffers=None, dim=3,
                                                        multi_device_global_semaphore=sems,
                                                        topology=ttnn.Topology.Linear)
    ref = ttnn.reduce_scatter(x, dim=3)
    for a, b in zip(_per_device(ttnn, rs), _per_device(ttnn, ref)):
        assert torch.equal(a, b)
    total = sum(p.bfloat16().double() for p in parts)
    for d in _per_device(ttnn, ref):
        assert d.dtype == torch.bfloat16
    assert torch.allclose(_per_device(ttnn, ref)[0].double(), torch.chunk(total, n, dim=3)[0], rtol=1e-2, atol=1e-2)


def test_collective_accounting(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    x = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    with ctx.counters.scope("ccl") as c:
        ttnn.all_gather(x, dim=3)
        ttnn.all_reduce(x)
    shard = 2 * 2048  # two bf16 tiles
    # a synchronous all_reduce is reduce_scatter + all_gather on cards: 2 programs, 2 collectives (programs.py)
    assert c.collectives == 3 and c.programs == 3 and c.per_op["ttnn.all_reduce"] == 1
    assert c.collective_bytes == (n - 1) * shard + 2 * (n - 1) * shard // n
    assert c.bytes_read["BFLOAT16"] == 2 * shard


# ---------------------------------------------------------------------------------------------
# KV caches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "bfloat8_b"])
def test_paged_update_cache(ctx1, cache_dtype):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    torch.manual_seed(1)
    num_blocks, nkv, bs, dh, users, blocks_per_user = 8, 2, 32, 64, 3, 2
    cache0 = torch.randn(num_blocks, nkv, bs, dh)
    page_table = torch.randperm(num_blocks)[: users * blocks_per_user].reshape(users, blocks_per_user).int()
    pos = torch.tensor([5, 40, -1], dtype=torch.int32)  # user 2 skipped
    new = torch.randn(1, users, nkv, dh)
    dt = getattr(ttnn, cache_dtype)
    cache = ttnn.from_torch(cache0, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh)
    before = ttnn.to_torch(cache).float()
    inp = ttnn.from_torch(new, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    out = ttnn.experimental.paged_update_cache(
        cache, inp, update_idxs_tensor=ttnn.from_torch(pos, dtype=ttnn.int32, device=mesh),
        page_table=ttnn.from_torch(page_table, dtype=ttnn.int32, device=mesh))
    assert out is cache
    got = ttnn.to_torch(cache).float()
    expect = before.clone()
    for b in range(users):
        p = int(pos[b])
        if p < 0:
            continue
        blk = int(page_table[b, p // bs])
        row = new[0, b].bfloat16().float()
        if cache_dtype == "bfloat8_b":  # each token row is packed on its own (exponents shared per 16 datums)
            import ttnn as real

            row = real.to_torch(real.from_torch(row.reshape(-1, dh), dtype=real.bfloat8_b,
                                                layout=real.TILE_LAYOUT)).reshape(nkv, dh)
        expect[blk, :, p % bs, :] = row
    assert torch.equal(got, expect)
    with pytest.raises(EmulatorError, match="FLOAT32 or BFLOAT16"):
        ttnn.experimental.paged_update_cache(
            cache, ttnn.from_torch(new, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh),
            update_idxs_tensor=ttnn.from_torch(pos, dtype=ttnn.int32, device=mesh),
            page_table=ttnn.from_torch(page_table, dtype=ttnn.int32, device=mesh))


def test_paged_fill_cache(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    num_blocks, nkv, bs, dh = 6, 1, 32, 32
    cache0 = torch.zeros(num_blocks, nkv, bs, dh)
    pt = torch.tensor([[4, 1, 3], [0, 2, 5]], dtype=torch.int32)
    prompt = torch.randn(1, nkv, 70, dh)
    cache = ttnn.from_torch(cache0, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    x = ttnn.from_torch(prompt, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    ttnn.experimental.paged_fill_cache(cache, x, ttnn.from_torch(pt, dtype=ttnn.int32, device=mesh), batch_idx=1)
    got = ttnn.to_torch(cache)
    expect = cache0.bfloat16().clone()
    for t in range(70):
        expect[int(pt[1, t // bs]), :, t % bs, :] = prompt[0, :, t, :].bfloat16()
    assert torch.equal(got, expect)
    with pytest.raises(EmulatorError, match="must match the cache dtype"):
        ttnn.experimental.paged_fill_cache(
            cache, ttnn.from_torch(prompt, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh),
            ttnn.from_torch(pt, dtype=ttnn.int32, device=mesh), batch_idx=1)


def test_update_and_fill_cache_non_paged(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    users, nkv, s, dh = 2, 1, 64, 32
    cache = ttnn.from_torch(torch.zeros(users, nkv, s, dh), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    prompt = torch.randn(1, nkv, 32, dh)
    ttnn.fill_cache(cache, ttnn.from_torch(prompt, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh), 1)
    tok = torch.randn(1, users, nkv, dh)
    ttnn.update_cache(cache, ttnn.from_torch(tok, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh), 40)
    got = ttnn.to_torch(cache)
    expect = torch.zeros(users, nkv, s, dh, dtype=torch.bfloat16)
    expect[1, :, :32] = prompt[0].bfloat16()
    expect[:, :, 40] = tok[0].bfloat16()
    assert torch.equal(got, expect)


# ---------------------------------------------------------------------------------------------
# decode attention
# ---------------------------------------------------------------------------------------------
def _ref_attention(q_rows, k_seq, v_seq, bound, scale):
    """q_rows [R, dh] against k/v [S, dh] with an inclusive causal bound, fp64."""
    s = (q_rows.double() @ k_seq.double().T) * scale
    s[:, bound + 1:] = float("-inf")
    return torch.softmax(s, -1) @ v_seq.double()


def _paged(ttnn, mesh, k, v, bs, seed=0):
    """k/v [B, nkv, S, dh] -> shuffled paged caches + page table."""
    b, nkv, s, dh = k.shape
    nblk = s // bs
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(b * nblk, generator=g)
    pt = perm.reshape(b, nblk).int()
    kp = torch.zeros(b * nblk, nkv, bs, dh)
    vp = torch.zeros_like(kp)
    for u in range(b):
        for j in range(nblk):
            kp[pt[u, j]] = k[u, :, j * bs:(j + 1) * bs]
            vp[pt[u, j]] = v[u, :, j * bs:(j + 1) * bs]
    mk = lambda x: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    return mk(kp), mk(vp), ttnn.from_torch(pt, dtype=ttnn.int32, device=mesh)


def test_paged_sdpa_decode_gqa(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    torch.manual_seed(2)
    users, nh, nkv, s, dh, bs = 3, 4, 2, 128, 64, 32
    k = torch.randn(users, nkv, s, dh).bfloat16().float()
    v = torch.randn(users, nkv, s, dh).bfloat16().float()
    q = torch.randn(1, users, nh, dh).bfloat16().float()
    pos = torch.tensor([0, 77, -1], dtype=torch.int32)
    kt, vt, ptt = _paged(ttnn, mesh, k, v, bs)
    qt = ttnn.from_torch(q, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    scale = dh ** -0.5
    out = ttnn.transformer.paged_scaled_dot_product_attention_decode(
        qt, kt, vt, ptt, cur_pos_tensor=ttnn.from_torch(pos, dtype=ttnn.int32, device=mesh), scale=scale)
    got = ttnn.to_torch(out).double()
    assert list(got.shape) == [1, users, nh, dh]
    for u in range(users):
        if pos[u] < 0:
            assert torch.all(got[0, u] == 0)
            continue
        for h in range(nh):
            ref = _ref_attention(q[0, u, h:h + 1], k[u, h // (nh // nkv)], v[u, h // (nh // nkv)], int(pos[u]), scale)
            assert torch.allclose(got[0, u, h], ref[0], atol=2e-2, rtol=2e-2), (u, h)
    # the golden (per-user loop, run on fp32 copies) agrees with the vectorised emulation
    import ttnn as real

    golden = real.transformer.paged_scaled_dot_product_attention_decode.golden_function
    gk = ttnn.to_torch(kt).float()
    gv = ttnn.to_torch(vt).float()
    g_out = golden(q.float(), gk, gv, ttnn.to_torch(ptt).long(), cur_pos_tensor=pos.long(), scale=scale)
    assert torch.allclose(got[0, :2].float(), g_out[0, :2].float(), atol=1e-2)


@pytest.mark.parametrize("t_cand,p", [(3, 40), (4, 62)])
def test_paged_sdpa_decode_spec_multi_pos(ctx1, t_cand, p):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    torch.manual_seed(3)
    groups, nkv, s, dh, bs, heads = 2, 1, 128, 64, 32, 6
    k = torch.randn(1, nkv, s, dh).bfloat16().float().expand(groups, -1, -1, -1).contiguous()
    v = torch.randn(1, nkv, s, dh).bfloat16().float().expand(groups, -1, -1, -1).contiguous()
    q_heads = torch.randn(groups, t_cand, heads, dh).bfloat16().float()
    q = torch.zeros(1, groups, t_cand * 32, dh)
    for g in range(groups):
        for j in range(t_cand):
            q[0, g, 32 * j: 32 * j + heads] = q_heads[g, j]
    bounds = torch.tensor([[p + g * 3 + j for j in range(t_cand)] for g in range(groups)], dtype=torch.int32)
    kt, vt, ptt = _paged(ttnn, mesh, k, v, bs, seed=5)
    scale = dh ** -0.5
    out = ttnn.transformer.paged_scaled_dot_product_attention_decode(
        ttnn.from_torch(q, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh), kt, vt, ptt,
        cur_pos_tensor=ttnn.from_torch(bounds.reshape(-1), dtype=ttnn.int32, device=mesh), scale=scale,
        spec_multi_pos_tiles=t_cand)
    got = ttnn.to_torch(out).double()
    assert list(got.shape) == [1, groups, t_cand * 32, dh]
    for g in range(groups):
        for j in range(t_cand):
            ref = _ref_attention(q_heads[g, j], k[g, 0], v[g, 0], int(bounds[g, j]), scale)
            assert torch.allclose(got[0, g, 32 * j: 32 * j + heads], ref, atol=2e-2, rtol=2e-2), (g, j)
    # candidate j is NOT the same as candidate j+1 (the per-row bound really differs)
    assert not torch.allclose(got[0, 0, 0:heads], got[0, 0, 32:32 + heads])
    # equivalence with the legacy form: T pseudo-users with aliased page tables and bounds p..p+T-1
    legacy_q = q[0, 0].reshape(t_cand, 32, dh).unsqueeze(0)
    pt_rows = ttnn.to_torch(ptt)[0:1].repeat(t_cand, 1)
    legacy = ttnn.transformer.paged_scaled_dot_product_attention_decode(
        ttnn.from_torch(legacy_q, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh), kt, vt,
        ttnn.from_torch(pt_rows, dtype=ttnn.int32, device=mesh),
        cur_pos_tensor=ttnn.from_torch(bounds[0], dtype=ttnn.int32, device=mesh), scale=scale)
    assert torch.equal(ttnn.to_torch(legacy).reshape(t_cand * 32, dh), ttnn.to_torch(out)[0, 0])


def test_spec_multi_pos_contract_checks(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    k = torch.randn(1, 2, 64, 32)
    kt, vt, ptt = _paged(ttnn, mesh, k, k, 32)
    q = ttnn.from_torch(torch.randn(1, 1, 64, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    pos = ttnn.from_torch(torch.tensor([5, 6], dtype=torch.int32), dtype=ttnn.int32, device=mesh)
    with pytest.raises(EmulatorError, match="one KV head"):
        ttnn.transformer.paged_scaled_dot_product_attention_decode(q, kt, vt, ptt, cur_pos_tensor=pos,
                                                                   spec_multi_pos_tiles=2)
    k1 = torch.randn(1, 1, 64, 32)
    kt, vt, ptt = _paged(ttnn, mesh, k1, k1, 32)
    bad = ttnn.from_torch(torch.tensor([9, 6], dtype=torch.int32), dtype=ttnn.int32, device=mesh)
    with pytest.raises(EmulatorError, match="ascend"):
        ttnn.transformer.paged_scaled_dot_product_attention_decode(q, kt, vt, ptt, cur_pos_tensor=bad,
                                                                   spec_multi_pos_tiles=2)
    with pytest.raises(EmulatorError, match="expects q"):
        ttnn.transformer.paged_scaled_dot_product_attention_decode(q, kt, vt, ptt, cur_pos_tensor=pos,
                                                                   spec_multi_pos_tiles=3)


def test_sdpa_decode_non_paged(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    users, nh, nkv, s, dh = 2, 2, 1, 64, 32
    k = torch.randn(users, nkv, s, dh).bfloat16().float()
    v = torch.randn(users, nkv, s, dh).bfloat16().float()
    q = torch.randn(1, users, nh, dh).bfloat16().float()
    mk = lambda x: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    out = ttnn.transformer.scaled_dot_product_attention_decode(mk(q), mk(k), mk(v), cur_pos=[10, 63], scale=0.25)
    got = ttnn.to_torch(out).double()
    for u, p in enumerate([10, 63]):
        ref = _ref_attention(q[0, u], k[u, 0], v[u, 0], p, 0.25)
        assert torch.allclose(got[0, u], ref, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# rotary embedding (llama)
# ---------------------------------------------------------------------------------------------
def _trans_mat():
    m = torch.zeros(1, 1, 32, 32)
    m[..., torch.arange(0, 32, 2), torch.arange(1, 32, 2)] = 1.0
    m[..., torch.arange(1, 32, 2), torch.arange(0, 32, 2)] = -1.0
    return m


def _rope_pairs(x, cos_half, sin_half):
    """Independent form: rotate adjacent pairs (x0, x1) by angle theta (cos/sin per pair)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos_half - x1 * sin_half
    out[..., 1::2] = x1 * cos_half + x0 * sin_half
    return out


def test_rotary_embedding_llama_prefill_and_decode(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    torch.manual_seed(4)
    nh, s, dh = 2, 32, 64
    theta = torch.rand(s, dh // 2) * math.pi
    cos = theta.cos().repeat_interleave(2, dim=-1)
    sin = theta.sin().repeat_interleave(2, dim=-1)
    x = torch.randn(1, nh, s, dh)
    mk = lambda t, dt=ttnn.float32: ttnn.from_torch(t, dtype=dt, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    tm = mk(_trans_mat())
    out = ttnn.experimental.rotary_embedding_llama(mk(x), mk(cos.view(1, 1, s, dh)), mk(sin.view(1, 1, s, dh)), tm)
    ref = _rope_pairs(x.double(), theta.cos().double(), theta.sin().double())
    assert torch.allclose(ttnn.to_torch(out).double(), ref, atol=1e-5)
    # decode: x [1, B, nh, dh], cos/sin [1, B, 32, dh] (one position per user, rows replicated)
    users = 3
    xd = torch.randn(1, users, nh, dh)
    th = torch.rand(users, dh // 2)
    cd = th.cos().repeat_interleave(2, -1).view(1, users, 1, dh).expand(1, users, 32, dh).contiguous()
    sd = th.sin().repeat_interleave(2, -1).view(1, users, 1, dh).expand(1, users, 32, dh).contiguous()
    outd = ttnn.experimental.rotary_embedding_llama(mk(xd), mk(cd), mk(sd), tm, is_decode_mode=True)
    refd = _rope_pairs(xd.double(), th.cos().double().view(1, users, 1, -1), th.sin().double().view(1, users, 1, -1))
    assert torch.allclose(ttnn.to_torch(outd).double(), refd, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet: plain and ring mode
# ---------------------------------------------------------------------------------------------
def _gdn_reference(q, k, v, g, beta, h0, scale):
    """Independent fp64 recurrence: per token, decay, delta-rule write, read with q. Returns o, states."""
    b_sz, t_len, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    rep = hv // h
    state = h0.double().clone()  # [B, HV, K, V]
    o = torch.zeros(b_sz, t_len, hv, vd, dtype=torch.float64)
    states = torch.zeros(b_sz, t_len, hv, kd, vd, dtype=torch.float64)
    for b in range(b_sz):
        for head in range(hv):
            kh = head // rep
            s = state[b, head]
            for t in range(t_len):
                s = s * math.exp(float(g[b, t, head]))
                kt = k[b, t, kh].double()
                pred = kt @ s  # [V]
                delta = (v[b, t, head].double() - pred) * float(beta[b, t, head])
                s = s + torch.outer(kt, delta)
                o[b, t, head] = (q[b, t, kh].double() * scale) @ s
                states[b, t, head] = s
    return o, states


def _gdn_inputs(b_sz, t_len, h, hv, kd, vd, seed):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b_sz, t_len, h, kd, generator=g_), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b_sz, t_len, h, kd, generator=g_), dim=-1)
    v = torch.randn(b_sz, t_len, hv, vd, generator=g_)
    g = -torch.rand(b_sz, t_len, hv, generator=g_) * 0.5
    beta = torch.sigmoid(torch.randn(b_sz, t_len, hv, generator=g_))
    return q, k, v, g, beta


def test_gdn_plain_matches_reference(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    b_sz, t_len, h, hv, kd, vd = 1, 3, 1, 2, 32, 32
    q, k, v, g, beta = _gdn_inputs(b_sz, t_len, h, hv, kd, vd, seed=7)
    h0 = torch.randn(b_sz, hv, kd, vd) * 0.1
    f32 = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(
        f32(q), f32(k), f32(v), f32(g), f32(beta), scale=kd ** -0.5, initial_state=f32(h0), output_final_state=True)
    ro, rstates = _gdn_reference(q, k, v, g, beta, h0, kd ** -0.5)
    assert st.dtype == ttnn.float32
    assert torch.allclose(ttnn.to_torch(o).double(), ro, atol=1e-5)
    assert torch.allclose(ttnn.to_torch(st).double(), rstates[:, -1], atol=1e-5)


def test_gdn_ring_mode_k_plus_one(ctx1):
    """K=2 drafts -> T=3 verify rows; ring [T*BH, K, V]; heads start from the committed slot of the last step."""
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    b_sz, t_len, h, hv, kd, vd = 2, 3, 1, 2, 32, 32
    bh = b_sz * hv
    q, k, v, g, beta = _gdn_inputs(b_sz, t_len, h, hv, kd, vd, seed=8)
    ring0 = torch.randn(t_len * bh, kd, vd) * 0.1
    accepted_slot = torch.tensor([2, 0, 1, 2])  # per head: which token slot of the previous step was accepted
    idx = (accepted_slot * bh + torch.arange(bh)).int()
    f32 = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    ring = f32(ring0)
    idx_t = ttnn.from_torch(idx, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(
        f32(q), f32(k), f32(v), f32(g), f32(beta), scale=kd ** -0.5, initial_state=ring,
        initial_state_block_idx=idx_t, output_per_token_state=True)
    assert st is ring  # same buffer, not a copy
    h0 = ring0[idx.long()].reshape(b_sz, hv, kd, vd)
    ro, rstates = _gdn_reference(q, k, v, g, beta, h0, kd ** -0.5)
    assert torch.allclose(ttnn.to_torch(o).double(), ro, atol=1e-5)
    got_ring = ttnn.to_torch(ring).double()
    for t in range(t_len):
        for b in range(b_sz):
            for head in range(hv):
                assert torch.allclose(got_ring[t * bh + b * hv + head], rstates[b, t, head], atol=1e-5), (t, b, head)
    # contract checks
    with pytest.raises(EmulatorError, match="idx\\[h\\] % BH == h"):
        bad = ttnn.from_torch(torch.tensor([1, 0, 2, 3], dtype=torch.int32), dtype=ttnn.uint32, device=mesh)
        ttnn.transformer.fused_recurrent_gated_delta_rule(
            f32(q), f32(k), f32(v), f32(g), f32(beta), initial_state=ring, initial_state_block_idx=bad,
            output_per_token_state=True)
    with pytest.raises(EmulatorError, match="output_per_token_state=True"):
        ttnn.transformer.fused_recurrent_gated_delta_rule(
            f32(q), f32(k), f32(v), f32(g), f32(beta), initial_state=ring, initial_state_block_idx=idx_t)
    with pytest.raises(EmulatorError, match="FLOAT32 in TILE"):
        ttnn.transformer.fused_recurrent_gated_delta_rule(
            f32(q), f32(k), f32(v), f32(g), f32(beta),
            initial_state=ttnn.from_torch(ring0, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh),
            initial_state_block_idx=idx_t, output_per_token_state=True)


def test_gdn_chunk_prefill_matches_recurrent_reference(ctx1):
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    b_sz, t_len, h, hv, kd, vd = 1, 40, 1, 2, 32, 32
    q, k, v, g, beta = _gdn_inputs(b_sz, t_len, h, hv, kd, vd, seed=9)
    h0 = torch.randn(b_sz, hv, kd, vd) * 0.1
    bf = lambda x: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    f32 = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
    o, st = ttnn.transformer.chunk_gated_delta_rule(bf(q), bf(k), bf(v), f32(g), f32(beta), initial_state=f32(h0),
                                                    output_final_state=True, chunk_size=32)
    # 0.81.1 docstring: o fp32 token-major ROW_MAJOR on the fused/phased paths; state fp32, never rounded to bf16
    assert o.dtype == ttnn.float32 and o.layout == ttnn.ROW_MAJOR_LAYOUT and st.dtype == ttnn.float32
    qb, kb, vb = (x.bfloat16().float() for x in (q, k, v))
    ro, rstates = _gdn_reference(qb, kb, vb, g, beta, h0, kd ** -0.5)
    assert torch.allclose(ttnn.to_torch(o).double(), ro, atol=3e-2)
    # the chunk kernel's TF32 operands: Tenstorrent's own gate for this op is PCC 0.99999 (a ~5e-3 relative floor)
    st_d, rs = ttnn.to_torch(st).double(), rstates[:, -1]
    assert float((st_d - rs).norm() / rs.norm()) < 1e-2 and torch.corrcoef(torch.stack([st_d.flatten(),
                                                                                      rs.flatten()]))[0, 1] > 0.99999


def test_accounting_of_cache_and_attention_ops(ctx1):
    """Cache/attention ops count what they really touch, not the whole cache they are handed."""
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    nblk, nkv, bs, dh = 16, 1, 32, 64
    k = torch.randn(1, nkv, nblk * bs, dh)
    kt, vt, ptt = _paged(ttnn, mesh, k, k, bs)
    block = 2 * 1 * 2048  # one [1, 1, 32, 64] bf16 block = 2 tiles
    q = ttnn.from_torch(torch.randn(1, 1, 4, dh), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    pos = ttnn.from_torch(torch.tensor([70], dtype=torch.int32), dtype=ttnn.int32, device=mesh)
    with ctx1.counters.scope("sdpa") as c:
        ttnn.transformer.paged_scaled_dot_product_attention_decode(q, kt, vt, ptt, cur_pos_tensor=pos)
    # positions 0..70 live in 3 blocks; K and V each
    kv = c.bytes_read["BFLOAT16"] - q.bytes_per_device()
    assert kv == 2 * 3 * block
    new = ttnn.from_torch(torch.randn(1, 1, nkv, dh), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    with ctx1.counters.scope("upd") as c:
        ttnn.experimental.paged_update_cache(kt, new, update_idxs_tensor=pos, page_table=ptt)
    assert c.bytes_written["BFLOAT16"] == 2 * 2048  # one token row of one KV head: the 2 tiles holding it
    assert c.bytes_read["BFLOAT16"] == new.bytes_per_device() + 2 * 2048


def test_uniform_in_place_seeded_replicated(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    t = ttnn.from_torch(torch.zeros(1, 1, 32, 64), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)
    out = ttnn.uniform(t, 2.0, 3.0, 1234)
    assert out is t
    ref = torch.rand(1, 1, 32, 64, generator=torch.Generator().manual_seed(1234)) * 1.0 + 2.0
    for d in _per_device(ttnn, t):
        assert torch.allclose(d, ref, atol=1e-6)


def test_all_gather_async_persistent_output_buffer(ctx):
    ttnn, mesh, n = ctx.ttnn, ctx.mesh_device, ctx.num_devices
    parts = [torch.randn(1, 1, 32, 32) for _ in range(n)]
    x = _dev_tensor(ttnn, mesh, parts, ttnn.bfloat16)
    buf = ttnn.from_torch(torch.zeros(1, 1, 32, 32 * n), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
    cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))})
    sems = [ttnn.create_global_semaphore(mesh, cores, 0) for _ in range(2)]
    out = ttnn.experimental.all_gather_async(x, persistent_output_buffer=buf, dim=3,
                                             multi_device_global_semaphore=sems, cluster_axis=1)
    assert out is buf
    for d in _per_device(ttnn, buf):
        assert torch.equal(d, torch.cat(parts, dim=3).bfloat16())
    with pytest.raises(TypeError, match="all_gather_async.*'bogus'"):
        ttnn.experimental.all_gather_async(x, dim=3, multi_device_global_semaphore=sems, bogus=1)
