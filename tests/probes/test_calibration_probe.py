"""qwen36 probe calibration: the calibrated prediction for Tenstorrent's qwen36 at a mesh, batch and context, printed in
the two lines it promises, with a record whose cells are the pins."""
from __future__ import annotations

import json
import re

import pytest


def _run(tmp_path, capsys, *extra):
    from qwen36.cli import main

    rc = main(["probe", "calibration", "--workload", "tt-qwen36", *extra, "--records-dir", str(tmp_path)])
    out = capsys.readouterr().out
    recs = [json.loads(line) for p in tmp_path.glob("calibration-*.jsonl") for line in p.read_text().splitlines()]
    return rc, out, recs


def test_prints_decode_and_ttft_and_records_the_pins(tmp_path, capsys):
    rc, out, recs = _run(tmp_path, capsys, "--mesh", "1x2", "--batch", "1", "--context", "4096")
    assert rc == 0
    dec = re.search(r"^decode: ([\d.]+) ms/step \(band ([\d.]+)-([\d.]+)\)$", out, re.M)
    ttft = re.search(r"^ttft: ([\d.]+) ms \(band ([\d.]+)-([\d.]+)\)", out, re.M)
    assert dec and ttft, out
    lo, mid, hi = float(dec[2]), float(dec[1]), float(dec[3])
    assert lo < mid < hi and abs(mid / 55.52 - 1) <= 0.15  # Thatch-cloud's 18.01 tok/s at 4k
    assert abs(float(ttft[1]) / 1040 - 1) <= 0.15
    (rec,) = recs
    assert rec["probe"] == "calibration" and rec["verdict"] == "pass" and rec["backend"].startswith("cost model")
    perf = rec["performance"]
    assert perf["label"] == "modelled (calibrated)" and perf["tp"] == 2
    assert perf["decode"]["ms"] == pytest.approx(mid, abs=0.01)
    pins = [c for c in rec["cells"] if c.get("pinned")]
    assert len(pins) >= 5 and all(abs(c["error"]) <= 0.15 for c in pins)
    assert all(c.get("why_not_pinned") for c in rec["cells"] if c.get("pinned") is False)


def test_other_meshes_batches_and_refusals(tmp_path, capsys):
    rc, out, _ = _run(tmp_path, capsys, "--mesh", "1x4", "--batch", "8", "--context", "16384")
    assert rc == 0 and "TP=4" in out and "batch 8" in out
    from qwen36.cli import main

    assert main(["probe", "calibration", "--batch", "33", "--records-dir", str(tmp_path)]) == 2
    assert "--batch 33" in capsys.readouterr().err
    assert main(["probe", "calibration", "--device", "emulated-p150x2", "--records-dir", str(tmp_path)]) == 2
    assert "runs no device" in capsys.readouterr().err
