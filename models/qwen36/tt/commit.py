"""In-place commit of a packed K+1 verify on device, every commit mechanism (``tt/mechanisms.py``), traceable.

Input: the verify's per-GDN-layer records (``verify.GDNRecord``) and the acceptor's accepted count ``a``
(``DeviceAcceptor.count``, fp32 [1,1,1,1] on device). Nothing is read back.

    conv (every mechanism): new conv state = window rows a+1 .. a+Kc-1 (the shift register after row a),
        selected by one exact 0/1 matmul with sel = (c_conv_sel == a)  [1,1,Kc-1,Kc-1+T] (fp32, one 1 per row)
    shadow_commit: initial_state_block_idx = a*Hv + h (DeviceAcceptor.ring_block_idx): the next verify starts
        every head from ring slot a. Zero state copies.
    snapshot: the verify advanced live through all T rows; restore = re-advance from the snapshot all T rows with
        rows > a masked to identity (g = 0 -> decay 1, beta = 0 -> no update): fixed shape, exact, final state
        into live. 2 state copies per GDN layer (save + restore).
    recompute: the verify ran on scratch; re-run on live with the same masking. 1 copy per layer (scratch).
    positions: n' = n + a + 1; pending' = emitted token a (from the acceptor's result row).

Rows > a never reach live state: KV rows past n+a are overwritten by the next verify before any query can
attend them (bounds are n'..n'+K and n' <= n+a+1), and the masked recurrence ignores them.
"""
from __future__ import annotations

from .model_config import compute_config_fp32_state
from .verify import SpecDeviceState, VerifyOutputs


def commit(spec: SpecDeviceState, vout: VerifyOutputs, result) -> None:
    """Device-only commit of one step (see module doc). ``result`` = the acceptor's persistent result."""
    ttnn = spec.ttnn
    acc = spec.acceptor
    a = acc.count  # [1,1,1,1] fp32
    sel = ttnn.eq(spec.c_conv_sel, a)  # [1,1,Kc-1,Kc-1+T] 0/1 fp32
    cfg = compute_config_fp32_state(ttnn)
    mech = spec.mechanism
    mask = ttnn.le(spec.c_rows, a) if mech.readvance else None  # [1,T,1]: 1 for rows <= a
    for r in vout.plan.records:
        conv = ttnn.matmul(sel, r.window, dtype=r.state.conv.dtype, compute_kernel_config=cfg)
        ttnn.copy(conv, r.state.conv)
        if mask is not None:
            g = ttnn.reshape(ttnn.multiply(r.g, mask), list(r.g.shape))
            beta = ttnn.reshape(ttnn.multiply(r.beta, mask), list(r.beta.shape))
            initial = mech.readvance_initial(r.state, spec.layer_bufs[id(r.state)])
            r.gdn.recurrence(r.q, r.k, r.v, g, beta, r.state, "decode", initial=initial, final=r.state.recurrent)
    mech.after_commit(spec)
    # positions and the pending token
    ttnn.copy(ttnn.add(spec.n, ttnn.add(a, spec.c_one)), spec.n)
    toks = ttnn.typecast(ttnn.slice(result, [0, 0, 0, 0], [1, 1, 1, spec.t]), ttnn.float32)
    pend = ttnn.sum(ttnn.multiply(toks, ttnn.eq(spec.c_tok_cols, a)), dim=3, keepdim=True)
    ttnn.copy(pend, spec.pending)


def abort_after_verify(spec: SpecDeviceState) -> None:
    """Undo a verify that will not be committed (eager): the mechanism's abort. snapshot copies the snapshot back
    into live; recompute has nothing to undo (live untouched, KV rows >= n are scratch); shadow_commit refuses
    (the ring verify overwrote, in place, the slot it started from)."""
    spec.mechanism.abort_after_verify(spec)
