"""The speculative engine (one protocol, one driver, one step) on the reference backend (``ReferenceBackend``, one
slot or B: one packed B x (K+1) forward per step, per-user accept and commit), every test at B = 1 and at B >= 4
users in one backend where the behaviour is per user: greedy lossless vs plain greedy (K = 1..7, every commit
mechanism, several prompts, EOS inside an accepted block, a user joining mid-run), per-user seeded sampling,
aborts, mechanism counters, stochastic exactness end to end (chi-square of the emitted joint distribution vs the
target's own sampling distribution), CLI. With the shipped trained checkpoint (its drafts are accepted): packed
users at B = 2, 4 (8 slow) lossless against each user's batch-1 greedy output and its own single-user run (a late
user reusing an EOS-freed slot), stochastic users with penalties and logprobs == their batch-1 runs, per-user
depth controllers; per-user stochastic exactness (chi-square, slow); the batched transaction probe (fast: B = 2;
slow: B = 4) and the broken batch mechanisms it catches."""
from __future__ import annotations

import argparse

import pytest
import torch

from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.probes import gdn_transaction as probe
from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.depth import FixedDepth
from qwen36.speculative.engine import (Acceptance, MechanismCounters, SpecBackend, SpecBatch, speculative_generate,
                                       speculative_step)
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.speculative.reference_mechanisms import ShadowCommit
from qwen36.generation.sampling import SamplingParams, probs_from_logits

from qwen36.testing.speculative import DistDrafter, ScriptedDrafter, engine_prompts as prompts, two_token_counts
from qwen36.testing.stats import P_VALUE_MIN, chi_square_p

BATCHES = [1, 4]  # B = 1 and several users in one backend: the same code path
STAT_SLOTS = 8  # users per backend in the statistical tests: n seeded runs go 8 at a time
# fp32 on CPU: a [B, T] forward may round differently from [1, T] (observed max abs ~1e-6 here)
ATOL = 1e-4
TEXTS = ["def add(a, b):\n", "import os\n", "class Point:\n    def __init__(self, x, y):\n", "x = [",
         "for i in range(10):\n    ", "# sum of squares\n", "def f(", "while True:\n"]


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("ci")


@pytest.fixture(scope="module")
def model(ckpt):
    return Qwen36Model.from_checkpoint(ckpt, require_mtp=True)


@pytest.fixture(scope="module")
def default_model():
    return Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, require_mtp=True)


@pytest.fixture(scope="module")
def code_prompts():
    from qwen36.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    return [tok.encode(t) for t in TEXTS]


@torch.no_grad()
def plain_greedy(model, prompt, n, eos=()):
    """Batch-1 plain greedy through the scalar-position path (independent of the slot machinery)."""
    state = model.new_state(1, len(prompt) + n + 1)
    out = model(torch.tensor([prompt]), state)
    toks = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
        if tok in eos or len(toks) >= n:
            return toks
        out = model(torch.tensor([[tok]]), state)


def decode(model, mechanism, users: list[list[int]], n: int, k, b: int, params=None, eos=(), arrivals=None,
           backend=ReferenceBackend, **kw):
    """Every user of ``users`` decoded on ``backend``: b = 1 one one-slot backend per user, else all users in one
    b-slot backend (one packed verify per step). -> (results, backends)."""
    params = params or [SamplingParams()] * len(users)
    ks = [k] * len(users) if isinstance(k, int) else k
    if b == 1:
        bes = [backend(model, mechanism, 96, **kw) for _ in users]
        return [speculative_generate(be, [u], n, [kk], [pp], eos)[0]
                for be, u, kk, pp in zip(bes, users, ks, params)], bes
    be = backend(model, mechanism, 96, slots=b, **kw)
    return speculative_generate(be, users, n, ks, params, eos, arrivals=arrivals), [be]


def scripted(model, mechanism, users, refs, b, **kw) -> list[ScriptedDrafter]:
    """b = 1: one scripted one-slot backend per user; else one b-slot backend for all (user i in slot i)."""
    if b == 1:
        return [ScriptedDrafter(model, mechanism, 96, [r], [len(u)], **kw) for u, r in zip(users, refs)]
    return [ScriptedDrafter(model, mechanism, 96, refs, [len(u) for u in users], slots=b, **kw)]


