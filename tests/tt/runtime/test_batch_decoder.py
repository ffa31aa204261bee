"""Batched TT plain decode (tt/runtime/batch.py) on the emulated P150a x2 mesh: every user's tokens and logits in a batch
equal its own batch-1 TT run (TTGenerator), users join and leave a bucket without a new trace capture, an inactive
slot (even NaN-poisoned) never reaches an active user's output, slot_remap moves state rows on device, and the
batched logits track the reference SlotDecoder.

The thinking budget on the batched decoders: each user of a batch counts its own thinking tokens; at its budget the
stop-thinking phrase's tokens replace the row's picks, one decode row a time. Every user's tokens and logits equal
the same request served alone by ``TTGenerator.generate`` (greedy, and seeded sampling with penalties, whose device
counts must follow the forced tokens, not the dropped picks)."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.batch import SlotDecoder
from qwen36.reference.model import Qwen36Model
from qwen36.generation.sampling import SamplingParams
from qwen36.generation.thinking import ThinkingBudget
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.runtime.batch import TTBatchDecoder, bucket_for
from qwen36.testing.pcc import comp_pcc
from qwen36.testing.tt_batch import (assert_users_match_single, host_greedy, batch_cli_equals_alone, batch_one_greedy as single,
                                     batch_test_checkpoint, batch_test_generator, gdn_rows, poison_slot,
                                     random_prompt as prompt)

# TT (accuracy preset, bf16 weights) vs the fp32 reference: the same gates as tests/tt/model/test_model.py's decode.
TT_VS_REF_PCC = 0.99


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return batch_test_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def gen(ckpt):
    g = batch_test_generator(ckpt)
    yield g
    g.close()


def test_bucket_for():
    assert [bucket_for(n) for n in (1, 2, 8, 9, 32)] == [1, 8, 8, 32, 32]
    with pytest.raises(ValueError, match="largest decode bucket"):
        bucket_for(33)


@pytest.mark.parametrize("b", [1, 4])
def test_slots_equal_batch_one_with_one_capture(gen, b):
    """Every user's tokens == its batch-1 TTGenerator run's, logits within BATCH_VS_SINGLE_MAX_ABS; the step is
    captured once. B = 1 is the batch of one (same graph as TTGenerator). B = 4 slots, five users of different prompt
    lengths and token counts: user 4 arrives at step 1 while all slots are held and joins the slot user 0 frees
    (mid-run, three users still decoding): one capture in all."""
    if b == 1:
        prompts, limits, arrivals = [prompt(8, 3)], [5], None
    else:
        prompts, limits, arrivals = [prompt(n, 10 + n) for n in (3, 9, 17, 6, 11)], [3, 7, 6, 8, 5], [0, 0, 0, 0, 1]
    dec = TTBatchDecoder(gen.model, b)
    try:
        res = host_greedy(dec, prompts, limits, arrivals=arrivals)
        assert dec.captures == 1, dict(dec.traces.captures)
    finally:
        dec.release()
    if b > 1:
        assert [r.slot for r in res] == [0, 1, 2, 3, 0]
    assert_users_match_single(gen, prompts, res, limits)


def test_generator_decodes_on_its_one_slot_decoder(gen):
    """TTGenerator's decode is TTBatchDecoder's at one slot over the generator's own state: a sampled generate runs
    the decoder's sampled step (eager once, then captured once and replayed), the slot and the state end at the same
    position, and the decoder (built without join buffers) refuses join / leave while a join decoder refuses
    hold."""
    p = prompt(6, 61).tolist()
    dec = gen.decoder
    assert dec.slots == 1 and dec.state is gen.state and not dec.joins and dec.scratch is None
    before = dec.traces.captures["decode+sample/B1"]
    res = gen.generate([p], 4, SamplingParams(temperature=0.8, seed=2, repetition_penalty=1.1))[0]
    assert len(res.tokens) == 4
    assert dec.traces.captures["decode+sample/B1"] == before + 1  # 3 decode steps: eager, capture + replay, replay
    assert dec.pos[0] == gen.state.pos == len(p) + 3
    with pytest.raises(ValueError, match="joins=True"):
        dec.join(0, p)
    with pytest.raises(ValueError, match="joins=True"):
        dec.leave(0)
    gen.release_trace()  # the next decoder allocates: no trace may be live
    with pytest.raises(ValueError, match="joins=False"):
        TTBatchDecoder(gen.model, 1).hold(0, 3)
    with pytest.raises(ValueError, match="holds 1 user slots, the decoder 2"):
        TTBatchDecoder(gen.model, 2, state=gen.state, joins=False)


def test_batched_logits_track_reference_slot_decoder(gen, ckpt):
    """The TT batch's logits per row vs the reference SlotDecoder teacher-forced on the same tokens (PCC)."""
    prompts = [prompt(4, 21), prompt(10, 22)]
    dec = TTBatchDecoder(gen.model, 2)
    try:
        res = host_greedy(dec, prompts, 5)
    finally:
        dec.release()
    ref = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)
    sd = SlotDecoder(ref, 2, 64)
    rows = [[sd.join(u, p.tolist())] for u, p in enumerate(prompts)]
    for t in range(4):
        out = sd.step(torch.tensor([res[0].tokens[t], res[1].tokens[t]]))
        for u in range(2):
            rows[u].append(out[u])
    for u in range(2):
        for t, (tt, rr) in enumerate(zip(res[u].logits, rows[u])):
            ok, pcc = comp_pcc(rr, tt, TT_VS_REF_PCC)
            assert ok, f"user {u} token {t}: PCC {pcc} < {TT_VS_REF_PCC}"


