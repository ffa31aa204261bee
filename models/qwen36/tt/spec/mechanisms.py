"""The three commit mechanisms on the TT backend, one class each (names: ``speculative.mechanisms.MECHANISMS``).

A mechanism owns, per GDN layer, its persistent buffers (allocated once, before any capture, through
``SpecDeviceState._dev``: the mechanisms are the step state's own parts), the device work
before the verify, the verify's recurrence routing, its part of the device commit, the eager abort after a verify,
and the counters one step adds. Everything here except :meth:`TTMechanism.start` and
:meth:`~TTMechanism.abort_after_verify` is device-only and traceable. The commit it plugs into is
``tt/spec/commit.py``; the step state is ``verify.SpecDeviceState``.

Device shapes are fixed per K, so every mechanism costs the same whatever the accepted count a:

    shadow_commit  the verify runs the recurrence in ring mode (per-row states written in place into K+1 ring slots,
                   head h starting from ring block ``initial_state_block_idx[h]``); the commit only moves the ring
                   index to slot a. Zero state copies; abort after a verify is impossible (see ShadowCommit).
    snapshot       copy live recurrent + conv, verify on live; the commit re-advances from the copy all K+1 rows
                   with rows > a masked to identity (exact, fixed shape). 2 copies / layer / step.
    recompute      copy recurrent to scratch, verify on scratch (the conv window is kept by the verify); the commit
                   re-advances live the same masked way. 1 copy / layer / step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ...speculative.engine import MechanismCounters
from ...speculative.mechanisms import resolve
from ..model.gdn_plan import GDNRoute


class StepState(Protocol):
    """What a mechanism uses of the step state that owns it (``verify.SpecDeviceState``): the mesh's ttnn, the
    verify's row count and GDN head shapes, the live state and per-layer buffers, the acceptor's ring index, and its
    device-tensor helper."""

    ttnn: Any
    t: int
    hv: int
    dk: int
    dv: int
    state: Any
    layer_bufs: dict
    acceptor: Any
    block_idx: Any
    c_zero: Any
    row_mask: Any

    def _dev(self, x: torch.Tensor, dtype=None, layout=None) -> Any: ...


FP32_BYTES = 4


@dataclass(frozen=True)
class GDNStateBytes:
    """Bytes of the GDN state of all GDN layers on one device (fp32): recurrent [Hv_d, Dk, Dv] and conv window
    [Kc-1, conv channels per device] per layer."""

    recurrent: int
    conv: int

    @property
    def total(self) -> int:
        return self.recurrent + self.conv

    @classmethod
    def of(cls, args, n_layers: int) -> "GDNStateBytes":
        """From TTModelArgs (per-device head counts) and the number of GDN layers built."""
        c = args.cfg
        rec = args.gdn_hv_d * c.linear_key_head_dim * c.linear_value_head_dim * FP32_BYTES
        conv = (c.linear_conv_kernel_dim - 1) * args.gdn_conv_dim_d * FP32_BYTES
        return cls(rec * n_layers, conv * n_layers)


@dataclass
class SpecLayerBuffers:
    """One GDN layer's persistent mechanism buffers (only the mechanism's own are set)."""

    ring: Any = None  # shadow_commit: [T*Hv_d, Dk, Dv] fp32
    snap_rec: Any = None  # snapshot
    snap_conv: Any = None
    scratch_rec: Any = None  # recompute


class TTMechanism:
    name: ClassVar[str]
    ring: ClassVar[bool] = False  # the committed recurrent state is the ring slot the ring index points at
    readvance: ClassVar[bool] = False  # the commit re-runs the K+1 rows, rows > a masked to identity

    # ---- buffers and host-side setup (outside any capture) -------------------------------------------------------
    def buffers(self, step_state: StepState, s) -> SpecLayerBuffers:
        """Allocate GDN layer state ``s``'s buffers."""
        raise NotImplementedError

    def start(self, step_state: StepState) -> None:
        """After a prefill (eager)."""

    def ring_index(self, acceptor):
        """The device ring index the verify starts each head from (None: no ring)."""
        return None

    # ---- switching draft depth between steps (device, traceable) ----------------------------------------------
    def leave(self, step_state: StepState) -> None:
        """After the last commit at this depth: the committed recurrent state into the live ``state.recurrent``
        (where the next depth's :meth:`enter` takes it from). Nothing to do when the commit already leaves it
        there (every mechanism but the ring)."""

    def enter(self, step_state: StepState) -> None:
        """Before the first verify at this depth, after another depth's :meth:`leave`."""

    def count_switch(self, c: MechanismCounters, n_gdn: int, nbytes: GDNStateBytes) -> None:
        """What one leave + enter pair adds."""

    # ---- device work (traceable) -----------------------------------------------------------------------------
    def pre_verify(self, step_state: StepState, s, bufs: SpecLayerBuffers) -> None:
        """Copies before the verify."""

    def route(self, step_state: StepState, bufs: SpecLayerBuffers) -> GDNRoute:
        """Where the verify's K+1 rows take one GDN layer's state (plain data the layer reads: conv window kept or
        advanced, the recurrent state's start and end buffers or the ring; the host-row mask)."""
        raise NotImplementedError

    def readvance_initial(self, state, bufs: SpecLayerBuffers):
        """The recurrent state the commit's masked re-advance starts from (``readvance`` mechanisms)."""
        raise NotImplementedError

    def after_commit(self, step_state: StepState) -> None:
        """Commit work after the per-layer part (every mechanism: conv select, then this)."""

    # ---- abort (eager) -----------------------------------------------------------------------------------------
    def abort_after_verify(self, step_state: StepState) -> None:
        """Undo a verify that will not be committed: live GDN state exactly as before it."""

    # ---- counters ----------------------------------------------------------------------------------------------
    def count_verify(self, c: MechanismCounters, t: int, n_gdn: int, nbytes: GDNStateBytes) -> None:
        """What the pre-verify copies and the verify's state writes add (the forward itself: the backend)."""

    def count_commit(self, c: MechanismCounters, t: int, n_gdn: int, nbytes: GDNStateBytes) -> None:
        """What the commit's state work adds."""

    def expected_step_counters(self, k: int, a: int, n_gdn: int, nbytes: GDNStateBytes) -> dict[str, int]:
        """Counters of one committed step, in closed form. ``a`` does not matter (fixed device shapes); it is taken
        for symmetry with the reference formula."""
        t = k + 1
        return {"steps": 1, "aborts": 0, "target_forwards": 1, "mtp_forwards": k,
                "state_copies": self.copies_per_step(n_gdn), "state_bytes_moved": self.bytes_per_step(nbytes),
                "slot_bytes_written": t * nbytes.total if self.ring else 0,
                "recurrence_steps": t * n_gdn * (2 if self.readvance else 1)}

    def copies_per_step(self, n_gdn: int) -> int:
        raise NotImplementedError

    def bytes_per_step(self, nbytes: GDNStateBytes) -> int:
        raise NotImplementedError