def run_scripted(bes, users, n, k, eos=()):
    if len(bes) == len(users) and bes[0].slots == 1:
        return [speculative_generate(be, [u], n, [k], eos_ids=eos)[0] for be, u in zip(bes, users)]
    return speculative_generate(bes[0], users, n, [k] * len(users), eos_ids=eos)


class CannedBackend:
    """A model-free SpecBackend: the i-th user to join gets ``first[i]``, then each step emits its next canned
    Acceptance from ``steps[i]`` (tests the loop alone)."""

    label, mechanism = "canned (no model)", "shadow_commit"

    def __init__(self, first: list[int], steps: list[list[Acceptance]]):
        self.slots = len(first)
        self.first, self.canned, self.counters, self.calls = first, [list(s) for s in steps], MechanismCounters(), []
        self.steps: dict[int, list[Acceptance]] = {}  # slot -> its user's canned steps
        self.joined, self.left = 0, []

    def join(self, slot, prompt, params):
        self.steps[slot] = self.canned[self.joined]
        self.joined += 1
        return self.first[self.joined - 1]

    def first_logprobs(self, slot):
        return None

    def leave(self, slot):
        self.left.append(slot)

    def draft(self, depths):
        self.calls.append("draft")
        return dict(depths)

    def verify(self, draft):
        self.calls.append("verify")
        return None

    def accept(self, draft, verify):
        self.calls.append("accept")
        return {s: self.steps[s].pop(0) for s in draft}

    def commit(self, acceptances):
        self.calls.append("commit")

    def abort(self):
        raise AssertionError("not used")


def test_loop_without_a_model_cuts_at_eos_and_length():
    steps = [Acceptance(2, [11, 12, 13]), Acceptance(0, [14]), Acceptance(3, [15, 99, 16, 17])]
    be = CannedBackend([10], [steps])
    assert isinstance(be, SpecBackend)
    out = speculative_generate(be, [[1, 2]], 100, [3], eos_ids=(99,))[0]
    assert out.tokens == [10, 11, 12, 13, 14, 15, 99]  # EOS inside the third block ends the output there
    assert be.calls == ["draft", "verify", "accept", "commit"] * 3 and be.left == [0]
    assert out.stats.histogram() == [1, 0, 1, 1] and out.stats.per_position() == [2 / 3, 2 / 3, 1 / 3]
    assert out.stats.mean_accepted == pytest.approx(5 / 3) and out.stats.mean_emitted == pytest.approx(8 / 3)
    out = speculative_generate(CannedBackend([10], [[Acceptance(2, [11, 12, 13])]]), [[1]], 3, [2])[0]
    assert out.tokens == [10, 11, 12]  # max_new_tokens cuts inside a block
    assert speculative_generate(CannedBackend([99], [[]]), [[1]], 5, [2], eos_ids=(99,))[0].tokens == [99]
    with pytest.raises(ValueError, match="num_accepted"):
        Acceptance(1, [5])


def test_loop_without_a_model_steps_users_together_and_each_stops_on_its_own():
    """Four users in one backend: one draft/verify/accept/commit per round for all of them; a user that is done
    leaves its slot at once (its join's token was EOS, or EOS / the length inside a block) while the others go on;
    user 3 arrives in round 2, takes the lowest free slot and sits that round's step out."""
    a = Acceptance
    be = CannedBackend([10, 99, 20, 30], [[a(1, [11, 12]), a(0, [13]), a(0, [14])], [],
                                          [a(2, [21, 99, 22])], [a(0, [31]), a(1, [32, 33])]])
    out = speculative_generate(be, [[1]] * 4, 4, [2] * 4, eos_ids=(99,), arrivals=[0, 0, 0, 2])
    assert [r.tokens for r in out] == [[10, 11, 12, 13], [99], [20, 21, 99], [30, 31, 32, 33]]
    assert [r.stats.steps for r in out] == [2, 0, 1, 2]
    # slots freed: user 1 at its join, user 2 (slot 1) in round 1, user 0 in round 2, user 3 (slot 1 again) in round 4
    assert be.left == [1, 1, 0, 1]
    assert be.calls == ["draft", "verify", "accept", "commit"] * 4  # rounds 1..4 (round 0: joins only)


