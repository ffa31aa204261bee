"""decode-cost probe at CI size: runs through the probe command, labels its figures modelled, and the
counted step equals what the decode trace records."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records


@pytest.mark.slow  # the decode-cost probe end to end
def test_decode_cost_probe_ci(tmp_path):
    from qwen36.cli import main

    rec = tmp_path / "dc.jsonl"
    rc = main(["probe", "decode-cost", "--device", "emulated-p150x2", "--preset", "ci", "--records", str(rec)])
    assert rc == 0
    (r,) = read_records(rec)
    perf = r["performance"]
    assert r["backend"].startswith("emulated-p150x2") and perf["label"] == "modelled"
    assert perf["programs_traced_step_check"]["regions_sum"] == perf["programs_traced_step_check"]["trace_replay"]
    p = perf["programs"]
    assert p["per_token"] == p["embed"] + 3 * p["gdn_layer"] + p["attention_layer"] + p["head"]
    # one all_reduce after each mixer and each MLP, one all_gather of the logits
    assert perf["collectives"]["per_token"] == 2 * 4 + 1
    assert perf["modelled_ms_per_step"] > 0 and perf["weight_bytes_per_device"]["per_token"] > 0
