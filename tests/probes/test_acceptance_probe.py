"""The acceptance probe (probes/acceptance.py): its pooling and tok/s arithmetic, and one tiny emulated run of its
mechanics at the CI preset (a TT precision with its own MTP head precision, the fp32 reference, reuse of the record,
gate-0b step times turned into tok/s)."""
from __future__ import annotations

import argparse
import json

import pytest

from qwen36.probes.acceptance import (
    ACCEPTANCE_RATIO_MIN,
    AGREEMENT_DROP_MAX,
    REFERENCE,
    agreement,
    earlier_cells,
    gate_cell,
    load_prompts,
    pooled,
    step_times,
    tok_s,
)
from qwen36.speculative.engine import AcceptanceStats, GenerationResult


def result(accepted, k, tokens=(1, 2)):
    return GenerationResult(list(tokens), AcceptanceStats(k, list(accepted), [k] * len(accepted)))


def test_pooled_counts_every_step_of_every_prompt():
    a, b = result([3, 0, 1], 3, tokens=(5, 6)), result([2], 3, tokens=(7, 8))
    f = pooled([a, b], ref_tokens=[[5, 6], [7, 9]])
    assert (f["steps"], f["prompts"]) == (4, 2)
    assert f["mean_accepted"] == pytest.approx(6 / 4) and f["mean_emitted"] == pytest.approx(1 + 6 / 4)
    assert f["per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])  # steps with >= 1, >= 2, >= 3 accepted
    assert f["histogram"] == [1, 1, 1, 1]
    assert f["per_prompt_mean_accepted"] == pytest.approx([4 / 3, 2.0]) and f["per_prompt_min_max"] == [4 / 3, 2.0]
    assert f["prompts_tokens_equal_reference"] == 0.5


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == pytest.approx((2 + 2) / 6)
    assert agreement([[1, 2]], [[1, 2]]) == 1.0 and agreement([[7]], [[1]]) == 0.0


def _figs(tokens, accepted):
    return {k: {"tokens_per_prompt": tokens, "mean_accepted": a} for k, a in accepted.items()}


def test_acceptance_aware_gate_passes_and_fails_by_its_thresholds():
    """Greedy agreement with the baseline >= the baseline's agreement with fp32 less 3 points; acceptance >= 95 % of
    the baseline's at every K; a fail says by how much."""
    ref = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    base = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 11]]  # 90 % of the reference's tokens before diverging
    figures = {REFERENCE: _figs(ref, {3: 1.4, 5: 1.7}), "performance": _figs(base, {3: 1.5, 5: 1.7})}
    figures["cand"] = _figs([[1, 2, 3, 4, 5, 6, 7, 8, 9, 12]], {3: 1.5 * (ACCEPTANCE_RATIO_MIN + 0.01), 5: 1.7})
    c = gate_cell("cand:performance", figures, (3, 5))
    assert c["baseline_agreement_vs_reference"] == pytest.approx(0.9)
    assert c["greedy_agreement_vs_baseline"] == pytest.approx(0.9)
    assert c["greedy_agreement_min"] == pytest.approx(0.9 - AGREEMENT_DROP_MAX) and c["pass"]
    figures["cand"] = _figs([[1, 2, 3, 4, 5, 6, 7, 8, 0, 0]], {3: 1.2, 5: 1.7})
    c = gate_cell("cand:performance", figures, (3, 5))
    assert not c["greedy_agreement_ok"] and c["greedy_agreement_shortfall"] == pytest.approx(0.87 - 0.8)
    assert not c["acceptance_ok"] and c["acceptance_shortfall"][3] == pytest.approx(0.95 - 0.8)
    assert c["acceptance_shortfall"][5] == 0.0 and not c["pass"]
    assert c["failed"] == ["greedy_agreement", "acceptance"]


def gate0b_line(precision, ms_by_k, batch=None) -> str:
    cfg = {"precision": precision, "preset": "27b", **({"batch": batch} if batch else {})}
    cal = {"label": "modelled (calibrated)", "step_ms_shadow_commit": {str(k): v for k, v in ms_by_k.items()}}
    return json.dumps({"probe": "gate-0b", "run_id": "r1", "config": cfg, "performance": {"calibrated": cal}})


