"""The bf8 KV cache (``--precision performance+kv_cache=bfloat8_b``): the paged K/V in bfloat8_b, as Tenstorrent's
attention keeps it, on the emulated mesh, CI checkpoint.

* every attention layer's cache is allocated in bfloat8_b (1,088 bytes per 32x32 tile against bf16's 2,048);
* prefill logits and every traced decode step's logits stay within the model gates of the fp32 reference, and within
  KV_BF8_VS_BF16 of the same model with the bf16 cache;
* speculative greedy is lossless with it, at B = 1 (the device-rows verify) and B = 4 (the packed host-rows verify):
  ``indexed_fused_update_cache`` takes bf16 caches only (0.81.1 docstring), so a block-float cache's verify rows go
  through ``paged_fused_update_cache`` with the rows as its users under an identity page table
  (``TTGatedAttention.attend_verify``); speculation equal to plain greedy shows those rows land where the decode's
  would.
The end-to-end accuracy gate on the trained checkpoint is ``qwen36 probe precision-gate --candidate
performance+kv_cache=bfloat8_b`` (docs/memory.md)."""
from __future__ import annotations

import pytest
import torch

from qwen36.generation.sampling import SamplingParams
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import speculative_generate
from qwen36.numerics import PCC_GATES, comp_pcc
from support.speculative import oracle_drafter
from qwen36.tiny import make_bf16_checkpoint
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.speculative.spec_backend import TTSpecBackend

pytest.importorskip("ttnn")

KV_BF8 = "performance+kv_cache=bfloat8_b"
# bf8 K/V against bf16 K/V, same weights: measured 0.99998 (prefill, 100 rows) on this checkpoint; bf8 keeps 7
# mantissa bits per value with a shared exponent per 16, bf16 keeps 7 with its own exponent
KV_BF8_VS_BF16 = 0.9999
PROMPTS = [list(range(5, 17)), [3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28, 18, 28, 45, 90], [11, 13, 17, 19, 23]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-kv-bf8"), "ci", seed=0)


def make_gen(ckpt, precision):
    return TTGenerator.from_checkpoint(ckpt, "emulated-p150x2", precision=precision, max_seq_len=256, progress=False,
                                       block_size=32, prefill_chunk=64)


@pytest.fixture(scope="module")
def gen8(ckpt):
    g = make_gen(ckpt, KV_BF8)
    yield g
    g.close()


@pytest.mark.slow
def test_bf8_cache_logits_track_the_reference_and_the_bf16_cache(ckpt, gen8):
    import ttnn

    kv = [s for s in gen8.state.layers if hasattr(s, "k")]
    assert kv and all(s.k.dtype == ttnn.bfloat8_b and s.v.dtype == ttnn.bfloat8_b for s in kv)
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(7))
    ref = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)
    exp = ref(ids[None], ref.new_state(1, 128)).logits[0]
    got = gen8.teacher_forced_logits(ids)
    ok, msg = comp_pcc(exp, got, PCC_GATES["model_prefill"])
    assert ok, f"bf8 KV prefill vs reference: {msg}"
    g16 = make_gen(ckpt, "performance")
    try:
        ok, msg = comp_pcc(g16.teacher_forced_logits(ids), got, KV_BF8_VS_BF16)
        assert ok, f"bf8 KV vs bf16 KV prefill: {msg}"
        # traced decode of the reference's tokens: every step within the decode gate, and close to the bf16 cache
        for g in (gen8, g16):
            g.prefill(ids[:40])
        for i, t in enumerate(ids[40:56].tolist()):
            lg8, _ = gen8.decode_step(t)
            lg16, _ = g16.decode_step(t)
            ok, msg = comp_pcc(exp[40 + i], lg8, PCC_GATES["model_decode_bf8"])
            assert ok, f"bf8 KV decode step {i} vs reference: {msg}"
            ok, msg = comp_pcc(lg16, lg8, KV_BF8_VS_BF16)
            assert ok, f"bf8 KV vs bf16 KV decode step {i}: {msg}"
        assert gen8.decoder.trace_name in gen8.decoder.traces.steps, "decode ran untraced"
    finally:
        g16.close()


@pytest.mark.slow
@pytest.mark.parametrize("b", [1, 4])
def test_speculative_greedy_with_the_bf8_cache_is_lossless(gen8, b):
    n = 12
    plain = []
    for p in PROMPTS[:b]:
        plain.append(gen8.generate([torch.tensor(p)], n + 8)[0].tokens)
        gen8.release_trace()
    drafters = {tuple(p): oracle_drafter(p, pl) for p, pl in zip(PROMPTS, plain)}

    def draft(hist, k):
        return next(d for p, d in drafters.items() if tuple(hist[: len(p)]) == p)(hist, k)

    be = (TTSpecBackend(gen8, "shadow_commit", drafter=draft, use_trace=True) if b == 1
          else TTSpecBackend(gen8, "shadow_commit", slots=b, k=3, drafter=draft))
    try:
        got = speculative_generate(be, PROMPTS[:b], n, [3] * b, [SamplingParams()] * b)
    finally:
        be.close()
    for i in range(b):
        assert got[i].tokens[:n] == plain[i][:n], f"user {i}: speculative greedy differs from plain greedy"


@pytest.mark.slow
def test_prefix_cache_warm_equals_cold_with_the_bf8_cache(gen8):
    """The prefix cache copies bf8 KV pages as they are (slices, then ``paged_fill_cache`` into the restoring
    request's pages): a warm request equals the cold one bit for bit, as with the bf16 cache
    (tests/tt/runtime/test_tt_prefix_cache.py)."""
    from qwen36.prefix_cache import PrefixCache

    prompt = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    cold = gen8.generate([prompt], 6, prefix_cache=PrefixCache(32, 1 << 34, with_mtp=False), keep_logits=True)[0]
    cache = PrefixCache(32, 1 << 34, with_mtp=False)
    gen8.generate([prompt[:65]], 1, prefix_cache=cache)  # caches the blocks up to 64
    warm = gen8.generate([prompt], 6, prefix_cache=cache, keep_logits=True)[0]
    assert (warm.prefill.reused, warm.prefill.computed) == (64, 6)
    assert warm.tokens == cold.tokens
    assert all(torch.equal(x, y) for x, y in zip(warm.logits, cold.logits))
