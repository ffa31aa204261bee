"""Conformance cases for the KDA convolution / gated norm and the fused GDN ops of ttnn 0.81.1, restated from
Tenstorrent's own tests for them (in our words, at their shapes or smaller); registered into
``emulator_conformance.CASES`` so ``qwen36 probe emu-conformance`` runs them.

Where a test was written against another tt-metal revision than the 0.81.1 library, the case follows 0.81.1 (its
docstring and the validation messages in the installed ``_ttnncpp.so``) and says so.

Sources (tenstorrent/tt-metal, read for facts):

* ``tests/ttnn/nightly/unit_tests/operations/experimental/kda/test_qkv_causal_conv1d_silu.py`` (+ its helpers in
  ``tests/ttnn/unit_tests/operations/experimental/kda/kda_test_utils.py``: bf16 inputs from one seeded generator,
  the reference ``silu(sum_t window[t:t+T] * tap_t)`` split q/k/v, PCC >= 0.999): the three geometries
  (512/512/512 in one 1536-channel block, 1024^3 in 768-channel blocks, the asymmetric 512/256/128 split with the
  full output contract: BFLOAT16 TILE DRAM outputs in new buffers, bit-identical trace replay, inputs unchanged),
  repeat calls bit-identical, program-cache reuse with fresh tensors, the key including the split widths and
  channel_chunk_size, the default compute config equal to its explicit form, and the refusals (approximate math,
  packer L1 accumulation, invalid channel_chunk_size, tensors, widths, a sharded output). That revision refuses a
  TILE input; 0.81.1 reads a TILE input in place and tilizes a ROW_MAJOR one (docstring), so that case checks both
  layouts agree; 0.81.1 also accepts an input wider than Q+K+V (``input_column_offset``), so the narrow-widths
  case is refused by the history shape instead.
* ``qkv_causal_conv1d_silu_with_carry``: no test in the index; cases from its 0.81.1 docstring (the carry is the
  three rows ending at ``actual_end``; q/k/v equal the plain op's).
* ``tests/ttnn/nightly/unit_tests/operations/experimental/kda/test_sigmoid_gated_rms_norm.py``: B=1, T=64, 12 heads
  of 128, fp32/bf16 input x fp32/bf16 output at PCC >= 0.999 and bit-identical repeats, the production geometries
  (T = 5120/2560/1280 with 12/24/48 heads, bf16 in and out, HiFi4 + fp32 dest), the program key including epsilon,
  the default config equal to (HiFi4, approx, fp32 dest), and the refusals. ``gate_column_offset`` (0.81.1
  docstring): the gate read out of a wider fused projection equals the sliced gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conformance_common import Case, _dev, _expect_rejected, pcc

SRC_CONV = "tt-metal tests/ttnn/nightly/unit_tests/operations/experimental/kda/test_qkv_causal_conv1d_silu.py"
SRC_CONV_DOC = "ttnn 0.81.1 docstring of experimental.kda.qkv_causal_conv1d_silu_with_carry"
SRC_NORM = "tt-metal tests/ttnn/nightly/unit_tests/operations/experimental/kda/test_sigmoid_gated_rms_norm.py"
SRC_NORM_DOC = "ttnn 0.81.1 docstring of experimental.kda.sigmoid_gated_rms_norm (gate_column_offset)"


CONV = "experimental.kda.qkv_causal_conv1d_silu"
CARRY = "experimental.kda.qkv_causal_conv1d_silu_with_carry"
NORM = "experimental.kda.sigmoid_gated_rms_norm"


def _first(ttnn, t):
    """Device 0's shard in its own torch dtype."""
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0])


def _start(ttnn, mesh, value=0):
    return ttnn.from_torch(torch.tensor([value], dtype=torch.int64), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT,
                           device=mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))


