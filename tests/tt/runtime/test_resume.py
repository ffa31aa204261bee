"""What resuming a prompt from a GDN checkpoint rests on (``tt/runtime/resume.py``), on the emulated mesh, and the
plan it builds.

The facts: a prefill row depends only on the tokens up to it and on the GDN state its forward started from, not on
how many rows the forward has or on the tokens after it; the state a forward starts from was rounded to fp32 at the
end of the forward before (the chunked kernel keeps it wider inside one), so cutting a prompt into more forwards
moves the rows after the cut. If a change to the prefill breaks the first fact, prefix-cache hits stop being exact
and this file says why."""
from __future__ import annotations

import pytest
import torch

from qwen36.tiny import make_bf16_checkpoint
from qwen36.tt.model.state import GDNLayerState, KVLayerState
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.runtime.resume import (CheckpointPolicy, CheckpointStore, PageLedger, chain_keys, plan_resume,
                                      write_row)

PAGE = 32
# a 100-token prompt of the CI checkpoint whose last row moves by 0.023 when the prompt is cut at 64
# (tests/tt/serving/test_vllm_soak_replay.py, R163)
R163 = [164, 139, 97, 448, 178, 61, 232, 247, 65, 350, 219, 335, 54, 445, 339, 287, 425, 467, 82, 472, 80, 364, 160, 7,
        62, 154, 155, 510, 34, 222, 53, 286, 193, 375, 41, 322, 124, 83, 399, 101, 299, 306, 236, 17, 34, 149, 32, 294,
        372, 70, 165, 143, 323, 357, 286, 272, 450, 368, 443, 281, 456, 154, 221, 203, 188, 331, 158, 127, 95, 112,
        83, 35, 470, 140, 456, 15, 110, 456, 462, 457, 482, 254, 386, 189, 118, 413, 397, 408, 451, 426, 340, 95,
        194, 334, 149, 139, 305, 170, 48, 174]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("resume") / "ci", "ci")  # the recordings' checkpoint
    g = TTGenerator.from_checkpoint(ck, "emulated-p150x2", precision="accuracy", max_seq_len=256, progress=False,
                                    block_size=PAGE, prefill_chunk=128)
    yield g
    g.close()


