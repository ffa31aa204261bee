"""Run records and the probe/records commands: one JSON line per run, atomic appends, table summary."""
from __future__ import annotations

import json

import pytest

from qwen36.probes.records import ProbeReport, append_record, default_records_path, read_records, summarize, to_record
from qwen36.probes.registry import PROBES, load_probe, probe_names


def fake_report(ok=True) -> ProbeReport:
    cells = [{"cell": "K=1 a=0 shadow_commit", "pass": True, "failed": []},
             {"cell": "K=1 a=1 shadow_commit", "pass": ok, "failed": [] if ok else ["gdn_recurrent"]}]
    return ProbeReport(probe="gdn-transaction", backend="reference (torch CPU)", config={"ks": [1]}, cells=cells,
                       counters={"shadow_commit": {"state_copies": 0, "steps": 2}}, gate_complete=False)


def test_record_fields_and_atomic_append(tmp_path):
    path = tmp_path / "runs.jsonl"
    rec = to_record(fake_report())
    for key in ("probe", "time_utc", "run_id", "git_commit", "config", "backend", "cells", "counters", "verdict",
                "gate_complete", "performance"):
        assert key in rec
    assert rec["verdict"] == "pass" and rec["performance"] is None
    append_record(rec, path)
    append_record(to_record(fake_report(ok=False)), path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    recs = read_records(path)
    assert [r["verdict"] for r in recs] == ["pass", "fail"]
    before = path.read_text()
    with pytest.raises(TypeError):
        append_record({**rec, "config": {"bad": object()}}, path)
    assert path.read_text() == before  # a failed append leaves the file as it was
    table = summarize(recs)
    assert "gdn-transaction" in table and "reference (torch CPU)" in table and "FAIL K=1 a=1" in table
    assert "state_copies" in table


def test_default_records_path_is_under_bench_runs():
    rec = to_record(fake_report(), run_id="abcd1234")
    path = default_records_path(rec)
    assert path.parent.name == "runs" and path.parent.parent.name == "bench"
    assert path.name.startswith("gdn-transaction-") and path.name.endswith("-abcd1234.jsonl")


def test_registry():
    assert "gdn-transaction" in probe_names()
    for name in PROBES:
        load_probe(name)
    with pytest.raises(KeyError, match="gdn-transaction"):
        load_probe("no-such-probe")


def test_probe_and_records_commands(tmp_path, capsys):
    from qwen36.cli import main

    path = tmp_path / "r.jsonl"
    assert main(["probe", "gdn-transaction", "--device", "reference", "--ks", "1", "--records", str(path)]) == 0
    (rec,) = read_records(path)
    assert rec["verdict"] == "pass" and rec["gate_complete"] is False  # K=1 only: not the whole gate
    assert rec["backend"] == "reference (torch CPU)" and len(rec["cells"]) == 6
    capsys.readouterr()
    assert main(["records", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gdn-transaction" in out and "pass" in out
    with pytest.raises(SystemExit, match="does not exist"):
        main(["records", str(tmp_path / "missing.jsonl")])