# ---- qkv_causal_conv1d_silu --------------------------------------------------------------------------------------
def _qkv_host(sequence=64, widths=(512, 512, 512), batch=1, history_rows=3, seed=223):
    g = torch.Generator().manual_seed(seed)
    c = sum(widths)
    x = torch.randn(batch, sequence, c, generator=g, dtype=torch.bfloat16)
    hist = torch.randn(batch, history_rows, c, generator=g, dtype=torch.bfloat16)
    taps = tuple(torch.randn(1, 1, c, generator=g, dtype=torch.bfloat16) for _ in range(4))
    return x, hist, taps


def _qkv_dev(ttnn, mesh, host, x_layout=None):
    x, hist, taps = host
    return (_dev(ttnn, mesh, x, layout=x_layout or ttnn.ROW_MAJOR_LAYOUT),
            _dev(ttnn, mesh, hist, layout=ttnn.ROW_MAJOR_LAYOUT), tuple(_dev(ttnn, mesh, t) for t in taps))


def _qkv_ref(x, hist, taps, widths):
    """The tests' reference: silu of the four shifted windows times their taps, split q/k/v (fp32 here)."""
    win = torch.cat([hist.float(), x.float()], 1)
    t = x.shape[1]
    return F.silu(sum(win[:, i:i + t] * taps[i].float() for i in range(4))).split(list(widths), -1)


def _conv(ttnn, mesh, x_tt, hist_tt, taps_tt, widths, chunk, **kw):
    return ttnn.experimental.kda.qkv_causal_conv1d_silu(
        x_tt, hist_tt, *taps_tt, *widths, actual_start=kw.pop("actual_start", None) or _start(ttnn, mesh),
        predecessor_carry=hist_tt, program_config=ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=chunk),
        **kw)


def _conv_contract(widths, chunk, full):
    def run(ttnn, mesh):
        host = _qkv_host(widths=widths)
        x_tt, hist_tt, taps_tt = _qkv_dev(ttnn, mesh, host)
        ins = (x_tt, hist_tt, *taps_tt)
        before = [_first(ttnn, t).clone() for t in ins]
        start = _start(ttnn, mesh)
        outs = _conv(ttnn, mesh, x_tt, hist_tt, taps_tt, widths, chunk, actual_start=start)
        for o, want, w in zip(outs, _qkv_ref(*host, widths), widths):
            assert list(o.shape) == [1, 64, w]
            assert pcc(want, _first(ttnn, o).float()) >= 0.999
            if full:
                assert o.dtype == ttnn.bfloat16 and o.layout == ttnn.TILE_LAYOUT
                assert o.memory_config() == ttnn.DRAM_MEMORY_CONFIG
                assert all(o.buffer_address() != t.buffer_address() for t in ins)
        if full:
            tid = ttnn.begin_trace_capture(mesh, cq_id=0)
            traced = _conv(ttnn, mesh, x_tt, hist_tt, taps_tt, widths, chunk, actual_start=start)
            ttnn.end_trace_capture(mesh, tid, cq_id=0)
            for _ in range(2):
                ttnn.execute_trace(mesh, tid, cq_id=0, blocking=False)
            ttnn.synchronize_device(mesh)
            for o, t in zip(outs, traced):
                assert torch.equal(_first(ttnn, o), _first(ttnn, t)), "trace replay differs from the eager call"
            for b, t in zip(before, ins):
                assert torch.equal(b, _first(ttnn, t)), "an input was modified"
            ttnn.release_trace(mesh, tid)
    return run


def _conv_deterministic(widths, chunk):
    def run(ttnn, mesh):
        host = _qkv_host(widths=widths)
        dev = _qkv_dev(ttnn, mesh, host)
        first = [_first(ttnn, o) for o in _conv(ttnn, mesh, *dev, widths, chunk)]
        for _ in range(2):
            assert all(torch.equal(a, _first(ttnn, o)) for a, o in zip(first, _conv(ttnn, mesh, *dev, widths, chunk)))
        for want, got in zip(_qkv_ref(*host, widths), first):
            assert pcc(want, got.float()) >= 0.999
    return run


