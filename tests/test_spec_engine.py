"""Speculative engine on the reference backend: greedy lossless vs plain greedy (K = 1..7, every commit
mechanism, several prompts, EOS inside an accepted block), mechanism counters, stochastic exactness end to
end (chi-square of the emitted joint distribution vs the target's own sampling distribution), CLI."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.model import Qwen36Model, greedy_generate
from qwen36.speculative.engine import Acceptance, MechanismCounters, SpecBackend, speculative_generate, speculative_step
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft
from qwen36.speculative.sampling import SamplingParams, probs_from_logits
from qwen36.testing.speculative import load_live

from test_spec_acceptance import P_VALUE_MIN, chi_square_p


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("ci")


@pytest.fixture(scope="module")
def model(ckpt):
    return Qwen36Model.from_checkpoint(ckpt, require_mtp=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]  # 30 > 16: chunked prefill


class ScriptedDrafter(ReferenceBackend):
    """Drafts from a known greedy continuation ``script`` (each token wrong with probability ``wrong``), so
    every acceptance length occurs. The real MTP still runs first (reseed + chain), then its tokens are replaced."""

    def __init__(self, model, mechanism, max_len, script: list[int], prompt_len: int, wrong: float = 0.3, seed: int = 0):
        super().__init__(model, mechanism, max_len)
        self.script, self.prompt_len, self.wrong = script, prompt_len, wrong
        self.g = torch.Generator().manual_seed(seed)
        self.committed: list[Acceptance] = []

    def draft(self, k):
        super().draft(k)
        i = self.live.state.pos - self.prompt_len + 1  # tokens emitted so far; the pending one is script[i-1]
        toks = (self.script[i:i + k] + [0] * k)[:k]
        bad = torch.rand(k, generator=self.g) < self.wrong
        toks = [(t + 1) % self.model.config.vocab_size if b else t for t, b in zip(toks, bad.tolist())]
        return ReferenceDraft(torch.tensor([toks]), None)

    def commit(self, acceptance):
        super().commit(acceptance)
        self.committed.append(acceptance)


class CannedBackend:
    """A model-free SpecBackend: each step emits the next canned Acceptance (tests the loop alone)."""

    label, mechanism = "canned (no model)", "shadow_commit"

    def __init__(self, first: int, steps: list[Acceptance]):
        self.first, self.steps, self.counters, self.calls = first, list(steps), MechanismCounters(), []

    def prefill(self, prompt, params):
        return self.first

    def draft(self, k):
        self.calls.append("draft")
        return k

    def verify(self, draft):
        self.calls.append("verify")
        return None

    def accept(self, draft, verify):
        self.calls.append("accept")
        return self.steps.pop(0)

    def commit(self, acceptance):
        self.calls.append("commit")

    def abort(self):
        raise AssertionError("not used")


def test_loop_without_a_model_cuts_at_eos_and_length():
    steps = [Acceptance(2, [11, 12, 13]), Acceptance(0, [14]), Acceptance(3, [15, 99, 16, 17])]
    be = CannedBackend(10, steps)
    assert isinstance(be, SpecBackend)
    out = speculative_generate(be, [1, 2], 100, 3, eos_ids=(99,))
    assert out.tokens == [10, 11, 12, 13, 14, 15, 99]  # EOS inside the third block ends the output there
    assert be.calls == ["draft", "verify", "accept", "commit"] * 3
    assert out.stats.histogram() == [1, 0, 1, 1] and out.stats.per_position() == [2 / 3, 2 / 3, 1 / 3]
    assert out.stats.mean_accepted == pytest.approx(5 / 3) and out.stats.mean_emitted == pytest.approx(8 / 3)
    out = speculative_generate(CannedBackend(10, [Acceptance(2, [11, 12, 13])]), [1], 3, 2)
    assert out.tokens == [10, 11, 12]  # max_new_tokens cuts inside a block
    assert speculative_generate(CannedBackend(99, []), [1], 5, 2, eos_ids=(99,)).tokens == [99]
    with pytest.raises(ValueError, match="num_accepted"):
        Acceptance(1, [5])


def test_reference_backend_satisfies_the_protocol(model):
    assert isinstance(ReferenceBackend(model), SpecBackend)
    assert ReferenceBackend(model).label == "reference (torch CPU)"
    with pytest.raises(ValueError, match="commit mechanism"):
        ReferenceBackend(model, "copy_everything")
    with pytest.raises(RuntimeError, match="before prefill"):
        ReferenceBackend(model).draft(2)


@pytest.mark.parametrize("mechanism", MECHANISMS)
# K = 1 and 3 in the fast tier; the other depths in the slow tier
@pytest.mark.parametrize("k", [k if k in (1, 3) else pytest.param(k, marks=pytest.mark.slow) for k in range(1, 8)])
def test_greedy_lossless(model, mechanism, k):
    ps = prompts(model.config.vocab_size)
    # scripted drafts (all acceptance lengths occur) on the first prompt
    ref = greedy_generate(model, torch.tensor(ps[0]), 20 + k)
    be = ScriptedDrafter(model, mechanism, 64, ref, len(ps[0]), seed=k)
    out = speculative_generate(be, ps[0], 20, k)
    assert out.tokens == ref[:20], f"scripted drafts, K={k} {mechanism}"
    assert len(set(out.stats.accepted)) > 1 or k == 1
    # the real MTP drafts on the other prompts
    for p in ps[1:]:
        ref = greedy_generate(model, torch.tensor(p), 10)
        out = speculative_generate(ReferenceBackend(model, mechanism, 64), p, 10, k)
        assert out.tokens == ref, f"MTP drafts, K={k} {mechanism}, prompt len {len(p)}"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_eos_inside_an_accepted_block_stops_there(model, mechanism):
    p, k = prompts(model.config.vocab_size)[1], 4
    ref = greedy_generate(model, torch.tensor(p), 16)
    # with perfect drafts step 1 emits ref[1..5]; put EOS at the first new token id in positions 2..4
    j = next(j for j in (2, 3, 4) if ref[j] not in ref[:j])
    eos = ref[j]
    want = greedy_generate(model, torch.tensor(p), 16, eos_ids=(eos,))
    assert want == ref[: j + 1]
    be = ScriptedDrafter(model, mechanism, 64, ref, len(p), wrong=0.0)
    out = speculative_generate(be, p, 16, k, eos_ids=(eos,))
    assert out.tokens == want
    block = be.committed[0].tokens
    assert eos in block[:-1], f"EOS {eos} should sit inside the accepted block {block}"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mechanism_counters(model, mechanism):
    p, k = prompts(model.config.vocab_size)[0], 3
    ref = greedy_generate(model, torch.tensor(p), 30)
    be = ScriptedDrafter(model, mechanism, 64, ref, len(p), seed=3)
    out = speculative_generate(be, p, 24, k)
    n_gdn, nbytes = be.gdn_layout
    assert n_gdn == 3
    steps, partial = out.stats.steps, sum(a < k for a in out.stats.accepted)
    assert 0 < partial < steps  # both branches of snapshot were exercised
    c = be.counters
    want = {}
    for a in out.stats.accepted:
        for key, v in be.mechanism.expected_step_counters(k, a, n_gdn, nbytes).items():
            want[key] = want.get(key, 0) + v
    assert c.as_dict() == want
    accepted_rows = sum(a + 1 for a in out.stats.accepted)
    if mechanism == "shadow_commit":
        assert c.state_copies == 0 and c.state_bytes_moved == 0
        assert c.target_forwards == steps and c.recurrence_steps == steps * (k + 1) * n_gdn
        assert c.slot_bytes_written == steps * (k + 1) * nbytes
    elif mechanism == "snapshot":
        assert c.state_copies == n_gdn * (steps + partial)  # save every step, restore on partial acceptance
        assert c.target_forwards == steps + partial
        rerun = sum(a + 1 for a in out.stats.accepted if a < k)
        assert c.recurrence_steps == n_gdn * (steps * (k + 1) + rerun)
    else:
        assert c.state_copies == n_gdn * steps and c.target_forwards == 2 * steps
        assert c.recurrence_steps == n_gdn * (steps * (k + 1) + accepted_rows)
    assert c.mtp_forwards == steps * k


class DistDrafter(ReferenceBackend):
    """Drafts from a fixed distribution ``q`` [V] (sampled drafts) or fixed tokens (one-hot drafts), so the
    draft overlaps the target's top-k support and both accept and reject paths occur."""

    def __init__(self, model, mechanism, max_len, q=None, fixed=None):
        super().__init__(model, mechanism, max_len)
        self.q, self.fixed = q, fixed

    def draft(self, k):
        super().draft(k)
        if self.q is not None:
            toks = torch.multinomial(self.q, k, replacement=True, generator=self.generator)
            return ReferenceDraft(toks[None], self.q.expand(1, k, -1).clone())
        return ReferenceDraft(torch.tensor([self.fixed[:k]]), None)