class ShadowCommit(TTMechanism):
    """Ring verify, commit = ring index to slot a. Abort after a verify is refused: the ring verify overwrites, in
    place, the slot it started from, and undoing that would need the copy this mechanism exists to avoid."""

    name = "shadow_commit"
    ring = True

    def buffers(self, step_state, s):
        return SpecLayerBuffers(ring=step_state._dev(torch.zeros(step_state.t * step_state.hv, step_state.dk, step_state.dv), step_state.ttnn.float32))

    def start(self, step_state):
        """Put the live recurrent state in ring slot 0 and point every head at it (count 0). Device ops only
        (traceable): :meth:`enter` runs it inside a trace."""
        ttnn = step_state.ttnn
        for s in step_state.state.gdn_states():
            ring = step_state.layer_bufs[id(s)].ring
            slot0 = ttnn.reshape(s.recurrent, [step_state.hv, step_state.dk, step_state.dv])
            rest = ttnn.slice(ring, [step_state.hv, 0, 0], [step_state.t * step_state.hv, step_state.dk, step_state.dv])
            ttnn.copy(ttnn.concat([slot0, rest], dim=0), ring)
        ttnn.copy(step_state.c_zero, step_state.acceptor.count)
        step_state.acceptor.ring_block_idx()

    def ring_index(self, acceptor):
        return acceptor.block_idx

    def leave(self, step_state):
        """Ring slot a (the ring index) -> live recurrent, per GDN layer: an exact row gather (``ttnn.embedding``
        over the ring viewed as [T*Hv, Dk*Dv], one index per head = the ring index itself)."""
        ttnn, hv, dk, dv, t = step_state.ttnn, step_state.hv, step_state.dk, step_state.dv, step_state.t
        for s in step_state.state.gdn_states():
            ring = step_state.layer_bufs[id(s)].ring
            table = ttnn.to_layout(ttnn.reshape(ring, [t * hv, dk * dv]), ttnn.ROW_MAJOR_LAYOUT)
            slot = ttnn.embedding(step_state.block_idx, table, layout=ttnn.TILE_LAYOUT, dtype=s.recurrent.dtype)
            ttnn.copy(ttnn.reshape(slot, list(s.recurrent.shape)), s.recurrent)

    def enter(self, step_state):
        """Live recurrent -> this depth's ring slot 0, ring index -> slot 0 (what :meth:`start` does)."""
        self.start(step_state)

    def count_switch(self, c, n_gdn, nbytes):
        c.state_copies += 2 * n_gdn  # ring slot -> live, live -> the other ring
        c.state_bytes_moved += 2 * nbytes.recurrent

    def route(self, step_state, bufs):
        return GDNRoute(conv_write=False, initial=bufs.ring, ring_idx=step_state.block_idx,
                        row_mask=step_state.row_mask)

    def after_commit(self, step_state):
        step_state.acceptor.ring_block_idx()  # initial_state_block_idx = a*Hv + h: the next verify starts from slot a

    def abort_after_verify(self, step_state):
        raise RuntimeError("shadow_commit: abort after verify is impossible without a copy (the ring verify "
                           "writes all K+1 slots in place, including the one it started from); abort before "
                           "verify, or use --commit snapshot/recompute")

    def count_verify(self, c, t, n_gdn, nbytes):
        c.slot_bytes_written += t * nbytes.total

    def copies_per_step(self, n_gdn):
        return 0

    def bytes_per_step(self, nbytes):
        return 0


