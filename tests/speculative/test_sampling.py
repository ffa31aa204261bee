"""Sampling parameters on the reference: validation, vLLM's penalty / min_p formulas, plain sampled decoding, and
exactness under speculation with penalties (greedy lossless, logprobs equal to plain decoding's, chi-square of the
speculative sampler against the target's own penalised law)."""
from __future__ import annotations

import math

import pytest
import torch

from qwen36.errors import UserError
from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import speculative_generate, speculative_step
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.reference.batch import generate
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.generation.sampling import (MAX_LOGPROBS, Penalties, SamplingParams, TokenHistory, penalize,
                                         probs_from_logits, token_logprobs)

from qwen36.testing.speculative import DistDrafter, ScriptedDrafter, penalty_prompts as prompts, two_token_counts
from qwen36.testing.stats import P_VALUE_MIN, chi_square_p

# repetition > 1 (divides positive logits), a negative presence penalty and a positive frequency penalty: on the
# untrained tiny model only this mix changes greedy output on both prompts (it rarely repeats on its own)
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=-1.5, frequency_penalty=0.7)
STAT_SLOTS = 8  # users per backend in the statistical tests: n seeded runs go 8 at a time
# at temperature 1 the seen tokens must be among the likely ones for penalties to move the law: these move the
# two-token law of the chi-square test below far enough (total variation > 0.2, asserted) for its negative control
STOCH_PENALTIES = dict(repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=0.5)


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("ci")


@pytest.fixture(scope="module")
def model(ckpt):
    return Qwen36Model.from_checkpoint(ckpt, require_mtp=True)


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=-0.01), "min_p"), (dict(min_p=1.2), "min_p"),
    (dict(top_k=-2), "top_k"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(draft="top"), "draft"),
])
def test_bad_values_are_refused_naming_the_parameter(kw, match):
    with pytest.raises(UserError, match=match) as e:
        SamplingParams(**kw)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_top_k_minus_one_means_off_and_edges_are_accepted():
    assert SamplingParams(top_k=-1).top_k == 0
    SamplingParams(temperature=1.0, top_p=1.0, min_p=1.0, logprobs=MAX_LOGPROBS, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.5)


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    h = TokenHistory([0], 5)  # token 0 only in the prompt
    h.add([1, 3, 3])  # output: 1 once, 3 twice
    p = SamplingParams(**PENALTIES)
    got = penalize(logits, p, h.now())
    r, pres, freq = PENALTIES["repetition_penalty"], PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"]
    want = torch.tensor([2.0 / r,  # prompt only: repetition penalty, no presence/frequency
                         -1.0 * r - pres - freq,  # output once, negative logit: multiplied
                         0.5,  # unseen
                         3.0 / r - pres - 2 * freq,  # output twice
                         -2.0])
    torch.testing.assert_close(got, want)
    # verify rows: row j also counts the drafts d_1..d_j
    rows = h.rows(torch.tensor([2, 2]))
    assert rows.counts[:, 2].tolist() == [0.0, 1.0, 2.0] and rows.seen[:, 2].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="no token context"):
        penalize(logits, p, None)