@pytest.mark.parametrize("drafts,mechanism", [("sampled", "shadow_commit"), ("one-hot", "snapshot")])
@pytest.mark.slow  # 1000 seeded generations per case
def test_stochastic_exactness_end_to_end(model, drafts, mechanism):
    """Joint law of the next two emitted tokens == the target's own sampling law (temperature 1, top-k 3)."""
    v, k, n = model.config.vocab_size, 2, 1000
    params = SamplingParams(temperature=1.0, top_k=3, seed=1, draft="greedy")
    p = prompts(v)[0]
    # the target's own law: p1 after the pending token, p2 after each possible first token
    probe = ReferenceBackend(model, "shadow_commit", 32)
    probe.prefill(p, params)
    pre = probe.live.clone()
    st = pre.state.clone()
    p1 = probs_from_logits(model(torch.tensor([[pre.pending]]), st).logits[0, -1], params)
    support = p1.nonzero().flatten().tolist()
    joint = torch.zeros(v, v, dtype=torch.float64)
    for x1 in support:
        s2 = st.clone()
        joint[x1] = p1[x1] * probs_from_logits(model(torch.tensor([[x1]]), s2).logits[0, -1], params).double()
    union = sorted({int(t) for t in joint.nonzero()[:, 1]} | set(support))
    if drafts == "sampled":  # overlaps the target support, plus one token the target never emits
        q = torch.zeros(v)
        q[union] = 1.0
        q[(max(union) + 1) % v] = 1.0
        be = DistDrafter(model, mechanism, 32, q=q / q.sum())
    else:
        be = DistDrafter(model, mechanism, 32, fixed=[support[1], int(joint[support[1]].argmax())])
    be.prefill(p, params)
    assert be.live.pending == pre.pending
    counts = torch.zeros(v, v, dtype=torch.float64)
    accepted = []
    for _ in range(n):
        load_live(be, pre)
        emitted = []
        while len(emitted) < 2:
            acc = speculative_step(be, k)
            accepted.append(acc.num_accepted)
            emitted += acc.tokens
        counts[emitted[0], emitted[1]] += 1
    assert 0 < sum(accepted) and min(accepted) == 0  # accept and reject paths both ran
    pval = chi_square_p(counts.flatten(), joint.flatten())
    print(f"{drafts}: p={pval:.3g}, accepted histogram {[accepted.count(i) for i in range(k + 1)]}")
    assert pval > P_VALUE_MIN, f"{drafts} drafts: chi-square p={pval:.2e}"


