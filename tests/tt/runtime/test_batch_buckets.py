"""Bucket switching of the batched TT plain decode (tt/runtime/batch_buckets.py) on the emulated P150a x2 mesh: users
grow the decoder into a bigger bucket and it shrinks back when they fit a smaller one, every user's tokens and
logits stay its batch-1 ones, a move copies the GDN state rows bit for bit, each bucket's step is captured once
however often the decoder comes back to it, and slot_remap relabels slots without moving state."""
from __future__ import annotations

import pytest
import torch

from qwen36.tt.runtime.batch_buckets import BucketedBatchDecoder
from qwen36.testing.tt_batch import (assert_users_match_single, host_greedy, batch_one_greedy as single, batch_test_checkpoint,
                                     batch_test_generator, gdn_rows, random_prompt as prompt)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    g = batch_test_generator(batch_test_checkpoint(tmp_path_factory))
    yield g
    g.close()


def captures_per_bucket(dec: BucketedBatchDecoder) -> dict[int, int]:
    return {b: d.captures for b, d in dec.decs.items()}


def test_grow_and_shrink_equal_batch_one(gen):
    """Buckets 1 / 2 / 4, shrink after 2 steps: one user, then two more at once (1 -> 2 -> 4), a fourth; two leave
    and the rest shrink to bucket 2; a fifth arrives late and grows it to 4 again; the last ones shrink it. Every
    user's tokens == its batch-1 tokens and its logits within the batched-vs-single bound; each bucket's step was
    captured at most once, although bucket 4 was entered twice."""
    prompts = [prompt(n, 70 + n) for n in (3, 9, 17, 6, 11)]
    limits = [4, 9, 3, 12, 6]
    dec = BucketedBatchDecoder(gen.model, (1, 2, 4), shrink_after=2)
    try:
        res = host_greedy(dec, prompts, limits, arrivals=[0, 1, 1, 2, 7])
        caps = captures_per_bucket(dec)
        assert caps[2] == caps[4] == 1 and caps[1] <= 1, caps  # bucket 1 stepped once: its eager step
    finally:
        dec.release()
    moves = dec.moves
    assert moves[:2] == [(1, 2), (2, 4)], moves
    assert (4, 2) in moves and moves.count((2, 4)) == 2, moves  # shrank, then grew into bucket 4 a second time
    assert_users_match_single(gen, prompts, res, limits)


def test_grow_moves_exact_rows(gen):
    """A user's GDN recurrent and conv rows after a grow (bucket 1 -> 2, triggered by a second user joining) equal
    its rows before the move bit for bit; the joining user's row is its own prefilled state."""
    a, b = prompt(7, 81), prompt(5, 82)
    dec = BucketedBatchDecoder(gen.model, (1, 2))
    try:
        tok = int(dec.join(0, a).argmax())
        for _ in range(2):
            _, ids = dec.step({0: tok})
            tok = int(ids[0])
        before = [gdn_rows(dec.decs[1], st) for st in dec.decs[1].state.gdn_states()]
        dec.join(1, b)  # bucket 1 is full: user a moves to bucket 2's row 0, user b joins row 1
        assert dec.cur == 2 and dec.row == {0: 0, 1: 1} and dec.pos == [9, 5]
        for st, (rec, conv) in zip(dec.decs[2].state.gdn_states(), before):
            rec2, conv2 = gdn_rows(dec.decs[2], st)
            assert torch.equal(rec2[0], rec[0]) and torch.equal(conv2[0], conv[0])
            assert not torch.equal(rec2[1], rec[0])
    finally:
        dec.release()


def test_shrink_moves_exact_rows(gen):
    """The shrink alone: two users in bucket 2, the first leaves; the move to bucket 1 copies the second's rows
    bit for bit (compared before any step runs on bucket 1)."""
    a, b = prompt(4, 91), prompt(8, 92)
    dec = BucketedBatchDecoder(gen.model, (1, 2), shrink_after=1)
    try:
        dec.join(0, a)
        dec.join(1, b)
        dec.step({0: 1, 1: 2})
        dec.leave(0)
        before = [gdn_rows(dec.decs[2], st) for st in dec.decs[2].state.gdn_states()]
        dec._move(1)
        assert dec.row == {1: 0} and dec.pos[1] == 9
        for st, (rec, conv) in zip(dec.decs[1].state.gdn_states(), before):
            rec1, conv1 = gdn_rows(dec.decs[1], st)
            assert torch.equal(rec1[0], rec[1]) and torch.equal(conv1[0], conv[1])
    finally:
        dec.release()


def test_slot_remap_relabels_without_moving_state(gen):
    """slot_remap([1, 0]) on a bucketed decoder: the slots swap labels, the device rows stay where they are (bit
    for bit), and both users go on emitting their batch-1 tokens under their new slot numbers."""
    prompts = [prompt(6, 41), prompt(13, 42)]
    n = 5
    want = [single(gen, p, n)[0] for p in prompts]
    dec = BucketedBatchDecoder(gen.model, (2,))
    try:
        toks = [[int(dec.join(u, p).argmax())] for u, p in enumerate(prompts)]
        rows, _ = dec.step({u: toks[u][-1] for u in range(2)})
        for u in range(2):
            toks[u].append(int(rows[u].argmax()))
        before = [gdn_rows(dec.dec, st) for st in dec.dec.state.gdn_states()]
        dec.slot_remap([1, 0])
        for st, (rec, conv) in zip(dec.dec.state.gdn_states(), before):
            rec2, conv2 = gdn_rows(dec.dec, st)
            assert torch.equal(rec2, rec) and torch.equal(conv2, conv)
        where = [1, 0]  # user u is now slot where[u]
        while len(toks[0]) < n:
            rows, _ = dec.step({where[u]: toks[u][-1] for u in range(2)})
            for u in range(2):
                toks[u].append(int(rows[where[u]].argmax()))
        assert dec.captures == 1
    finally:
        dec.release()
    assert toks == want
    with pytest.raises(ValueError, match="permutation"):
        dec.slot_remap([0, 0])


def test_unwarmed_bucket_is_refused_while_a_trace_is_live(gen):
    """A bucket whose first (eager) step would run while another bucket's trace is live fails by name instead of
    allocating under a live trace."""
    dec = BucketedBatchDecoder(gen.model, (1, 2))
    try:
        tok = int(dec.join(0, prompt(5, 5)).argmax())
        for _ in range(2):
            _, ids = dec.step({0: tok})  # warms both buckets, then captures bucket 1
            tok = int(ids[0])
        dec.decs[2].release()  # forget bucket 2's warm step
        dec.join(1, prompt(3, 6))  # grows into bucket 2
        with pytest.raises(RuntimeError, match="warm"):
            dec.step({0: tok, 1: 1})
    finally:
        dec.release()
