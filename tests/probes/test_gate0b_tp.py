"""gate-0b probe at CI size through the probe command: record structure, labels (modelled on the emulator),
verify_cost_ratio >= 1 and increasing with K, every phase costed, commit mechanisms ordered by their copies."""
from __future__ import annotations

import pytest

from qwen36.probes.records import read_records


@pytest.mark.slow  # the gate-0b probe end to end
def test_gate0b_probe_ci(tmp_path):
    from qwen36.cli import main

    rec = tmp_path / "g0b.jsonl"
    rc = main(["probe", "gate-0b", "--device", "emulated-p150x2", "--preset", "ci", "--ks", "1,2,3,7",
               "--records", str(rec)])
    assert rc == 0
    (r,) = read_records(rec)
    perf = r["performance"]
    assert r["probe"] == "gate-0b" and r["verdict"] == "pass" and r["gate_complete"]
    assert r["backend"].startswith("emulated-p150x2") and perf["label"] == "modelled"
    assert perf["vocab"]["extrapolated_to"] == r["config"]["real_vocab"]
    ks = ["1", "2", "3", "7"]
    ratios = [perf["verify_cost_ratio"][k] for k in ks]
    assert all(x >= 1 for x in ratios) and ratios == sorted(ratios) and len(set(ratios)) == 4, ratios
    for k in ks:
        v = perf["verify"][k]
        assert v["rows"] == int(k) + 1 and v["programs"] > perf["decode"]["programs"]
        assert abs(v["ms"] / perf["decode"]["ms"] - perf["verify_cost_ratio"][k]) < 1e-9
        d = perf["draft"][k]
        assert 0 < d["reseed"]["ms"] < d["total"]["ms"] and d["per_drafted_token_ms"] > 0
        assert perf["accept"][k]["ms"] > 0 and perf["commit_shadow_commit_by_k"][k]["ms"] > 0
    # the reseed runs K+1 rows: it grows with K
    assert perf["draft"]["7"]["reseed"]["ms"] > perf["draft"]["1"]["reseed"]["ms"]
    c = perf["commit"]
    assert set(c) == {"shadow_commit", "snapshot", "recompute"}
    # shadow_commit copies no state; snapshot copies live twice per GDN layer, recompute once
    assert c["shadow_commit"]["ms"] < c["recompute"]["ms"] <= c["snapshot"]["ms"]
    assert "cost_model_constants" in perf
    # the calibrated block (docs/cost_model.md "Record keys"): every phase carries its calibrated figure and band,
    # the block's step is their sum, its ratios increase with K, and each figure is above the roofline lower bound
    cal = perf["calibrated"]
    assert cal["label"] == "modelled (calibrated)"
    d, dlo, dhi = cal["decode_ms"]
    assert dlo < d < dhi and d == pytest.approx(perf["decode"]["calibrated_ms"]) and d > perf["decode"]["ms"]
    cal_ratios = [cal["verify_cost_ratio"][k][0] for k in ks]
    assert all(x >= 1 for x in cal_ratios) and cal_ratios == sorted(cal_ratios), cal_ratios
    for k in ks:
        step = (perf["verify"][k]["calibrated_ms"] + perf["accept"][k]["calibrated_ms"]
                + perf["draft"][k]["total"]["calibrated_ms"] + perf["commit_shadow_commit_by_k"][k]["calibrated_ms"])
        st = cal["step_ms_shadow_commit"][k]
        assert st[0] == pytest.approx(step) and st[1] < st[0] < st[2]
        rank = cal["ranking"][f"verify_k{k}"]
        assert [r["ms"] for r in rank] == sorted((r["ms"] for r in rank), reverse=True) and rank[0]["ms"] > 0
        tok = cal["mtp_tok_s_shadow_commit"]["0.8"][k]
        assert tok[0] == pytest.approx(sum(0.8 ** i for i in range(int(k) + 1)) * 1e3 / step) and tok[1] < tok[0] < tok[2]


@pytest.fixture(scope="module")
def tp4_figures():
    """gate-0b at CI size with the 27B TP=2 attention shape (2 KV heads per device), K = 1 and 3."""
    import dataclasses

    from support.tt import tp4_config
    from qwen36.probes import gate_0b

    cfg = dataclasses.replace(tp4_config(), eos_token_id=())
    return gate_0b.measure("emulated-p150x2", cfg, "performance", 256, [1, 3], 1, 0, cfg.vocab_size)


