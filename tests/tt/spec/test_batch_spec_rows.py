"""Users with different sampling settings in one TT speculative batch (tt/spec/spec_backend.py TTSpecBackend, host
rows, with ``stages``: per-user params on the device acceptor) on the emulated P150a x2 mesh, ci checkpoint.

Three users in one batch: a greedy one and two seeded sampled ones (one with top-k; one with top-p, a frequency
penalty and logprobs, joining two rounds later and sitting its join round out); two ask for logprobs. Each user's
tokens, accepted counts and logprobs (the raw log-softmax of its verify rows: a logits-level check, compared
exactly) equal the same user's run alone in a batch-1 backend with the same seed, and the greedy user's tokens its
plain batch-1 greedy output. Exact equality holds because each user's uniform stream is seeded per user and
advances once per step it is in, whatever its row, the batched verify's per-user logits are bit-equal to a batch-1
verify's (row-wise ops), and the per-row parameters are exact in fp32 (tests/tt/spec/test_accept_rows.py says why that
matters on the emulator).
"""
from __future__ import annotations

import pytest
import torch

from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.sampling import SamplingParams
from qwen36.testing.speculative import oracle_drafter
from qwen36.testing.tt import make_bf16_checkpoint
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.runtime.sampler_transform import SamplerStages
from qwen36.tt.spec.spec_backend import BatchSpecError, TTSpecBackend

N_NEW = 10
PROMPTS = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(s)).tolist()
           for n, s in ((5, 1), (12, 2), (3, 3))]
USERS = [SamplingParams(logprobs=1),
         SamplingParams(temperature=0.8, top_k=20, seed=11, draft="greedy"),
         SamplingParams(temperature=0.8, top_p=0.875, frequency_penalty=0.5, logprobs=2, seed=12, draft="greedy")]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ckpt = make_bf16_checkpoint(tmp_path_factory.mktemp("tt-batch-spec-rows") / "ci", "ci")
    g = TTGenerator.from_checkpoint(ckpt, "emulated-p150x2", precision="accuracy", max_seq_len=128, progress=False,
                                    block_size=32, prefill_chunk=64)
    yield g
    g.close()


def _drafter(plain):
    """Host drafter: user i's oracle drafts (its plain greedy continuation with deliberate misses), by prompt."""
    by_prompt = {tuple(p): oracle_drafter(p, pl) for p, pl in zip(PROMPTS, plain)}
    return lambda hist, k: next(d for p, d in by_prompt.items() if tuple(hist[: len(p)]) == p)(hist, k)


@pytest.mark.slow
def test_users_with_different_params_in_one_batch_equal_each_user_alone(gen):
    plain = []
    for p in PROMPTS:
        plain.append(gen.greedy(torch.tensor(p), N_NEW + 4))
        gen.release_trace()
    drafter = _drafter(plain)
    be = TTSpecBackend(gen, "snapshot", drafter=drafter, slots=3, k=1, stages=SamplerStages.of(USERS, 512))
    try:
        # the penalised user joins in round 2 and sits that round out: its token counts must not take the inert
        # rows' tokens
        got = speculative_generate(be, PROMPTS, N_NEW, [1, 1, 1], USERS, arrivals=[0, 0, 2])
        assert be.captures == 2  # one verify and one commit trace for the whole run
    finally:
        be.close()
    for u, (p, params) in enumerate(zip(PROMPTS, USERS)):
        alone = TTSpecBackend(gen, "snapshot", drafter=drafter, slots=1, k=1, params=params, rows="host")
        try:
            want = speculative_generate(alone, [p], N_NEW, [1], [params])[0]
        finally:
            alone.close()
        r = got[u]
        assert r.tokens == want.tokens, f"user {u} ({params.describe()})"
        assert r.stats.accepted == want.stats.accepted, f"user {u}"
        assert r.logprobs == want.logprobs and (r.logprobs is None) == (params.logprobs is None), f"user {u}"
    assert got[0].tokens == plain[0][:N_NEW]
    assert got[1].tokens != plain[1][:N_NEW] and got[2].tokens != plain[2][:N_NEW]  # the sampled users sampled
    assert any(a > 0 for r in got[1:] for a in r.stats.accepted)  # and accepted drafts
    assert all(lp.token == t for lp, t in zip(got[2].logprobs, got[2].tokens))


