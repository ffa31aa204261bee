"""The thinking budget under TT speculation (``TTSpecBackend.inject``, one user): the step that reaches the budget is
cut after its last thinking token (the commit takes the cut, not the device's count), the stop-thinking phrase goes
through the step's own verify / commit traces with every forced row accepted, and the token after it is picked from
the last forced row. Greedy output == TT plain decoding with the same budget (``TTGenerator.generate``), every
mechanism; the committed state continues exactly as a plain run of prompt + emitted tokens would.

B slots (host rows, ``HostRows.inject`` in tt/spec/host_slots.py): three users, one forced at its first token, one cut mid-step, one never
forced: each user's tokens and every emitted token's logits row == the TT plain batch (``plain_generate`` with host picks) with the
same budget (bit-equal), two mechanisms; seeded sampling == each user run alone on the one-user layout. The pick after
a phrase forced over several rounds counts each earlier token once (both layouts)."""
from __future__ import annotations

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.speculative.engine import speculative_generate
from qwen36.generation.sampling import SamplingParams
from qwen36.generation.thinking import ThinkingBudget
from qwen36.testing.pcc import pcc
from qwen36.testing.tt import small_tt_generator
from qwen36.testing.tt_batch import record_emitted_logits
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
    plain = gen.generate([PROMPT], 24, thinking=budget(n), keep_logits=True)[0]
    want = plain.tokens
    free = gen.generate([PROMPT], 24)[0].tokens
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
    be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader), depths=(1, 2))
    try:
        be.join(0, PROMPT)
        with pytest.raises(ValueError, match="not one of this backend's depths"):
            be.inject({0: list(PHRASE)}, {0: 3})
    finally:
        be.close()


# ---- B slots (host rows: HostRows.inject) ------------------------------------------------------------------------
# START_B stands in for <think> where user 2's own greedy output emits it (its 3rd token): with budget 1 user 0
# (prompt ends in an open block) is forced at its first token, before any step, user 2 in the middle of a step (its
# second step accepts 2 drafts, tokens 3-5, and is cut after its 4th token: the commit takes a = 1, not the device's
# 2), and user 1 never: it steps normally in the rounds where the others are forced.
START_B = 803
PROMPTS_B = [[1734, 4064, 17, 279, 1076, 4064, 17, 279, START_B], [17, 279, 1076],
             [4064, 17, 279, 1076, 4064, 17, 279, 1734, 4064, 17, 279, 1076]]
N_B = 18


def budget_b() -> ThinkingBudget:
    return ThinkingBudget(1, START_B, END, PHRASE)


@pytest.fixture(scope="module")
def plain_b(gen):
    """TT plain greedy of the three users as one batch (TTBatchDecoder, ForcedFeed) with the same budget."""
    from types import SimpleNamespace

    from qwen36.testing.tt_batch import host_greedy
    from qwen36.tt.runtime.batch import TTBatchDecoder

    gen.release_trace()
    dec = TTBatchDecoder(gen.model, 4, use_trace=gen.use_trace)
    try:
        out = host_greedy(dec, PROMPTS_B, N_B, thinking=budget_b())
        return SimpleNamespace(tokens=[r.tokens for r in out], logits=[r.logits for r in out])
    finally:
        dec.release()


@pytest.mark.slow
@pytest.mark.parametrize("mech", ["snapshot", "shadow_commit"])
def test_batch_slots_budget_equals_tt_plain_batch(gen, reader, plain_b, mech):
    want = plain_b.tokens
    assert tuple(want[0][1:1 + len(PHRASE)]) == PHRASE and tuple(want[2][4:4 + len(PHRASE)]) == PHRASE
    assert END not in want[1]
    be = TTSpecBackend(gen, mech, drafter=TTMTPDrafter(reader), slots=4, k=3)
    try:
        rows = record_emitted_logits(be)
        res = speculative_generate(be, PROMPTS_B, N_B, [3] * 3, thinking=budget_b())
        for u in range(3):
            assert res[u].tokens == want[u], f"user {u}"
            got = rows[u][: len(want[u])]
            assert len(got) == len(want[u])
            diff = max(float((a - b).abs().max()) for a, b in zip(got, plain_b.logits[u]))
            low = min(pcc(a, b) for a, b in zip(got, plain_b.logits[u]))
            print(f"{mech} user {u}: every emitted token's logits vs TT plain batch: max abs {diff:.3g}, "
                  f"min pcc {low:.7f}")
            assert diff == 0.0  # the same row-wise programs on the same tiles: bit-equal (measured)
        assert sum(map(sum, (r.stats.accepted for r in res))) > 0  # drafts were accepted around the injections
        assert res[2].stats.accepted[1] == 1  # the cut step (without the cut forced into the commit this fails)
        assert be.captures == 3  # draft, verify, commit: the forced rounds replay the step's own traces
    finally:
        be.close()


