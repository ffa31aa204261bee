"""Prefix cache (``qwen36.prefix_cache`` + ``qwen36.reference.prefix``) on the reference backend.

The contract: a warm request (resumed from cached blocks) emits the same tokens with bit-identical logits as the same
request served cold on the same backend: plain greedy and seeded sampling, speculative with every commit mechanism,
greedy and sampled; at every block boundary, for prefixes ending mid-block, under eviction, and for a prefix shared
by a running and a finished user of one batch. Plus the tree's own rules (LRU, references, budget) and that
speculative steps (drafts, rejected rows, aborts) never put anything into the cache."""
from __future__ import annotations

import pytest
import torch

from qwen36.prefix_cache import PrefixCache
from qwen36.reference.model import Qwen36Model
from qwen36.reference.prefix import fill, prefill
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.reference.batch import generate
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.generation.sampling import SamplingParams

BLOCK = 4
BIG = 1 << 30
GREEDY = SamplingParams(logprobs=5)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=7, logprobs=5)


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return Qwen36Model.from_checkpoint(ckpt_factory("ci"), require_mtp=True)


def rand_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    return rand_prompt(model.config.vocab_size, 23, 3)  # boundaries 4..20 cacheable (a block needs the token after it)


# ---- the tree alone ------------------------------------------------------------------------------
def test_tree_match_lru_references_budget():
    c = PrefixCache(2, budget_bytes=30, with_mtp=False)
    lease = c.lease()
    a = c.insert(None, (1, 2), "a", 10, lease)
    b = c.insert(a, (3, 4), "b", 10, lease)
    assert [n.payload for n in c.match([1, 2, 3, 4, 5])] == ["a", "b"]
    assert [n.payload for n in c.match([1, 2, 3, 4], limit=3)] == ["a"]  # the limit cuts whole blocks
    assert c.match([1, 9, 3, 4]) == []  # a block must match whole
    x = c.insert(None, (7, 7), "x", 10, c.lease())
    x_lease = x  # held by a lease nobody releases
    assert c.bytes == 30
    # full: a new block needs room, every leaf is referenced -> refused, nothing evicted
    assert c.insert(b, (5, 6), "c", 10, c.lease()) is None and c.stats.refused == 1 and c.stats.evictions == 0
    lease.release()
    assert a.refs == 0 and b.refs == 0 and x_lease.refs == 1
    # now b (an unreferenced leaf, least recently used) goes; a is an inner node until b is gone, x is held
    c.match([1, 2])  # touch a: b stays the least recently used leaf
    d = c.insert(None, (8, 8), "d", 10, c.lease())
    assert d is not None and c.stats.evictions == 1 and b.payload is None and a.payload == "a"
    assert c.match([1, 2, 3, 4]) == [a]
    c.check()
    with pytest.raises(ValueError, match="block holds 2"):
        c.insert(None, (1,), "y", 1, c.lease())
    assert PrefixCache(2, budget_bytes=5).insert(None, (1, 2), "big", 10, PrefixCache(2, 5).lease()) is None


# ---- plain decoding --------------------------------------------------------------------------------
def prime(model, cache: PrefixCache, tokens: list[int]) -> None:
    fill(model, tokens, cache)


