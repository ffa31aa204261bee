"""Four dies (TP=4) on the emulated 1x4 P150a mesh, at CI size: the CI config with doubled heads
(``tp4_config``: 8 q / 4 KV attention heads, 4 / 12 GDN heads -> 2 / 1 and 1 / 3 per device).

Speculative greedy through the same TT code (packed K+1 verify, commit mechanisms, device MTP) must equal TT plain
greedy on the same mesh (lossless), and the logits must agree with the fp32 reference on the same weights.
Tolerances are those of tests/tt/model/test_model.py (``model_prefill``) and tests/tt/spec/test_spec_backend.py (verify vs decode)."""
from __future__ import annotations

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import speculative_generate
from qwen36.testing.speculative import oracle_drafter
from qwen36.testing.tt import make_bf16_checkpoint, tp4_config
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.testing.pcc import PCC_GATES, comp_pcc
from qwen36.tt.spec.spec_backend import TTSpecBackend

pytestmark = pytest.mark.slow  # one 1x4 mesh build and a few emulated generations: ~tens of seconds

PROMPT = list(range(5, 17))
MAX_NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tp4") / "ci4", tp4_config(), seed=1)


@pytest.fixture(scope="module")
def gen(ckpt):
    g = TTGenerator.from_checkpoint(ckpt, "emulated-p150x4", precision="accuracy", max_seq_len=128, progress=False,
                                    block_size=32, prefill_chunk=64, require_mtp=True)
    a = g.model.args
    assert g.ctx.num_devices == 4 and (a.hq_d, a.hkv_d) == (2, 1), (g.ctx.num_devices, a.hq_d, a.hkv_d)
    yield g
    g.close()


@pytest.fixture(scope="module")
def plain(gen):
    out = gen.generate([PROMPT], MAX_NEW)[0].tokens
    gen.release_trace()
    return out


def test_tp4_logits_pcc_vs_reference(gen, ckpt):
    """Prefill logits of every row of a 40-token prompt (one partial 64-row chunk) against the fp32 reference."""
    ref = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    got = gen.teacher_forced_logits(ids)
    exp = ref(ids[None], ref.new_state(1, 64)).logits[0]
    ok, msg = comp_pcc(exp, got.reshape(exp.shape), PCC_GATES["model_prefill"])
    assert ok, f"TP=4 prefill logits: {msg}"
    # counted in integers: 36 of 40 rows is the 90% floor, but its fp32 mean (0.89999998) compares below 0.9
    agree, rows = int((exp.argmax(-1) == got.reshape(exp.shape).argmax(-1)).sum()), exp.shape[0]
    assert agree * 10 >= rows * 9, f"TP=4 argmax agrees with the reference on only {agree} of {rows} rows"


@pytest.mark.parametrize("mech,k", [("shadow_commit", 3), ("snapshot", 2)])
def test_tp4_spec_greedy_equals_plain_host_drafter(gen, plain, mech, k):
    """Drafts with deliberate misses, so steps accept mixed lengths: the committed state after a partial accept
    must continue exactly like plain decoding."""
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain), use_trace=True)
    r = speculative_generate(be, [PROMPT], MAX_NEW, [k])[0]
    be.close()
    assert r.tokens == plain
    assert sum(1 for c in r.stats.histogram() if c) >= 2, f"acceptance lengths not mixed: {r.stats.histogram()}"


def test_tp4_spec_greedy_equals_plain_device_mtp(gen, ckpt, plain):
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

    be = TTSpecBackend(gen, "shadow_commit", drafter=TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True)),
                       use_trace=True)
    r = speculative_generate(be, [PROMPT], MAX_NEW, [3])[0]
    be.close()
    assert r.tokens == plain