def test_spec_batch_step_is_the_one_step_order():
    """SpecBatch: add() joins now (lowest free slot), step() runs every running request or the ones named (the
    driver names those that joined before the round)."""
    be = CannedBackend([10, 20], [[Acceptance(0, [11]), Acceptance(0, [12])], [Acceptance(0, [21])]])
    batch = SpecBatch(be)
    r0 = batch.add([1], 3, 1)
    assert batch.step([]) == [] and be.calls == []  # nothing named: no backend call
    r1 = batch.add([1], 2, 1)
    assert (r0.slot, r1.slot) == (0, 1)
    assert batch.step([r0]) == [r0] and r0.tokens == [10, 11]
    assert batch.step() == [r0, r1] and r0.done and r1.done and batch.free == [0, 1] and not batch.running
    assert r0.result().tokens == [10, 11, 12] and r1.result().tokens == [20, 21]
    with pytest.raises(ValueError, match="no slot is free"):
        full = SpecBatch(CannedBackend([10], [[]]))
        full.add([1], 5, 1)
        full.add([1], 5, 1)


class CappedBackend(CannedBackend):
    """CannedBackend that records the drafts a caller capped and the aborts."""

    def cap_drafts(self, drafts):
        self.calls.append(("cap", {s: list(d) for s, d in drafts.items()}))

    def abort(self):
        self.calls.append("abort")


class Observed(FixedDepth):
    def __init__(self, k):
        super().__init__(k)
        self.seen = []

    def observe(self, k, num_accepted):
        self.seen.append((k, num_accepted))


def test_spec_batch_open_step_with_caller_drafts():
    """A server that hands the drafts out: draft() opens the step, step(drafts=...) finishes it with the caller's
    (capped) drafts; the depth policy learns from the drafts offered, nothing from a step that offered none;
    abort() drops an open step; nothing else runs while a step is open."""
    be = CappedBackend([10], [[Acceptance(0, [11]), Acceptance(1, [5, 12]), Acceptance(0, [13])]])
    batch = SpecBatch(be)
    depth = Observed(3)
    r = batch.add([1], 99, depth)
    assert batch.draft() == [r] and be.calls == ["draft"] and batch.is_open
    with pytest.raises(RuntimeError, match="step\\(\\) or abort\\(\\) first"):
        batch.draft()
    with pytest.raises(ValueError, match="finishes the step draft\\(\\) opened"):
        batch.step([r])
    assert batch.step(drafts={0: []}) == [r] and not batch.is_open
    assert be.calls[1:] == [("cap", {0: []}), "verify", "accept", "commit"] and depth.seen == []
    batch.step(drafts={0: [5, 6]})  # no open step: step() drafts first
    assert depth.seen == [(2, 1)] and r.last.tokens == [5, 12] and r.stats.depths == [3, 3]
    batch.draft()
    batch.abort()
    assert be.calls[-2:] == ["draft", "abort"] and not batch.is_open
    with pytest.raises(RuntimeError, match="no open step"):
        batch.abort()
    batch.step()
    assert depth.seen == [(2, 1), (3, 0)] and r.tokens == [10, 11, 5, 12, 13]
    batch.leave(r)
    assert batch.free == [0] and be.left == [0] and r.slot == -1