def test_poisoned_free_slot_is_inert(gen):
    """Slot 1 free and NaN in its GDN, conv and KV: slot 0's logits equal the clean run's exactly and are finite;
    the poisoned slot's position does not move; a user joining it afterwards gets its batch-1 prefill logits."""
    ids, joiner = prompt(7, 31), prompt(9, 32)
    joiner_logits = single(gen, joiner, 1)[1][0]  # before any batch trace is live (the generator's prefill allocates)
    clean = TTBatchDecoder(gen.model, 2)
    try:
        want = host_greedy(clean, [ids], 5)
    finally:
        clean.release()
    dec = TTBatchDecoder(gen.model, 2)
    try:
        poison_slot(dec, 1)
        got = host_greedy(dec, [ids], 5)
        assert [r.slot for r in got] == [0] and dec.pos[1] == -1
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for a, b in zip(got[0].logits, want[0].logits):
            assert torch.isfinite(a).all() and torch.equal(a, b)
        assert torch.equal(dec.join(1, joiner), joiner_logits)
    finally:
        dec.release()


def test_slot_remap_moves_state_rows(gen):
    """Two users decode two steps, then slot_remap([1, 0]) swaps their slots on device (the GDN recurrent and conv
    rows of slot 0 and 1 are exchanged bit for bit, page-table rows follow); both users' tokens and logits are still their batch-1 ones, and the swapped
    run's logits equal the unpermuted run's row for row."""
    prompts = [prompt(6, 41), prompt(13, 42)]
    n = 6
    want = [single(gen, p, n)[0] for p in prompts]

    def run(remap_at: int | None):
        dec = TTBatchDecoder(gen.model, 2)
        where = [0, 1]  # slot of each user
        toks = [[int(dec.join(u, p).argmax())] for u, p in enumerate(prompts)]
        logits = [[], []]
        try:
            for t in range(n - 1):
                if t == remap_at:
                    before = [gdn_rows(dec, st) for st in dec.state.gdn_states()]
                    dec.slot_remap(torch.tensor([1, 0], dtype=torch.int32))
                    where = where[::-1]
                    for st, (rec, conv) in zip(dec.state.gdn_states(), before):  # rows moved, bit for bit
                        rec_after, conv_after = gdn_rows(dec, st)
                        assert not torch.equal(rec[0], rec[1])  # two users' states: a swap is visible
                        assert torch.equal(rec_after[0], rec[1]) and torch.equal(rec_after[1], rec[0])
                        assert torch.equal(conv_after[0], conv[1]) and torch.equal(conv_after[1], conv[0])
                rows, _ = dec.step({where[u]: toks[u][-1] for u in range(2)})
                for u in range(2):
                    logits[u].append(rows[where[u]])
                    toks[u].append(int(rows[where[u]].argmax()))
            assert dec.captures == 1
        finally:
            dec.release()
        return toks, logits

    toks, logits = run(None)
    toks_r, logits_r = run(2)
    assert toks_r == toks
    for u in range(2):
        for a, b in zip(logits_r[u], logits[u]):
            assert torch.equal(a, b)
        assert toks[u] == want[u]


def test_slot_remap_rejects_non_permutation(gen):
    dec = TTBatchDecoder(gen.model, 2)
    with pytest.raises(ValueError, match="permutation"):
        dec.slot_remap([0, 0])


