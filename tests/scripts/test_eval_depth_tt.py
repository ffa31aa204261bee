"""scripts/eval_depth_tt.py: its bookkeeping without a TT run (which prompts it takes and in what order, how it scores
a run, how it picks the best fixed K per class, the like-for-like scoring on TT traces, what invalidates a resumed
report, where a speculative run and plain greedy part), and, on the emulated mesh (slow), the TT acceptance trace
itself: one token committed per step, and real TT runs take exactly the steps of their replay on it."""
from __future__ import annotations

import json

import pytest
from qwen36.testing.scripts import load_script

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


def test_tt_traces_are_made_for_the_first_class_first_then_round_robin():
    rows = [{"class": c, "key": i} for i, c in enumerate(["a", "prose", "b", "a", "prose", "b", "a"])]
    order = ev.tt_trace_order(rows, "prose")
    assert [r["key"] for r in order] == [1, 4, 0, 2, 3, 5, 6]
    assert sorted(r["key"] for r in order) == list(range(len(rows)))


def _auto_row(trace, cls="prose"):
    """A row as the script records a TT auto run whose steps are the controller replayed on ``trace``."""
    costs = DepthPolicy.load().costs["p150x2-27b"]
    make = lambda: DepthPolicy.load().controller("p150x2-27b")  # noqa: E731
    _, steps = fit.replay(trace, 64, make())
    return {"class": cls, "tt_steps": [list(s) for s in steps], "reference_trace": trace,
            "tt_auto_tokens_per_cost": ev.steps_tokens_per_cost(steps, costs)}, make, costs


def test_like_for_like_scores_fixed_k_on_the_tt_trace():
    """Fixed K is replayed on the TT trace; a TT run that took the TT-trace replay's steps is flagged as such, one
    that did not is not, and the summary covers only prompts with a TT trace."""
    ref_trace = [3, 0, 7, 1, 2, 5, 0, 0, 4, 6] * 8
    tt_trace = [0 if x == 5 else x for x in ref_trace]  # the TT path rejects where the reference accepted 5
    row, make, costs = _auto_row(tt_trace)
    ks = list(range(1, 8))
    ev.add_tt_trace(row, tt_trace, [1, 2, 3], [1, 2, 3, 4], 64, make, costs, ks)
    assert row["tt_steps_equal_tt_replay"] and row["tt_trace_tokens_equal_reference_greedy"]
    assert row["tt_trace_positions_differing_from_reference"] == 0  # the run's "reference" trace here is tt_trace
    for k in ks:
        want = fit.tokens_per_cost(tt_trace, 64, FixedDepth(k), costs)
        assert row["tt_fixed_tokens_per_cost"][str(k)] == pytest.approx(want)
    assert row["tt_replay_auto_tokens_per_cost"] == pytest.approx(row["tt_auto_tokens_per_cost"])

    other, _, _ = _auto_row(ref_trace, "code")  # its TT run followed the reference trace, not its TT trace
    ev.add_tt_trace(other, tt_trace, [1, 2], [1, 3], 64, make, costs, ks)
    assert not other["tt_steps_equal_tt_replay"] and not other["tt_trace_tokens_equal_reference_greedy"]
    assert other["tt_trace_positions_differing_from_reference"] == ref_trace.count(5)

    untraced, _, _ = _auto_row(ref_trace, "code")
    s = ev.summarize_tt([row, other, untraced], ks)
    assert s["mixed"]["prompts"] == 2 and s["prose"]["prompts"] == 1
    assert s["mixed"]["steps_equal_tt_replay"] == 1
    best = max(ks, key=lambda k: row["tt_fixed_tokens_per_cost"][str(k)])
    assert s["prose"]["best_fixed_k"] == best
    want = row["tt_auto_tokens_per_cost"] / row["tt_fixed_tokens_per_cost"][str(best)]
    assert s["prose"]["ratio"] == pytest.approx(want)


def test_a_refit_invalidates_resumed_rows(monkeypatch):
    """The controller's description does not change with a refit; the fingerprint a report is resumed on does."""
    ctrl = "K=auto (1..7, ...)"
    before = ev.controller_fingerprint("emulated-p150x2", ctrl)
    pol = DepthPolicy.load()
    p = pol.params["p150x2-27b"]
    pol.params["p150x2-27b"] = type(p)(0.5 if p.decay != 0.5 else 0.3, p.prior, p.prior_weight)
    monkeypatch.setattr(ev.DepthPolicy, "load", classmethod(lambda cls, path=None: pol))
    assert ev.controller_fingerprint("emulated-p150x2", ctrl) != before


@pytest.mark.slow  # device MTP and every depth's traces on the emulated mesh
def test_tt_acceptance_trace_commits_one_token_per_step_and_predicts_the_engine():
    """The TT trace's tokens are TT plain greedy (one token committed per K-deep step), and a real TT engine run,
    fixed K or the controller, takes exactly the steps of its replay on the TT trace; TT plain greedy can follow a
    speculative run on the same backend."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.speculative.engine import speculative_generate
    from qwen36.testing.tt import small_tt_generator
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.spec_backend import TTSpecBackend

    ckpt, prompt, n, k_max = "models/qwen36/default_checkpoint", [1734, 4064, 17, 279, 1076, 4064, 17, 279], 24, 5
    gen = small_tt_generator(ckpt, prefill_chunk=64, require_mtp=True)
    drafter = TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True))
    make = lambda: DepthPolicy.load().controller("reference", k_max=k_max)  # noqa: E731  (switches K on this text)
    try:
        plain = gen.generate([prompt], n)[0].tokens
        gen.release_trace()
        be = TTSpecBackend(gen, "shadow_commit", drafter=drafter, depths=make().depths)
        trace, tokens = ev.tt_acceptance_trace(be, prompt, n, k_max)
        assert tokens == plain and len(trace) == n - 1
        assert all(0 <= x <= k_max for x in trace) and max(trace) >= 2, trace
        for policy in (make, lambda: FixedDepth(3)):
            r = speculative_generate(be, [prompt], n, [policy()])[0]
            _, steps = fit.replay(trace, n, policy())
            assert r.tokens == plain
            assert list(zip(r.stats.depths, r.stats.accepted)) == steps[: len(r.stats.depths)]
        # plain greedy right after a speculative run: its step traces are still live and the plain prefill
        # allocates, so the helper releases them first
        assert ev.tt_plain_greedy(be, prompt, n) == plain
        be.close()
    finally:
        gen.close()


def test_first_difference_reports_where_and_how_close_the_tie_was():
    import torch

    from qwen36.commands.common import DEFAULT_CHECKPOINT
    from qwen36.reference.model import Qwen36Model

    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32)
    prompt = [1734, 4064, 17, 279]
    plain, _ = fit.plain_greedy(model, prompt, 6)  # the reference's own greedy: its argmax at every position
    assert ev.first_difference(model, prompt, plain, plain) is None
    spec = plain[:3] + [(plain[3] + 1) % 50] + plain[4:]
    d = ev.first_difference(model, prompt, spec, plain)
    assert d["position"] == 3 and d["plain_token"] == plain[3] and d["speculative_token"] == spec[3]
    assert d["reference_argmax"] == plain[3]
    assert d["reference_logit_plain_token"] - d["reference_logit_speculative_token"] >= d["reference_top2_margin"] >= 0