def _conv_cache_hit_fresh_tensors(ttnn, mesh):
    mesh.enable_program_cache()  # an enabled, empty cache, as the tests' isolated_program_cache fixture gives
    mesh.clear_program_cache()
    widths = (128, 128, 128)
    ha, hb = _qkv_host(32, widths, seed=1911), _qkv_host(32, widths, seed=1912)
    da, db = _qkv_dev(ttnn, mesh, ha), _qkv_dev(ttnn, mesh, hb)
    oa = _conv(ttnn, mesh, *da, widths, 384)
    n = mesh.num_program_cache_entries()
    ob = _conv(ttnn, mesh, *db, widths, 384)
    assert mesh.num_program_cache_entries() == n, "a second call with new tensors of the same specs compiled again"
    assert all(a.buffer_address() != b.buffer_address() for a, b in zip(oa, ob))
    for wa, wb, a, b in zip(_qkv_ref(*ha, widths), _qkv_ref(*hb, widths), oa, ob):
        a, b = _first(ttnn, a), _first(ttnn, b)
        assert pcc(wa, a.float()) >= 0.999 and pcc(wb, b.float()) >= 0.999 and not torch.equal(a, b)


def _conv_program_key(ttnn, mesh):
    mesh.enable_program_cache()  # an enabled, empty cache, as the tests' isolated_program_cache fixture gives
    mesh.clear_program_cache()
    widths = (128, 128, 128)
    dev = _qkv_dev(ttnn, mesh, _qkv_host(32, widths, seed=772))
    _conv(ttnn, mesh, *dev, widths, 384)
    n = mesh.num_program_cache_entries()
    for _ in range(2):
        _conv(ttnn, mesh, *dev, (64, 128, 192), 384)
        assert mesh.num_program_cache_entries() == n + 1, "the split widths are part of the program key"
    for _ in range(2):
        _conv(ttnn, mesh, *dev, widths, 192)
        assert mesh.num_program_cache_entries() == n + 2, "channel_chunk_size is part of the program key"


def _conv_default_config(ttnn, mesh):
    mesh.enable_program_cache()  # an enabled, empty cache, as the tests' isolated_program_cache fixture gives
    mesh.clear_program_cache()
    widths = (128, 128, 128)
    dev = _qkv_dev(ttnn, mesh, _qkv_host(32, widths, seed=817))
    implicit = _conv(ttnn, mesh, *dev, widths, 384)
    n = mesh.num_program_cache_entries()
    cfg = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4,
                                                 math_approx_mode=False, fp32_dest_acc_en=False, packer_l1_acc=False)
    explicit = _conv(ttnn, mesh, *dev, widths, 384, compute_kernel_config=cfg)
    assert mesh.num_program_cache_entries() == n, "the explicit default config compiled another program"
    assert all(torch.equal(_first(ttnn, a), _first(ttnn, b)) for a, b in zip(implicit, explicit))


def _conv_rejects_configs(ttnn, mesh):
    widths = (128, 128, 128)
    dev = _qkv_dev(ttnn, mesh, _qkv_host(32, widths, seed=818))
    approx = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4,
                                                    math_approx_mode=True, fp32_dest_acc_en=False, packer_l1_acc=False)
    _expect_rejected(lambda: _conv(ttnn, mesh, *dev, widths, 384, compute_kernel_config=approx),
                     "math_approx_mode=true is unsupported")
    l1acc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, packer_l1_acc=True)
    _expect_rejected(lambda: _conv(ttnn, mesh, *dev, widths, 384, compute_kernel_config=l1acc),
                     "packer_l1_acc=true is unsupported")


def _conv_rejects_chunk_sizes(ttnn, mesh):
    widths = (128, 128, 128)
    dev = _qkv_dev(ttnn, mesh, _qkv_host(32, widths))
    for chunk, msg in ((0, "channel_chunk_size must be positive"), (16, "channel_chunk_size must be tile aligned"),
                       (416, "channel_chunk_size must not exceed Q+K+V width"),
                       (160, "channel_chunk_size must divide Q+K+V width exactly")):
        _expect_rejected(lambda: _conv(ttnn, mesh, *dev, widths, chunk), msg)


