"""Trace capture/replay on the emulated mesh: record-not-execute, bit-identical replay, and every rule."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import EmulatorError, TraceRuleError  # noqa: E402
from qwen36.tt.model.ccl import TTCCL  # noqa: E402

HID, FF = 64, 128


def _open(trace_region_size=1_000_000, **kw):
    return open_mesh("emulated-p150x2", trace_region_size=trace_region_size, **kw)


class TwoLayer:
    """Tiny TP=2 two-layer program: column-parallel up, row-parallel down + all_reduce, residual, norm,
    plus a persistent running state updated in place each step (like a recurrent state)."""

    def __init__(self, ctx, seed=0):
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        self.ttnn, self.mesh = ttnn, mesh
        g = torch.Generator().manual_seed(seed)
        self.w_up = [ttnn.from_torch(torch.randn(HID, FF, generator=g) * 0.1, dtype=ttnn.bfloat8_b,
                                     layout=ttnn.TILE_LAYOUT, device=mesh,
                                     mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1)) for _ in range(2)]
        self.w_down = [ttnn.from_torch(torch.randn(FF, HID, generator=g) * 0.1, dtype=ttnn.bfloat8_b,
                                       layout=ttnn.TILE_LAYOUT, device=mesh,
                                       mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=0)) for _ in range(2)]
        self.norm_w = ttnn.from_torch(torch.rand(HID, generator=g) + 0.5, dtype=ttnn.bfloat16,
                                      layout=ttnn.TILE_LAYOUT, device=mesh)
        self.state0 = torch.zeros(1, 1, 32, HID)
        self.state = ttnn.from_torch(self.state0, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)
        self.ccl = TTCCL(ttnn, mesh)  # traced collectives need semaphores created before capture (trace rule 7)

    def reset_state(self):
        ttnn = self.ttnn
        host = ttnn.from_torch(self.state0, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        ttnn.copy_host_to_device_tensor(host, self.state)

    def __call__(self, x):
        ttnn = self.ttnn
        for layer in range(2):
            h = ttnn.linear(x, self.w_up[layer], memory_config=ttnn.DRAM_MEMORY_CONFIG)
            a = ttnn.silu(h)
            ttnn.deallocate(h)
            y = ttnn.linear(a, self.w_down[layer])
            y = self.ccl.all_reduce(y)
            x = ttnn.add(x, y)
            x = ttnn.rms_norm(x, epsilon=1e-6, weight=self.norm_w)
        s_new = ttnn.add(self.state, ttnn.typecast(x, ttnn.float32))
        ttnn.copy(s_new, self.state)
        return x


def _host_x(ttnn, seed, mesh):
    """Replicated host tensor (one shard per device) - the form a persistent replicated input takes."""
    return ttnn.from_torch(torch.randn(1, 1, 32, HID, generator=torch.Generator().manual_seed(seed)),
                           dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))


def _read(ttnn, mesh, t):
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0])


def test_capture_records_and_replay_is_bit_identical_to_eager():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        model = TwoLayer(ctx)
        x_dev = ttnn.to_device(_host_x(ttnn, 1, mesh), mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        # eager reference: two steps with different inputs; state accumulates
        e1 = _read(ttnn, mesh, model(x_dev))
        s1 = _read(ttnn, mesh, model.state)
        ttnn.copy_host_to_device_tensor(_host_x(ttnn, 2, mesh), x_dev)
        e2 = _read(ttnn, mesh, model(x_dev))
        s2 = _read(ttnn, mesh, model.state)
        assert not torch.equal(e1, e2)

        # capture: recorded, not executed -> state untouched, outputs hold garbage (NaN) until replay
        model.reset_state()
        with ctx.counters.scope("capture") as cap:
            tid = ttnn.begin_trace_capture(mesh, cq_id=0)
            out = model(x_dev)
            ttnn.end_trace_capture(mesh, tid, cq_id=0)
        assert cap.programs == 0, "capture must not execute device programs"
        assert torch.equal(_read(ttnn, mesh, model.state), model.state0)
        assert torch.isnan(_read(ttnn, mesh, out).float()).all()

        ttnn.copy_host_to_device_tensor(_host_x(ttnn, 1, mesh), x_dev)
        with ctx.counters.scope("replay1") as r1:
            ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)
        assert torch.equal(_read(ttnn, mesh, out), e1)
        assert torch.equal(_read(ttnn, mesh, model.state), s1)
        # replay after overwriting the persistent input gives the new (correct) result, in the same buffer
        ttnn.copy_host_to_device_tensor(_host_x(ttnn, 2, mesh), x_dev)
        ttnn.execute_trace(mesh, tid, cq_id=0)
        assert torch.equal(_read(ttnn, mesh, out), e2)
        assert torch.equal(_read(ttnn, mesh, model.state), s2)
        # the replay did the captured device work: 2 layers x 6 ops + typecast + add + copy = 15 op calls. The
        # traced collectives are the async all_reduce (synchronous ones are refused inside a capture), each a
        # reduce-scatter + all-gather on cards (tt_ops/emulator/programs.py): 17 programs, 4 collectives
        assert sum(r1.per_op.values()) == 15 and r1.programs == 17
        assert r1.trace_replays == 1 and r1.collectives == 4
        assert r1.bytes_read["BFLOAT8_B"] > 0
        ttnn.release_trace(mesh, tid)
        with pytest.raises(TraceRuleError, match="released"):
            ttnn.execute_trace(mesh, tid)


def test_trace_needs_trace_region():
    with _open(trace_region_size=0) as ctx:
        with pytest.raises(TraceRuleError, match="trace_region_size"):
            ctx.ttnn.begin_trace_capture(ctx.mesh_device, cq_id=0)


def test_no_host_to_device_or_reads_inside_capture():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        host = _host_x(ttnn, 0, mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        with pytest.raises(TraceRuleError, match="from_torch.*inside trace capture"):
            ttnn.from_torch(torch.randn(4), dtype=ttnn.bfloat16, device=mesh)
        with pytest.raises(TraceRuleError, match="as_tensor.*inside trace capture"):
            ttnn.as_tensor(torch.randn(4), dtype=ttnn.bfloat16, device=mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        with pytest.raises(TraceRuleError, match="copy_host_to_device_tensor.*inside trace capture"):
            ttnn.copy_host_to_device_tensor(host, x)
        with pytest.raises(TraceRuleError, match="to_torch.*inside trace capture"):
            ttnn.to_torch(x, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=0))
        with pytest.raises(TraceRuleError, match="still being captured"):
            ttnn.begin_trace_capture(mesh, cq_id=0)
        with pytest.raises(TraceRuleError, match="inside a trace capture"):
            ttnn.execute_trace(mesh, tid)
        # host tensors are not traceable inputs
        with pytest.raises(EmulatorError, match="on host"):
            ttnn.silu(ttnn.from_torch(torch.randn(32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT))
        ttnn.silu(x)
        ttnn.end_trace_capture(mesh, tid)


def test_inputs_only_through_persistent_buffers_and_shard_count():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        y = ttnn.neg(x)
        ttnn.end_trace_capture(mesh, tid)
        # a fresh device tensor for the next step is an allocation while the trace is live (and the trace would
        # never see it): refused with the fix in the message
        with pytest.raises(TraceRuleError, match="copy_host_to_device_tensor"):
            ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1))
        # host tensor with the wrong shard count (no mapper -> 1 shard) for a 2-shard buffer
        with pytest.raises(TraceRuleError, match="shard"):
            ttnn.copy_host_to_device_tensor(
                ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT), x)
        with pytest.raises(EmulatorError, match="does not match"):
            ttnn.copy_host_to_device_tensor(
                ttnn.from_torch(torch.randn(1, 1, 32, 64), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                                mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1)), x)
        new = torch.randn(1, 1, 32, 64)
        ttnn.copy_host_to_device_tensor(
            ttnn.from_torch(new, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=-1)), x)
        ttnn.execute_trace(mesh, tid)
        got = ttnn.to_torch(y, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=-1))
        assert torch.equal(got, -new.bfloat16())


def test_no_allocation_while_trace_live():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        ttnn.exp(x)  # allocation inside capture is part of the trace: fine
        ttnn.end_trace_capture(mesh, tid)
        with pytest.raises(TraceRuleError, match="while trace\\(s\\) \\[0\\] are live"):
            ttnn.exp(x)  # eager op output = device allocation
        with pytest.raises(TraceRuleError, match="live"):
            ttnn.to_device(_host_x(ttnn, 0, mesh), mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        ttnn.release_trace(mesh, tid)
        ttnn.exp(x)  # fine once released
    with _open(alloc_while_trace_live="warn") as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        ttnn.exp(x)
        ttnn.end_trace_capture(mesh, tid)
        ttnn.exp(x)  # policy "warn": logged, not raised


def test_scratch_allocation_while_trace_live():
    """Inside ttnn's corruptible_allocation_scope (buffers declared scratch: dead before the next replay) an eager
    allocation while a trace is live is allowed (a user's prefill between batched decode replays); outside the
    scope it still raises."""
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        y = ttnn.exp(x)
        ttnn.end_trace_capture(mesh, tid)
        with ttnn.tools.trace_allocation_tracker.corruptible_allocation_scope(mesh):
            z = ttnn.neg(x)
        assert torch.equal(_read(ttnn, mesh, z), -_read(ttnn, mesh, x))
        with pytest.raises(TraceRuleError, match="live"):
            ttnn.neg(x)
        ttnn.execute_trace(mesh, tid)
        assert torch.equal(_read(ttnn, mesh, y), torch.exp(_read(ttnn, mesh, x).float()).bfloat16())


def test_deallocation_rules():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = ttnn.from_torch(torch.randn(1, 1, 32, 32), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        h = ttnn.exp(x)
        y = ttnn.neg(h)
        ttnn.deallocate(h)  # allowed inside capture
        ttnn.end_trace_capture(mesh, tid)
        ttnn.execute_trace(mesh, tid)  # replay still computes through the captured intermediate
        assert torch.equal(_read(ttnn, mesh, y), -torch.exp(_read(ttnn, mesh, x).float()).bfloat16())
        with pytest.raises(EmulatorError, match="deallocated"):
            ttnn.to_torch(h, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=0))
        with pytest.raises(TraceRuleError, match="owned by live trace"):
            ttnn.deallocate(y)
        ttnn.deallocate(x)  # a persistent input freed after capture ...
        with pytest.raises(TraceRuleError, match="deallocated after capture"):
            ttnn.execute_trace(mesh, tid)  # ... makes the replay read freed memory


def test_gdn_ring_state_not_advanced_by_capture():
    """The bug the feasibility prototype hit: executing at capture advanced the GDN state twice."""
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        b, t, h, hv, kd, vd = 1, 2, 1, 1, 32, 32
        bh = b * hv
        f32 = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)  # noqa: E731
        q = f32(torch.nn.functional.normalize(torch.randn(b, t, h, kd), dim=-1))
        k = f32(torch.nn.functional.normalize(torch.randn(b, t, h, kd), dim=-1))
        v, g, beta = f32(torch.randn(b, t, hv, vd)), f32(-torch.rand(b, t, hv)), f32(torch.rand(b, t, hv))
        ring0 = torch.randn(t * bh, kd, vd) * 0.1
        ring = f32(ring0)
        idx = ttnn.from_torch(torch.tensor([bh * (t - 1)], dtype=torch.int32), dtype=ttnn.uint32, device=mesh)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        o, st = ttnn.transformer.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=ring,
                                                                  initial_state_block_idx=idx,
                                                                  output_per_token_state=True)
        ttnn.end_trace_capture(mesh, tid)
        assert torch.equal(_read(ttnn, mesh, ring), ring0)  # capture did not write the ring
        ttnn.execute_trace(mesh, tid)
        after_one = _read(ttnn, mesh, ring).clone()
        assert not torch.equal(after_one, ring0)
        ttnn.execute_trace(mesh, tid)  # second step starts from the first step's last slot
        assert not torch.equal(_read(ttnn, mesh, ring), after_one)


def test_traced_decode_step_with_cache_ring_and_collectives_matches_eager():
    """A K+1-row verify-like step: paged KV update + spec multi-position SDPA + ring GDN + all_reduce,
    captured once and replayed twice == the same two steps run eagerly."""
    T, nkv, dh, bs, nblk, kd = 3, 1, 32, 32, 4, 32

    def build(ctx):
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        g = torch.Generator().manual_seed(11)
        rep = ttnn.ReplicateTensorToMesh(mesh)
        bf = lambda x, m=rep: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,  # noqa
                                              mesh_mapper=m)
        f32 = lambda x: ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh,  # noqa
                                        mesh_mapper=rep)
        s = dict(
            kc=bf(torch.randn(nblk, nkv, bs, dh, generator=g)), vc=bf(torch.randn(nblk, nkv, bs, dh, generator=g)),
            pt=ttnn.from_torch(torch.tensor([[2, 0, 3, 1]], dtype=torch.int32), dtype=ttnn.int32, device=mesh,
                               mesh_mapper=rep),
            ring=f32(torch.randn(T, kd, kd, generator=g) * 0.1),
            # persistent inputs (written with copy_host_to_device_tensor each step)
            q=bf(torch.zeros(1, 1, T * 32, dh)), knew=bf(torch.zeros(1, T, nkv, dh)),
            upd_pos=ttnn.from_torch(torch.zeros(T, dtype=torch.int32), dtype=ttnn.int32, device=mesh, mesh_mapper=rep),
            cur=ttnn.from_torch(torch.zeros(T, dtype=torch.int32), dtype=ttnn.int32, device=mesh, mesh_mapper=rep),
            idx=ttnn.from_torch(torch.zeros(1, dtype=torch.int32), dtype=ttnn.uint32, device=mesh, mesh_mapper=rep),
            gq=f32(torch.zeros(1, T, 1, kd)), gv=f32(torch.zeros(1, T, 1, kd)), gg=f32(torch.zeros(1, T, 1)),
            gb=f32(torch.zeros(1, T, 1)),
            ccl=TTCCL(ttnn, mesh),
        )
        return s

    def step(ctx, s):
        ttnn = ctx.ttnn
        # K/V of the T candidate rows go to positions pos..pos+T-1 (one pseudo-user per row, aliased page table)
        pt_rows = ttnn.concat([s["pt"]] * T, dim=0)
        ttnn.experimental.paged_update_cache(s["kc"], s["knew"], update_idxs_tensor=s["upd_pos"], page_table=pt_rows)
        ttnn.experimental.paged_update_cache(s["vc"], s["knew"], update_idxs_tensor=s["upd_pos"], page_table=pt_rows)
        att = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            s["q"], s["kc"], s["vc"], s["pt"], cur_pos_tensor=s["cur"], scale=dh ** -0.5, spec_multi_pos_tiles=T)
        o, _ = ttnn.transformer.fused_recurrent_gated_delta_rule(
            s["gq"], s["gq"], s["gv"], s["gg"], s["gb"], initial_state=s["ring"], initial_state_block_idx=s["idx"],
            output_per_token_state=True)
        return s["ccl"].all_reduce(att), o

    def inputs(ctx, step_no):
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        g = torch.Generator().manual_seed(100 + step_no)
        rep = ttnn.ReplicateTensorToMesh(mesh)
        pos = 40 + 3 * step_no
        h = lambda x, dt=ttnn.bfloat16, lay=ttnn.TILE_LAYOUT: ttnn.from_torch(x, dtype=dt, layout=lay,  # noqa
                                                                              mesh_mapper=rep)
        return dict(
            q=h(torch.randn(1, 1, T * 32, dh, generator=g)), knew=h(torch.randn(1, T, nkv, dh, generator=g)),
            upd_pos=h(torch.arange(pos, pos + T, dtype=torch.int32), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT),
            cur=h(torch.arange(pos, pos + T, dtype=torch.int32), ttnn.int32, ttnn.ROW_MAJOR_LAYOUT),
            idx=h(torch.tensor([step_no % T], dtype=torch.int32), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT),
            gq=h(torch.nn.functional.normalize(torch.randn(1, T, 1, kd, generator=g), dim=-1), ttnn.float32),
            gv=h(torch.randn(1, T, 1, kd, generator=g), ttnn.float32),
            gg=h(-torch.rand(1, T, 1, generator=g), ttnn.float32), gb=h(torch.rand(1, T, 1, generator=g), ttnn.float32),
        )

    def write(ctx, s, inp):
        for k, v in inp.items():
            ctx.ttnn.copy_host_to_device_tensor(v, s[k])

    def read(ctx, t):
        return ctx.ttnn.to_torch(ctx.ttnn.get_device_tensors(t)[1]).clone()

    eager, eager_counts = [], []
    with _open() as ctx:
        s = build(ctx)
        for n in range(2):
            write(ctx, s, inputs(ctx, n))
            with ctx.counters.scope(f"eager {n}") as ec:
                att, o = step(ctx, s)
            eager.append((read(ctx, att), read(ctx, o), read(ctx, s["ring"]), read(ctx, s["kc"])))
            eager_counts.append(ec)
    with _open() as ctx:
        s = build(ctx)
        write(ctx, s, inputs(ctx, 0))
        tid = ctx.ttnn.begin_trace_capture(ctx.mesh_device, cq_id=0)
        att, o = step(ctx, s)
        ctx.ttnn.end_trace_capture(ctx.mesh_device, tid, cq_id=0)
        for n in range(2):
            write(ctx, s, inputs(ctx, n))
            with ctx.counters.scope("verify") as c:
                ctx.ttnn.execute_trace(ctx.mesh_device, tid, cq_id=0)
            got = (read(ctx, att), read(ctx, o), read(ctx, s["ring"]), read(ctx, s["kc"]))
            for a, b in zip(got, eager[n]):
                assert torch.equal(a, b)
            # a replay counts what the eager step counts (ops counted from shapes alone are summed once per trace,
            # the SDPA's KV reads follow this step's positions): programs, bytes, collectives, compute work
            want = {k: v for k, v in eager_counts[n].as_dict().items() if k not in ("name", "trace_replays")}
            assert {k: v for k, v in c.as_dict().items() if k not in ("name", "trace_replays")} == want
            assert dict(c.compute_work) == dict(eager_counts[n].compute_work)
            assert dict(c.bytes_read_per_op) == dict(eager_counts[n].bytes_read_per_op)
        # 6 op calls; no dim of the [1, 1, 96, 32] all-reduce input splits into whole tiles over 2 devices, so the
        # async all-reduce is its all-gather + local sum form (programs.py): 2 programs, 1 collective
        assert c.programs == 7 and c.collectives == 1


def test_replay_accounting_follows_current_positions():
    with _open() as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        rep = ttnn.ReplicateTensorToMesh(mesh)
        nblk, bs, dh = 8, 32, 32
        mk = lambda x: ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,  # noqa: E731
                                       mesh_mapper=rep)
        kc, vc = mk(torch.randn(nblk, 1, bs, dh)), mk(torch.randn(nblk, 1, bs, dh))
        pt = ttnn.from_torch(torch.arange(nblk, dtype=torch.int32).reshape(1, nblk), dtype=ttnn.int32, device=mesh,
                             mesh_mapper=rep)
        q = mk(torch.randn(1, 1, 8, dh))
        pos = ttnn.from_torch(torch.tensor([0], dtype=torch.int32), dtype=ttnn.int32, device=mesh, mesh_mapper=rep)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        ttnn.transformer.paged_scaled_dot_product_attention_decode(q, kc, vc, pt, cur_pos_tensor=pos)
        ttnn.end_trace_capture(mesh, tid)
        reads = []
        for p in (0, 100, 255):
            ttnn.copy_host_to_device_tensor(
                ttnn.from_torch(torch.tensor([p], dtype=torch.int32), dtype=ttnn.int32, mesh_mapper=rep), pos)
            with ctx.counters.scope("step") as c:
                ttnn.execute_trace(mesh, tid)
            reads.append(c.bytes_read["BFLOAT16"] - q.bytes_per_device())
        block = 2048  # [1, 1, 32, 32] bf16
        assert reads == [2 * 1 * block, 2 * 4 * block, 2 * 8 * block]
