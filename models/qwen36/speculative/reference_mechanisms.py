"""The three commit mechanisms on the torch reference backend, one class each (names: ``mechanisms.MECHANISMS``).

A mechanism routes the GDN state of every slot through a packed verify (:meth:`ReferenceMechanism.verify`),
publishes each user's state after its own accepted row (:meth:`~ReferenceMechanism.commit`) or undoes the verify
(:meth:`~ReferenceMechanism.abort`), and counts the copies it makes where it makes them. What it keeps between
verify and commit lives in the step's transaction (``txn.saved``). :meth:`~ReferenceMechanism.expected_step_counters`
is the closed form of one user's step that the probes and tests check those counts against.

The reference model never mutates state tensors in place (it reassigns them), so shadow_commit's "point live at
slot a" is an assignment (a per-row gather), like a ring index on device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ..reference.batch import packed_forward
from ..reference.state import GDNState, ModelState
from .engine import MechanismCounters
from .mechanisms import resolve


@dataclass
class ReferenceVerify:
    rows: torch.Tensor  # [B, K+1] int64: user b's [pending, d_1..d_{k_b}] then inert padding
    n_valid: torch.Tensor  # [B] real rows per slot (k_b + 1; 0 outside the step)
    logits: torch.Tensor  # [B, K+1, V] fp32
    hidden: torch.Tensor  # [B, K+1, H]
    slots: dict[int, Any] | None = None  # layer -> GDN state after every row (shadow_commit)


@dataclass
class Transaction:
    """One step of the backend, from draft to commit or abort: what the mechanisms read and leave (``saved``)."""

    depths: dict[int, int]
    pos: torch.Tensor  # [B] target positions before the step
    mtp_pos: torch.Tensor  # [B]
    rng: dict[int, torch.Tensor]
    k: int = 0
    part: torch.Tensor | None = None  # [B] bool: slots in the step
    kvec: torch.Tensor | None = None  # [B] k_b (0 outside the step)
    verified: bool = False
    saved: Any = None
    verify: ReferenceVerify | None = None


class MechanismHost(Protocol):
    """What a mechanism uses of the backend that owns it (``ReferenceBackend``)."""

    model: Any
    state: ModelState
    occupied: torch.Tensor
    counters: MechanismCounters
    slots: int
    gdn_ids: list[int]

    def gdn(self) -> list[GDNState]: ...

    def gdn_bytes(self) -> int: ...

    def advance(self, rows: torch.Tensor, n_valid: torch.Tensor) -> None: ...


class ReferenceMechanism:
    """Routes the batch's GDN state through a packed verify and commits each user at its own accepted row."""

    name: ClassVar[str]

    def verify(self, be: MechanismHost, txn: Transaction, rows: torch.Tensor, n_valid: torch.Tensor):
        raise NotImplementedError

    def commit(self, be: MechanismHost, txn: Transaction, a: torch.Tensor) -> None:
        """``a`` [B]: accepted drafts per slot (0 outside the step). Leave every user of the step at the state
        after its row a_b with position pos_b + a_b + 1; slots outside the step unchanged."""
        raise NotImplementedError

    def abort(self, be: MechanismHost, txn: Transaction) -> None:
        """Undo a verify: GDN state of every slot exactly as before it (positions are the backend's)."""

    # ---- the closed form of one committed step of one user alone in the backend ----------------------------
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
        """Counters of one committed step (draft k, accept a) of a one-slot backend with n_gdn GDN layers holding
        gdn_bytes of state."""
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