def _conv_rejects_tensors(ttnn, mesh):
    widths = (128, 128, 128)
    for case, msg in (("host_input", "allocated device tensor"), ("batch", "input must be [1,T,W]"),
                      ("history_shape", "history must be [1,3,Q+K+V]"),
                      ("tap_last_dimension", "tap2 last dimension must equal Q+K+V"),
                      ("tap_volume", "tap2 logical volume must equal"),
                      ("history_layout", "history must use ROW_MAJOR layout, got Layout::TILE"),
                      ("tap_layout", "tap1 must use TILE layout, got Layout::ROW_MAJOR"),
                      ("input_dtype", "input must be BFLOAT16"), ("history_dtype", "history must be BFLOAT16"),
                      ("tap_dtype", "tap3 must be BFLOAT16"),
                      ("sequence_alignment", "sequence must be positive and tile aligned"),
                      ("sharded_history", "history must use interleaved memory")):
        host = _qkv_host(33 if case == "sequence_alignment" else 32, widths, batch=2 if case == "batch" else 1,
                         history_rows=2 if case == "history_shape" else 3, seed=991)
        x, hist, taps = host
        x_tt, hist_tt, taps_tt = _qkv_dev(ttnn, mesh, host)
        taps_tt = list(taps_tt)
        if case == "host_input":
            x_tt = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT)
        elif case == "tap_last_dimension":
            taps_tt[2] = _dev(ttnn, mesh, taps[2].reshape(-1, 1))
        elif case == "tap_volume":
            taps_tt[2] = _dev(ttnn, mesh, torch.cat((taps[2], taps[2]), 0))
        elif case == "history_layout":
            hist_tt = _dev(ttnn, mesh, hist)
        elif case == "tap_layout":
            taps_tt[1] = _dev(ttnn, mesh, taps[1], layout=ttnn.ROW_MAJOR_LAYOUT)
        elif case == "input_dtype":
            x_tt = _dev(ttnn, mesh, x.float(), ttnn.float32, ttnn.ROW_MAJOR_LAYOUT)
        elif case == "history_dtype":
            hist_tt = _dev(ttnn, mesh, hist.float(), ttnn.float32, ttnn.ROW_MAJOR_LAYOUT)
        elif case == "tap_dtype":
            taps_tt[3] = _dev(ttnn, mesh, taps[3].float(), ttnn.float32)
        elif case == "sharded_history":
            spec = ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}),
                                  [hist.shape[0] * hist.shape[1], hist.shape[2]], ttnn.ShardOrientation.ROW_MAJOR)
            hist_tt = ttnn.from_torch(hist, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
                                      memory_config=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED,
                                                                      ttnn.BufferType.L1, spec))
        _expect_rejected(lambda: ttnn.experimental.kda.qkv_causal_conv1d_silu(
            x_tt, hist_tt, *taps_tt, *widths, actual_start=_start(ttnn, mesh), predecessor_carry=hist_tt,
            program_config=ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=384)), msg)


def _conv_rejects_widths_and_sharded_output(ttnn, mesh):
    dev = _qkv_dev(ttnn, mesh, _qkv_host(32, (128, 128, 128)))
    for widths, msg in (((0, 128, 256), "Q/K/V widths must be positive"),
                        ((100, 128, 156), "Q/K/V widths must be tile aligned"),
                        ((128, 128, 64), "history must be [1,3,Q+K+V]")):
        _expect_rejected(lambda: _conv(ttnn, mesh, *dev, widths, sum(widths)), msg)
    spec = ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}), [32, 128],
                          ttnn.ShardOrientation.ROW_MAJOR)
    sharded = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1, spec)
    _expect_rejected(lambda: _conv(ttnn, mesh, *dev, (128, 128, 128), 384, memory_config=sharded),
                     "output memory layout must be INTERLEAVED, got HEIGHT_SHARDED")


