"""Conformance cases for the chunked Gated-DeltaNet ops of ttnn 0.81.1 (``transformer.chunk_gated_delta_rule`` and
``transformer.gated_delta_attn_seq``), restated from Tenstorrent's tests (registered into
``emulator_conformance.CASES``).

Sources (read for facts):

* ``tests/ttnn/unit_tests/operations/transformers/test_chunk_gated_delta_rule.py``: the chunk op against the
  token-by-token recurrence on the same bf16-rounded inputs (q/k L2-normalised upstream, beta from a sigmoid,
  g = -softplus/2, s0 zero or 0.1 randn), chunk 32, T in {32, 128, 256}, the regime shapes (TP-4 per-device
  4/12 heads, no GQA 12/12, batch 2, V = 64 and V = 32 with K = 128) at PCC >= 0.99999 for o and the final
  state (that test's measured bar; its ~5e-3 relative floor is the chunk kernel's own rounding). The same gate is
  applied to the flat rank-3 form (raw q/k, in-kernel L2 norm; 0.81.1 docstring) and to a T = 1 decode padded to
  32 rows with zero g/beta rows (identity steps). Its multicast A/B needs ``use_mcast``, which 0.81.1 lacks.
* ``transformer.gated_delta_attn_seq``: Tenstorrent's smoke test of Path A (its docstring "Quick smoke test for
  gated_delta_attn_seq Path A API"; the index does not give its path): L_unit and L_inv identity blocks, chunk/key/
  value 128, dl 0.95, (BH, NC) in {(1, 1), (1, 2), (2, 2), (4, 2), (12, 4), (12, 32)}, out and final state at
  PCC >= 0.99 against the chunked reference; and the device op's validation (``gated_delta_attn_device_operation
  .cpp``, its messages present in 0.81.1's library): float32 only, dims exactly 128, shapes checked per dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conformance_common import Case, _dev, _expect_rejected, pcc

SRC_CHUNK_REF = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_chunk_gated_delta_rule.py"
CHUNK = "transformer.chunk_gated_delta_rule"
SEQ = "transformer.gated_delta_attn_seq"
SRC_SEQ = "Tenstorrent's gated_delta_attn_seq Path A smoke test (tt-metal tree; path not given by the index)"
SRC_SEQ_OP = "tt-metal ttnn/cpp/ttnn/operations/transformer/gated_delta_attn/device/gated_delta_attn_device_operation.cpp"


def _first(ttnn, t):
    """Device 0's shard in its own torch dtype."""
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0])


# ---- chunk_gated_delta_rule against the token-by-token recurrence --------------------------------------------------
def _recurrent_ref(q, k, v, beta, g, s0):
    """The token-by-token gated delta rule in fp64 (q/k already expanded to the value heads), scale 1/sqrt(K)."""
    b, t, hv, dk = q.shape
    s = torch.zeros(b, hv, dk, v.shape[-1], dtype=torch.float64) if s0 is None else s0.double().clone()
    outs = []
    for i in range(t):
        s = s * torch.exp(g[:, i].double())[..., None, None]
        delta = (v[:, i].double() - torch.einsum("bhk,bhkv->bhv", k[:, i].double(), s)) * beta[:, i].double()[..., None]
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i].double(), delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i].double() * dk ** -0.5, s))
    return torch.stack(outs, 1), s


def _chunk_inputs(b, t, hk, hv, dk, dv, with_state, seed=20260910):
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, hk, dk, generator=g_), dim=-1)
    k = F.normalize(torch.randn(b, t, hk, dk, generator=g_), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=g_)
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=g_))
    g = -F.softplus(torch.randn(b, t, hv, generator=g_)) * 0.5
    s0 = 0.1 * torch.randn(b, hv, dk, dv, generator=g_) if with_state else None
    return q, k, v, beta, g, s0