class Snapshot(TTMechanism):
    """Save live recurrent + conv, verify on live; commit: masked re-advance from the saved copy into live."""

    name = "snapshot"
    readvance = True

    def buffers(self, step_state, s):
        return SpecLayerBuffers(snap_rec=step_state._dev(torch.zeros(list(s.recurrent.shape)), s.recurrent.dtype),
                                snap_conv=step_state._dev(torch.zeros(list(s.conv.shape)), s.conv.dtype,
                                                          s.conv.layout))

    def pre_verify(self, step_state, s, bufs):
        step_state.ttnn.copy(s.recurrent, bufs.snap_rec)
        step_state.ttnn.copy(s.conv, bufs.snap_conv)

    def route(self, step_state, bufs):
        return GDNRoute(conv_write=True, row_mask=step_state.row_mask)  # live advances through all T rows

    def readvance_initial(self, state, bufs):
        return bufs.snap_rec

    def abort_after_verify(self, step_state):
        ttnn = step_state.ttnn
        for s in step_state.state.gdn_states():
            b = step_state.layer_bufs[id(s)]
            ttnn.copy(b.snap_rec, s.recurrent)
            ttnn.copy(b.snap_conv, s.conv)

    def count_verify(self, c, t, n_gdn, nbytes):
        c.state_copies += n_gdn
        c.state_bytes_moved += nbytes.total

    def count_commit(self, c, t, n_gdn, nbytes):
        c.state_copies += n_gdn  # restore (fixed shape: always, rows > a masked to identity)
        c.state_bytes_moved += nbytes.total
        c.recurrence_steps += t * n_gdn  # the masked re-advance runs all K+1 rows

    def copies_per_step(self, n_gdn):
        return 2 * n_gdn

    def bytes_per_step(self, nbytes):
        return 2 * nbytes.total


class Recompute(TTMechanism):
    """Verify on a scratch copy of the recurrent state; commit: masked re-advance of live (untouched by the verify).
    Abort after a verify: nothing to undo (live untouched, KV rows >= n are scratch)."""

    name = "recompute"
    readvance = True

    def buffers(self, step_state, s):
        return SpecLayerBuffers(scratch_rec=step_state._dev(torch.zeros(list(s.recurrent.shape)), s.recurrent.dtype))

    def pre_verify(self, step_state, s, bufs):
        step_state.ttnn.copy(s.recurrent, bufs.scratch_rec)

    def route(self, step_state, bufs):
        return GDNRoute(conv_write=False, initial=bufs.scratch_rec, final=bufs.scratch_rec,
                        row_mask=step_state.row_mask)

    def readvance_initial(self, state, bufs):
        return state.recurrent

    def count_verify(self, c, t, n_gdn, nbytes):
        c.state_copies += n_gdn
        c.state_bytes_moved += nbytes.recurrent  # the conv window is kept by the verify, not copied

    def count_commit(self, c, t, n_gdn, nbytes):
        c.recurrence_steps += t * n_gdn  # the masked re-advance runs all K+1 rows

    def copies_per_step(self, n_gdn):
        return n_gdn

    def bytes_per_step(self, nbytes):
        return nbytes.recurrent


TT_MECHANISMS: dict[str, type[TTMechanism]] = {m.name: m for m in (Snapshot, ShadowCommit, Recompute)}


def tt_mechanism(mechanism: str | TTMechanism) -> TTMechanism:
    """A name from ``speculative.mechanisms.MECHANISMS`` (or a built TTMechanism) -> the TT backend's object."""
    return resolve(TT_MECHANISMS, mechanism)