def _conv_tile_input_and_column_offset(ttnn, mesh):
    """0.81.1: a TILE input is read in place, a ROW_MAJOR one tilized first; ``input_column_offset`` reads the
    channels out of a wider fused projection."""
    widths = (128, 64, 128)
    x, hist, taps = _qkv_host(64, widths, seed=5)
    fused = torch.cat([torch.randn(1, 64, 64, dtype=torch.bfloat16), x, torch.randn(1, 64, 32).bfloat16()], -1)
    hist_tt = _dev(ttnn, mesh, hist, layout=ttnn.ROW_MAJOR_LAYOUT)
    taps_tt = tuple(_dev(ttnn, mesh, t) for t in taps)
    rm = _conv(ttnn, mesh, _dev(ttnn, mesh, x, layout=ttnn.ROW_MAJOR_LAYOUT), hist_tt, taps_tt, widths, 320)
    tile = _conv(ttnn, mesh, _dev(ttnn, mesh, x), hist_tt, taps_tt, widths, 320)
    off = _conv(ttnn, mesh, _dev(ttnn, mesh, fused), hist_tt, taps_tt, widths, 320, input_column_offset=64)
    for a, b, c, want in zip(rm, tile, off, _qkv_ref(x, hist, taps, widths)):
        assert torch.equal(_first(ttnn, a), _first(ttnn, b)) and torch.equal(_first(ttnn, a), _first(ttnn, c))
        assert pcc(want, _first(ttnn, a).float()) >= 0.999
    _expect_rejected(lambda: _conv(ttnn, mesh, _dev(ttnn, mesh, fused), hist_tt, taps_tt, widths, 320,
                                   input_column_offset=48), "input_column_offset must be tile aligned")


def _carry_case(ttnn, mesh):
    widths = (64, 64, 128)
    c = sum(widths)
    x, hist, taps = _qkv_host(64, widths, seed=31)
    x_tt, hist_tt, taps_tt = _qkv_dev(ttnn, mesh, (x, hist, taps))
    plain = _conv(ttnn, mesh, x_tt, hist_tt, taps_tt, widths, 256)
    buf = ttnn.from_torch(torch.zeros(1, 12, c), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
    sems = [ttnn.create_global_semaphore(mesh, ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0),
                                                                                 ttnn.CoreCoord(0, 0))}), 0)
            for _ in range(3)]
    for end, rows in ((None, 64), (40, 40), (2, 2)):
        kw = {} if end is None else {"actual_end": _start(ttnn, mesh, end)}
        q, k, v, carry = ttnn.experimental.kda.qkv_causal_conv1d_silu_with_carry(
            x_tt, hist_tt, *taps_tt, *widths, actual_start=_start(ttnn, mesh), exchange_buffer=buf,
            exchange_semaphores=sems, program_config=ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=256),
            **kw)
        assert all(torch.equal(_first(ttnn, a), _first(ttnn, b)) for a, b in zip((q, k, v), plain))
        assert carry.layout == ttnn.ROW_MAJOR_LAYOUT and carry.dtype == ttnn.bfloat16
        want = torch.cat([hist, x[:, :rows]], 1)[:, -3:]
        assert torch.equal(_first(ttnn, carry), want), f"carry for {rows} valid rows"


# ---- sigmoid_gated_rms_norm --------------------------------------------------------------------------------------
def _norm_host(batch=1, sequence=64, heads=12, value_dim=128, fp32_input=True, seed=319):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * heads, sequence, value_dim, generator=g,
                    dtype=torch.float32 if fp32_input else torch.bfloat16)
    gate = torch.randn(batch, sequence, heads * value_dim, generator=g, dtype=torch.bfloat16)
    w = torch.randn(value_dim, generator=g, dtype=torch.bfloat16)
    return x, gate, w


def _norm_ref(x, gate, w, batch, heads, eps=1e-5):
    bh, t, v = x.shape
    xs = x.double().reshape(batch, heads, t, v).permute(0, 2, 1, 3)
    y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return (y * torch.sigmoid(gate.double().reshape(batch, t, heads, v))).reshape(batch, t, heads * v)


def _norm_run(ttnn, mesh, dev, heads=12, **kw):
    return ttnn.experimental.kda.sigmoid_gated_rms_norm(*dev, heads, **kw)