def test_gate0b_two_kv_heads_per_device(tp4_figures):
    """The 27B TP=2 attention shape (2 KV heads per device) at CI size: the verify is costed (per-head cache
    view), ratio > 1, figures modelled."""
    fig = tp4_figures
    assert fig["kv_heads_per_device"] == 2 and fig["label"] == "modelled"
    assert 1 < fig["verify_cost_ratio"]["1"] < fig["verify_cost_ratio"]["3"]


def test_gate0b_decode_layer_no_costlier_than_verify_layer(tp4_figures):
    """Advancing one layer by one token costs no more than advancing it by the K=1 verify's two rows, per layer
    type: the 1-row decode writes its GDN state in place (recurrent state by the op's ring mode, conv state sliced
    into its buffer) where it used to copy both; the verify defers those writes to the commit, so its GDN side
    includes the commit's per-layer part."""
    pl = tp4_figures["per_layer"]
    d, v = pl["decode"], pl["verify_k1"]
    assert d["attention"]["programs"] <= v["attention"]["programs"], (d["attention"], v["attention"])
    assert d["attention"]["ms"] <= v["attention"]["ms"]
    v_gdn = v["gdn"]["programs"] + v["commit_per_gdn_layer"]["programs"]
    assert d["gdn"]["programs"] <= v_gdn, (d["gdn"], v["gdn"], v["commit_per_gdn_layer"])
    assert d["gdn"]["ms"] <= v["gdn"]["ms"] + v["commit_per_gdn_layer"]["ms"]
    assert v["commit_per_gdn_layer"]["programs"] > 0  # the deferred conv-state select is counted


def test_mtp_tok_s_per_scenario():
    """tokens per step (1 + p + .. + p^K, or 1 + a1 + .. + aK for a per-position profile) over the step time."""
    from qwen36.probes.step_figures import mtp_tok_s

    fig = {"step_ms_shadow_commit": {"1": 50.0, "3": 60.0, "7": 80.0}}
    out = mtp_tok_s(fig, [1, 3, 7])
    assert out["0.8"]["1"] == pytest.approx(1.8 * 1e3 / 50)
    assert out["0.5"]["3"] == pytest.approx((1 + 0.5 + 0.25 + 0.125) * 1e3 / 60)
    assert out["0.8/0.6/0.5"]["3"] == pytest.approx((1 + 0.8 + 0.6 + 0.5) * 1e3 / 60)
    assert out["0.8/0.6/0.5"]["7"] is None  # the profile has 3 positions


# ---- batch B > 1: the batched plain decode and the packed B x (K+1) verify ----------------------------------------
@pytest.fixture(scope="module")
def batch4_record(tmp_path_factory):
    from qwen36.cli import main

    rec = tmp_path_factory.mktemp("g0b-batch") / "g0b.jsonl"
    assert main(["probe", "gate-0b", "--device", "emulated-p150x2", "--preset", "ci", "--batch", "4",
                 "--ks", "1,2,3", "--records", str(rec)]) == 0
    (r,) = read_records(rec)
    return r


