"""gate-0a probe at CI size through the probe command: record structure, labels from what ran (modelled on the
emulator), both splits summing to the step total, the speculative step growing with K, per-layer program lists
consistent with the extrapolated counts, and the decode step agreeing with decode-cost's accounting."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records

KS = ("1", "3", "7")


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    from qwen36.cli import main

    path = tmp_path_factory.mktemp("g0a") / "g0a.jsonl"
    rc = main(["probe", "gate-0a", "--device", "emulated-p150x2", "--preset", "ci", "--ks", ",".join(KS),
               "--records", str(path)])
    assert rc == 0
    (r,) = read_records(path)
    return r


def test_gate0a_record_structure_and_label(record):
    perf = record["performance"]
    assert record["probe"] == "gate-0a" and record["verdict"] == "pass" and record["gate_complete"]
    assert record["backend"].startswith("emulated-p150x2") and perf["label"] == "modelled"
    assert perf["host_readback_model"]["label"] == "assumed" and "cost_model_constants" in perf
    assert set(perf["steps"]) == {"decode"} | {f"spec_k{k}" for k in KS}
    layer_types = {"gdn", "attention", "mlp", "lm_head"}
    assert layer_types | {"embed", "sampling_accept", "host_readback"} == set(perf["steps"]["decode"]["components"])
    for k in KS:
        s = perf["steps"][f"spec_k{k}"]
        assert s["kind"] == "spec" and s["rows"] == int(k) + 1
        assert set(s["components"]) >= layer_types | {"mtp_draft", "commit", "verify_setup", "host_readback"}
        cats = s["categories"]
        assert {"dispatch", "collectives", "host_readback", "other_reads", "kv_cache", "gdn_state"} <= set(cats)
        assert {"weights:gdn_in", "weights:attn_qkv", "weights:mlp_gate_up", "weights:lm_head"} <= set(cats)
        assert all(v > 0 for v in cats.values()), cats
    # the calibrated figures (docs/cost_model.md "Record keys"): per step, its terms sum to it, a band around it,
    # above the roofline lower bound; tok/s per scenario from the calibrated step
    cal = perf["calibrated"]
    assert cal["label"] == "modelled (calibrated)"
    for name, s in perf["steps"].items():
        c, lo, hi = cal["step_ms"][name]
        assert lo < c < hi and c > s["ms"] and c == pytest.approx(s["calibrated_ms"])
        assert sum(cal["terms_ms"][name].values()) == pytest.approx(c)
    for k in KS:
        tok = cal["spec_tok_s"][k]["0.8"]
        assert tok[0] == pytest.approx(sum(0.8 ** i for i in range(int(k) + 1)) * 1e3 / cal["step_ms"][f"spec_k{k}"][0])
        assert cal["verify_cost_ratio"][k] >= 1


def test_gate0a_splits_sum_to_step_total(record):
    for name, s in record["performance"]["steps"].items():
        comp = sum(c["ms"] for c in s["components"].values())
        cats = sum(s["categories"].values())
        assert abs(comp - s["ms"]) <= 1e-9 * s["ms"], (name, comp, s["ms"])
        assert abs(cats - s["ms"]) <= 1e-9 * s["ms"], (name, cats, s["ms"])
        assert s["programs"] == sum(c["programs"] for c in s["components"].values())
        for c in s["components"].values():
            assert abs(sum(c["categories"].values()) - c["ms"]) <= 1e-9 * max(c["ms"], 1e-12)
            assert c["other_read_bytes_per_device"] >= 0


def test_gate0a_verify_cost_grows_with_k(record):
    perf = record["performance"]
    step = [perf["steps"][f"spec_k{k}"]["ms"] for k in KS]
    ratio = [perf["verify_cost_ratio"][k] for k in KS]
    assert step == sorted(step) and len(set(step)) == len(KS), step
    assert all(r >= 1 for r in ratio) and ratio == sorted(ratio) and len(set(ratio)) == len(KS), ratio
    # more drafts: more MTP programs and more emitted tokens per step at a fixed acceptance rate
    draft = [perf["steps"][f"spec_k{k}"]["components"]["mtp_draft"]["programs"] for k in KS]
    assert draft == sorted(draft) and len(set(draft)) == len(KS)
    assert abs(perf["tokens_per_step"]["3"]["0.5"] - 1.875) < 1e-12
    # a per-position profile (fraction of steps accepting drafts 1..i) covers K up to its length
    assert abs(perf["tokens_per_step"]["3"]["0.8/0.6/0.5"] - 2.9) < 1e-12 and "0.8/0.6/0.5" not in perf["spec_tok_s"]["7"]
    for k in KS:
        for p, n in perf["tokens_per_step"][k].items():
            assert abs(perf["spec_tok_s"][k][p] - n * 1e3 / perf["steps"][f"spec_k{k}"]["ms"]) < 1e-9


def test_gate0a_program_lists_match_counts(record):
    perf = record["performance"]
    n_gdn, n_attn = perf["layers"]["gdn"], perf["layers"]["attention"]
    for s in perf["steps"].values():
        lists, comps = s["programs_per_layer"], s["components"]
        assert sum(lists["gdn_layer (mixer + norms)"].values()) * n_gdn == comps["gdn"]["programs"]
        assert sum(lists["attention_layer (mixer + norms)"].values()) * n_attn == comps["attention"]["programs"]
        mlp = sum(lists["mlp (GDN layer)"].values()) * n_gdn + sum(lists["mlp (attention layer)"].values()) * n_attn
        assert mlp == comps["mlp"]["programs"]
        assert lists["gdn_layer (mixer + norms)"]["ttnn.transformer.fused_recurrent_gated_delta_rule"] == 1
        # the vocab-parallel LM head gathers once, through the trace-safe async collective (tt/model/ccl.py)
        assert lists["lm_head"]["ttnn.experimental.all_gather_async"] == 1


def test_gate0a_decode_agrees_with_decode_cost(record):
    """The decode step's device part is decode-cost's modelled step, and the weight bytes gate-0a attributes are
    decode-cost's per-token weight bytes (less the one embedding row, which gate-0a counts with the other reads)."""
    import dataclasses

    from qwen36.probes import decode_cost
    from qwen36.tiny import PRESETS

    cfg = PRESETS["ci"]
    c = record["config"]
    fig = decode_cost.measure("emulated-p150x2", dataclasses.replace(cfg, vocab_size=c["vocab_built"], eos_token_id=()),
                              c["precision"], c["context"], c["seed"], real_vocab=c["real_vocab"])
    d = record["performance"]["steps"]["decode"]
    device_ms = d["ms"] - d["components"]["host_readback"]["ms"]
    assert abs(device_ms - fig["modelled_ms_per_step"]) <= 1e-9 * device_ms, (device_ms, fig["modelled_ms_per_step"])
    assert d["programs"] == fig["programs"]["per_token"]
    attributed = sum(x["weight_bytes_per_device"] for x in d["components"].values())
    expected = fig["weight_bytes_per_device"]["per_token"] - 2 * cfg.hidden_size
    assert abs(attributed - expected) <= 2, (attributed, expected)