def _norm_dev(ttnn, mesh, host):
    x, gate, w = host
    return (_dev(ttnn, mesh, x, ttnn.float32 if x.dtype == torch.float32 else ttnn.bfloat16),
            _dev(ttnn, mesh, gate), _dev(ttnn, mesh, w))


def _norm_accurate(fp32_in, fp32_out, batch=1, sequence=64, heads=12, production=False):
    def run(ttnn, mesh):
        host = _norm_host(batch, sequence, heads, 128, fp32_in)
        dev = _norm_dev(ttnn, mesh, host)
        before = [_first(ttnn, t).clone() for t in dev]
        out_dtype = ttnn.float32 if fp32_out else ttnn.bfloat16
        kw = dict(output_dtype=out_dtype)
        if production:
            kw["compute_kernel_config"] = ttnn.init_device_compute_kernel_config(
                mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4, fp32_dest_acc_en=True, packer_l1_acc=False)
        n = None
        outs = []
        for _ in range(3):
            o = _norm_run(ttnn, mesh, dev, heads, **kw)
            outs.append(_first(ttnn, o))
            n = mesh.num_program_cache_entries() if n is None else n
            assert mesh.num_program_cache_entries() == n
        assert o.dtype == out_dtype and o.layout == ttnn.TILE_LAYOUT and o.memory_config() == ttnn.DRAM_MEMORY_CONFIG
        assert list(o.shape) == [batch, sequence, heads * 128]
        assert all(o.buffer_address() != t.buffer_address() for t in dev)
        assert pcc(_norm_ref(*host, batch, heads), outs[0]) >= 0.999
        assert all(torch.equal(outs[0], x) for x in outs[1:])
        assert all(torch.equal(b, _first(ttnn, t)) for b, t in zip(before, dev))
    return run


def _norm_program_key_epsilon(ttnn, mesh):
    mesh.enable_program_cache()  # an enabled, empty cache, as the tests' isolated_program_cache fixture gives
    mesh.clear_program_cache()
    dev = _norm_dev(ttnn, mesh, _norm_host(1, 32, 2, 64, seed=1321))
    _norm_run(ttnn, mesh, dev, 2, epsilon=1e-5)
    n = mesh.num_program_cache_entries()
    for _ in range(2):
        _norm_run(ttnn, mesh, dev, 2, epsilon=2e-5)
        assert mesh.num_program_cache_entries() == n + 1


def _norm_default_config(ttnn, mesh):
    mesh.enable_program_cache()  # an enabled, empty cache, as the tests' isolated_program_cache fixture gives
    mesh.clear_program_cache()
    dev = _norm_dev(ttnn, mesh, _norm_host(seed=817))
    implicit = _first(ttnn, _norm_run(ttnn, mesh, dev))
    n = mesh.num_program_cache_entries()
    cfg = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4,
                                                 math_approx_mode=True, fp32_dest_acc_en=True, packer_l1_acc=False)
    explicit = _first(ttnn, _norm_run(ttnn, mesh, dev, compute_kernel_config=cfg))
    assert mesh.num_program_cache_entries() == n and torch.equal(implicit, explicit)
    exact = ttnn.init_device_compute_kernel_config(mesh.arch(), math_fidelity=ttnn.MathFidelity.HiFi4,
                                                   math_approx_mode=False, fp32_dest_acc_en=True, packer_l1_acc=False)
    _norm_run(ttnn, mesh, dev, compute_kernel_config=exact)
    assert mesh.num_program_cache_entries() == n + 1, "exact math is another program"