def assert_same(cold, warm):
    assert warm.tokens == cold.tokens
    assert len(warm.logits) == len(cold.logits)
    for a, b in zip(cold.logits, warm.logits):
        assert torch.equal(a, b)  # bitwise
    assert [(l.token, l.logprob, l.rank, l.top) for l in warm.logprobs] == \
           [(l.token, l.logprob, l.rank, l.top) for l in cold.logprobs]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_warm_equals_cold_at_every_boundary(model, prompt, params):
    cold = generate(model, [prompt], 8, params, prefix_cache=PrefixCache(BLOCK, BIG), keep_logits=True)[0]
    assert cold.prefill.reused == 0 and cold.prefill.computed == len(prompt)
    for k in range(1, (len(prompt) - 1) // BLOCK + 1):
        cache = PrefixCache(BLOCK, BIG)
        prime(model, cache, prompt[: k * BLOCK + 1])  # caches exactly the blocks ending at or before k * BLOCK
        warm = generate(model, [prompt], 8, params, prefix_cache=cache, keep_logits=True)[0]
        assert (warm.prefill.reused, warm.prefill.computed) == (k * BLOCK, len(prompt) - k * BLOCK)
        assert_same(cold, warm)
        assert all(n.refs == 0 for n in cache.nodes())  # released when the request returned
    # the segmented prefill vs the one-forward prefill: equal to rounding, not bitwise (documented)
    plain = generate(model, [prompt], 8, params, keep_logits=True)[0]
    assert max(float((a - b).abs().max()) for a, b in zip(plain.logits, cold.logits)) < 1e-4


def test_partial_block_prefixes(model, prompt):
    """A cached conversation that diverges from the prompt mid-block reuses only the whole blocks before it."""
    cold = generate(model, [prompt], 6, GREEDY, prefix_cache=PrefixCache(BLOCK, BIG), keep_logits=True)[0]
    vocab = model.config.vocab_size
    for shared in (2, 6, 9, 14):  # tokens in common; blocks 0..shared // BLOCK - 1 are reusable
        cache = PrefixCache(BLOCK, BIG)
        other = prompt[:shared] + [(t + 1) % vocab for t in prompt[shared:]]
        prime(model, cache, other)
        warm = generate(model, [prompt], 6, GREEDY, prefix_cache=cache, keep_logits=True)[0]
        assert warm.prefill.reused == shared // BLOCK * BLOCK
        assert_same(cold, warm)


# ---- speculative decoding --------------------------------------------------------------------------
class Recording(ReferenceBackend):
    """Keeps every logits tensor the request produced (prefill row, every verify) to compare bitwise."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[torch.Tensor] = []

    def join(self, slot, prompt, params=SamplingParams()):
        first = super().join(slot, prompt, params)
        self.seen.append(self.last_prefill.logits.clone())
        return first

    def leave(self, slot):
        self.final = self.live(slot)  # the finished user's state, as it leaves
        super().leave(slot)

    def verify(self, draft):
        out = super().verify(draft)
        self.seen.append(out.logits.clone())
        return out


def spec_run(model, prompt, mech, params, cache, k=3, n=10):
    be = Recording(model, mech, max_len=64, prefix_cache=cache)
    res = speculative_generate(be, [prompt], n, [k], [params])[0]
    return be, res


def live_equal(a: Recording, b: Recording) -> None:
    la, lb = a.final, b.final
    assert la.state.pos == lb.state.pos and la.mtp.pos == lb.mtp.pos
    for x, y in zip(la.state.layers, lb.state.layers):
        if hasattr(x, "recurrent"):
            assert torch.equal(x.recurrent, y.recurrent) and torch.equal(x.conv, y.conv)
        else:
            assert torch.equal(x.k[:, :, : la.state.pos], y.k[:, :, : la.state.pos])
            assert torch.equal(x.v[:, :, : la.state.pos], y.v[:, :, : la.state.pos])
    assert torch.equal(la.mtp.kv.k[:, :, : la.mtp.pos], lb.mtp.kv.k[:, :, : la.mtp.pos])


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculative_warm_equals_cold_at_every_boundary(model, prompt, mech, params):
    cold_be, cold = spec_run(model, prompt, mech, params, PrefixCache(BLOCK, BIG))
    assert cold_be.counters.steps >= 2
    for k in range(1, (len(prompt) - 1) // BLOCK + 1):
        cache = PrefixCache(BLOCK, BIG)
        prime(model, cache, prompt[: k * BLOCK + 1])
        be, warm = spec_run(model, prompt, mech, params, cache)
        assert be.last_prefill.reused == k * BLOCK
        assert warm.tokens == cold.tokens and warm.stats.accepted == cold.stats.accepted
        assert [l.logprob for l in warm.logprobs] == [l.logprob for l in cold.logprobs]
        assert len(be.seen) == len(cold_be.seen) and all(torch.equal(a, b) for a, b in zip(cold_be.seen, be.seen))
        live_equal(cold_be, be)


def test_speculative_steps_never_enter_the_cache(model, prompt):
    """Drafts, rejected rows and an aborted verify leave the cache as a plain fill of the prompt leaves it."""
    cache = PrefixCache(BLOCK, BIG)
    be = ReferenceBackend(model, "snapshot", max_len=64, prefix_cache=cache)
    be.join(0, prompt, GREEDY)
    d = be.draft({0: 3})
    be.verify(d)
    be.abort()  # an aborted verify
    be.leave(0)
    speculative_generate(be, [prompt], 12, [3], [GREEDY])  # a fresh prefill (hits), then steps with rejections
    assert be.counters.steps >= 2
    ref = PrefixCache(BLOCK, BIG)
    prime(model, ref, prompt)
    got = {tuple(t for a in path for t in a.tokens): n for n, path in _paths(cache)}
    want = {tuple(t for a in path for t in a.tokens): n for n, path in _paths(ref)}
    assert got.keys() == want.keys() and len(got) == (len(prompt) - 1) // BLOCK
    for key, n in got.items():
        for x, y in zip(_tensors(n.payload), _tensors(want[key].payload)):
            assert torch.equal(x, y)


def _paths(cache):
    for n in cache.nodes():
        path, m = [], n
        while m is not None and m.tokens:
            path.append(m)
            m = m.parent
        yield n, path[::-1]


def _tensors(pl):
    return [t for pair in pl.kv + pl.gdn for t in pair] + list(pl.mtp) + [pl.hidden]


# ---- batched: shared blocks, a running and a finished user, eviction -----------------------------------
def _batch_schedule(model, mech, cache, prompts, fillers):
    """slot 0 joins; 2 steps; slot 1 joins (shares slot 0's prefix); 2 steps; slot 0 finishes and leaves; other
    prompts fill the cache (eviction pressure); slot 2 joins with the prefix held by running slot 1; 3 steps."""
    be = ReferenceBackend(model, mech, max_len=64, slots=3, max_k=3, prefix_cache=cache)
    out = {s: [] for s in range(3)}
    logits = []

    def join(slot):
        out[slot].append(be.join(slot, prompts[slot], GREEDY))
        logits.append(be.dec.prefills[slot].logits.clone())

    def step(slots):
        d = be.draft({s: 3 for s in slots})
        v = be.verify(d)
        logits.append(v.logits.clone())
        acc = be.accept(d, v)
        be.commit(acc)
        for s, a in acc.items():
            out[s] += a.tokens

    join(0)
    step([0]); step([0])
    join(1)
    shared = be.dec.prefills[1].lease.nodes
    refs_while_both_run = [n.refs for n in shared]
    step([0, 1]); step([0, 1])
    be.leave(0)  # finished
    refs_after_finish = [n.refs for n in shared]
    for f in fillers:
        fill(model, f, cache)
    join(2)
    reused = [be.dec.prefills[s].reused for s in (1, 2)]
    step([1, 2]); step([1, 2]); step([1, 2])
    return out, logits, reused, refs_while_both_run, refs_after_finish


@pytest.mark.parametrize("mech", ["shadow_commit", "snapshot"])
def test_batch_shared_prefix_running_and_finished_users_under_eviction(model, mech):
    vocab = model.config.vocab_size
    common = rand_prompt(vocab, 13, 5)  # 3 whole blocks shared
    prompts = [common + rand_prompt(vocab, 6, 10 + i) for i in range(3)]
    fillers = [rand_prompt(vocab, 17, 20 + i) for i in range(3)]
    probe = PrefixCache(BLOCK, BIG)
    prime(model, probe, prompts[0])
    per_block = probe.nodes()[0].nbytes
    # room for the prompts' 4 + 1 + 1 blocks and 2 more: the fillers' 12 blocks evict (and cannot all be cached)
    budget = 8 * per_block
    cold_out, cold_logits, cold_reused, *_ = _batch_schedule(model, mech, PrefixCache(BLOCK, 0), prompts, fillers)
    assert cold_reused == [0, 0]  # budget 0: nothing is ever cached, every user prefills cold
    cache = PrefixCache(BLOCK, budget)
    out, logits, reused, refs_both, refs_fin = _batch_schedule(model, mech, cache, prompts, fillers)
    assert refs_both[:3] == [2, 2, 2]  # slot 0 and slot 1 hold the 3 shared blocks
    assert refs_fin[:3] == [1, 1, 1]  # slot 0 left: only running slot 1 holds them
    # pressure: unreferenced blocks were evicted, and blocks that found only referenced ones were not cached
    assert cache.stats.evictions > 0 and cache.stats.refused > 0
    assert reused == [12, 12]  # slot 2 found the shared blocks although the budget was under pressure
    assert out == cold_out
    assert len(logits) == len(cold_logits) and all(torch.equal(a, b) for a, b in zip(cold_logits, logits))
    cache.check()