def _chunk_vs_recurrent(b, hk, hv, dk, dv, t, with_state, flat=False):
    def run(ttnn, mesh):
        q, k, v, beta, g, s0 = _chunk_inputs(b, t, hk, hv, dk, dv, with_state)
        grp = hv // hk
        if flat:  # raw q/k: the kernel normalises; scale them so the in-kernel norm has work to do
            q, k = q * 3.0, k * 0.25
        qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
        dev = lambda x, dt=ttnn.float32: _dev(ttnn, mesh, x, dt)  # noqa: E731
        shape = (lambda x: x.reshape(b, t, -1)) if flat else (lambda x: x)
        o, fs = ttnn.transformer.chunk_gated_delta_rule(
            dev(shape(qb), ttnn.bfloat16), dev(shape(kb), ttnn.bfloat16), dev(shape(vb), ttnn.bfloat16), dev(g),
            dev(beta), initial_state=None if s0 is None else dev(s0), output_final_state=True, chunk_size=32)
        qr, kr = qb.double(), kb.double()
        if flat:
            qr, kr = F.normalize(qr, dim=-1, eps=1e-6), F.normalize(kr, dim=-1, eps=1e-6)
        ro, rs = _recurrent_ref(qr.repeat_interleave(grp, 2), kr.repeat_interleave(grp, 2), vb, beta, g, s0)
        got_o = _first(ttnn, o).float().reshape(b, t, hv, dv)
        got_s = _first(ttnn, fs).float().reshape(b, hv, dk, dv)
        assert pcc(ro, got_o) >= 0.99999, pcc(ro, got_o)
        assert pcc(rs, got_s) >= 0.99999, pcc(rs, got_s)
    return run


def _chunk_decode_padded(ttnn, mesh):
    """A T = 1 decode through the flat chunk form: the token padded to 32 rows whose g and beta are zero, so the
    padding rows are identity steps; the state equals one recurrence step, o's row 0 the step's output."""
    hk, hv, d = 2, 6, 128
    q, k, v, beta, g, s0 = _chunk_inputs(1, 1, hk, hv, d, d, True, seed=3)
    pad = lambda x: torch.cat([x, torch.zeros(1, 31, *x.shape[2:])], 1)  # noqa: E731
    qb, kb, vb = (pad(x).to(torch.bfloat16) for x in (q, k, v))
    dev = lambda x, dt=ttnn.float32: _dev(ttnn, mesh, x, dt)  # noqa: E731
    o, fs = ttnn.transformer.chunk_gated_delta_rule(
        dev(qb.reshape(1, 32, -1), ttnn.bfloat16), dev(kb.reshape(1, 32, -1), ttnn.bfloat16),
        dev(vb.reshape(1, 32, -1), ttnn.bfloat16), dev(pad(g)), dev(pad(beta)), initial_state=dev(s0),
        output_final_state=True, chunk_size=32, output_head_major=True)
    qr = F.normalize(qb[:, :1].double(), dim=-1, eps=1e-6).repeat_interleave(3, 2)
    kr = F.normalize(kb[:, :1].double(), dim=-1, eps=1e-6).repeat_interleave(3, 2)
    ro, rs = _recurrent_ref(qr, kr, vb[:, :1], beta, g, s0)
    got = _first(ttnn, o)
    assert list(o.shape) == [hv, 32, d] and pcc(ro[0, 0], got[:, 0]) >= 0.99999
    assert pcc(rs, _first(ttnn, fs)) >= 0.99999


