"""Probe gdn-transaction at CI size, in process: every cell passes; deliberately broken commit / abort
mechanisms make it fail (the probe tests the engine, these tests test the probe)."""
from __future__ import annotations

import argparse

import pytest
import torch

from qwen36.errors import UserError
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.speculative.reference_mechanisms import ShadowCommit, Snapshot
from qwen36.probes import gdn_transaction as probe


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return Qwen36Model.from_checkpoint(ckpt_factory("ci"), require_mtp=True)


@pytest.mark.slow  # the whole 51-cell reference probe
def test_probe_passes_every_cell_at_ci_size():
    args = argparse.Namespace(device="reference", full=False, checkpoint=None, ks="1,2,3,7", seed=0)
    report = probe.run(args)
    assert report.backend == "reference (torch CPU)"
    assert len(report.cells) == 3 * (2 + 3 + 4 + 8)
    failed = [(c["cell"], c["failed"]) for c in report.cells if not c["pass"]]
    assert not failed, failed
    assert report.verdict == "pass" and report.gate_complete
    assert report.counters["shadow_commit"]["state_copies"] == 0
    assert report.counters["snapshot"]["state_copies"] > 0 and report.counters["recompute"]["state_copies"] > 0
    # the exact cells really were exact
    for c in report.cells:
        assert all(c["abort"].values())
        if c["a"] == 0 and c["mechanism"] != "shadow_commit":
            assert c["gdn_recurrent"]["bit_equal"] and c["target_kv"]["bit_equal"], c["cell"]


class OffByOneSlot(ShadowCommit):
    def commit(self, be, txn, a):
        super().commit(be, txn, a - 1)  # the state after the row before the accepted one (a = 0: after row K)
        be.state.pos = torch.where(txn.part, txn.pos + a + 1, be.state.pos)  # positions stay right


class SnapshotWithoutRestore(Snapshot):
    def commit(self, be, txn, a):
        txn.saved = [g.clone() for g in be.gdn()]  # "restores" the advanced state, then re-advances on top of it
        super().commit(be, txn, a)


class RecomputeOneRowShort(ReferenceBackend):
    def advance(self, rows, n_valid):
        if rows.shape[1] == 1:  # a = 0 re-runs one row: nothing to drop
            return super().advance(rows, n_valid)
        short = n_valid > 1
        super().advance(rows[:, :-1], torch.where(short, n_valid - 1, n_valid))
        self.state.pos = self.state.pos + short.long()


class AbortForgetsShadow(ReferenceBackend):
    def abort(self):
        self._txn.verified = False  # skip restoring the pre-verify GDN tensors
        super().abort()


def with_mechanism(broken: type):
    """A backend factory whose backends run the (deliberately broken) mechanism class ``broken``."""
    return lambda model, mechanism, max_len: ReferenceBackend(model, broken(), max_len)


@pytest.mark.slow  # four probe runs with broken mechanisms
@pytest.mark.parametrize("factory,mechanism,must_fail,broken_at", [
    (with_mechanism(OffByOneSlot), "shadow_commit", "gdn_recurrent", (0, 1, 2)),
    (with_mechanism(SnapshotWithoutRestore), "snapshot", "gdn_recurrent", (0, 1)),  # only partial acceptance restores
    (RecomputeOneRowShort, "recompute", "gdn_recurrent", (1, 2)),  # a = 0 re-runs one row: nothing to drop
    (AbortForgetsShadow, "shadow_commit", "abort:gdn_recurrent", (0, 1, 2)),
])
def test_broken_mechanisms_fail_the_probe(model, factory, mechanism, must_fail, broken_at):
    cells, _ = probe.run_matrix(model, ks=(2,), mechanisms=(mechanism,), factory=factory)
    cells = [c for c in cells if c["a"] in broken_at]
    assert cells and all(not c["pass"] for c in cells), [(c["cell"], c["failed"]) for c in cells]
    assert all(must_fail in c["failed"] for c in cells), [(c["cell"], c["failed"]) for c in cells]


def test_probe_refuses_tt_devices_clearly():
    """The reference probe refuses a TT device and names the TT probe to run instead."""
    args = argparse.Namespace(device="emulated-p150x2", full=False, checkpoint=None, ks="1", seed=0)
    with pytest.raises(UserError, match="runs the reference engine.*gdn-transaction-tp --device emulated-p150x2"):
        probe.run(args)