def _run(gen, ids, cuts):
    """Prefill ``ids`` as forwards ending at ``cuts`` (and at the end): all rows' logits, the KV pages, GDN state."""
    m, st = gen.model, gen.state
    gen.reset()
    ids = torch.as_tensor(ids)
    out = [m.prefill_forward(ids[a:b], st, all_rows=True) for a, b in zip([0] + cuts, cuts + [len(ids)])]
    pages = -(-len(ids) // PAGE)
    kv = [m.to_host(s.k)[:pages].clone() for s in st.layers if isinstance(s, KVLayerState)]
    gdn = [m.to_host(s.recurrent).clone() for s in st.layers if isinstance(s, GDNLayerState)]
    return torch.cat(out), kv, gdn


def test_prefill_rows_depend_only_on_their_prefix_and_the_starting_state(gen):
    vocab = gen.config.vocab_size
    ids = torch.randint(1, vocab, (120,), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[70:] = torch.randint(1, vocab, (50,), generator=torch.Generator().manual_seed(2))
    whole, kv_whole, _ = _run(gen, ids, [])  # one forward of 120 rows
    short, kv_short, _ = _run(gen, ids[:70], [])  # 70 rows
    diverged, kv_div, _ = _run(gen, other, [])  # other tokens after row 69
    assert torch.equal(whole[:70], short) and torch.equal(whole[:70], diverged[:70])
    full_pages = 70 // PAGE  # pages wholly below row 70 hold the same bits whatever came after
    assert all(torch.equal(a[:full_pages], b[:full_pages]) for a, b in zip(kv_whole, kv_short))
    assert all(torch.equal(a[:full_pages], b[:full_pages]) for a, b in zip(kv_whole, kv_div))


def test_a_cut_moves_the_rows_after_it(gen):
    """R163 as one forward and as two cut at 64: rows before the cut agree, the last row moves (by 0.023: the state at
    64 rounded to fp32 where one forward kept it wider), and so does the final GDN state. Hence checkpoints only at
    the boundaries a cold prefill cuts at (the grid), and a chunk of a prompt reruns from the grid boundary below."""
    one, _, s_one = _run(gen, R163, [])
    two, _, s_two = _run(gen, R163, [64])
    assert torch.equal(one[:64], two[:64])
    assert float((one[-1] - two[-1]).abs().max()) > 1e-2
    assert any(not torch.equal(a, b) for a, b in zip(s_one, s_two))


def test_chain_keys():
    a = chain_keys(list(range(100)), 32)
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_keys(list(range(64)) + [7] * 36, 32)[:2] == a[:2]  # a key is its prefix's, whatever follows
    assert chain_keys([9] + list(range(1, 100)), 32)[2] != a[2]  # and every earlier token is in it
    assert chain_keys(list(range(100)), 32, upto=64) == a[:2]


class _Pool:
    """Stand-in for the device pool: records the copies."""

    def __init__(self, n):
        self.n, self.saved = n, []

    def __len__(self):
        return self.n

    def save(self, index, layers):
        self.saved.append((index, layers))


def test_store_keeps_the_newest_and_evicts_the_least_recently_used():
    keys = chain_keys(list(range(1000)), 32)
    store = CheckpointStore(_Pool(2), 64, 32)
    for b in (64, 128, 192):
        assert store.save(keys[b // 32 - 1], b, [])
    assert store.stats.evictions == 1 and not store.has(keys[1])  # 64 went first
    assert store.newest_at_or_before(keys, 300) == (192, store.entries[keys[5]][0])
    assert store.newest_at_or_before(keys, 191)[0] == 128
    assert store.newest_at_or_before(keys, 127) == (0, None)
    assert store.save(keys[7], 256, [])  # 192 is now the least recently used (128 was looked up after it)
    assert store.has(keys[3]) and not store.has(keys[5]) and store.stats.evictions == 2
    assert not CheckpointStore(_Pool(0), 64, 32).save(keys[1], 64, [])


def test_policy():
    p = CheckpointPolicy(last=2, every=256)
    wanted = [b for b in range(64, 1000, 64) if p.wants(b, 700, 64)]
    assert wanted == [256, 512, 576, 640]  # every 256, and the two newest boundaries at or before token 699
    assert p.wants(704, 705, 64) and not p.wants(704, 704, 64)  # a boundary at the prompt's end is no prefix
    assert [b for b in range(64, 1000, 64) if CheckpointPolicy(last=1).wants(b, 700, 64)] == [640]


def test_plan_restores_the_grid_boundary_and_diverts_cached_pages():
    tokens = list(range(1, 401))
    keys = chain_keys(tokens, 32)
    ledger = PageLedger()
    row = list(range(10, 23))
    for j in range(12):
        ledger.prefilled(row[j], keys[j])
    store = CheckpointStore(_Pool(4), 64, 32, CheckpointPolicy(last=1))
    store.save(keys[5], 192, [])
    plan = plan_resume(tokens, 400, 320, row, ledger, store, 64, 32)  # hit at 320: grid boundary 320
    assert (plan.start, plan.target, plan.checkpoint is None) == (192, 320, False)  # 320 not kept: 192 serves
    assert plan.divert == set(range(6, 10)) and plan.own_from == 10 and not plan.repairs
    assert plan.recomputed == 128 and plan.saves == [(keys[11], 384)]
    wr = write_row(torch.tensor([row]), plan, 256, 320, [90, 91], 32)
    assert wr[0, 8:10].tolist() == [90, 91] and wr[0, 10:].tolist() == row[10:]
    # a page the ledger does not vouch for (decode rows): recomputed from its grid boundary and rewritten
    ledger.decoded(row[7], writer=5)
    plan = plan_resume(tokens, 400, 320, row, ledger, store, 64, 32)
    assert (plan.start, plan.target) == (192, 192) and plan.repairs == {7: 5} and plan.divert == {6, 8, 9}
    ledger.forget(row[9])  # never written by either: no writer known
    plan = plan_resume(tokens, 400, 320, row, ledger, store, 64, 32)
    assert plan.repairs == {7: 5, 9: None} and plan.divert == {6, 8}
    with pytest.raises(ValueError, match="cached"):
        plan_resume(tokens, 400, 400, row, ledger, store, 64, 32)