# ---- gated_delta_attn_seq -----------------------------------------------------------------------------------------
def _seq_host(bh, nc, c=128, d=128):
    g_ = torch.Generator().manual_seed(42)
    blocks = torch.block_diag(*[torch.eye(32)] * (c // 32))
    return {"L_unit": blocks.expand(bh, nc, c, c).clone(), "v_beta_sc": torch.randn(bh, nc, c, d, generator=g_) * 0.3,
            "k_bd_sc": torch.randn(bh, nc, c, d, generator=g_) * 0.1,
            "intra_attn": torch.randn(bh, nc, c, c, generator=g_) * 0.01,
            "q_decay": torch.randn(bh, nc, c, d, generator=g_) * 0.1,
            "k_decay_t": torch.randn(bh, nc, d, c, generator=g_) * 0.1, "dl_exp": torch.full((bh, nc, 1, 1), 0.95),
            "L_inv": torch.eye(32).repeat(c // 32, 1).expand(bh, nc, c, 32).clone()}


_SEQ_ORDER = ("L_unit", "v_beta_sc", "k_bd_sc", "intra_attn", "q_decay", "k_decay_t", "dl_exp", "L_inv")


def _seq_smoke(bh, nc):
    def run(ttnn, mesh):
        x = _seq_host(bh, nc)
        out, st = ttnn.transformer.gated_delta_attn_seq(*(_dev(ttnn, mesh, x[n], ttnn.float32) for n in _SEQ_ORDER))
        s = torch.zeros(bh, 128, 128, dtype=torch.float64)
        outs = []
        for n in range(nc):  # L_unit = I: v_cor = v_beta_sc, k_cum = k_bd_sc
            v_new = x["v_beta_sc"][:, n].double() - x["k_bd_sc"][:, n].double() @ s
            outs.append(x["q_decay"][:, n].double() @ s + x["intra_attn"][:, n].double() @ v_new)
            s = s * 0.95 + x["k_decay_t"][:, n].double() @ v_new
        assert list(out.shape) == [bh, nc, 128, 128] and out.dtype == ttnn.float32 and list(st.shape) == [bh, 128, 128]
        assert pcc(torch.stack(outs, 1), _first(ttnn, out)) >= 0.99
        assert pcc(s, _first(ttnn, st)) >= 0.99
    return run


def _seq_rejects(ttnn, mesh):
    x = _seq_host(1, 1)
    dev = {n: _dev(ttnn, mesh, x[n], ttnn.float32) for n in _SEQ_ORDER}
    call = lambda d: ttnn.transformer.gated_delta_attn_seq(*(d[n] for n in _SEQ_ORDER))  # noqa: E731
    _expect_rejected(lambda: call(dict(dev, q_decay=_dev(ttnn, mesh, x["q_decay"], ttnn.bfloat16))),
                     "q_decay must be float32, got DataType::BFLOAT16")
    _expect_rejected(lambda: call(dict(dev, L_inv=_dev(ttnn, mesh, x["L_inv"], ttnn.float32,
                                                       ttnn.ROW_MAJOR_LAYOUT))), "L_inv must be tiled")
    _expect_rejected(lambda: call(dict(dev, dl_exp=_dev(ttnn, mesh, torch.ones(1, 1, 1, 2), ttnn.float32))),
                     "dl_exp dim[3] expected 1 got 2")
    small = _seq_host(1, 1, d=64)
    _expect_rejected(lambda: call(dict(dev, k_bd_sc=_dev(ttnn, mesh, small["k_bd_sc"], ttnn.float32))),
                     "key_dim must be exactly 128, got 64")


CASES: list[Case] = []
for _name, _shape in (("tp4", (1, 4, 12, 128, 128)), ("no_gqa", (1, 12, 12, 128, 128)), ("batch2", (2, 4, 12, 128, 128)),
                      ("v64", (1, 4, 12, 128, 64)), ("v32", (1, 4, 12, 128, 32))):
    for _t in (32, 128):
        for _st in (False, True):
            CASES.append(Case(CHUNK, f"vs_recurrent_{_name}_T{_t}_{'s0rand' if _st else 's0zero'}", SRC_CHUNK_REF,
                              _chunk_vs_recurrent(*_shape, _t, _st), ci=_name == "tp4" and _t == 32))
for _t in (32, 256):
    CASES.append(Case(CHUNK, f"flat_rank3_vs_recurrent_tp4_T{_t}", SRC_CHUNK_REF,
                      _chunk_vs_recurrent(1, 4, 12, 128, 128, _t, True, flat=True), ci=_t == 32))
CASES += [
    Case(CHUNK, "vs_recurrent_T256", SRC_CHUNK_REF, _chunk_vs_recurrent(1, 4, 12, 128, 128, 256, True), ci=False),
    Case(CHUNK, "flat_decode_padded_to_32_rows", SRC_CHUNK_REF, _chunk_decode_padded),
    Case(CHUNK, "scan_mcast_bit_exact", SRC_CHUNK_REF,
         skip="the multicast A/B toggles use_mcast, which is not an argument of 0.81.1's chunk_gated_delta_rule"),
]
for _bh, _nc in ((1, 1), (1, 2), (2, 2), (4, 2), (12, 4), (12, 32)):
    CASES.append(Case(SEQ, f"smoke_bh{_bh}_nc{_nc}", SRC_SEQ, _seq_smoke(_bh, _nc), ci=_bh * _nc <= 2))
CASES.append(Case(SEQ, "rejects_dtype_layout_shape_and_dims", SRC_SEQ_OP, _seq_rejects))
