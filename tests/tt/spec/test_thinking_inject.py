"""The thinking budget under TT speculation (``TTSpecBackend.inject``, one user): the step that reaches the budget is
cut after its last thinking token (the commit takes the cut, not the device's count), the stop-thinking phrase goes
through the step's own verify / commit traces with every forced row accepted, and the token after it is picked from
the last forced row. Greedy output == TT plain decoding with the same budget (``TTGenerator.generate``), every
mechanism; the committed state continues exactly as a plain run of prompt + emitted tokens would."""
from __future__ import annotations

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.sampling import SamplingParams
from qwen36.speculative.thinking import ThinkingBudget
from qwen36.testing.pcc import pcc
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
from qwen36.tt.spec.spec_backend import TTSpecBackend

CKPT = "models/qwen36/default_checkpoint"
START, END = 7, 9  # stand-ins for <think> / </think>
PHRASE = (31, 32, 33, END, 34, 35, 36)
PROMPT = [1734, 4064, 17, 279, 1076, 4064, 17, 279, START]  # ends inside an open thinking block


@pytest.fixture(scope="module")
def gen():
    g = small_tt_generator(CKPT, require_mtp=True)
    yield g
    g.close()


@pytest.fixture(scope="module")
def reader():
    return load_checkpoint(CKPT, require_mtp=True)


def budget(n: int) -> ThinkingBudget:
    return ThinkingBudget(n, START, END, PHRASE)


@pytest.mark.slow
@pytest.mark.parametrize("mech,k,n", [("shadow_commit", 3, 2), ("snapshot", 2, 5), ("recompute", 3, 4),
                                      ("snapshot", 3, 1)])  # n = 1: reached at the prompt's token, before any step
def test_speculative_budget_equals_plain_with_the_same_injection(gen, reader, mech, k, n):
    plain = gen.generate(PROMPT, 24, thinking=budget(n), keep_logits=True)
    want = plain.tokens
    free = gen.generate(PROMPT, 24).tokens
    assert END not in free[:n] and tuple(want[n:n + len(PHRASE)]) == PHRASE  # the phrase at exactly n
    be = TTSpecBackend(gen, mech, drafter=TTMTPDrafter(reader))
    try:
        res = speculative_generate(be, [PROMPT], 24, [k], [SamplingParams()], thinking=budget(n))[0]
        assert res.tokens == want
        # the row the token after the phrase came from: the last forced verify row vs plain's decode row there
        got, ref = be.inject_logits, plain.logits[n + len(PHRASE)]
        diff = float((got - ref).abs().max())
        print(f"{mech} k={k} n={n}: inject row vs plain decode row max abs {diff:.3g}, pcc {pcc(got, ref):.7f}")
        assert pcc(got, ref) > 0.9999 and diff <= 1e-4
        assert sum(res.stats.accepted) > 0  # real drafts were accepted around the injection
        # the device commit followed the cut and the forced rows: its position (device-resident n) is the host's
        # (the last step may commit past the token limit, never fewer rows than were emitted)
        n = int(be.model.to_host(be.step_state.n).flatten()[0])
        assert n == be.position(0) >= len(PROMPT) + len(res.tokens) - 1
    finally:
        be.close()


@pytest.mark.slow
def test_sampled_speculative_injects_at_exactly_n(gen, reader):
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)
    be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader))
    try:
        res = speculative_generate(be, [PROMPT], 20, [2], [params], thinking=budget(3))[0]
    finally:
        be.close()
    tokens = res.tokens
    first_end = tokens.index(END) if END in tokens else len(tokens)
    assert first_end >= 3 and tuple(tokens[3:3 + len(PHRASE)]) == PHRASE  # no </think> before it, phrase at 3


def test_inject_refusals(gen, reader):
    be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader))
    try:
        be.join(0, PROMPT)
        with pytest.raises(ValueError, match="needs the next draft depth"):
            be.inject({0: list(PHRASE)})
    finally:
        be.close()
    with pytest.raises(ValueError, match="per-step depths"):
        TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader), depths=(1, 2)).inject({0: [1]}, {0: 1})