def _norm_rejects(ttnn, mesh):
    l1acc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, packer_l1_acc=True)
    dev = _norm_dev(ttnn, mesh, _norm_host())
    _expect_rejected(lambda: _norm_run(ttnn, mesh, dev, compute_kernel_config=l1acc),
                     "packer_l1_acc=true is unsupported")
    for case, msg in (("host_input", "allocated device tensor"), ("input_dtype", "input has unsupported dtype"),
                      ("gate_dtype", "gate has unsupported dtype"), ("weight_dtype", "weight has unsupported dtype"),
                      ("input_layout", "input must use TILE layout"), ("gate_shape", "must be [B, T, W]"),
                      ("weight_shape", "weight must be [V]"),
                      ("sequence_alignment", "sequence must be positive and tile aligned"),
                      ("value_alignment", "value_dim must be positive and tile aligned"),
                      ("sharded_input", "input must use interleaved memory")):
        x, gate, w = _norm_host(sequence=33 if case == "sequence_alignment" else 32,
                                value_dim=100 if case == "value_alignment" else 128, seed=9321)
        x_tt, gate_tt, w_tt = _norm_dev(ttnn, mesh, (x, gate, w))
        if case == "host_input":
            x_tt = ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT)
        elif case == "input_dtype":
            x_tt = _dev(ttnn, mesh, x, ttnn.bfloat8_b)
        elif case == "gate_dtype":
            gate_tt = _dev(ttnn, mesh, gate.float(), ttnn.float32)
        elif case == "weight_dtype":
            w_tt = _dev(ttnn, mesh, w.float(), ttnn.float32)
        elif case == "input_layout":
            x_tt = _dev(ttnn, mesh, x, ttnn.float32, ttnn.ROW_MAJOR_LAYOUT)
        elif case == "gate_shape":
            gate_tt = _dev(ttnn, mesh, gate[..., :-32])
        elif case == "weight_shape":
            w_tt = _dev(ttnn, mesh, w.reshape(2, -1))
        elif case == "sharded_input":
            spec = ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}),
                                  [x.shape[0] * x.shape[1], x.shape[2]], ttnn.ShardOrientation.ROW_MAJOR)
            x_tt = ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh,
                                   memory_config=ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED,
                                                                   ttnn.BufferType.L1, spec))
        _expect_rejected(lambda: _norm_run(ttnn, mesh, (x_tt, gate_tt, w_tt)), msg)
    for heads, eps, dt, msg in ((0, 1e-5, ttnn.float32, "num_heads must be positive"),
                                (5, 1e-5, ttnn.float32, "leading dimension must be divisible"),
                                (12, 0.0, ttnn.float32, "epsilon must be finite and positive"),
                                (12, float("nan"), ttnn.float32, "epsilon must be finite and positive"),
                                (12, 1e-5, ttnn.uint32, "output_dtype must be FLOAT32 or BFLOAT16")):
        _expect_rejected(lambda: _norm_run(ttnn, mesh, dev, heads, epsilon=eps, output_dtype=dt), msg)
    spec = ttnn.ShardSpec(ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(0, 0))}),
                          [64, 12 * 128], ttnn.ShardOrientation.ROW_MAJOR)
    sharded = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1, spec)
    _expect_rejected(lambda: _norm_run(ttnn, mesh, dev, memory_config=sharded),
                     "output memory configuration must be interleaved")


def _norm_gate_column_offset(ttnn, mesh):
    x, gate, w = _norm_host(1, 32, 4, 64, seed=11)
    fused = torch.cat([torch.randn(1, 32, 96).bfloat16(), gate, torch.randn(1, 32, 32).bfloat16()], -1)
    x_tt, gate_tt, w_tt = _norm_dev(ttnn, mesh, (x, gate, w))
    sliced = _first(ttnn, _norm_run(ttnn, mesh, (x_tt, gate_tt, w_tt), 4))
    offset = _first(ttnn, _norm_run(ttnn, mesh, (x_tt, _dev(ttnn, mesh, fused), w_tt), 4, gate_column_offset=96))
    assert torch.equal(sliced, offset)
    _expect_rejected(lambda: _norm_run(ttnn, mesh, (x_tt, _dev(ttnn, mesh, fused), w_tt), 4, gate_column_offset=16),
                     "gate_column_offset must be tile aligned")
    _expect_rejected(lambda: _norm_run(ttnn, mesh, (x_tt, _dev(ttnn, mesh, fused), w_tt), 4, gate_column_offset=160),
                     "hold H*V = 256 columns at gate_column_offset 160")


