"""Probe gdn-transaction-tp at CI size on the emulated 1x2 mesh: the full gate grid passes every cell (same cells as
`qwen36 probe gdn-transaction-tp --device emulated-p150x2`); deliberately broken
commits / aborts make the probe fail at the comparison they break (these tests test the probe)."""
from __future__ import annotations

import argparse

import pytest
import torch

from qwen36.errors import UserError
from qwen36.tt.spec.device_rows import DeviceRows
from qwen36.tt.spec.spec_backend import TTSpecBackend
from qwen36.testing.tt import make_bf16_checkpoint
from qwen36.probes import gdn_transaction_tp as probe
from qwen36.probes.registry import load_probe


@pytest.fixture(scope="module")
def tp_probe(tmp_path_factory):
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("gdn-tp") / "ci", "ci")
    p = probe.open_probe(ck, "emulated-p150x2", "accuracy", seed=0)
    yield p
    p.gen.close()


@pytest.mark.slow  # the whole CI grid through the emulated TT path
def test_full_grid_passes_every_cell(tp_probe):
    """The whole gate grid at CI size: K in {1,2,3,7} x every a x 3 mechanisms (51 cells) + the refusal cell."""
    cells, totals = probe.run_matrix(tp_probe)
    failed = [(c["cell"], c["failed"]) for c in cells if not c["pass"]]
    assert not failed, failed
    assert len(cells) == 3 * (2 + 3 + 4 + 8) + 1
    assert tp_probe.label == "tt (emulated-p150x2 (ttnn goldens on CPU))"  # from the MeshContext, never typed
    for c in cells:
        if "abort" not in c:
            assert c["result"] == "refused by design" and "ring" in c["reason"]
            continue
        assert all(c["abort"].values()) and c["accepted"] == c["a"], c["cell"]
        assert c["traces_replayed"] == 2, c["cell"]  # verify+accept and commit(+MTP) traces ran the cell's steps
        # measured on the emulator: conv, KV, MTP KV and the continuation are bit-equal to the decode replay;
        # the recurrent state differs from K+1 single-row recurrences in the last fp32 bits only
        for name in ("conv", "target_kv", "mtp_kv", "continuation_logits"):
            assert c[name]["bit_equal"], (c["cell"], name, c[name])
        assert c["gdn_recurrent"]["max_abs"] <= 1e-6 and not c["continuation_argmax_flips"], c["cell"]
    assert totals["shadow_commit"]["state_copies"] == 0 and totals["shadow_commit"]["slot_bytes_written"] > 0
    n_gdn = tp_probe.n_gdn
    assert totals["snapshot"]["state_copies"] == 17 * 2 * n_gdn and totals["recompute"]["state_copies"] == 17 * n_gdn


# ---- deliberately broken backends ------------------------------------------------------------------------------
def _write_const(spec, buf, x: torch.Tensor) -> None:
    spec.ttnn.copy_host_to_device_tensor(spec.host(x, buf), buf)


class WrongConvWindowRows(DeviceRows):
    """Commit selects the conv window one row too late (rows a+2.. instead of a+1..)."""

    def _setup(self, k):
        super()._setup(k)
        s = self.step_state
        _write_const(s, s.c_conv_rows, torch.arange(2, s.kc + 1, dtype=torch.float32).reshape(1, 1, 1, s.kc - 1))


class RingSlotOffByOneRows(DeviceRows):
    """shadow_commit points the next verify at ring slot a+1 instead of a."""

    def _setup(self, k):
        super()._setup(k)
        acc = self.acceptor
        hv = self.model.args.gdn_hv_d
        _write_const(self.step_state, acc.c_ring_heads, torch.arange(hv, dtype=torch.float32).reshape(1, 1, 1, hv) + hv)
        acc.ring_block_idx()


class ReadvanceMaskShortRows(DeviceRows):
    """snapshot/recompute re-advance masks one row too many (rows <= a-1 kept)."""

    def _setup(self, k):
        super()._setup(k)
        s = self.step_state
        _write_const(s, s.c_rows, torch.arange(s.t, dtype=torch.float32).reshape(1, s.t, 1) + 1)


class AbortWithoutRestoreRows(DeviceRows):
    """Abort after verify skips the snapshot restore."""

    def abort(self):
        if self._phase in ("verified", "accepted"):
            self._phase = "drafted"
        super().abort()


def broken(rows_cls):
    """A TTSpecBackend whose one-user layout is ``rows_cls`` (the probe builds backends from this factory)."""
    return type(rows_cls.__name__.removesuffix("Rows"), (TTSpecBackend,), {"one_user_layout": rows_cls})


WrongConvWindow, RingSlotOffByOne = broken(WrongConvWindowRows), broken(RingSlotOffByOneRows)
ReadvanceMaskShort, AbortWithoutRestore = broken(ReadvanceMaskShortRows), broken(AbortWithoutRestoreRows)


@pytest.mark.parametrize("factory,mechanism,accepts,must_fail", [
    (WrongConvWindow, "shadow_commit", (0, 2), "conv"),
    (RingSlotOffByOne, "shadow_commit", (0, 1), "gdn_recurrent"),
    (ReadvanceMaskShort, "recompute", (0, 2), "gdn_recurrent"),
    (AbortWithoutRestore, "snapshot", (1,), "abort:gdn_recurrent"),
])
@pytest.mark.slow  # probe runs with deliberately broken commits
def test_broken_commit_fails_the_probe(tp_probe, factory, mechanism, accepts, must_fail):
    tp_probe.factory = factory
    try:
        cells, _ = probe.run_matrix(tp_probe, ks=(2,), mechs=(mechanism,), accepts=set(accepts))
    finally:
        tp_probe.factory = TTSpecBackend
    cells = [c for c in cells if "abort" in c]
    assert len(cells) == len(accepts)
    assert all(not c["pass"] and must_fail in c["failed"] for c in cells), [(c["cell"], c["failed"]) for c in cells]


def test_registered_and_refuses_reference_devices():
    assert load_probe("gdn-transaction-tp") is probe
    args = argparse.Namespace(device="reference", full=False, checkpoint=None, ks="1", mechanisms="snapshot",
                              accepts=None, precision="accuracy", seed=0)
    with pytest.raises(UserError, match="runs the TT path"):
        probe.run(args)