@pytest.mark.slow
def test_batch_slots_sampled_budget_equals_one_user_path(gen, reader):
    """Seeded sampling (argmax drafts: the packed chain's sampled-draft columns are not the one-user stream): each
    user's tokens equal its run alone on the one-user layout with the same seed and budget: the same acceptance
    uniforms (its own row, restarted from its seed), the same forced rounds, the same host stream for the pick."""
    params = [SamplingParams(temperature=0.8, top_k=20, seed=3 + i, draft="greedy") for i in range(3)]
    alone = []
    for p, pr in zip(PROMPTS_B, params):
        be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader))
        try:
            alone.append(speculative_generate(be, [p], N_B, [3], [pr], thinking=budget_b())[0].tokens)
        finally:
            be.close()
    assert tuple(alone[0][1:1 + len(PHRASE)]) == PHRASE
    be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader), slots=4, k=3, params=params[0])
    try:
        res = speculative_generate(be, PROMPTS_B, N_B, [3] * 3, params, thinking=budget_b())
    finally:
        be.close()
    assert [r.tokens for r in res] == alone


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_pick_after_the_phrase_counts_each_token_once(gen, reader, monkeypatch, slots):
    """Penalties: the host pick after a phrase forced over several rounds sees the output counts of exactly the
    tokens emitted before it (a regression: the one-user layout added the earlier rounds' tokens twice)."""
    import qwen36.tt.spec.device_rows as device_mod
    import qwen36.tt.spec.host_slots as slots_mod

    seen = []

    def recording_pick(logits, params, generator, penalties=None):
        seen.append(penalties.counts.clone())
        return pick(logits, params, generator, penalties)

    pick = device_mod.pick_token
    monkeypatch.setattr(device_mod, "pick_token", recording_pick)  # the one-user join's and inject's picks
    monkeypatch.setattr(slots_mod, "pick_token", recording_pick)  # the B-slot join's and inject's picks
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
                            draft="greedy")
    kw = {} if slots == 1 else {"slots": slots, "k": 2, "params": params}
    be = TTSpecBackend(gen, "snapshot", drafter=TTMTPDrafter(reader), **kw)
    try:
        res = speculative_generate(be, [PROMPT], 14, [2], [params], thinking=budget(2))[0]
    finally:
        be.close()
    n = 2 + len(PHRASE)  # K = 2: the phrase goes in three rounds (3 + 3 + 1 forced rows)
    assert tuple(res.tokens[2:n]) == PHRASE and len(seen) == 2  # the join's pick, then the pick after the phrase
    want = torch.bincount(torch.tensor(res.tokens[:n]), minlength=gen.config.vocab_size).float()
    assert torch.equal(seen[1], want)


class Schedule:
    """A depth policy stepping through a fixed schedule of depths (cycled): the engine asks it before every step."""

    def __init__(self, ks):
        self.ks, self.i, self.k_max = list(ks), 0, max(ks)

    def choose(self) -> int:
        k = self.ks[self.i % len(self.ks)]
        self.i += 1
        return k

    def observe(self, k: int, num_accepted: int) -> None:
        pass

    def describe(self) -> str:
        return f"schedule {self.ks}"


@pytest.mark.slow
@pytest.mark.parametrize("mech,n", [("shadow_commit", 4), ("snapshot", 1)])  # n = 1: before any step
def test_per_step_depths_budget_equals_plain_with_the_same_injection(gen, reader, mech, n):
    """``depths=`` (``--spec-k auto``): the forced rounds run at the depth the last commit prepared, the last round's
    chain at the user's next depth; greedy output == TT plain with the same budget, the pick row == plain's row."""
    plain = gen.generate([PROMPT], 24, thinking=budget(n), keep_logits=True)[0]
    be = TTSpecBackend(gen, mech, drafter=TTMTPDrafter(reader), depths=(1, 2, 3))
    try:
        res = speculative_generate(be, [PROMPT], 24, [Schedule([3, 1, 2])], [SamplingParams()],
                                   thinking=budget(n))[0]
        assert res.tokens == plain.tokens
        got, ref = be.inject_logits, plain.logits[n + len(PHRASE)]
        diff = float((got - ref).abs().max())
        print(f"{mech} depths 1-3 n={n}: inject row vs plain decode row max abs {diff:.3g}, pcc {pcc(got, ref):.7f}")
        assert diff == 0.0
        assert len(set(res.stats.depths)) == 3 and sum(res.stats.accepted) > 0  # it switched depth, drafts accepted
        assert int(be.model.to_host(be.step_state.n).flatten()[0]) == be.position(0)
    finally:
        be.close()
