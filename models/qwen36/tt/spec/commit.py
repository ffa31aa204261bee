"""In-place commit of a packed K+1 verify on device, every commit mechanism (``tt/spec/mechanisms.py``), traceable.

Input: what each GDN layer kept in the verify (``tt/model/gdn_plan.GDNKept``, in ``vout.plan.gdn.kept``) and the
acceptor's accepted count ``a`` (``DeviceAcceptor.count``, fp32 [1,1,1,1] on device). Nothing is read back.

    conv (every mechanism): new conv state = window rows a+1 .. a+Kc-1 (the shift register after row a),
        gathered exactly with ``ttnn.embedding`` (row indices a+1+i as uint32). A 0/1 selector matmul is not exact
        on cards: the FPU reads the fp32 window as TF32, and with K = Kc-1+T not a multiple of 32 it multiplies
        the garbage tile padding of the selector and the window (tests/emulator/test_strict_numerics.py shows both).
    shadow_commit: initial_state_block_idx = a*Hv + h (DeviceAcceptor.ring_block_idx): the next verify starts
        every head from ring slot a. Zero state copies.
    snapshot: the verify advanced live through all T rows; restore = re-advance from the snapshot all T rows with
        rows > a masked to identity (g = 0 -> decay 1, beta = 0 -> no update): fixed shape, exact, final state
        into live. 2 state copies per GDN layer (save + restore).
    recompute: the verify ran on scratch; re-run on live with the same masking. 1 copy per layer (scratch).
    positions: n' = n + a + 1; pending' = emitted token a (from the acceptor's result row).

Host rows (``HostRowsState``, tt/spec/host_rows.py, B user slots): user b's a_b = count_b for the users in the step and -1
for the others (``active`` [1, B, 1, 1], written by the host): conv rows 0.. (unchanged), nothing re-advanced, and
count_b zeroed so the ring points the user at slot 0 (its unchanged state). Positions and pending tokens are host
inputs of the next step there, not device state.

Rows > a never reach live state: KV rows past n+a are overwritten by the next verify before any query can
attend them (bounds are n'..n'+K and n' <= n+a+1), and the masked recurrence ignores them.
"""
from __future__ import annotations

from .verify import SpecDeviceState, VerifyOutputs


def commit(step_state: SpecDeviceState, vout: VerifyOutputs, result=None) -> None:
    """Device-only commit of one step (see module doc): the step state's row selection (one user: from the accepted
    count; B slots: per user, -1 outside the step), the GDN layers, then the position and pending token (one user:
    from ``result``, the acceptor's persistent result; B slots take none)."""
    idx, mask = step_state.commit_selection()
    commit_gdn_layers(step_state, vout.plan.gdn.kept, idx, mask)
    step_state.advance(result)


def commit_gdn_layers(step_state, kept, conv_idx, mask) -> None:
    """The GDN part of a commit, device and host rows alike: per layer,
    conv state = window rows ``conv_idx`` (uint32 ROW_MAJOR [1, B*(Kc-1)], rows of the window viewed as
    [B*(Kc-1+T), Cd]); for the re-advance mechanisms, the K+1 rows re-run with g and beta multiplied by ``mask``
    (1 for the rows to keep); then the mechanism's own commit work (``after_commit``)."""
    ttnn, mech = step_state.ttnn, step_state.mechanism
    for r in kept:
        shape = list(r.window.shape)  # [B, 1, Kc-1+T, Cd]
        rows = 1
        for d in shape[:-1]:
            rows *= d
        table = ttnn.reshape(r.window, [rows, shape[-1]])  # the window is ROW_MAJOR (tt/model/gdn.py causal_conv): a view
        conv = ttnn.embedding(conv_idx, table, layout=r.state.conv.layout, dtype=r.state.conv.dtype)
        ttnn.copy(ttnn.reshape(conv, list(r.state.conv.shape)), r.state.conv)
        if mask is not None:
            g = ttnn.reshape(ttnn.multiply(r.g, mask), list(r.g.shape))
            beta = ttnn.reshape(ttnn.multiply(r.beta, mask), list(r.beta.shape))
            initial = mech.readvance_initial(r.state, step_state.layer_bufs[id(r.state)])
            r.layer.recurrence(r.q, r.k, r.v, g, beta, r.state, "decode", initial=initial, final=r.state.recurrent)
    mech.after_commit(step_state)


def abort_after_verify(step_state: SpecDeviceState) -> None:
    """Undo a verify that will not be committed (eager): the mechanism's abort. snapshot copies the snapshot back
    into live; recompute has nothing to undo (live untouched, KV rows >= n are scratch); shadow_commit refuses
    (the ring verify overwrote, in place, the slot it started from)."""
    step_state.mechanism.abort_after_verify(step_state)