def test_step_times_and_tok_s(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text(gate0b_line("performance", {3: [60.0, 55.0, 75.0]}) + "\n"
                 + gate0b_line("performance", {3: [1.0, 1.0, 1.0]}, batch=8) + "\n")  # a batched record is skipped
    st = step_times([p])
    assert list(st) == [("performance", 3)] and st[("performance", 3)][0] == [60.0, 55.0, 75.0]
    assert st[("performance", 3)][3] == "modelled (calibrated)"
    assert tok_s(2.4, [60.0, 55.0, 75.0]) == pytest.approx([40.0, 32.0, 2400 / 55])  # low tok/s from the high ms


def test_prompts_and_reuse_refusals(tmp_path):
    rows = load_prompts(None, "eval", ["prose", "short"], 2)
    assert [r["class"] for r in rows] == ["prose", "prose", "short", "short"]
    assert all(r["split"] == "eval" for r in rows)
    with pytest.raises(ValueError, match="asked for 99"):
        load_prompts(None, "eval", ["prose"], 99)
    rec = tmp_path / "a.jsonl"
    rec.write_text(json.dumps({"probe": "acceptance", "config": {"max_new_tokens": 8}, "cells": []}) + "\n")
    with pytest.raises(ValueError, match="max_new_tokens"):
        earlier_cells([rec], {"max_new_tokens": 16, "checkpoint": None, "split": None, "classes": None,
                              "per_class": None, "prompt_sources": None, "mechanism": None}, (3,))


def test_probe_mechanics_on_the_ci_preset(tmp_path):  # 4.8 s on the 2-core machine under some load
    """One 6-token prompt, K=2, 6 new tokens: the fp32 reference and the TT path at ``performance+mtp=accuracy``
    each give a pooled cell; the record reloads (no TT run the second time) and gate-0b step times become tok/s."""
    from qwen36.probes.acceptance import run
    from qwen36.probes.records import to_record
    from qwen36.testing.tt import make_bf16_checkpoint

    ckpt = make_bf16_checkpoint(tmp_path / "ckpt", "ci", seed=0)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"class": "c", "split": "eval", "source": "s", "ids": [5, 9, 2, 7, 1, 3]}]}))
    prec = "performance+mtp=accuracy"
    ns = dict(checkpoint=ckpt, precisions=prec, ks="2", prompts=prompts, split="eval", classes="c", per_class=1,
              max_new_tokens=6, step_records=[], no_reference=False, acceptance_records=[], device="emulated-p150x2",
              gate=None)
    rep = run(argparse.Namespace(**ns))
    ref, tt = rep.cells
    assert ref["precision"] == REFERENCE and tt["precision"] == prec and "emulated" in rep.backend
    for c in (ref, tt):
        assert c["k"] == 2 and c["steps"] >= 1 and sum(c["histogram"]) == c["steps"]
        assert c["mean_emitted"] == pytest.approx(c["mean_accepted"] + 1) and c["acceptance_label"] == "measured"
    assert len(ref["tokens_per_prompt"][0]) == 6 and tt["prompts_tokens_equal_reference"] in (0.0, 1.0)
    rec = tmp_path / "acc.jsonl"
    rec.write_text(json.dumps(to_record(rep)) + "\n")
    g = tmp_path / "g.jsonl"
    g.write_text(gate0b_line(prec, {2: [50.0, 45.0, 60.0]}) + "\n")
    again = run(argparse.Namespace(**{**ns, "acceptance_records": [rec], "step_records": [g]}))
    assert again.notes["wall_s"] == {}  # nothing ran again
    tt2 = next(c for c in again.cells if c["precision"] == prec)
    assert tt2["mean_accepted"] == tt["mean_accepted"] and tt2["measured_in"] == str(rec)
    assert tt2["tok_s_27b"] == pytest.approx(tok_s(tt["mean_emitted"], [50.0, 45.0, 60.0]))
    assert again.gate_complete is False  # one prompt is a mechanics check, not a measurement
    # the gate over the reused record (a precision against itself: agreement 1, acceptance 100 %); refusals by name
    gated = run(argparse.Namespace(**{**ns, "acceptance_records": [rec], "gate": f"{prec}:{prec}"}))
    (g_cell,) = [c for c in gated.cells if c.get("gate")]
    assert g_cell["greedy_agreement_vs_baseline"] == 1.0 and g_cell["acceptance_ratio"] == {2: 1.0} and g_cell["pass"]
    from qwen36.errors import UserError

    with pytest.raises(UserError, match="CANDIDATE:BASELINE"):
        run(argparse.Namespace(**{**ns, "gate": "performance-bf4:performance"}))