def test_reference_backend_satisfies_the_protocol_and_refuses_misuse(model):
    assert isinstance(ReferenceBackend(model), SpecBackend)
    assert ReferenceBackend(model).label == "reference (torch CPU)" and ReferenceBackend(model).slots == 1
    with pytest.raises(ValueError, match="commit mechanism"):
        ReferenceBackend(model, "copy_everything")
    with pytest.raises(ValueError, match="slot 0 holds no user"):
        ReferenceBackend(model).draft({0: 2})
    be = ReferenceBackend(model, max_len=32, slots=2)
    d = FixedDepth(1)
    with pytest.raises(ValueError, match="its own depth policy"):
        speculative_generate(be, [[1], [2]], 4, [d, d], [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="no slot is free"):
        speculative_generate(be, [[1], [2], [3]], 4, [1, 1, 1])
    be = ReferenceBackend(model, max_len=16, slots=2, max_k=2)
    be.join(0, [1, 2, 3])
    with pytest.raises(ValueError, match="holds no user"):
        be.draft({1: 1})
    with pytest.raises(ValueError, match=r"draft depth must be in \[1, 2\]"):
        be.draft({0: 3})
    d = be.draft({0: 2})
    with pytest.raises(RuntimeError, match="open step"):
        be.join(1, [4])
    v = be.verify(d)
    with pytest.raises(ValueError, match="one acceptance per user"):
        be.commit({})
    be.commit(be.accept(d, v))
    with pytest.raises(ValueError, match="no slot is free"):
        speculative_generate(ReferenceBackend(model, max_len=16, max_k=1), [[1], [2]], 4, [1, 1],
                             [SamplingParams()] * 2)


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("mechanism", MECHANISMS)
# K = 1 and 3 in the fast tier; the other depths in the slow tier
@pytest.mark.parametrize("k", [k if k in (1, 3) else pytest.param(k, marks=pytest.mark.slow) for k in range(1, 8)])
def test_greedy_lossless(model, mechanism, k, b):
    ps = prompts(model.config.vocab_size, max(3, b))
    # scripted drafts (all acceptance lengths occur) on the first prompt(s)
    users = ps[:1] if b == 1 else ps[:b]
    refs = [generate(model, [torch.tensor(p)], 20 + k)[0].tokens for p in users]
    out = run_scripted(scripted(model, mechanism, users, refs, b, seed=k), users, 20, k)
    for r, ref in zip(out, refs):
        assert r.tokens == ref[:20], f"scripted drafts, K={k} {mechanism} B={b}"
    assert len({a for r in out for a in r.stats.accepted}) > 1 or k == 1
    # the real MTP drafts on the other prompts (B > 1: the last one joins while the others are mid-run)
    users = ps[1:] if b == 1 else ps[:b]
    arrivals = None if b == 1 else [0] * (b - 1) + [2]
    got, _ = decode(model, mechanism, users, 10, k, b, arrivals=arrivals)
    for p, r in zip(users, got):
        assert r.tokens == generate(model, [torch.tensor(p)], 10)[0].tokens, f"MTP drafts, K={k} {mechanism} B={b}"


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_eos_inside_an_accepted_block_stops_there(model, mechanism, b):
    ps, k = prompts(model.config.vocab_size, 4), 4
    users = [ps[1]] if b == 1 else [ps[1], ps[0], ps[2], ps[3]]
    refs = [generate(model, [torch.tensor(p)], 16)[0].tokens for p in users]
    ref = refs[0]
    # with perfect drafts step 1 emits ref[1..5]; put EOS at the first new token id in positions 2..4
    j = next(j for j in (2, 3, 4) if ref[j] not in ref[:j])
    eos = ref[j]
    wants = [generate(model, [torch.tensor(p)], 16, eos_ids=(eos,))[0].tokens for p in users]
    assert wants[0] == ref[: j + 1]
    bes = scripted(model, mechanism, users, refs, b, wrong=0.0)
    out = run_scripted(bes, users, 16, k, eos=(eos,))
    assert [r.tokens for r in out] == wants
    block = bes[0].committed[0][0].tokens
    assert eos in block[:-1], f"EOS {eos} should sit inside the accepted block {block}"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_mechanism_counters(model, mechanism):
    """One user: the counters equal the mechanism's closed form summed over the steps (a packed step of several
    users counts each forward once: test_packed_speculative_greedy_is_lossless)."""
    p, k = prompts(model.config.vocab_size)[0], 3
    ref = generate(model, [torch.tensor(p)], 30)[0].tokens
    be = ScriptedDrafter(model, mechanism, 64, [ref], [len(p)], seed=3)
    out = speculative_generate(be, [p], 24, [k])[0]
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


@pytest.mark.parametrize("drafts,mechanism", [("sampled", "shadow_commit"), ("one-hot", "snapshot")])
@pytest.mark.slow  # 1000 seeded generations per case
def test_stochastic_exactness_end_to_end(model, drafts, mechanism):
    """Joint law of the next two emitted tokens == the target's own sampling law (temperature 1, top-k 3)."""
    v, k, n = model.config.vocab_size, 2, 1000
    params = SamplingParams(temperature=1.0, top_k=3, seed=1, draft="greedy")
    p = prompts(v)[0]
    # the target's own law: p1 after the pending token, p2 after each possible first token
    probe = ReferenceBackend(model, "shadow_commit", 32)
    probe.join(0, p, params)
    pre = probe.live(0)
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
        be = DistDrafter(model, mechanism, 32, q=q / q.sum(), slots=STAT_SLOTS)
    else:
        be = DistDrafter(model, mechanism, 32, fixed=[support[1], int(joint[support[1]].argmax())], slots=STAT_SLOTS)
    for b in range(STAT_SLOTS):  # each slot its own sampler stream
        be.join(b, p, SamplingParams(**{**params.__dict__, "seed": params.seed + b}))
    pre = be.live(0)
    assert pre.pending == probe.live(0).pending
    # n runs from the same state, STAT_SLOTS users at a time (each user's steps are its batch-1 steps:
    # test_packed_speculative_stochastic_equals_each_users_batch1_run)
    counts, accepted = two_token_counts(be, pre, k, n, v)
    assert 0 < sum(accepted) and min(accepted) == 0  # accept and reject paths both ran
    pval = chi_square_p(counts.flatten(), joint.flatten())
    print(f"{drafts}: p={pval:.3g}, accepted histogram {[accepted.count(i) for i in range(k + 1)]}")
    assert pval > P_VALUE_MIN, f"{drafts} drafts: chi-square p={pval:.2e}"


@pytest.mark.parametrize("b", BATCHES)
def test_stochastic_with_mtp_drafts_is_seeded_per_user(model, b):
    """User i's sampler is its own (seeded from its params): the same params give the same tokens, and in a batch
    each user's output equals its one-user run, whatever the other users draw."""
    ps = prompts(model.config.vocab_size, b)
    params = [SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=4 + i) for i in range(b)]
    got, _ = decode(model, "recompute", ps, 12, 3, b, params)
    again, _ = decode(model, "recompute", ps, 12, 3, b, params)
    assert [r.tokens for r in got] == [r.tokens for r in again] and all(len(r.tokens) == 12 for r in got)
    alone, _ = decode(model, "recompute", ps, 12, 3, 1, params)
    assert [(r.tokens, r.stats.accepted) for r in got] == [(r.tokens, r.stats.accepted) for r in alone]
    if b > 1:
        assert len({tuple(r.tokens) for r in got}) == b


