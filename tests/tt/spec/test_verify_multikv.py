"""Packed K+1 verify with 2 KV heads per device (the real 27B TP=2 shape: 4 KV heads over 2 devices) on the
emulated 1x2 mesh, at CI size: the CI config with doubled heads (8 q / 4 KV heads -> 4 q / 2 KV per device).

The multi-position SDPA takes one KV head per cache; the verify runs one group per local KV head over a per-head
view of the paged cache (tt/model/attention.py ``attend_verify``). Tolerances are those of tests/tt/spec/test_spec_backend.py."""
from __future__ import annotations

import pytest
import torch

from qwen36.config import FULL

from qwen36.speculative.engine import speculative_generate
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.spec.spec_backend import TTSpecBackend
from qwen36.testing.tt import make_bf16_checkpoint, tp4_config
from qwen36.tt.spec.verify import VerifyShapeError, check_verify_shape
from qwen36.testing.speculative import oracle_drafter

PROMPT = list(range(5, 17))
MAX_NEW = 16


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("multikv") / "ci2kv", tp4_config())
    g = TTGenerator.from_checkpoint(ck, "emulated-p150x2", precision="accuracy", max_seq_len=256, progress=False,
                                    block_size=32, prefill_chunk=64)
    assert g.model.args.hkv_d == 2 and g.model.args.hq_d == 4
    yield g
    g.close()


@pytest.fixture(scope="module")
def plain(gen):
    out = gen.generate([PROMPT], MAX_NEW)[0].tokens
    gen.release_trace()
    return out


def test_shape_check_accepts_two_kv_heads_and_refuses_big_k(gen):
    check_verify_shape(gen.model.args, 3)
    with pytest.raises(VerifyShapeError, match="exceed the multi-position SDPA kernel's limit"):
        check_verify_shape(gen.model.args, 64)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_equals_sequential_decode(gen, k, paged):
    """Same tolerance as tests/tt/spec/test_spec_backend.py::test_verify_vs_decode_shared_rows (max abs <= 1e-6,
    PCC >= 0.99999, argmax equal; GDN per-token states PCC >= 0.99999, max abs <= 1e-5)."""
    from qwen36.probes.verify_tp import run_case, shuffle_pages

    if paged:
        shuffle_pages(gen, 3)
    c = run_case(gen, k, PROMPT, [7, 99, 250, 3, 41, 8, 77, 12][: k + 1])
    assert c["logits_max_abs"] <= 1e-6 and c["logits_pcc_min"] >= 0.99999 and c["argmax_equal"], c
    assert c["gdn_state_pcc_min"] >= 0.99999 and c["gdn_state_max_abs"] <= 1e-5, c


def test_verify_rows_across_a_page_boundary_one_indexed_kv_write(gen):
    """Positions 30..33 straddle the 32-row page edge on shuffled pages: the verify's physical KV rows
    (page_table[p // bs] * bs + p % bs, computed on device) must land where the paged reads find them. The KV
    caches are zeroed between the sequential decode and the verify, so rows written anywhere else leave the
    attention reading the wrong values. Every attention layer writes its K+1 K and V rows with ONE
    indexed_fused_update_cache (no per-row paged_update_cache)."""
    from qwen36.numerics import pcc
    from qwen36.probes.verify_tp import shuffle_pages
    from qwen36.tt.model.state import KVLayerState

    ttnn = gen.ttnn
    shuffle_pages(gen, 5)
    prompt, rows = list(range(5, 35)), [7, 99, 250, 3]  # 30 tokens: verify rows at positions 30, 31 | 32, 33
    gen.use_trace = False
    gen.prefill(prompt)
    seq = torch.stack([gen.decode_step(tok)[0].float() for tok in rows])
    for s in gen.state.layers:
        if isinstance(s, KVLayerState):
            for buf in (s.k, s.v):
                ttnn.copy_host_to_device_tensor(
                    ttnn.from_torch(torch.zeros(list(buf.shape)), dtype=buf.dtype, layout=buf.layout,
                                    mesh_mapper=ttnn.ReplicateTensorToMesh(gen.mesh)), buf)
    be = TTSpecBackend(gen, "shadow_commit", drafter=lambda h, kk: rows[1:kk + 1], use_trace=False)
    be.join(0, prompt)
    be.history[-1] = rows[0]
    be.draft({0: 3})
    with gen.ctx.counters.scope("verify") as n:
        vout = be.verify(None)
    packed = gen.model.to_host(vout.out.logits).float().reshape(4, -1)
    be.release()
    assert float((packed - seq).abs().max()) <= 1e-6 and min(pcc(packed[j], seq[j]) for j in range(4)) >= 0.99999
    assert torch.equal(packed.argmax(-1), seq.argmax(-1))
    ops = dict(n.per_op)
    attention_layers = sum(1 for t in gen.model.args.cfg.layer_types if t == FULL)
    assert ops.get("ttnn.experimental.indexed_fused_update_cache") == attention_layers, ops
    assert "ttnn.experimental.paged_update_cache" not in ops, ops


@pytest.mark.parametrize("mech", ["shadow_commit", "snapshot"])
@pytest.mark.parametrize("k", [1, 3])
def test_spec_greedy_lossless_two_kv_heads(gen, plain, mech, k):
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain), use_trace=True)
    r = speculative_generate(be, [PROMPT], MAX_NEW, [k])[0]
    be.close()
    assert r.tokens == plain
    assert sum(1 for c in r.stats.histogram() if c) >= 2, f"acceptance lengths not mixed: {r.stats.histogram()}"