def test_stochastic_with_mtp_drafts_is_seeded(model):
    p = prompts(model.config.vocab_size)[0]
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=4)
    a = speculative_generate(ReferenceBackend(model, "recompute", 64), p, 12, 3, params)
    b = speculative_generate(ReferenceBackend(model, "recompute", 64), p, 12, 3, params)
    assert a.tokens == b.tokens and len(a.tokens) == 12


def test_abort_then_step_matches_uninterrupted(model):
    p = prompts(model.config.vocab_size)[1]
    for mechanism in MECHANISMS:
        ref = greedy_generate(model, torch.tensor(p), 12)
        be = ScriptedDrafter(model, mechanism, 64, ref, len(p), seed=9)
        toks = [be.prefill(p, SamplingParams())]
        while len(toks) < 12:
            d = be.draft(3)
            be.verify(d)
            be.abort()
            toks += speculative_step(be, 3).tokens
        assert toks[:12] == ref, mechanism
        assert be.counters.aborts == be.counters.steps


def test_stochastic_abort_rewinds_the_sampler(model):
    """An aborted step leaves no trace, sampler included: with aborts interleaved, the same tokens come out."""
    p = prompts(model.config.vocab_size)[0]
    params = SamplingParams(temperature=1.0, top_k=16, seed=2)
    want = speculative_generate(ReferenceBackend(model, "shadow_commit", 64), p, 10, 2, params).tokens
    be = ReferenceBackend(model, "shadow_commit", 64)
    toks = [be.prefill(p, params)]
    while len(toks) < 10:
        be.verify(be.draft(2))
        be.abort()
        toks += speculative_step(be, 2).tokens
    assert toks[:10] == want


@pytest.mark.slow  # a CLI run per mechanism
def test_generate_cli_speculative_matches_greedy(ckpt, capsys):
    from qwen36.cli import main

    main(["generate", "-c", str(ckpt), "--ids", "5,6,7,8", "--max-new-tokens", "12"])
    plain = capsys.readouterr().out.splitlines()[0]
    for mech in MECHANISMS:
        main(["generate", "-c", str(ckpt), "--ids", "5,6,7,8", "--max-new-tokens", "12", "--spec-k", "3", "--commit", mech])
        out = capsys.readouterr().out
        assert out.splitlines()[0] == plain
        assert "backend: reference (torch CPU)" in out and "mean accepted/step" in out and "histogram" in out
    # the TT speculative path prints the same statistics as the reference path
    capsys.readouterr()
    assert main(["generate", "-c", str(ckpt), "--ids", "5,6", "--spec-k", "2", "--device", "emulated-p150x2"]) == 0
    out = capsys.readouterr().out
    assert "backend: tt (emulated-p150x2" in out and "mean accepted/step" in out and "histogram" in out


def test_divergence_note_gives_the_reference_top2_margin_where_tokens_part(model):
    """A failing lossless check says where two greedy continuations part and the reference's top-2 logit margin
    there, so a near-tie flip reads differently from a state bug."""
    from qwen36.speculative.oracle import divergence_note, first_difference

    prompt = prompts(model.config.vocab_size)[0]
    want = greedy_generate(model, torch.tensor(prompt), 6)
    assert divergence_note(model, prompt, want, want) == "" and first_difference(want, want) is None
    got = want[:3] + [(want[3] + 1) % model.config.vocab_size] + want[4:]
    note = divergence_note(model, prompt, got, want)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:3]])).logits[0, -1]
    top = torch.topk(logits, 2)
    assert int(top.indices[0]) == want[3]
    assert f"first difference at generated token 3 (got {got[3]}, expected {want[3]})" in note
    assert f"reference top-2 margin {float(top.values[0] - top.values[1]):.4g}" in note
    assert first_difference(want[:4], want) == 4  # a shorter run parts where it ends