def test_min_p_is_relative_to_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.1
    assert (p[0] > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(p[0, :3], torch.tensor([0.5, 0.3, 0.12]) / 0.92)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_raw_logprobs_and_rank():
    logits = torch.tensor([1.0, 3.0, 2.0])
    lp = token_logprobs(logits, 2, 2)
    ref = torch.log_softmax(logits.double(), -1)
    assert lp.rank == 2 and math.isclose(lp.logprob, float(ref[2]))
    assert [t for t, _ in lp.top] == [1, 2] and math.isclose(lp.top[0][1], float(ref[1]))


def test_plain_greedy_without_penalties_is_greedy_generate(model):
    p = prompts(model.config.vocab_size)[1]
    assert generate(model, [p], 10)[0].tokens == generate(model, [torch.tensor(p)], 10)[0].tokens


def test_plain_sampling_is_seeded(model):
    p = prompts(model.config.vocab_size)[0]
    params = SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=3, **PENALTIES)
    a, b = generate(model, [p], 12, params)[0], generate(model, [p], 12, params)[0]
    c = generate(model, [p], 12, SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=4, **PENALTIES))[0]
    assert a.tokens == b.tokens and len(a.tokens) == 12 and a.tokens != c.tokens


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_greedy_speculative_with_penalties_is_plain_greedy_with_penalties(model, mechanism):
    """Lossless with penalties: verify row j sees d_1..d_j in its counts, so every accepted block is what plain
    penalised greedy emits; logprobs (raw) equal plain decoding's within float tolerance."""
    v = model.config.vocab_size
    params = SamplingParams(logprobs=3, **PENALTIES)
    for p in prompts(v):
        plain = generate(model, [p], 16, params)[0]
        assert plain.tokens != generate(model, [torch.tensor(p)], 16)[0].tokens, "penalties change nothing: weak test"
        for k in (1, 3):
            # the real MTP drafts (an untrained head here: mostly rejected), then drafts from the known answer with
            # 30% wrong tokens, so that every acceptance length occurs
            spec = speculative_generate(ReferenceBackend(model, mechanism, 64), [p], 16, [k], [params])[0]
            assert spec.tokens == plain.tokens, (mechanism, k)
            spec = speculative_generate(ScriptedDrafter(model, mechanism, 64, [plain.tokens], [len(p)], seed=k), [p], 16,
                                        [k], [params])[0]
            assert spec.tokens == plain.tokens, (mechanism, k, "scripted")
            assert sum(spec.stats.accepted) > 0 and min(spec.stats.accepted) == 0
            assert [lp.token for lp in spec.logprobs] == spec.tokens
            for a, b in zip(spec.logprobs, plain.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4


def test_stochastic_abort_with_penalties_leaves_no_trace(model):
    """The token counts are part of the commit: aborted steps change neither the sampler nor the counts."""
    p = prompts(model.config.vocab_size)[0]
    params = SamplingParams(temperature=1.0, top_k=16, seed=2, **PENALTIES)
    want = speculative_generate(ReferenceBackend(model, "shadow_commit", 64), [p], 10, [2], [params])[0].tokens
    be = ReferenceBackend(model, "shadow_commit", 64)
    toks = [be.join(0, p, params)]
    while len(toks) < 10:
        be.verify(be.draft({0: 2}))
        be.abort()
        toks += speculative_step(be, {0: 2})[0].tokens
    assert toks[:10] == want


def _law(model, state, first_logits, history, params):
    """Joint law of the next two tokens: y1 from ``first_logits`` with ``history``'s penalties, y2 from the model
    after y1 (on a copy of ``state``) with y1 added to the history: what plain decoding samples from."""
    v = model.config.vocab_size
    p1 = probs_from_logits(first_logits, params, history.now()).double()
    joint = torch.zeros(v, v, dtype=torch.float64)
    for y1 in p1.nonzero().flatten().tolist():
        h2 = history.clone()
        h2.add([y1])
        lg = model(torch.tensor([[y1]]), state.clone()).logits[0, -1]
        joint[y1] = p1[y1] * probs_from_logits(lg, params, h2.now()).double()
    return joint


def _joint_law(model, pre, params):
    """Law of the next two emitted tokens from live state ``pre`` (pending token not yet consumed)."""
    st = pre.state.clone()
    first = model(torch.tensor([[pre.pending]]), st).logits[0, -1]
    return _law(model, st, first, pre.history, params)


@pytest.mark.slow  # 800 seeded speculative step pairs + 400 plain decodes
@pytest.mark.parametrize("draft", ["sample", "greedy"])
def test_speculative_sampling_with_penalties_and_min_p_is_the_target_law(model, draft):
    v, k, n = model.config.vocab_size, 2, 800
    params = SamplingParams(temperature=1.0, top_k=6, min_p=0.05, seed=7, draft=draft, **STOCH_PENALTIES)
    prompt = prompts(v)[0]
    probe = ReferenceBackend(model, "shadow_commit", 32)
    probe.join(0, prompt, params)
    pre = probe.live(0)
    joint = _joint_law(model, pre, params)
    support = joint.sum(1).nonzero().flatten().tolist()
    # drafts that overlap the target's support (the untrained MTP's are almost always rejected): a distribution
    # over the support plus one token the target never emits, or fixed tokens (one-hot drafts)
    if draft == "sample":
        union = sorted({int(t) for t in joint.nonzero()[:, 1]} | set(support))
        q = torch.zeros(v)
        q[union] = 1.0
        q[(max(union) + 1) % v] = 1.0
        be = DistDrafter(model, "shadow_commit", 32, q=q / q.sum(), slots=STAT_SLOTS)
    else:
        be = DistDrafter(model, "shadow_commit", 32, fixed=[support[1], int(joint[support[1]].argmax())],
                         slots=STAT_SLOTS)
    for b in range(STAT_SLOTS):  # each slot its own sampler stream
        be.join(b, prompt, SamplingParams(**{**params.__dict__, "seed": params.seed + b}))
    counts, accepted = two_token_counts(be, pre, k, n, v)  # n runs from the same state, STAT_SLOTS at a time
    assert 0 < sum(accepted) and min(accepted) == 0  # accept and reject paths both ran
    pval = chi_square_p(counts.flatten(), joint.flatten())
    assert pval > P_VALUE_MIN, f"speculative ({draft} drafts) vs target law: chi-square p={pval:.2e}"
    # the plain sampler draws its first two tokens from the law after the prompt
    st = model.new_state(1, 32)
    first = model(torch.tensor([prompt]), st).logits[0, -1]
    plain_law = _law(model, st, first, TokenHistory(prompt, v), params)
    plain = torch.zeros(v, v, dtype=torch.float64)
    for seed in range(n // 2):
        toks = generate(model, [prompt], 2, SamplingParams(**{**params.__dict__, "seed": seed}))[0].tokens
        plain[toks[0], toks[1]] += 1
    pval = chi_square_p(plain.flatten(), plain_law.flatten())
    assert pval > P_VALUE_MIN, f"plain sampler vs target law: chi-square p={pval:.2e}"
    # and the penalties matter here: the law without them is rejected by the same counts
    off = SamplingParams(temperature=1.0, top_k=6, min_p=0.05)
    law_off = _joint_law(model, pre.clone(), off)
    assert 0.5 * float((law_off - joint).abs().sum()) > 0.2
    assert chi_square_p(counts.flatten(), law_off.flatten()) < 1e-6


def test_generate_cli_plain_sampling_and_logprobs(ci_ckpt, capsys):
    """--temperature without --spec-k samples (seeded: same seed, same ids); --logprobs prints one line per token;
    speculative greedy with penalties prints the plain run's ids and logprobs."""
    from qwen36.cli import main

    base = ["generate", "-c", str(ci_ckpt), "--ids", "5,6,7,8", "--max-new-tokens", "6"]
    sampled = base + ["--temperature", "0.8", "--top-k", "40", "--min-p", "0.01", "--seed", "3",
                      "--repetition-penalty", "1.2", "--logprobs", "2"]
    capsys.readouterr()
    assert main(sampled) == 0
    a = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == a
    lines = a.splitlines()
    assert lines[0].startswith("ids:") and len(lines[0].split(":")[1].split(",")) == 6
    lp_lines = lines[lines.index(next(l for l in lines if l.startswith("logprobs"))) + 1:]
    assert len(lp_lines) == 6 and all(len(l.split("|")[1].split()) == 2 for l in lp_lines)
    ids = [int(t) for t in lines[0].split(":")[1].split(",")]
    assert [int(l.split()[1]) for l in lp_lines] == ids
    greedy = base + ["--presence-penalty", "-1.5", "--frequency-penalty", "0.7", "--logprobs", "1"]
    assert main(greedy) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(greedy + ["--spec-k", "2"]) == 0
    spec = capsys.readouterr().out.splitlines()
    assert spec[: len(plain)] == plain  # ids and the logprob lines (printed to 4 decimals)


def test_generate_help_documents_every_sampling_parameter(capsys):
    from qwen36.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--logprobs N", "--seed", "--spec-k"):
        assert flag in out, flag
    assert "[0, 20]" in out and "raw logprobs" in out
