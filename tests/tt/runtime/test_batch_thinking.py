"""The thinking budget on the batched TT plain decoders (``tt/runtime/batch.py``): each user of a batch counts its
own thinking tokens; at its budget the stop-thinking phrase's tokens replace the row's picks, one decode row a
time. Every user's tokens and logits equal the same request served alone by ``TTGenerator.generate`` (greedy,
and seeded sampling with penalties, whose device counts must follow the forced tokens, not the dropped picks)."""
from __future__ import annotations

import pytest
import torch

from qwen36.speculative.sampling import SamplingParams
from qwen36.speculative.thinking import ThinkingBudget
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.runtime.batch import TTBatchDecoder, batched_greedy

START, END = 7, 9  # stand-ins for <think> / </think> on the random ci checkpoint
PHRASE = (31, 32, 33, END, 34, 35)


@pytest.fixture(scope="module")
def gen(ckpt_factory):
    g = small_tt_generator(ckpt_factory("ci"))
    yield g
    g.close()


def prompts_of(vocab):
    g = torch.Generator().manual_seed(5)
    # users 0 and 2 end inside an open thinking block, user 1 outside one (nothing is forced unless it opens one)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() + tail for n, tail in ((12, [START]), (9, []),
                                                                                        (20, [START]))]


@pytest.mark.slow
def test_batched_greedy_budgets_equal_batch_one(gen):
    prompts = prompts_of(gen.config.vocab_size)
    for n in (0, 3):
        budget = ThinkingBudget(n, START, END, PHRASE)
        alone = [gen.generate(p, 14, thinking=budget, keep_logits=True) for p in prompts]
        for u in (0, 2):  # the phrase at exactly n thinking tokens (none of them closed the block first)
            assert END not in alone[u].tokens[:n] and tuple(alone[u].tokens[n:n + len(PHRASE)]) == PHRASE
        gen.release_trace()
        dec = TTBatchDecoder(gen.model, 4, use_trace=gen.use_trace)
        try:
            got = batched_greedy(dec, prompts, 14, thinking=budget, keep_logits=True)
        finally:
            dec.release()
        for u, want in enumerate(alone):
            assert got.tokens[u] == want.tokens
            diff = max(float((a - b).abs().max()) for a, b in zip(got.logits[u], want.logits))
            assert diff <= 1e-4, f"user {u}: batched logits differ from batch 1 by {diff}"
    # the greedy_batch entry point (the CLI's several-prompt path) passes the budget through
    budget = ThinkingBudget(3, START, END, PHRASE)
    assert gen.greedy_batch(prompts, 14, thinking=budget) == [gen.generate(p, 14, thinking=budget).tokens
                                                              for p in prompts]


@pytest.mark.slow
def test_batched_sampled_budget_with_penalties_equals_batch_one(gen):
    """Seeded sampling + penalties: the forced rows' penalty counts are rewritten from the history, so every user's
    draws match its batch-1 run; without the rewrite the penalised picks after the phrase would differ."""
    prompts = prompts_of(gen.config.vocab_size)
    params = SamplingParams(temperature=0.9, top_k=20, seed=4, repetition_penalty=1.3, presence_penalty=0.7)
    budget = ThinkingBudget(2, START, END, PHRASE)
    alone = [gen.generate(p, 14, params, thinking=budget).tokens for p in prompts]
    assert all(tuple(t[2:2 + len(PHRASE)]) == PHRASE for t in (alone[0], alone[2]))
    assert gen.sample_batch(prompts, 14, params, thinking=budget) == alone


def test_budget_with_logprobs_is_refused(gen):
    budget = ThinkingBudget(2, START, END, PHRASE)
    with pytest.raises(ValueError, match="logprobs with a thinking budget"):
        gen.sample_batch(prompts_of(gen.config.vocab_size), 4, SamplingParams(temperature=1.0, seed=1, logprobs=2),
                         thinking=budget)