@pytest.mark.parametrize("b", BATCHES)
def test_abort_then_step_matches_uninterrupted(model, b):
    users = prompts(model.config.vocab_size, max(2, b))[1:] if b == 1 else prompts(model.config.vocab_size, b)
    users = users[:1] if b == 1 else users
    for mechanism in MECHANISMS:
        refs = [generate(model, [torch.tensor(p)], 12)[0].tokens for p in users]
        be = scripted(model, mechanism, users, refs, b if b > 1 else 1, seed=9)[0]
        toks = [[be.join(s, p, SamplingParams())] for s, p in enumerate(users)]
        depths = {s: 3 for s in range(len(users))}
        while min(map(len, toks)) < 12:
            be.verify(be.draft(depths))
            be.abort()
            for s, acc in speculative_step(be, depths).items():
                toks[s] += acc.tokens
        assert [t[:12] for t in toks] == refs, mechanism
        assert be.counters.aborts == be.counters.steps


@pytest.mark.parametrize("b", BATCHES)
def test_stochastic_abort_rewinds_the_sampler(model, b):
    """An aborted step leaves no trace, sampler included: with aborts interleaved, the same tokens come out."""
    users = prompts(model.config.vocab_size, b)
    params = [SamplingParams(temperature=1.0, top_k=16, seed=2 + i) for i in range(b)]
    want, _ = decode(model, "shadow_commit", users, 10, 2, b, params)
    be = ReferenceBackend(model, "shadow_commit", 64, slots=b)
    toks = [[be.join(s, p, pp)] for s, (p, pp) in enumerate(zip(users, params))]
    depths = {s: 2 for s in range(b)}
    while min(map(len, toks)) < 10:
        be.verify(be.draft(depths))
        be.abort()
        for s, acc in speculative_step(be, depths).items():
            toks[s] += acc.tokens
    assert [t[:10] for t in toks] == [r.tokens for r in want]


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
    want = generate(model, [torch.tensor(prompt)], 6)[0].tokens
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