def test_gate0a_label_from_the_mesh():
    from types import SimpleNamespace

    from qwen36.probes.gate_0a import label_of

    assert label_of(SimpleNamespace(is_emulated=True)) == "modelled"
    assert label_of(SimpleNamespace(is_emulated=False)) == "measured"


def test_gate0a_lm_head_weights_at_their_placements_rate(record):
    """The LM head's weight term streams at the rate of where the weight lies: DRAM-interleaved in the default
    ``mcast_1d`` decode layout, so the interleaved rate (regression: the static weight key once lacked the
    placement, so a DRAM-sharded head was charged at the interleaved rate; tt/model/decode_matmuls.py)."""
    from qwen36.tiny import PRESETS
    from qwen36.tt_ops.cost_model import P150A_DRAM_BW_EFFECTIVE_GBPS

    cfg = PRESETS["ci"]
    head_bytes = cfg.hidden_size * (cfg.vocab_size // 2) // 1024 * 1088  # bf8 [H, V/2] per device, whole tiles
    want_ms = head_bytes / (P150A_DRAM_BW_EFFECTIVE_GBPS * 1e9) * 1e3
    got = record["performance"]["steps"]["decode"]["categories"]["weights:lm_head"]
    assert got == pytest.approx(want_ms, rel=1e-6), (got, want_ms)