def _where_rows(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


class Snapshot(ReferenceMechanism):
    """Copy the batch's GDN state, verify on live; users with a_b < k_b get their rows restored from the copy and
    re-advanced over their a_b + 1 accepted rows in one packed forward (the others inert)."""

    name = "snapshot"

    def verify(self, be, txn, rows, n_valid):
        txn.saved = [g.clone() for g in be.gdn()]
        be.counters.state_copies += len(txn.saved)
        be.counters.state_bytes_moved += be.gdn_bytes()
        return packed_forward(be.model, be.state, rows, n_valid, be.occupied)

    def commit(self, be, txn, a):
        redo = txn.part & (a < txn.kvec)
        if not bool(redo.any()):
            return
        for g, s in zip(be.gdn(), txn.saved):
            g.recurrent, g.conv = _where_rows(redo, s.recurrent, g.recurrent), _where_rows(redo, s.conv, g.conv)
        be.counters.state_copies += len(txn.saved)
        be.counters.state_bytes_moved += be.gdn_bytes() // be.slots * int(redo.sum())
        be.state.pos = torch.where(redo, txn.pos, be.state.pos)
        n = torch.where(redo, a + 1, 0)
        be.advance(txn.verify.rows[:, : int(n.max())], n)

    def abort(self, be, txn):
        for g, s in zip(be.gdn(), txn.saved):
            g.recurrent, g.conv = s.recurrent, s.conv
        be.counters.state_copies += len(txn.saved)
        be.counters.state_bytes_moved += be.gdn_bytes()

    def copies(self, k, a, n_gdn):
        return n_gdn * (1 + (a < k))

    def rerun_rows(self, k, a):
        return (a + 1) * (a < k)


class ShadowCommit(ReferenceMechanism):
    """Verify keeps every slot's state after every row; commit points each user at its own row a_b: no copies."""

    name = "shadow_commit"

    def verify(self, be, txn, rows, n_valid):
        txn.saved = [(g.recurrent, g.conv) for g in be.gdn()]  # references, not copies
        out = packed_forward(be.model, be.state, rows, n_valid, be.occupied)
        be.counters.slot_bytes_written += rows.shape[1] * be.gdn_bytes()
        return out

    def commit(self, be, txn, a):
        rows = torch.arange(be.slots, device=a.device)
        for i in be.gdn_ids:
            g, s = be.state.layers[i], txn.verify.slots[i]
            g.recurrent = _where_rows(txn.part, s.recurrent[rows, a], g.recurrent)
            g.conv = _where_rows(txn.part, s.conv[rows, a], g.conv)
        be.state.pos = torch.where(txn.part, txn.pos + a + 1, be.state.pos)

    def abort(self, be, txn):
        for g, (rec, conv) in zip(be.gdn(), txn.saved):
            g.recurrent, g.conv = rec, conv

    def copies(self, k, a, n_gdn):
        return 0

    def rerun_rows(self, k, a):
        return 0

    def slot_rows(self, k):
        return k + 1


class Recompute(ReferenceMechanism):
    """Verify on a scratch copy of the batch's GDN state (KV shared: rows past each position are scratch); commit
    re-runs every user's a_b + 1 accepted rows on live in one packed forward."""

    name = "recompute"

    def verify(self, be, txn, rows, n_valid):
        scratch = ModelState([s.clone() if isinstance(s, GDNState) else s for s in be.state.layers], be.state.pos)
        be.counters.state_copies += len(be.gdn_ids)
        be.counters.state_bytes_moved += be.gdn_bytes()
        return packed_forward(be.model, scratch, rows, n_valid, be.occupied)

    def commit(self, be, txn, a):
        n = torch.where(txn.part, a + 1, 0)
        be.advance(txn.verify.rows[:, : int(n.max())], n)

    def copies(self, k, a, n_gdn):
        return n_gdn

    def rerun_rows(self, k, a):
        return a + 1


REFERENCE_MECHANISMS: dict[str, type[ReferenceMechanism]] = {m.name: m for m in (Snapshot, ShadowCommit, Recompute)}


def reference_mechanism(mechanism: "str | ReferenceMechanism") -> ReferenceMechanism:
    """A name from ``mechanisms.MECHANISMS`` (or a built ReferenceMechanism) -> the reference backend's object."""
    return resolve(REFERENCE_MECHANISMS, mechanism)