# ==== packed users on the shipped checkpoint, the batched probe ==============================================
# ---- lossless --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,mechanism", [(2, "snapshot"), (4, "shadow_commit"),
                                         pytest.param(8, "recompute", marks=pytest.mark.slow)])
def test_packed_speculative_greedy_is_lossless(default_model, code_prompts, b, mechanism):
    """B users in one ReferenceBackend: prompts of different lengths, different depths (users with fewer
    valid drafts than the step's K), one user joining mid-run while the others sit in their steps and, with
    fewer slots than users, a late user reusing the slot of one that stopped early at an EOS. Each user's tokens
    equal its plain batch-1 greedy output, and tokens + per-step accepted counts equal its own single-user
    speculative run."""
    m, n = default_model, 16
    prompts = code_prompts[:b]
    depths = [3, 2, 3, 1, 3, 2, 1, 3][:b]
    arrivals = [0] * (b - 1) + [8 if b >= 4 else 2]
    eos = (plain_greedy(m, prompts[1], n)[2],)  # user 1 stops within 3 rounds and frees its slot
    slots = b - 1 if b >= 4 else b
    be = ReferenceBackend(m, mechanism, max_len=max(map(len, prompts)) + n + 4, slots=slots, max_k=3)
    assert isinstance(be, SpecBackend)
    got = speculative_generate(be, prompts, n, depths, [SamplingParams()] * b, eos, arrivals)
    for p, k, r in zip(prompts, depths, got):
        assert r.tokens == plain_greedy(m, p, n, eos)
        alone = speculative_generate(ReferenceBackend(m, mechanism, max_len=len(p) + n + 4), [p], n, [k],
                                     eos_ids=eos)[0]
        assert (r.tokens, r.stats.accepted) == (alone.tokens, alone.stats.accepted)
    steps = [(a, k) for r in got for a, k in zip(r.stats.accepted, r.stats.depths)]
    assert any(a == 0 for a, _ in steps) and any(a == k for a, k in steps), steps  # both commit branches ran
    assert len({r.stats.steps for r in got}) > 1
    assert be.counters.steps < sum(r.stats.steps for r in got)  # steps really were shared
    assert be.counters.target_forwards >= be.counters.steps and not be.users  # everyone left at the end


# ---- stochastic --------------------------------------------------------------------------------------------
def test_packed_speculative_stochastic_equals_each_users_batch1_run(default_model, code_prompts):
    """Stochastic, with a penalty and logprobs on some users: each user samples from its own generator, so its
    tokens, accepted counts and logprobs equal its batch-1 run with the same params."""
    prompts, n, k = code_prompts[:3], 12, 2
    params = [SamplingParams(temperature=0.8, top_k=50, seed=10, presence_penalty=0.5),
              SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.2, draft="greedy"),
              SamplingParams(temperature=0.7, top_p=0.9, seed=12, logprobs=2)]
    be = ReferenceBackend(default_model, "recompute", max_len=64, slots=3, max_k=k)
    got = speculative_generate(be, prompts, n, [k] * 3, params)
    for p, pr, r in zip(prompts, params, got):
        alone = speculative_generate(ReferenceBackend(default_model, "recompute", max_len=64), [p], n, [k], [pr])[0]
        assert (r.tokens, r.stats.accepted) == (alone.tokens, alone.stats.accepted)
        if pr.logprobs is not None:
            assert [x.token for x in r.logprobs] == r.tokens
            for x, y in zip(r.logprobs, alone.logprobs):
                assert x.token == y.token and abs(x.logprob - y.logprob) < ATOL


