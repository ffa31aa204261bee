"""Thinking budget (``generation/thinking.py``) on the reference: the stop-thinking phrase is forced at exactly N
thinking tokens, plain and speculative (every commit mechanism) emit the same tokens, and the forced rows are a
prefill continuation (plain decoding of prompt + kept tokens + phrase continues the same way)."""
from __future__ import annotations

import pytest
import torch

from qwen36.prefix_cache import PrefixCache
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.reference.batch import generate
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft
from qwen36.generation.sampling import SamplingParams
from qwen36.generation.thinking import ThinkingBudget

START, END = 7, 9  # stand-ins for <think> / </think> on the random ci checkpoint
PHRASE = (31, 32, 33, END, 34, 35)


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return Qwen36Model.from_checkpoint(ckpt_factory("ci"), require_mtp=True)


def budget(n: int) -> ThinkingBudget:
    return ThinkingBudget(n, START, END, PHRASE)


PROMPT = [5, 11, 12, 13, 40, 41, 42, 43, 44, START]  # ends inside an open thinking block


def test_tracker_counts_and_cuts():
    t = budget(3).tracker(PROMPT)
    assert t.open
    assert t.cut([1, 2], 0) == (2, False)
    assert t.cut([4, 5, 6], 2) == (1, True) and t.injected_at == 3  # the 3rd thinking token, then the phrase
    t = budget(3).tracker(PROMPT)
    assert t.cut([1, END, 2, 3, 4], 0) == (5, False) and not t.open  # closed within the budget: nothing forced
    t = budget(2).tracker([5, 6])  # no block open: counting starts after a generated <think>
    assert t.cut([1, START, 2, 3, 4], 0) == (4, True) and t.injected_at == 4
    assert budget(0).tracker(PROMPT).inject_first() and not budget(0).tracker([5, START, 6, END]).inject_first()
    with pytest.raises(ValueError, match="close"):
        ThinkingBudget(1, START, END, (1, 2))


@pytest.mark.parametrize("n", [0, 1, 4, 7])
def test_plain_injects_at_exactly_n_and_continues_as_a_prefill(model, n):
    out = generate(model, [PROMPT], 20, thinking=budget(n))[0].tokens
    free = generate(model, [PROMPT], 20)[0].tokens
    assert END not in free[:n], "the test needs a stretch of thinking without </think>"
    assert out[:n] == free[:n]
    assert tuple(out[n:n + len(PHRASE)]) == PHRASE
    # the continuation is what plain decoding of prompt + kept + phrase gives
    cont = generate(model, [PROMPT + out[:n + len(PHRASE)]], 20 - n - len(PHRASE))[0].tokens
    assert out[n + len(PHRASE):] == cont


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_speculative_equals_plain_with_the_same_injection(model, mech, n):
    want = generate(model, [PROMPT], 20, thinking=budget(n))[0].tokens
    be = ReferenceBackend(model, mech, max_len=64)
    got = speculative_generate(be, [PROMPT], 20, [3], [SamplingParams()], thinking=budget(n))[0]
    assert got.tokens == want
    assert tuple(got.tokens[n:n + len(PHRASE)]) == PHRASE


class OracleDrafts(ReferenceBackend):
    """Drafts the known output (all accepted), so a step crosses the budget and must be cut inside it."""

    def __init__(self, model, mech, want, prompt_len):
        super().__init__(model, mech, max_len=64)
        self.want, self.prompt_len, self.commits = want, prompt_len, []

    def draft(self, depths):
        super().draft(depths)
        k = depths[0]
        i = int(self.state.pos[0]) - self.prompt_len + 1  # tokens emitted so far (the pending one included)
        return ReferenceDraft(dict(depths), {0: torch.tensor([(self.want[i:i + k] + [0] * k)[:k]])}, {0: None})

    def commit(self, acceptances):
        super().commit(acceptances)
        self.commits.append(acceptances[0].num_accepted)


