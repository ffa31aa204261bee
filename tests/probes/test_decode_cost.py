"""decode-cost probe at CI size: runs through the probe command, labels its figures modelled, and the
counted step equals what the decode trace records."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records


@pytest.mark.slow  # the decode-cost probe end to end
def test_decode_cost_probe_ci(tmp_path):
    from qwen36.cli import main

    rec = tmp_path / "dc.jsonl"
    rc = main(["probe", "decode-cost", "--device", "emulated-p150x2", "--preset", "ci", "--contexts", "64,2048,4096",
               "--records", str(rec)])
    assert rc == 0
    (r,) = read_records(rec)
    perf = r["performance"]
    assert r["backend"].startswith("emulated-p150x2") and perf["label"] == "modelled"
    assert perf["programs_traced_step_check"]["regions_sum"] == perf["programs_traced_step_check"]["trace_replay"]
    p = perf["programs"]
    assert p["per_token"] == p["embed"] + 3 * p["gdn_layer"] + p["attention_layer"] + p["head"]
    # one all_reduce after each mixer (the composite form: a reduce-scatter and an all-gather), one after each MLP
    # (the decode MLP's single-op form on its L1 output: one collective), one all_gather of the logits
    assert perf["collectives"]["per_token"] == (2 + 1) * 4 + 1
    assert perf["modelled_ms_per_step"] > 0 and perf["weight_bytes_per_device"]["per_token"] > 0
    # the calibrated figure (docs/cost_model.md "Record keys"): a band around it, the regions and the ranking of
    # every program add up to it, and the roofline is a lower bound
    cal = perf["calibrated"]
    assert cal["label"] == "modelled (calibrated)" and perf["roofline_label"] == "modelled (roofline lower bound)"
    assert cal["ms_low"] < cal["ms"] < cal["ms_high"] and cal["tok_s"] == pytest.approx(1e3 / cal["ms"])
    rs = cal["regions_ms"]
    assert rs["embed"] + 3 * rs["gdn_layer"] + rs["attention_layer"] + rs["head"] == pytest.approx(cal["ms"])
    assert sum(r["ms_per_step"] for r in cal["program_ranking"]) == pytest.approx(cal["ms"], rel=1e-6)
    assert sum(r["programs_per_step"] for r in cal["program_ranking"]) == p["per_token"]
    assert cal["ms"] > perf["modelled_ms_per_step"]
    # further contexts, each its own counted step on the same build: the primary one is the calibrated figure, and
    # from 2,048 to 4,096 positions the step reads 32 more K and V pages of the one attention layer (64 rows x
    # 32 dims, one KV head per device: two bf16 tiles each), charged at the bf16 interleaved rate
    from qwen36.tt_ops.cost_model import CALIBRATION

    by = perf["calibrated_by_context"]
    assert sorted(by, key=int) == ["64", "2048", "4096"] and by["4096"]["ms"] == cal["ms"]
    assert by["64"]["ms"] < by["2048"]["ms"] < by["4096"]["ms"]
    extra = 2 * (4096 // 64 - 2048 // 64) * 2 * 2048
    assert by["4096"]["dram_interleaved_ms"] - by["2048"]["dram_interleaved_ms"] == pytest.approx(
        extra / (CALIBRATION["interleaved_bf16_gbps"].value * 1e9) * 1e3, rel=1e-6)


@pytest.mark.slow  # two probe runs end to end
def test_decode_cost_batch_charges_weights_once(tmp_path):
    """--batch 8 at CI size: the same weight bytes per step as batch 1 (read once for all users), 8x the KV bytes,
    the same collectives, aggregate tok/s = 8 x per-user tok/s, and more aggregate throughput than batch 1."""
    from qwen36.cli import main

    perf = {}
    for b in (1, 8):
        rec = tmp_path / f"dc{b}.jsonl"
        assert main(["probe", "decode-cost", "--device", "emulated-p150x2", "--preset", "ci", "--batch", str(b),
                     "--records", str(rec)]) == 0
        (r,) = read_records(rec)
        perf[b] = r["performance"]
        assert perf[b]["label"] == "modelled" and r["config"]["batch"] == b and perf[b]["batch"] == b
        check = perf[b]["programs_traced_step_check"]
        assert check["regions_sum"] == check["trace_replay"]
    one, eight = perf[1], perf[8]
    assert eight["weight_bytes_per_device"] == one["weight_bytes_per_device"]
    assert eight["kv_bytes_per_device_per_step_at_context"] == 8 * one["kv_bytes_per_device_per_step_at_context"]
    assert eight["collectives"]["per_token"] == one["collectives"]["per_token"]
    assert eight["modelled_aggregate_tok_s"] == pytest.approx(8 * eight["modelled_tok_s"])
    assert eight["modelled_aggregate_tok_s"] > 4 * one["modelled_aggregate_tok_s"]