def test_join_rejects_a_held_slot(gen):
    dec = TTBatchDecoder(gen.model, 2)
    dec.join(0, prompt(3, 51))
    with pytest.raises(ValueError, match="held"):
        dec.join(0, prompt(3, 52))
    with pytest.raises(ValueError, match="no user"):
        dec.step({1: 5})


@pytest.mark.slow
def test_generate_cli_several_prompts_on_tt(capsys, tmp_path, monkeypatch):
    """`qwen36 generate --device emulated-p150x2` with two prompts decodes them as one TT batch: `ids[i]` equal
    each prompt's own single-prompt TT run (speculative with several prompts on TT: tests/tt/spec/test_tt_mtp.py)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the TT weight cache goes under $HOME
    base = ["generate", "--max-new-tokens", "5", "--device", "emulated-p150x2"]
    lines = batch_cli_equals_alone(capsys, base)
    assert sum(l.startswith("text[") for l in lines) == 2


# ---- the thinking budget ----------------------------------------------------------------------------------------
START, END = 7, 9  # stand-ins for <think> / </think> on the random ci checkpoint
PHRASE = (31, 32, 33, END, 34, 35)


@pytest.fixture(scope="module")
def thinking_gen(ckpt_factory):
    """The thinking tests' generator (fp32-written ci checkpoint, 128-token sequences), as they were written for."""
    g = small_tt_generator(ckpt_factory("ci"))
    yield g
    g.close()


def prompts_of(vocab):
    g = torch.Generator().manual_seed(5)
    # users 0 and 2 end inside an open thinking block, user 1 outside one (nothing is forced unless it opens one)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() + tail for n, tail in ((12, [START]), (9, []),
                                                                                        (20, [START]))]


@pytest.mark.slow
def test_batched_greedy_budgets_equal_batch_one(thinking_gen):
    prompts = prompts_of(thinking_gen.config.vocab_size)
    for n in (0, 3):
        budget = ThinkingBudget(n, START, END, PHRASE)
        alone = [thinking_gen.generate([p], 14, thinking=budget, keep_logits=True)[0] for p in prompts]
        for u in (0, 2):  # the phrase at exactly n thinking tokens (none of them closed the block first)
            assert END not in alone[u].tokens[:n] and tuple(alone[u].tokens[n:n + len(PHRASE)]) == PHRASE
        thinking_gen.release_trace()
        dec = TTBatchDecoder(thinking_gen.model, 4, use_trace=thinking_gen.use_trace)
        try:
            got = host_greedy(dec, prompts, 14, thinking=budget)
        finally:
            dec.release()
        for u, want in enumerate(alone):
            assert got[u].tokens == want.tokens
            diff = max(float((a - b).abs().max()) for a, b in zip(got[u].logits, want.logits))
            assert diff <= 1e-4, f"user {u}: batched logits differ from batch 1 by {diff}"
    # the several-prompt entry point (the CLI's) passes the budget through
    budget = ThinkingBudget(3, START, END, PHRASE)
    assert [r.tokens for r in thinking_gen.generate(prompts, 14, thinking=budget)] == \
        [thinking_gen.generate([p], 14, thinking=budget)[0].tokens for p in prompts]


@pytest.mark.slow
def test_batched_sampled_budget_with_penalties_equals_batch_one(thinking_gen):
    """Seeded sampling + penalties: the forced rows' penalty counts are rewritten from the history, so every user's
    draws match its batch-1 run; without the rewrite the penalised picks after the phrase would differ."""
    prompts = prompts_of(thinking_gen.config.vocab_size)
    params = SamplingParams(temperature=0.9, top_k=20, seed=4, repetition_penalty=1.3, presence_penalty=0.7)
    budget = ThinkingBudget(2, START, END, PHRASE)
    alone = [thinking_gen.generate([p], 14, params, thinking=budget)[0].tokens for p in prompts]
    assert all(tuple(t[2:2 + len(PHRASE)]) == PHRASE for t in (alone[0], alone[2]))
    assert [r.tokens for r in thinking_gen.generate(prompts, 14, params, thinking=budget)] == alone


def test_budget_with_logprobs_is_refused(thinking_gen):
    budget = ThinkingBudget(2, START, END, PHRASE)
    with pytest.raises(ValueError, match="logprobs with a thinking budget"):
        thinking_gen.generate(prompts_of(thinking_gen.config.vocab_size), 4,
                              SamplingParams(temperature=1.0, seed=1, logprobs=2), thinking=budget)
