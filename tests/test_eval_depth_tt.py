"""scripts/eval_depth_tt.py's bookkeeping (no TT run): which prompts it takes, how it scores a run and how it picks
the best fixed K per class."""
from __future__ import annotations

import json

import pytest
from script_loader import load_script

from qwen36.speculative.depth import DepthPolicy, FixedDepth

ev = load_script("eval_depth_tt")
fit = ev.fit


def test_held_out_prompts_round_robin_over_classes():
    items = json.loads(fit.PROMPTS.read_text())["prompts"]
    chosen = ev.held_out_round_robin(items, 2)
    classes = sorted({it["class"] for it in items})
    assert len(chosen) == 2 * len(classes)
    assert sorted(it["class"] for it in chosen[: len(classes)]) == classes  # prompt 1 of every class first
    assert all(items[it["key"]]["split"] == "eval" and items[it["key"]]["ids"] == it["ids"] for it in chosen)
    assert len({it["key"] for it in chosen}) == len(chosen)


def test_a_run_is_scored_like_the_replays():
    """The TT run's score from its steps equals the replay's score when the steps are the same (tokens past the
    requested count in the last step included on both sides)."""
    costs = DepthPolicy.load().costs["p150x2-27b"]
    trace = [3, 0, 7, 1, 2, 5, 0, 0, 4, 6] * 8
    for k in (1, 3, 7):
        _, steps = fit.replay(trace, 64, FixedDepth(k))
        assert ev.steps_tokens_per_cost(steps, costs) == pytest.approx(fit.tokens_per_cost(trace, 64, FixedDepth(k),
                                                                                          costs), rel=1e-12)


def test_best_fixed_k_is_chosen_per_class_not_per_prompt():
    def row(cls, auto, fixed):
        return {"class": cls, "tt_auto_tokens_per_cost": auto, "replay_auto_tokens_per_cost": auto,
                "fixed_tokens_per_cost": {str(k): v for k, v in fixed.items()}, "steps_equal": True,
                "tt_equals_reference_greedy": True}

    rows = [row("a", 2.0, {1: 1.0, 2: 2.2}), row("a", 2.0, {1: 3.0, 2: 1.6}),  # per prompt best: 2.2 and 3.0
            row("b", 1.5, {1: 1.4, 2: 1.0})]
    s = ev.summarize(rows, [1, 2])
    assert s["a"]["best_fixed_k"] == 1 and s["a"]["best_fixed"] == pytest.approx(2.0)  # class means 2.0 vs 1.9
    assert s["a"]["ratio"] == pytest.approx(1.0) and s["a"]["goal_met"]
    assert s["b"]["ratio"] == pytest.approx(1.5 / 1.4)
    assert s["mixed"]["best_fixed_k"] == 1 and s["mixed"]["prompts"] == 3
    assert s["mixed"]["ratio"] == pytest.approx((5.5 / 3) / (5.4 / 3)) and s["mixed"]["goal_met"]
    low = ev.summarize([row("a", 1.0, {1: 1.1, 2: 0.5})], [1, 2])
    assert not low["a"]["goal_met"] and not low["mixed"]["goal_met"]