@pytest.mark.slow  # 400 packed steps
@torch.no_grad()
def test_packed_speculative_stochastic_chi_square_per_user(model):
    """B = 4 users with different sampling params in one packed step: the first emitted token of each user
    (accepted draft or residual sample) follows that user's own target distribution (chi-square), over many
    steps re-seeded each time (draft -> verify -> accept -> abort)."""
    m, trials, k = model, 400, 2
    v = m.config.vocab_size
    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=t, top_k=tk, seed=0) for t, tk in ((1.0, 6), (0.7, 8), (1.3, 5), (1.0, 10))]
    params[3] = SamplingParams(temperature=1.0, top_k=10, seed=0, draft="greedy")
    be = ReferenceBackend(m, "shadow_commit", max_len=32, slots=4, max_k=k)
    targets = []
    for s, p in enumerate(params):
        prompt = torch.randint(0, v, (4 + 3 * s,), generator=g).tolist()
        be.join(s, prompt, p)
        alone = ReferenceBackend(m, "shadow_commit", max_len=32)  # the user's own target row 0, batch 1
        alone.join(0, prompt, p)
        live = alone.live(0)
        row0 = m(torch.tensor([[live.pending]]), live.state).logits[:, -1]
        targets.append(probs_from_logits(row0, p)[0])
    counts = torch.zeros(4, v)
    depths = {s: k for s in range(4)}
    for t in range(trials):
        for s in range(4):
            be.users[s].generator.manual_seed(1000 + 7 * t + s)
        d = be.draft(depths)
        acc = be.accept(d, be.verify(d))
        for s in range(4):
            counts[s, acc[s].tokens[0]] += 1
        be.abort()
    for s in range(4):
        p_val = chi_square_p(counts[s], targets[s])
        assert p_val > P_VALUE_MIN, f"user {s}: chi-square p={p_val:.2e}"
    # the test can fail: user 0's counts against user 1's distribution
    assert chi_square_p(counts[0], targets[1]) < 1e-6


# ---- the batched transaction probe --------------------------------------------------------------------------
def batch_args(b: int, ks: str) -> argparse.Namespace:  # what `probe gdn-transaction --batch B` passes
    return argparse.Namespace(device="reference", full=False, checkpoint=None, ks=ks, seed=0, batch=b)


