"""The prefix cache on the emulated TT mesh (``tt/runtime/prefix.py``): a warm request (GDN recurrent + conv and KV pages
restored by device copies) emits the same tokens with bit-identical logits as the same request served cold on the
same backend, greedy and seeded sampling, at every block boundary, for prefixes that diverge mid-block and under
eviction; the device buffers of evicted or uncached blocks are freed."""
from __future__ import annotations

import pytest
import torch

from qwen36.prefix_cache import PrefixCache
from qwen36.generation.sampling import SamplingParams
from qwen36.testing.tt import small_tt_generator

BLOCK = 32  # = the paged-KV block size of small_tt_generator (a cached block is whole pages)
BIG = 1 << 34


@pytest.fixture(scope="module")
def gen(ckpt_factory):
    g = small_tt_generator(ckpt_factory("ci"), prefill_chunk=64)
    yield g
    g.close()


def prompt_of(vocab, n, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def same(a, b):
    assert a.tokens == b.tokens
    assert len(a.logits) == len(b.logits) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_warm_equals_cold_at_every_boundary_greedy(gen):
    vocab = gen.config.vocab_size
    prompt = prompt_of(vocab, 70, 1)  # boundaries 32 and 64 before the last token
    cold = gen.generate([prompt], 6, prefix_cache=PrefixCache(BLOCK, BIG, with_mtp=False), keep_logits=True)[0]
    assert cold.prefill.reused == 0
    for k in (1, 2):
        cache = PrefixCache(BLOCK, BIG, with_mtp=False)
        gen.generate([prompt[: k * BLOCK + 1]], 1, prefix_cache=cache)[0]  # caches the blocks up to k * BLOCK
        warm = gen.generate([prompt], 6, prefix_cache=cache, keep_logits=True)[0]
        assert (warm.prefill.reused, warm.prefill.computed) == (k * BLOCK, 70 - k * BLOCK)
        same(cold, warm)
    # a prefix that diverges inside the second block reuses only the first
    cache = PrefixCache(BLOCK, BIG, with_mtp=False)
    gen.generate([prompt[:40] + [(t + 1) % vocab for t in prompt[40:]]], 1, prefix_cache=cache)[0]
    warm = gen.generate([prompt], 6, prefix_cache=cache, keep_logits=True)[0]
    assert warm.prefill.reused == BLOCK
    same(cold, warm)
    # without a cache the prompt is one prefill: equal to rounding only
    plain = gen.generate([prompt], 6, keep_logits=True)[0]
    assert max(float((x - y).abs().max()) for x, y in zip(plain.logits, cold.logits)) < 0.1


def test_fused_gdn_prefill_warm_equals_cold(ckpt_factory):
    """The same at the config whose GDN prefill runs ttnn's fused ops (conv carry in bf16, flat chunk rule, gated
    norm; tt/model/gdn_prefill.py): the segmented prefill's GDN state, restored, gives the cold request's bits."""
    gen = small_tt_generator(ckpt_factory("ci-gdn32"), prefill_chunk=64)
    try:
        gdn = [layer.mixer for layer in gen.model.layers if hasattr(layer.mixer, "fused_prefill")]
        assert gdn and all(m.prefill_path == "fused" for m in gdn)
        prompt = prompt_of(gen.config.vocab_size, 70, 5)
        cold = gen.generate([prompt], 6, prefix_cache=PrefixCache(BLOCK, BIG, with_mtp=False), keep_logits=True)[0]
        for k in (1, 2):
            cache = PrefixCache(BLOCK, BIG, with_mtp=False)
            gen.generate([prompt[: k * BLOCK + 1]], 1, prefix_cache=cache)
            warm = gen.generate([prompt], 6, prefix_cache=cache, keep_logits=True)[0]
            assert (warm.prefill.reused, warm.prefill.computed) == (k * BLOCK, 70 - k * BLOCK)
            same(cold, warm)
    finally:
        gen.close()


def test_warm_equals_cold_sampled_traced_and_eviction(gen):
    """Seeded sampling through the traced device sampler; a budget of one block: every insert evicts the
    previous (unreferenced) block, whose device buffers are freed."""
    vocab = gen.config.vocab_size
    prompt = prompt_of(vocab, 40, 2)
    params = SamplingParams(temperature=0.8, top_k=20, seed=4)
    cold = gen.generate([prompt], 8, params, prefix_cache=PrefixCache(BLOCK, BIG, with_mtp=False))[0]
    probe = PrefixCache(BLOCK, BIG, with_mtp=False)
    gen.generate([prompt], 1, prefix_cache=probe)[0]
    one_block = probe.bytes
    cache = PrefixCache(BLOCK, one_block, with_mtp=False)
    gen.generate([prompt], 1, prefix_cache=cache)[0]  # caches block 0
    warm = gen.generate([prompt], 8, params, prefix_cache=cache)[0]
    assert warm.prefill.reused == BLOCK and warm.tokens == cold.tokens
    evicted = cache.nodes()[0].payload
    gen.generate([prompt_of(vocab, 40, 3)], 1, prefix_cache=cache)[0]  # another prompt's block evicts it
    assert cache.stats.evictions == 1 and evicted.gdn == [] and evicted.kv == []
    cache.check()


def _batch_run(gen, cache, prompts, limits, arrivals, pool_blocks=0, keep_pool=False):
    from types import SimpleNamespace

    from qwen36.testing.tt_batch import host_greedy
    from qwen36.tt.runtime.batch import TTBatchDecoder

    gen.release_trace()
    dec = TTBatchDecoder(gen.model, 4, prefix_cache=cache, pool_blocks=pool_blocks)
    try:
        out = host_greedy(dec, prompts, limits, arrivals=arrivals)
        res = SimpleNamespace(tokens=[r.tokens for r in out], logits=[r.logits for r in out])
        return (res, dict(dec.prefills)) if not keep_pool else (res, dec)
    finally:
        dec.release()
        if not keep_pool:
            dec.release_pool()


def test_batched_users_share_blocks_running_and_finished(gen):
    """Three users of one TT batch share a 64-token prefix: user 0 inserts it, user 1 joins in the same round and
    holds the same blocks, user 0 finishes after 2 tokens, user 2 joins at step 4 (decode trace live: it reuses the
    blocks, which running user 1 still holds, and inserts none). Every token and logits row equals the same
    schedule with nothing cached (budget 0)."""
    vocab = gen.config.vocab_size
    common = prompt_of(vocab, 66, 5)
    prompts = [common + prompt_of(vocab, 3 + i, 6 + i) for i in range(3)]
    limits, arrivals = [2, 9, 4], [0, 0, 4]
    cold, _ = _batch_run(gen, PrefixCache(BLOCK, 0, with_mtp=False), prompts, limits, arrivals)
    cache = PrefixCache(BLOCK, BIG, with_mtp=False)
    warm, _ = _batch_run(gen, cache, prompts, limits, arrivals)
    assert warm.tokens == cold.tokens
    for a, b in zip(warm.logits, cold.logits):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert cache.stats.lookups == 3 and cache.stats.tokens_reused == 2 * 64  # users 1 and 2 each reused 2 blocks
    assert cache.stats.inserts == 2  # only user 0's blocks: user 1 found them, user 2 joined under a live trace
    assert all(n.refs == 0 for n in cache.nodes())  # every user left


def test_block_pool_caches_under_a_live_trace(gen):
    """With a block pool (device buffers allocated before the first capture) a user joining under the live decode
    trace caches its new blocks too: user 2 (step 3) inserts its own third block, user 3 (step 6) reuses all three.
    Tokens and every logits row equal the schedule with nothing cached; a pool of 2 slots evicts the least recently
    used unheld block, and refuses (caches nothing more) while every slot is held."""
    vocab = gen.config.vocab_size
    common = prompt_of(vocab, 64, 9)
    third = prompt_of(vocab, 32, 10)
    prompts = [common + prompt_of(vocab, 5, 11), common + third + [3, 4], common + third + [5, 6, 7]]
    limits, arrivals = [3, 6, 4], [0, 3, 6]
    cold, _ = _batch_run(gen, PrefixCache(BLOCK, 0, with_mtp=False), prompts, limits, arrivals)
    cache = PrefixCache(BLOCK, BIG, with_mtp=False)
    warm, dec = _batch_run(gen, cache, prompts, limits, arrivals, pool_blocks=4, keep_pool=True)
    try:
        assert warm.tokens == cold.tokens
        for a, b in zip(warm.logits, cold.logits):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        # user 0: blocks 0-1 inserted; user 1 (live trace): block 2 inserted into the pool; user 2: all three reused
        assert cache.stats.inserts == 3 and cache.stats.tokens_reused == 2 * BLOCK + 3 * BLOCK
        assert len(dec.pool.free) == 1 and all(n.refs == 0 for n in cache.nodes())
    finally:
        dec.release_pool()
    small = PrefixCache(BLOCK, BIG, with_mtp=False)
    other = [prompt_of(vocab, 70, 12), prompt_of(vocab, 70, 13)]  # two blocks each, no common prefix
    warm2, dec2 = _batch_run(gen, small, other, [8, 2], [0, 0], pool_blocks=2, keep_pool=True)
    try:
        # user 0 takes both slots; user 1's blocks find every slot held by running user 0: refused, not cached
        assert small.stats.inserts == 2 and small.stats.refused == 1 and small.stats.evictions == 0
        cold2, _ = _batch_run(gen, PrefixCache(BLOCK, 0, with_mtp=False), other, [8, 2], [0, 0])
        assert warm2.tokens == cold2.tokens
        gen.release_trace()
        dec2.join(0, prompt_of(vocab, 40, 14))  # both earlier users left: the LRU block is evicted for this one
        assert small.stats.evictions == 1 and small.stats.inserts == 3
    finally:
        dec2.leave(0)
        dec2.release()
        dec2.release_pool()


def test_pool_joins_leave_no_buffer_behind_under_a_live_trace(gen):
    """Why the pool exists: a snapshot without one allocates device buffers that outlive the join (allowed inside
    the join's scratch scope, but a later replay may write over them on cards); with the pool a join under the live
    trace caches its blocks and leaves the device's allocated DRAM exactly where it was."""
    import gc

    from qwen36.tt.runtime.batch import TTBatchDecoder

    vocab = gen.config.vocab_size

    def join_under_trace(pool_blocks):
        gen.release_trace()
        cache = PrefixCache(BLOCK, BIG, with_mtp=False)
        dec = TTBatchDecoder(gen.model, 4, prefix_cache=cache, pool_blocks=pool_blocks)
        try:
            dec.join(0, prompt_of(vocab, 10, 15))
            for t in (1, 2, 3):
                dec.step({0: t})
            assert len(dec.traces) > 0
            gc.collect()
            before = list(gen.mesh.dram_used)
            dec.join(1, prompt_of(vocab, 70, 16), insert=True)
            gc.collect()
            grown = gen.mesh.dram_used[0] - before[0]
            dec.step({0: 4, 1: 5})  # the trace replays with the new user
            return grown, cache.stats.inserts
        finally:
            dec.release()
            dec.release_pool()

    grown, inserts = join_under_trace(0)
    assert inserts == 2 and grown > 0  # two blocks cached into fresh buffers
    grown, inserts = join_under_trace(2)
    assert inserts == 2 and grown == 0  # the same blocks copied into the pool's slots


def test_thinking_budget_on_tt_plain(gen):
    """The stop-thinking phrase at exactly N thinking tokens on the TT generator (fed as decode rows), with and
    without a prefix cache (the same tokens: the cache only changes where the prompt's prefill starts)."""
    from qwen36.generation.thinking import ThinkingBudget

    start, end = 7, 9
    phrase = (31, 32, 33, end, 34, 35)
    prompt = prompt_of(gen.config.vocab_size, 40, 8) + [start]
    free = gen.generate([prompt], 16)[0].tokens
    n = 4
    assert end not in free[:n]
    budget = ThinkingBudget(n, start, end, phrase)
    out = gen.generate([prompt], 16, thinking=budget, prefix_cache=PrefixCache(BLOCK, BIG, with_mtp=False))[0]
    assert out.tokens[:n] == free[:n] and tuple(out.tokens[n:n + len(phrase)]) == phrase and len(out.tokens) == 16
    cache = PrefixCache(BLOCK, BIG, with_mtp=False)
    gen.generate([prompt], 1, prefix_cache=cache)[0]
    warm = gen.generate([prompt], 16, thinking=budget, prefix_cache=cache, keep_logits=True)[0]
    assert warm.prefill.reused == BLOCK and warm.tokens == out.tokens
    zero = gen.generate([prompt], 8, thinking=ThinkingBudget(0, start, end, phrase))[0].tokens
    assert tuple(zero[:len(phrase)]) == phrase  # budget 0 with the block open: the phrase first


@pytest.mark.parametrize("mech", ["shadow_commit", "snapshot", "recompute"])
def test_speculative_warm_equals_cold(gen, ckpt_factory, mech):
    """TTSpecBackend (traced verify / commit, device MTP) through the cache: the target state is restored, the MTP
    prefill is redone over every prompt row from bit-identical hidden rows (cached ones for the restored blocks), so
    the warm request's prefill logits, tokens and accepted counts equal the cold request's, at both boundaries."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.speculative.engine import speculative_generate
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
    from qwen36.tt.spec.spec_backend import TTSpecBackend

    drafter = TTMTPDrafter(load_checkpoint(ckpt_factory("ci"), require_mtp=True))
    prompt = prompt_of(gen.config.vocab_size, 70, 11)

    ttnn = gen.ttnn

    def mtp_prompt_rows():  # the MTP KV rows of the prompt (written by the MTP prefill, not rewritten later)
        kv = drafter._base.kv
        out = []
        for c in (kv.k, kv.v):
            for t in ttnn.get_device_tensors(c):  # [pages, Hkv/N, page, D] per device, identity page table
                x = ttnn.to_torch(t).float()
                out.append(x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :70])
        return out

    def run(cache):
        gen.release_trace()
        be = TTSpecBackend(gen, mech, drafter=drafter, prefix_cache=cache)
        try:
            res = speculative_generate(be, [prompt], 10, [2], [SamplingParams()])[0]
            return res, be.prefill_logits.clone(), be.last_prefill.reused, mtp_prompt_rows()
        finally:
            be.close()

    cold, cold_logits, reused, cold_mtp = run(PrefixCache(BLOCK, BIG, with_mtp=False))
    assert reused == 0
    for k in (1, 2):
        cache = PrefixCache(BLOCK, BIG, with_mtp=False)
        gen.generate([prompt[: k * BLOCK + 1]], 1, prefix_cache=cache)[0]  # plain decoding fills the same blocks
        warm, warm_logits, reused, warm_mtp = run(cache)
        assert reused == k * BLOCK
        assert torch.equal(warm_logits, cold_logits)
        assert all(torch.equal(a, b) for a, b in zip(warm_mtp, cold_mtp))  # the MTP prefill saw the same hiddens
        assert warm.tokens == cold.tokens and warm.stats.accepted == cold.stats.accepted


def test_batched_speculative_shares_blocks(ckpt_factory):
    """TTSpecBackend with B slots (one packed verify, batched device MTP) with a prefix cache: users sharing a prefix reuse
    each other's blocks (user 2 joins in round 3, once the step traces are live: it reuses without inserting);
    every user's tokens
    and accepted counts equal the same schedule with nothing cached."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.speculative.engine import speculative_generate
    from qwen36.tt.spec.spec_backend import TTSpecBackend
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

    ckpt = ckpt_factory("ci")
    g = small_tt_generator(ckpt, prefill_chunk=64, require_mtp=True)
    reader = load_checkpoint(ckpt, require_mtp=True)
    common = prompt_of(g.config.vocab_size, 66, 21)
    prompts = [common + prompt_of(g.config.vocab_size, 2 + i, 22 + i) for i in range(3)]

    def run(cache):
        be = TTSpecBackend(g, "shadow_commit", slots=4, k=1, drafter=TTMTPDrafter(reader), prefix_cache=cache)
        try:
            return speculative_generate(be, prompts, 8, [1, 1, 1], [SamplingParams()] * 3, arrivals=[0, 0, 3])
        finally:
            be.release()

    try:
        cold = run(PrefixCache(BLOCK, 0, with_mtp=False))
        cache = PrefixCache(BLOCK, BIG, with_mtp=False)
        warm = run(cache)
    finally:
        g.close()
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert [r.stats.accepted for r in warm] == [r.stats.accepted for r in cold]
    assert cache.stats.tokens_reused == 2 * 64 and cache.stats.inserts == 2
    assert all(n.refs == 0 for n in cache.nodes())  # every user left


@pytest.mark.slow  # three runs of the B-slot backend with the device MTP
def test_batched_speculative_pool_caches_under_a_live_trace(ckpt_factory):
    """TTSpecBackend with B slots and a block pool (``pool_blocks``, the decoder's ``TTBlockPool``): user 1 joins in
    round 3, under the live step traces (round 0 has no step, 1 is eager, 2 captures), and caches its two prefix blocks into the pool; user 2 shares that prefix,
    joins later and reuses both. Every user's tokens, accepted counts and every emitted token's logits row are
    bit-equal (``torch.equal``) to the same schedule with nothing cached; without the pool the same schedule caches
    nothing under the live trace (the behaviour the pool lifts)."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.speculative.engine import speculative_generate
    from qwen36.testing.tt_batch import record_emitted_logits
    from qwen36.tt.spec.spec_backend import TTSpecBackend
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

    ckpt = ckpt_factory("ci")
    g = small_tt_generator(ckpt, prefill_chunk=64, require_mtp=True)
    reader = load_checkpoint(ckpt, require_mtp=True)
    v = g.config.vocab_size
    common = prompt_of(v, 66, 31)
    prompts = [prompt_of(v, 5, 30), common + prompt_of(v, 2, 32), common + prompt_of(v, 3, 33)]

    def run(cache, pool_blocks):
        be = TTSpecBackend(g, "shadow_commit", slots=4, k=1, drafter=TTMTPDrafter(reader), prefix_cache=cache,
                           pool_blocks=pool_blocks)
        rows = record_emitted_logits(be)
        try:
            res = speculative_generate(be, prompts, 8, [1, 1, 1], [SamplingParams()] * 3, arrivals=[0, 3, 6])
            assert len(be.traces) > 0  # users 1 and 2 joined under live traces
            return res, rows
        finally:
            be.release()
            be.decoder.release_pool()

    try:
        cold, cold_rows = run(PrefixCache(BLOCK, 0, with_mtp=False), 0)
        cache = PrefixCache(BLOCK, BIG, with_mtp=False)
        warm, warm_rows = run(cache, 4)
        unpooled = PrefixCache(BLOCK, BIG, with_mtp=False)
        run(unpooled, 0)
    finally:
        g.close()
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert [r.stats.accepted for r in warm] == [r.stats.accepted for r in cold]
    for u in range(3):
        assert len(warm_rows[u]) == len(cold_rows[u]) >= len(warm[u].tokens)
        assert all(torch.equal(a, b) for a, b in zip(warm_rows[u], cold_rows[u])), f"user {u}"
    assert cache.stats.inserts == 2 and cache.stats.tokens_reused == 2 * BLOCK  # user 1 inserted, user 2 reused
    assert all(n.refs == 0 for n in cache.nodes())  # every user left
    assert unpooled.stats.inserts == 0 and unpooled.stats.tokens_reused == 0