CASES: list[Case] = [
    Case(CONV, "contract_single_block_512x3_c1536", SRC_CONV, _conv_contract((512, 512, 512), 1536, False)),
    Case(CONV, "contract_multiple_blocks_1024x3_c768", SRC_CONV, _conv_contract((1024, 1024, 1024), 768, False),
         ci=False),
    Case(CONV, "contract_asymmetric_512_256_128_c896_full", SRC_CONV, _conv_contract((512, 256, 128), 896, True)),
    Case(CONV, "repeat_calls_bit_identical_production_geometries", SRC_CONV, _conv_deterministic((512, 256, 128), 896)),
    Case(CONV, "cache_hit_rebinds_fresh_tensors", SRC_CONV, _conv_cache_hit_fresh_tensors),
    Case(CONV, "program_key_includes_split_widths_and_channel_chunk_size", SRC_CONV, _conv_program_key),
    Case(CONV, "default_compute_config_matches_explicit_defaults", SRC_CONV, _conv_default_config),
    Case(CONV, "rejects_approximate_math_and_packer_l1_acc", SRC_CONV, _conv_rejects_configs),
    Case(CONV, "rejects_invalid_channel_chunk_size", SRC_CONV, _conv_rejects_chunk_sizes),
    Case(CONV, "rejects_invalid_tensors", SRC_CONV, _conv_rejects_tensors),
    Case(CONV, "rejects_invalid_widths_and_sharded_output", SRC_CONV, _conv_rejects_widths_and_sharded_output),
    Case(CONV, "tile_input_in_place_and_input_column_offset", SRC_CONV, _conv_tile_input_and_column_offset),
    Case(CONV, "production_performance", SRC_CONV,
         skip="a real-time-profiler duration band on a P150b; the emulator has no device clock (the cost model "
              "charges the op from its counts)"),
    Case(CARRY, "carry_is_the_three_rows_ending_at_actual_end", SRC_CONV_DOC, _carry_case),
    Case(NORM, "fp32_in_fp32_out", SRC_NORM, _norm_accurate(True, True)),
    Case(NORM, "fp32_in_bf16_out", SRC_NORM, _norm_accurate(True, False)),
    Case(NORM, "bf16_in_fp32_out", SRC_NORM, _norm_accurate(False, True)),
    Case(NORM, "bf16_in_bf16_out", SRC_NORM, _norm_accurate(False, False)),
    Case(NORM, "production_sp1_tp8_local_t5120_h12", SRC_NORM,
         _norm_accurate(False, False, 1, 5120, 12, production=True), ci=False),
    Case(NORM, "production_sp2_tp4_local_t2560_h24", SRC_NORM,
         _norm_accurate(False, False, 1, 2560, 24, production=True), ci=False),
    Case(NORM, "production_sp4_tp2_local_t1280_h48", SRC_NORM,
         _norm_accurate(False, False, 1, 1280, 48, production=True), ci=False),
    Case(NORM, "program_key_includes_epsilon", SRC_NORM, _norm_program_key_epsilon),
    Case(NORM, "default_config_matches_explicit_and_exact_math_is_another_program", SRC_NORM, _norm_default_config),
    Case(NORM, "exact_math_changes_output", SRC_NORM,
         skip="the SFPU's approximate rsqrt/sigmoid are not modelled (the emulator computes both exactly), so "
              "approximate and exact configs give the same numbers here"),
    Case(NORM, "rejects_throttle_level", SRC_NORM,
         skip="the tested revision refuses throttle_level LEVEL_1; 0.81.1's library has no such message (absent "
              "from _ttnncpp.so), so 0.81.1 accepts it"),
    Case(NORM, "rejects_invalid_configs_tensors_options_and_sharded_output", SRC_NORM, _norm_rejects),
    Case(NORM, "gate_column_offset_reads_a_fused_projection", SRC_NORM_DOC, _norm_gate_column_offset),
    Case(NORM, "production_performance", SRC_NORM,
         skip="a real-time-profiler duration band on a P150b; the emulator has no device clock"),
]
