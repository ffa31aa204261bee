"""Run records and the probe/records commands: one JSON line per run, atomic appends, table summary."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen36.probes.records import (RECORDS_DIR_ENV, ProbeReport, append_record, default_records_path, read_records,
                                  summarize, to_record)
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


def test_default_records_path_is_bench_runs_under_the_current_directory(tmp_path, monkeypatch):
    import qwen36

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RECORDS_DIR_ENV, raising=False)
    rec = to_record(fake_report(), run_id="abcd1234")
    path = default_records_path(rec)
    assert path.parent == tmp_path / "bench" / "runs"
    assert path.name.startswith("gdn-transaction-") and path.name.endswith("-abcd1234.jsonl")
    # never inside the installed package tree (site-packages for a normal install)
    package_parent = Path(qwen36.__file__).resolve().parents[1]
    assert package_parent not in path.resolve().parents
    # the environment variable, then an explicit directory, take precedence
    monkeypatch.setenv(RECORDS_DIR_ENV, str(tmp_path / "env-runs"))
    assert default_records_path(rec).parent == tmp_path / "env-runs"
    assert default_records_path(rec, tmp_path / "arg-runs").parent == tmp_path / "arg-runs"
    written = append_record(rec, records_dir_arg=tmp_path / "arg-runs")
    assert written.parent == tmp_path / "arg-runs" and read_records(written)[0]["run_id"] == "abcd1234"


@pytest.mark.slow
def test_probe_command_records_dir(tmp_path, monkeypatch, capsys):
    """`qwen36 probe --records-dir DIR` writes its record there (the flag wins over $QWEN36_RECORDS_DIR; the
    default, ./bench/runs, is checked above through the same append_record call)."""
    from qwen36.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RECORDS_DIR_ENV, str(tmp_path / "from-env"))
    assert main(["probe", "gdn-transaction", "--device", "reference", "--ks", "1", "--records-dir", "mine"]) == 0
    (f,) = (tmp_path / "mine").glob("gdn-transaction-*.jsonl")
    assert f"record: {f.relative_to(tmp_path)}" in capsys.readouterr().out
    assert not (tmp_path / "from-env").exists() and not (tmp_path / "bench").exists()