def test_batch_probe_b2_passes(tmp_path, capsys):
    """`qwen36 probe gdn-transaction --batch 2` through the command line: one JSONL record, labelled by what ran,
    every cell passing with the two users at a = 0 and a = K in the same step."""
    from qwen36.cli import main
    from qwen36.probes.records import read_records

    argv = ["probe", "gdn-transaction", "--device", "reference", "--batch", "2", "--ks", "3"]
    assert main(argv + ["--records-dir", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("gdn-transaction-*.jsonl")
    (report,) = read_records(f)
    assert report["backend"] == "reference (torch CPU)" and report["config"]["batch"] == 2
    assert len(report["cells"]) == len(MECHANISMS)
    assert report["verdict"] == "pass", [(c["cell"], c["failed"]) for c in report["cells"] if not c["pass"]]
    assert not report["gate_complete"]  # K = 2 did not run
    for c in report["cells"]:
        assert [u["accepted"] for u in c["users"]] == [0, 3]
    assert report["counters"]["shadow_commit"]["state_copies"] == 0
    capsys.readouterr()
    try:
        rc = main(argv[:-4] + ["--batch", "0", "--records-dir", str(tmp_path)])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--batch must be >= 1" in capsys.readouterr().err


@pytest.mark.slow  # 6 cells at B = 4
def test_batch_probe_b4_passes():
    report = probe.run(batch_args(4, ",".join(map(str, probe.BATCH_KS))))
    assert report.verdict == "pass", [(c["cell"], c["failed"]) for c in report.cells if not c["pass"]]
    assert report.gate_complete and len(report.cells) == len(MECHANISMS) * len(probe.BATCH_KS)
    for c in report.cells:
        k = c["k"]
        assert [u.get("accepted") for u in c["users"]] == [0, k, k - 1, None]
        assert c["users"][3]["pass"] and all(c["users"][3]["untouched"].values())


class ShadowIgnoresInertRows(ShadowCommit):
    """Broken: points a user that drafted fewer rows than the step's K at the state after the step's last row."""

    def commit(self, be, txn, a):
        super().commit(be, txn, a)
        rows, wrong = torch.arange(be.slots), torch.where(a == txn.kvec, txn.k, a)
        for i in be.gdn_ids:
            g, s = be.state.layers[i], txn.verify.slots[i]
            g.recurrent = torch.where(txn.part[:, None, None, None], s.recurrent[rows, wrong], g.recurrent)


class ShadowCommitsEveryone(ShadowCommit):
    """Broken: commits every slot, also the one sitting the step out."""

    def commit(self, be, txn, a):
        txn.part = txn.part | be.occupied
        super().commit(be, txn, a)


@pytest.mark.parametrize("broken,must_fail", [(ShadowIgnoresInertRows, "user2:gdn_recurrent"),
                                              (ShadowCommitsEveryone, "user3:touched")])
def test_broken_batch_mechanisms_fail_the_probe(model, broken, must_fail):
    """The probe catches a user committed past its own valid rows, and a user moved although it sat out."""
    factory = lambda model, mechanism, **kw: ReferenceBackend(model, broken(), **kw)  # noqa: E731
    cells, _ = probe.run_matrix(model, batch=4, ks=(3,), mechanisms=("shadow_commit",), factory=factory)
    assert not cells[0]["pass"] and must_fail in cells[0]["failed"], cells[0]["failed"]


def test_packed_speculative_with_depth_controllers(default_model, code_prompts):
    """`--spec-k auto` with several users: one depth controller per user, so users draft different K in the same
    packed step; each user's tokens, accepted counts and chosen depths equal its single-user run."""
    from qwen36.speculative.depth import DepthPolicy, cost_key

    def ctrl():
        return DepthPolicy.load().controller(cost_key("reference"))

    prompts, n = code_prompts[:3], 12
    ctrls = [ctrl() for _ in prompts]
    be = ReferenceBackend(default_model, "shadow_commit", max_len=64, slots=3, max_k=ctrls[0].k_max)
    got = speculative_generate(be, prompts, n, ctrls, [SamplingParams()] * 3)
    for p, r in zip(prompts, got):
        alone = speculative_generate(ReferenceBackend(default_model, "shadow_commit", max_len=64), [p], n, [ctrl()])[0]
        assert (r.tokens, r.stats.accepted, r.stats.depths) == (alone.tokens, alone.stats.accepted, alone.stats.depths)
    assert len({k for r in got for k in r.stats.depths}) > 1  # K differed between users / steps


def test_plan_next_depths_is_called_between_accept_and_commit(model):
    """A batched backend that drafts the next step inside its commit is told the next depths first: one call per
    step, after accept and before commit, naming every user that goes on (not the ones that just finished)."""
    calls: list[tuple[str, dict]] = []

    class Planning(ReferenceBackend):
        def accept(self, draft, verify):
            calls.append(("accept", {}))
            return super().accept(draft, verify)

        def plan_next_depths(self, depths):
            calls.append(("plan", dict(depths)))

        def commit(self, acceptances):
            calls.append(("commit", {}))
            super().commit(acceptances)

    be = Planning(model, max_len=32, slots=2, max_k=2)
    got = speculative_generate(be, [[1, 2, 3], [4, 5]], 6, [2, 1], [SamplingParams()] * 2)
    assert [c[0] for c in calls] == ["accept", "plan", "commit"] * be.counters.steps
    plans = [c[1] for c in calls if c[0] == "plan"]
    assert all(set(p.values()) <= {1, 2} and p.get(0, 2) == 2 and p.get(1, 1) == 1 for p in plans)
    assert plans[-1] == {} and all(len(r.tokens) == 6 for r in got)  # the last step finishes whoever was left
