"""The one-function greedy speculative loop (qwen36/speculative/greedy_loop.py) gives the engine's greedy output:
the same tokens and the same accepted count at every step, on the trained default checkpoint (whose MTP head
drafts well, so steps accept none, some and all of the drafts)."""
from __future__ import annotations

import pytest
import torch

from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.greedy_loop import greedy_speculative_generate
from qwen36.speculative.reference_backend import ReferenceBackend

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def model_and_prompt():
    from qwen36.reference.model import Qwen36Model
    from qwen36.tokenizer import load_tokenizer

    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, require_mtp=True)
    return model, load_tokenizer(DEFAULT_CHECKPOINT).encode(PROMPT)


def engine(model, prompt, n, k, mechanism, eos=()):
    backend = ReferenceBackend(model, mechanism, max_len=len(prompt) + n + k + 2)
    res = speculative_generate(backend, [prompt], n, [k], eos_ids=eos)[0]
    return res.tokens, res.stats.accepted


@pytest.mark.parametrize("k", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)])
def test_same_tokens_and_acceptances_as_the_engine(model_and_prompt, k):
    model, prompt = model_and_prompt
    tokens, accepted = greedy_speculative_generate(model, prompt, 32, k)
    assert len(tokens) == 32
    assert (tokens, accepted) == engine(model, prompt, 32, k, "snapshot")
    assert (tokens, accepted) == engine(model, prompt, 32, k, "shadow_commit")
    if k == 3:  # both branches of the commit ran: a rejection (restore + re-advance) and a full acceptance
        assert min(accepted) < k and max(accepted) == k, accepted
    from qwen36.reference.batch import generate

    assert tokens == generate(model, [torch.tensor(prompt)], 32)[0].tokens  # lossless vs plain greedy


def test_eos_inside_an_accepted_block_ends_the_output(model_and_prompt):
    model, prompt = model_and_prompt
    full, _ = greedy_speculative_generate(model, prompt, 32, 3)
    eos = full[9]
    first = full.index(eos)
    tokens, accepted = greedy_speculative_generate(model, prompt, 32, 3, eos_ids=(eos,))
    assert tokens == full[: first + 1]
    assert (tokens, accepted) == engine(model, prompt, 32, 3, "recompute", eos=(eos,))


def test_k_must_be_positive(model_and_prompt):
    model, prompt = model_and_prompt
    with pytest.raises(ValueError, match="k must be >= 1"):
        greedy_speculative_generate(model, prompt, 8, 0)