@pytest.mark.slow  # the probe end to end at B = 4 (~10 s)
def test_gate0b_batch_probe_ci(batch4_record):
    """B = 4 at CI size: K = 2 (12 rows, not whole rows of 8 cores) is listed as refused with the reason, K = 1 and
    3 (8 and 16 rows) are costed; verify_cost_ratio > 1 and increasing but below K+1 (the packed verify reads the
    weights once for every row), its bytes above the decode's (the rows' activations and the per-row ring); the
    packed device MTP draft (reseed + chain) is costed and in the step; tok/s per user and aggregate follow from
    the step times; every figure labelled modelled."""
    r = batch4_record
    perf, b = r["performance"], 4
    assert r["verdict"] == "pass" and r["config"]["batch"] == b and perf["batch"] == b
    assert perf["label"] == "modelled" and r["backend"].startswith("emulated-p150x2")
    assert list(perf["ks_refused"]) == ["2"] and "multiple of 8" in perf["ks_refused"]["2"]
    assert set(perf["verify"]) == {"1", "3"} and perf["decode"]["rows"] == b
    ratios = [perf["verify_cost_ratio"][k] for k in ("1", "3")]
    assert 1 < ratios[0] < ratios[1] < 4, ratios
    d_ms = perf["decode"]["ms"]
    assert perf["plain_decode_tok_s"]["per_user"] == pytest.approx(1e3 / d_ms)
    assert perf["plain_decode_tok_s"]["aggregate"] == pytest.approx(b * 1e3 / d_ms)
    dec_bytes = sum(perf["decode"]["bytes_read_per_device"].values())
    for k in ("1", "3"):
        v = perf["verify"][k]
        assert v["rows"] == b * (int(k) + 1) and abs(v["ms"] / d_ms - perf["verify_cost_ratio"][k]) < 1e-9
        assert sum(v["bytes_read_per_device"].values()) > dec_bytes
        d = perf["draft"][k]
        assert d["reseed"]["ms"] > 0 and d["chain"]["ms"] > 0
        assert d["total"]["ms"] == pytest.approx(d["reseed"]["ms"] + d["chain"]["ms"])
        step = v["ms"] + perf["accept"][k]["ms"] + d["total"]["ms"] + perf["commit_shadow_commit_by_k"][k]["ms"]
        assert perf["step_ms_shadow_commit"][k] == pytest.approx(step)
        want = (1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 if k == "3" else 1.8) * 1e3 / step
        assert perf["mtp_tok_s_shadow_commit"]["0.8"][k] == pytest.approx(want)
        assert perf["mtp_aggregate_tok_s_shadow_commit"]["0.8"][k] == pytest.approx(b * want)
    # the packed reseed runs B x (K+1) rows, the chain K - 1 body steps: both grow with K
    assert perf["draft"]["3"]["reseed"]["ms"] > perf["draft"]["1"]["reseed"]["ms"]
    assert perf["draft"]["3"]["chain"]["ms"] > perf["draft"]["1"]["chain"]["ms"]
    c = perf["commit"]
    assert set(c) == {"shadow_commit", "snapshot", "recompute"} and perf["commit_k"] == 3
    assert c["shadow_commit"]["ms"] < c["recompute"]["ms"] <= c["snapshot"]["ms"]


@pytest.mark.slow
def test_gate0b_batch32_is_plain_decode_only(tmp_path):
    """B = 32: no K fits 32 x (K+1) <= 32 rows, so every K is refused by name and the record holds the plain
    decode only (no verify-ratio cell that could not fail)."""
    from qwen36.cli import main

    rec = tmp_path / "g0b.jsonl"
    assert main(["probe", "gate-0b", "--device", "emulated-p150x2", "--preset", "ci", "--batch", "32",
                 "--ks", "1,3", "--records", str(rec)]) == 0
    (r,) = read_records(rec)
    perf = r["performance"]
    assert set(perf["ks_refused"]) == {"1", "3"} and all("at most 32" in v for v in perf["ks_refused"].values())
    assert perf["verify"] == {} and perf["commit"] == {} and "at most 32" in perf["commit_refused"]
    assert perf["plain_decode_tok_s"]["aggregate"] == pytest.approx(32 * 1e3 / perf["decode"]["ms"])
    assert [c["cell"] for c in r["cells"]] == ["every phase costed"] and r["verdict"] == "pass"


@pytest.mark.parametrize("b", [2, 3, 4, 8, 16, 32])
def test_batch_verify_refusal_is_the_backends_bound(b):
    """The probe's admission of B x (K+1) rows is the one TTSpecBackend with B slots refuses by: refused (B, K) raise the
    backend's BatchSpecError before it touches the generator; admitted ones get past that check."""
    from qwen36.probes.gate_0b import batch_verify_refusal
    from qwen36.tt.speculative.spec_backend import BatchSpecError, TTSpecBackend

    for k in range(1, 8):
        with pytest.raises(Exception) as e:
            TTSpecBackend(None, slots=b, k=k, drafter=lambda hist, n: [0] * n)  # no generator: only the checks run
        assert isinstance(e.value, BatchSpecError) == (batch_verify_refusal(b, k) is not None), (b, k, e.value)


def test_gate0b_batch_refuses_a_batch_the_decoder_cannot_run(capsys):
    from qwen36.cli import main

    assert main(["probe", "gate-0b", "--device", "emulated-p150x2", "--preset", "ci", "--batch", "12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --batch 12:") and "multiple of 8" in err[-1], err