@pytest.mark.parametrize("mech", MECHANISMS)
def test_budget_inside_a_fully_accepted_step(model, mech):
    n = 2
    want = generate(model, [PROMPT], 20, thinking=budget(n))[0].tokens
    be = OracleDrafts(model, mech, want, len(PROMPT))
    got = speculative_generate(be, [PROMPT], 20, [3], [SamplingParams()], thinking=budget(n))[0]
    assert got.tokens == want
    # step 1 had 3 correct drafts after the prefill's token, but commits only up to the 2nd thinking token (a = 0:
    # the pending token is the 2nd), then the phrase is injected (all 6 forced rows committed)
    assert be.commits[:2] == [0, len(PHRASE)]


def test_speculative_sampled_injects_at_exactly_n_with_a_prefix_cache(model):
    params = SamplingParams(temperature=1.0, top_k=10, seed=3)
    for n in (2, 6):
        cache = PrefixCache(4, 1 << 30)
        be = ReferenceBackend(model, "shadow_commit", max_len=64, prefix_cache=cache)
        got = speculative_generate(be, [PROMPT], 24, [3], [params], thinking=budget(n))[0].tokens
        assert END not in got[:n] and tuple(got[n:n + len(PHRASE)]) == PHRASE
        assert cache.stats.inserts == 2  # the prompt's two whole blocks before its last token, nothing else


def test_refusals(model):
    be = ReferenceBackend(model, "snapshot", max_len=64)
    with pytest.raises(ValueError, match="logprobs"):
        speculative_generate(be, [PROMPT], 8, [2], [SamplingParams(logprobs=2)], thinking=budget(2))[0]
    with pytest.raises(ValueError, match="logprobs"):
        generate(model, [PROMPT], 8, SamplingParams(logprobs=2), thinking=budget(2))[0]


def test_batched_speculative_budgets_equal_single_user_runs(model):
    """Three users of one ReferenceBackend, each with the budget counted on its own (users reach it in
    different steps, one at its first token); the phrases of users reaching it in the same step go in one packed
    inject. Each user's tokens == its plain run with the budget."""
    prompts = [PROMPT, [3, 4, 5, START], [60, 61, START, 62, 63]]  # the third: thinking opened mid-prompt
    for n in (1, 3):
        want = [generate(model, [p], 20, thinking=budget(n))[0].tokens for p in prompts]
        be = ReferenceBackend(model, "snapshot", max_len=64, slots=3, max_k=3)
        got = speculative_generate(be, prompts, 20, [3, 2, 3], [SamplingParams()] * 3, thinking=budget(n),
                                   arrivals=[0, 0, 1])
        assert [r.tokens for r in got] == want
        assert all(tuple(w[n:n + len(PHRASE)]) == PHRASE for w in want)


@pytest.mark.parametrize("n", [0, 2, 5])
def test_batched_plain_budgets_equal_single_user_runs(model, n):
    """The reference slot decoder (``reference.batch``) with a budget: each user's forced phrase is fed one decode
    row a time, replacing its picks (``ForcedFeed``); its tokens equal its own run alone with the budget. The users
    reach the budget in different steps, one never opens a block."""

    prompts = [PROMPT, [3, 4, 5, START], [60, 61, 62, 63], [60, 61, START, 62, 63]]
    want = [generate(model, [p], 20, thinking=budget(n))[0].tokens for p in prompts]
    assert [r.tokens for r in generate(model, prompts, 20, thinking=budget(n))] == want
    forced_users = [u for u in (0, 1, 3) if END not in want[u][:n]]
    assert forced_users and all(tuple(want[u][n:n + len(PHRASE)]) == PHRASE for u in forced_users)


def test_forced_feed_replaces_picks_in_order():
    from qwen36.generation.thinking import ForcedFeed

    feed = ForcedFeed(budget(2), PROMPT)
    emitted = [feed.choose(p, i) for i, p in enumerate([50, 51, 52, 53, 54, 55, 56, 57, 58])]
    assert emitted == [(50, False), (51, False), *[(t, True) for t in PHRASE], (58, False)]
    first = ForcedFeed(budget(0), PROMPT)  # budget 0, block open: the phrase comes before any pick
    assert [first.choose(99, i)[0] for i in range(len(PHRASE) + 1)] == [*PHRASE, 99]
