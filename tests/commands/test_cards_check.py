"""The card suite (`qwen36 cards-check`, `make test-cards`): the whole sequence end to end on the emulated mesh at
CI size, stop-at-first-failure with a one-line reason and the record path, and every registered probe placed."""
from __future__ import annotations

import json

import pytest

from qwen36.probes import card_suite
from qwen36.probes.card_suite import Step, run_suite


def _records(d):
    return {p.name: [json.loads(l) for l in p.read_text().splitlines() if l.strip()] for p in sorted(d.glob("*.jsonl"))}


@pytest.mark.slow  # the whole sequence: smoke, two pytest runs and every TT probe at CI size
def test_card_suite_runs_end_to_end_on_the_emulated_mesh(tmp_path, capsys):
    from qwen36.cli import main
    from qwen36.probes.registry import PROBES

    rc = main(["cards-check", "--device", "emulated-p150x2", "--size", "ci", "--records-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    recs = _records(tmp_path)
    expected = ["smoke", "layer-pcc", "traced-decode"] + [n for n in card_suite.PROBE_ORDER if n in PROBES]
    assert [name.split("-", 1)[1].removesuffix(".jsonl") for name in recs] == expected  # in order, one file each
    for name, (rec,) in recs.items():
        assert rec["verdict"] == "pass" and rec["cells"], name
        assert "emulated-p150x2" in rec["backend"] and "hardware" not in rec["backend"], (name, rec["backend"])
        assert rec["ttnn_version"] == "0.81.1"
    # the pytest steps really ran the card tests on the emulated mesh (a skip would be a failed cell)
    pcc = recs["02-layer-pcc.jsonl"][0]["cells"]
    assert len(pcc) == 1 and all("test_layers_on_cards" in c["cell"] and "accuracy" in c["cell"] for c in pcc)
    assert any("test_traced_greedy" in c["cell"] for c in recs["03-traced-decode.jsonl"][0]["cells"])
    assert "cards-check passed on emulated-p150x2 (ttnn goldens on CPU)" in out
    if "gate-0a" not in PROBES:
        assert "gate-0a: skipped (not registered" in out


def test_suite_stops_at_the_first_failure_with_reason_and_record(tmp_path, monkeypatch):
    ran = []

    def fake_probe(step, device):
        ran.append(step.name)
        if step.name == "lossless":
            raise RuntimeError("TT greedy != reference greedy at token 3\nsecond line")
        return card_suite.ProbeReport(probe=step.name, backend="from-probe", config={}, cells=[{"pass": True}])

    monkeypatch.setattr(card_suite, "run_probe", fake_probe)
    lines = []
    steps = [Step("verify-tp", "probe"), Step("gate-0a", "unavailable", "not registered"), Step("lossless", "probe"),
             Step("gate-0b", "probe")]
    results = run_suite("emulated-p150x2", "ci", tmp_path, steps=steps, echo=lines.append)
    assert ran == ["verify-tp", "lossless"]  # gate-0b never started
    assert [r.verdict for r in results] == ["pass", "skipped", "fail"]
    fail = results[-1]
    assert fail.record == tmp_path / "03-lossless.jsonl" and fail.record.is_file()
    rec = json.loads(fail.record.read_text())
    assert rec["verdict"] == "fail" and "token 3" in rec["cells"][0]["failed"][0]
    assert (tmp_path / "03-lossless.traceback.txt").is_file()
    last = lines[-1]
    assert "\n" not in last and "FAILED at lossless" in last and "token 3 second line" in last
    assert str(fail.record) in last
    assert not (tmp_path / "04-gate-0b.jsonl").exists()


def test_every_registered_probe_is_placed_in_the_suite():
    assert card_suite.unplaced_probes() == []
    assert set(card_suite.PROBE_ORDER).isdisjoint(card_suite.NOT_IN_SUITE)


def test_hardware_suite_leaves_out_emulator_only_probes(monkeypatch, tmp_path):
    from qwen36.tt_ops import device as dev

    monkeypatch.delenv("TT_METAL_SIMULATOR", raising=False)
    steps = {s.name: s for s in card_suite.build_steps("p150x2", "full")}
    assert steps["decode-cost"].kind == "unavailable" and "hardware" in steps["decode-cost"].detail
    assert steps["gdn-transaction-tp"].args == ["--full"]
    monkeypatch.setenv("TT_METAL_SIMULATOR", str(tmp_path / "libttsim_bh.so"))
    assert dev.select_backend("p150x2") == dev.SIMULATOR
    assert "simulator" in {s.name: s for s in card_suite.build_steps("p150x2")}["decode-cost"].detail


def test_skipped_or_failed_card_tests_are_failed_cells(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="ok" time="0.1"/>'
                   '<testcase classname="t" name="sk"><skipped message="needs 2 cards"/></testcase>'
                   '<testcase classname="t" name="bad"><failure message="PCC 0.91 &lt; 0.99">x</failure></testcase>'
                   '</testsuite></testsuites>')
    cells = card_suite._junit_cells(xml)
    assert [c["pass"] for c in cells] == [True, False, False]
    assert cells[1]["failed"] == ["skipped: needs 2 cards"] and "PCC 0.91" in cells[2]["failed"][0]


def test_card_tests_skip_naming_the_missing_cards_or_simulator(monkeypatch, tmp_path):
    from support.cards import card_device_or_skip_reason
    from qwen36.tt_ops import device as dev

    monkeypatch.setattr(dev, "TT_DEVICE_DIR", tmp_path / "none")
    monkeypatch.delenv("TT_METAL_SIMULATOR", raising=False)
    name, reason = card_device_or_skip_reason(None)
    assert name is None and "P150a cards" in reason and "TT_METAL_SIMULATOR" in reason
    assert card_device_or_skip_reason("emulated-p150x2") == ("emulated-p150x2", None)
    assert card_device_or_skip_reason("p150")[0] is None  # the card tests need a 2-device mesh
    monkeypatch.setenv("TT_METAL_SIMULATOR", str(tmp_path / "libttsim_bh.so"))
    assert card_device_or_skip_reason(None) == ("p150x2", None)
