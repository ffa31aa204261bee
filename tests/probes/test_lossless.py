"""The `lossless` probe through the probe command, full gate grid (K = 1..7 x 3 mechanisms) on the shipped
checkpoint: TT speculative greedy == TT plain greedy == reference greedy, token for token. Also runs from a
directory other than the repository root (regression: the default checkpoint path was relative to the CWD)."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records


@pytest.mark.slow  # K=1..7 x 3 mechanisms on the emulated mesh
def test_lossless_probe_full_grid(tmp_path, monkeypatch):
    from qwen36.cli import main

    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "lossless.jsonl"
    assert main(["probe", "lossless", "--device", "emulated-p150x2", "--records", str(rec)]) == 0
    (r,) = read_records(rec)
    assert r["probe"] == "lossless" and r["verdict"] == "pass" and r["gate_complete"]
    assert r["backend"].startswith("emulated-p150x2 (ttnn goldens on CPU)")
    cells = r["cells"]
    assert len(cells) >= 21 and all(c["pass"] for c in cells)
