"""The three commit mechanisms on the torch reference backend, one class each (names: ``mechanisms.MECHANISMS``).

A mechanism routes the GDN state through the verify (:meth:`ReferenceMechanism.verify`), publishes the state after
the accepted row (:meth:`~ReferenceMechanism.commit`) or undoes the verify (:meth:`~ReferenceMechanism.abort`),
and counts the copies it makes where it makes them. What it keeps between verify and commit lives in the step's
transaction (``txn.saved``). :meth:`~ReferenceMechanism.expected_step_counters` is the closed form the probes and
tests check those counts against.

The reference model never mutates state tensors in place (it reassigns them), so shadow_commit's "point live at
slot a" is an assignment, like a ring index on device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..reference.state import GDNState, ModelState
from .mechanisms import resolve

if TYPE_CHECKING:
    from .reference_backend import ReferenceBackend, _Transaction

VERIFY_GDN_MODE = "recurrent"  # the token-by-token recurrence, as in single-row decode


class ReferenceMechanism:
    name: ClassVar[str]

    def verify(self, be: "ReferenceBackend", txn: "_Transaction", rows: torch.Tensor) -> Any:
        """Run the K+1 ``rows`` [1, K+1] through the target with this mechanism's state routing -> model output."""
        raise NotImplementedError

    def commit(self, be: "ReferenceBackend", txn: "_Transaction", a: int, accepted_rows: torch.Tensor) -> None:
        """Leave live GDN state = the state after row ``a`` and ``live.state.pos`` = n + a + 1."""
        raise NotImplementedError

    def abort(self, be: "ReferenceBackend", txn: "_Transaction") -> None:
        """Undo a verify: live GDN state exactly as before it (positions are the backend's)."""

    # ---- the closed form of one committed step ----------------------------------------------------------------
    def copies(self, k: int, a: int, n_gdn: int) -> int:
        """GDN layer-state copies of one step."""
        raise NotImplementedError

    def rerun_rows(self, k: int, a: int) -> int:
        """Rows the commit runs through the target again."""
        raise NotImplementedError

    def slot_rows(self, k: int) -> int:
        """Per-row state slots the verify writes."""
        return 0

    def expected_step_counters(self, k: int, a: int, n_gdn: int, gdn_bytes: int) -> dict[str, int]:
        """Counters of one committed step (draft k, accept a) with n_gdn GDN layers holding gdn_bytes of state."""
        copies, rerun = self.copies(k, a, n_gdn), self.rerun_rows(k, a)
        return {
            "steps": 1,
            "aborts": 0,
            "state_copies": copies,
            "state_bytes_moved": copies // max(1, n_gdn) * gdn_bytes,
            "slot_bytes_written": self.slot_rows(k) * gdn_bytes,
            "recurrence_steps": (k + 1 + rerun) * n_gdn,
            "target_forwards": 1 + (rerun > 0),
            "mtp_forwards": k,
        }


class Snapshot(ReferenceMechanism):
    """Verify copies live GDN state (1 copy / layer) and advances live through the K+1 rows; a commit with a < K
    restores the copy (1 copy / layer) and re-advances the a+1 accepted rows."""

    name = "snapshot"

    def verify(self, be, txn, rows):
        c = be.counters
        c.state_bytes_moved += be.gdn_bytes()
        txn.saved = [g.clone() for g in be.gdn()]
        c.state_copies += len(txn.saved)
        return be.model(rows, be.live.state, gdn_mode=VERIFY_GDN_MODE)

    def commit(self, be, txn, a, accepted_rows):
        if a < txn.k:  # partial acceptance: restore and re-advance the accepted rows
            self.restore(be, txn.saved)
            be.live.state.pos = txn.pos
            be.advance(accepted_rows)

    def abort(self, be, txn):
        self.restore(be, txn.saved)

    def restore(self, be: "ReferenceBackend", saved: list[GDNState]) -> None:
        for g, s in zip(be.gdn(), saved):
            g.copy_(s)  # live tensors were freshly produced by the verify: no one else holds them
        be.counters.state_copies += len(saved)
        be.counters.state_bytes_moved += sum(s.nbytes() for s in saved)

    def copies(self, k, a, n_gdn):
        return n_gdn * (1 + (a < k))

    def rerun_rows(self, k, a):
        return (a + 1) * (a < k)


class ShadowCommit(ReferenceMechanism):
    """Verify runs on live and keeps the state after every row (slots); commit points live at slot a: zero
    copies. Abort points live back at the pre-verify tensors (kept by reference, not copied)."""

    name = "shadow_commit"

    def verify(self, be, txn, rows):
        txn.saved = [(g.recurrent, g.conv) for g in be.gdn()]  # references, not copies
        out = be.model(rows, be.live.state, gdn_mode=VERIFY_GDN_MODE, per_token_states=True)
        be.counters.slot_bytes_written += rows.shape[1] * be.gdn_bytes()
        return out

    def commit(self, be, txn, a, accepted_rows):
        self.select_slots(be, txn.verify.slots, a)
        be.live.state.pos = txn.pos + a + 1

    def abort(self, be, txn):
        for g, (rec, conv) in zip(be.gdn(), txn.saved):
            g.recurrent, g.conv = rec, conv

    def select_slots(self, be: "ReferenceBackend", slots: dict, a: int) -> None:
        """The live state becomes slot a (the state after row a). No copy."""
        for i in be.gdn_ids:
            g = be.live.state.layers[i]
            g.recurrent, g.conv = slots[i].recurrent[:, a], slots[i].conv[:, a]

    def copies(self, k, a, n_gdn):
        return 0

    def rerun_rows(self, k, a):
        return 0

    def slot_rows(self, k):
        return k + 1


class Recompute(ReferenceMechanism):
    """Verify runs on a scratch copy of the GDN state (1 copy / layer; KV is shared, rows >= pos are scratch space
    anyway); commit re-runs the a+1 accepted rows on live, which the verify never touched. Abort: nothing to undo."""

    name = "recompute"

    def verify(self, be, txn, rows):
        c, live = be.counters, be.live
        c.state_bytes_moved += be.gdn_bytes()
        scratch = ModelState([s.clone() if isinstance(s, GDNState) else s for s in live.state.layers], live.state.pos)
        c.state_copies += len(be.gdn_ids)
        return be.model(rows, scratch, gdn_mode=VERIFY_GDN_MODE)

    def commit(self, be, txn, a, accepted_rows):
        be.advance(accepted_rows)

    def copies(self, k, a, n_gdn):
        return n_gdn

    def rerun_rows(self, k, a):
        return a + 1


REFERENCE_MECHANISMS: dict[str, type[ReferenceMechanism]] = {m.name: m for m in (Snapshot, ShadowCommit, Recompute)}


def reference_mechanism(mechanism: str | ReferenceMechanism) -> ReferenceMechanism:
    """A name from ``mechanisms.MECHANISMS`` (or a built ReferenceMechanism) -> the reference backend's object."""
    return resolve(REFERENCE_MECHANISMS, mechanism)