def test_per_user_params_refused_where_unsupported(gen):
    stages = SamplerStages.of([SamplingParams(temperature=0.8)], 512)
    be = TTSpecBackend(gen, drafter=lambda hist, k: [0] * k, slots=2, k=1, stages=stages, use_trace=False)
    try:
        with pytest.raises(BatchSpecError, match="needs greedy"):
            be.join(0, PROMPTS[0], SamplingParams())
        with pytest.raises(BatchSpecError, match="needs top_k"):
            be.join(0, PROMPTS[0], SamplingParams(temperature=0.8, top_k=5))
    finally:
        be.close()
    scalar = TTSpecBackend(gen, drafter=lambda hist, k: [0] * k, slots=2, k=1, use_trace=False)
    try:
        with pytest.raises(BatchSpecError, match="build it with stages"):
            scalar.join(0, PROMPTS[0], SamplingParams(temperature=0.7))
    finally:
        scalar.close()


class _DeviceDrafterShape:
    """Has the hooks by which TTSpecBackend recognises a packed device drafter (nothing runs: the refusals come
    before the generator is touched)."""

    def allocate(self, *a): ...
    def join(self, *a): ...
    def write_inputs(self, *a): ...
    def device_chain(self, *a): ...
    def device_reseed(self, *a): ...


def test_sampled_device_drafts_refused_where_the_batched_chain_cannot_draw_them():
    sampled = SamplingParams(temperature=0.8)
    with pytest.raises(BatchSpecError, match="per-user params draft by argmax"):
        TTSpecBackend(None, drafter=_DeviceDrafterShape(), slots=2, k=1, params=sampled,
                      stages=SamplerStages.of([sampled], 512))
    with pytest.raises(BatchSpecError, match="penalties with sampled device drafts"):
        TTSpecBackend(None, drafter=_DeviceDrafterShape(), slots=2, k=1,
                      params=SamplingParams(temperature=0.8, presence_penalty=0.5))
    # argmax drafts pass these checks (and then need a generator)
    with pytest.raises(AttributeError):
        TTSpecBackend(None, drafter=_DeviceDrafterShape(), slots=2, k=1,
                      params=SamplingParams(temperature=0.8, draft="greedy"), stages=SamplerStages.of([sampled], 512))


# ---- with the packed device MTP drafter, against the one-user layout --------------------------------------------
MTP_CKPT = "models/qwen36/default_checkpoint"  # trained, with MTP: its drafts are accepted
MTP_PROMPTS = [[1734, 4064, 17, 279, 1076], [4064, 17, 279, 1076, 4064, 17, 279], [17, 279, 1076]]
MTP_USERS = [SamplingParams(logprobs=2),
             SamplingParams(temperature=0.8, top_k=20, seed=3, draft="greedy"),
             SamplingParams(repetition_penalty=1.3, logprobs=1)]


@pytest.mark.slow
def test_per_user_params_with_the_device_drafter_equal_each_user_on_the_one_user_layout():
    """Three users (greedy with logprobs; sampled, argmax device drafts; greedy with a repetition penalty) in one
    B-slot backend with the packed device MTP (host rows, per-user params; 4 slots at K = 1, one free): each user's tokens, accepted counts and
    logprobs equal the same user run alone on the one-user layout (device rows, its own MTP head and acceptor seeded
    from the user's seed), exactly: the packed drafts equal one user's, per-user logits are row-wise, and each user's
    uniform stream follows its own seed and steps."""
    from qwen36.checkpoint import load_checkpoint
    from qwen36.testing.tt import small_tt_generator
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

    g = small_tt_generator(MTP_CKPT, prefill_chunk=64, require_mtp=True)
    reader = load_checkpoint(MTP_CKPT, require_mtp=True)
    try:
        be = TTSpecBackend(g, "snapshot", drafter=TTMTPDrafter(reader), slots=4, k=1,
                           stages=SamplerStages.of(MTP_USERS, g.model.args.cfg.vocab_size))
        try:
            got = speculative_generate(be, MTP_PROMPTS, N_NEW, [1, 1, 1], MTP_USERS)
        finally:
            be.close()
        for u, (p, params) in enumerate(zip(MTP_PROMPTS, MTP_USERS)):
            one = TTSpecBackend(g, "snapshot", drafter=TTMTPDrafter(reader))
            try:
                want = speculative_generate(one, [p], N_NEW, [1], [params])[0]
            finally:
                one.close()
            r = got[u]
            assert r.tokens == want.tokens, f"user {u} ({params.describe()})"
            assert r.stats.accepted == want.stats.accepted, f"user {u}"
            assert r.logprobs == want.logprobs and (r.logprobs is None) == (params.logprobs is None), f"user {u}"
        assert any(a > 0 for r in got for a in r.stats.accepted)  # the device drafts were accepted
    finally:
        g.close()
