"""The TT speculative backend (tt/spec/spec_backend.py ``TTSpecBackend``) on the emulated P150a x2 mesh, ci checkpoint:
one user (``slots=1``: the device-rows layout) and B slots (host rows: one packed B x (K+1) verify per step over
TTBatchDecoder's slots, per-user on-device acceptance and commit). Where a property is per user the same test runs
at B = 1 and at B >= 2 users in one backend.

* lossless: every user's speculative greedy output equals its own plain batch-1 TT greedy output, every mechanism:
  B = 1 at K = 1 (K = 3, 7 slow), with the mechanism's counters; B = 4 (prompts of different lengths, different
  draft depths, a user joining mid-run) with two traces for the whole run; B = 8 at K = 3 (32 rows, slow
  tier), with two users' committed state vs their single-user runs;
* B = 1: the traced step equals the untraced step bit for bit; verify and decode agree on shared rows; the GDN
  state-bytes formula; verify shapes the kernel cannot run are refused; the verify-tp probe at CI size (slow);
* state: each user's committed GDN recurrent, conv and KV rows equal its own single-user TT speculative run
  (TTSpecBackend with the same drafts), within BATCH_VS_SINGLE_MAX_ABS; a user sitting a step out is bit-unchanged;
  a NaN-poisoned free slot never reaches a user; abort after verify restores every user (B = 1 and 4);
* the batched verify's logits track the reference ReferenceBackend's packed verify (PCC per real row);
* stochastic: each user's first emitted token follows its own target distribution (chi-square, B = 4);
* per-user params (``stages``): a greedy user and two seeded sampled ones (one with top-k; one with top-p, a
  frequency penalty and logprobs, joining two rounds later and sitting its join round out; two ask for logprobs)
  in one batch: each user's tokens, accepted counts and logprobs (the raw log-softmax of its verify rows: a
  logits-level check, compared exactly) equal the same user's run alone in a batch-1 backend with the same seed,
  and the greedy user's tokens its plain batch-1 greedy output. Exact equality holds because each user's uniform
  stream is seeded per user and advances once per step it is in, whatever its row, the batched verify's per-user
  logits are bit-equal to a batch-1 verify's (row-wise ops), and the per-row parameters are exact in fp32
  (tests/tt/spec/test_accept.py says why that matters on the emulator); with the packed device MTP drafter, the
  same against the one-user layout; where per-user params are unsupported they are refused.
"""
from __future__ import annotations

import math

import pytest
import torch

from qwen36.probes.gdn_transaction_tp_checks import gdn_host_batch1, kv_host
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import SpecBackend, speculative_generate
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.reference_backend import ReferenceBackend, ReferenceDraft as RefBatchDraft
from qwen36.generation.sampling import SamplingParams, probs_from_logits
from qwen36.testing.pcc import comp_pcc, pcc
from qwen36.testing.speculative import oracle_drafter
from qwen36.testing.tt import device_position, make_bf16_checkpoint
from qwen36.testing.tt_batch import poison_slot
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.runtime.sampler_transform import SamplerStages
from qwen36.tt.spec.mechanisms import GDNStateBytes
from qwen36.tt.spec.spec_backend import BatchSpecError, TTSpecBackend
from qwen36.tt.spec.verify import VerifyShapeError, check_verify_shape

# Batched vs batch-1 on the same TT graph: row-wise ops see the same tiles (measured: bit-equal); a cross-user
# leak or a wrong row select would be O(1).
BATCH_VS_SINGLE_MAX_ABS = 1e-4
TT_VS_REF_PCC = 0.99  # TT (accuracy preset, bf16 weights) vs the fp32 reference, as tests/tt/model/test_model.py
N_NEW = 12
# the one-user runs' prompt and length
PROMPT = list(range(5, 17))
MAX_NEW = 24


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(5, 1), prompt(12, 2), prompt(3, 3), prompt(9, 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-spec-backend") / "ci", "ci")


@pytest.fixture(scope="module")
def gen(ckpt):
    g = TTGenerator.from_checkpoint(ckpt, "emulated-p150x2", precision="accuracy", max_seq_len=256, progress=False,
                                    block_size=32, prefill_chunk=64)
    yield g
    g.close()


@pytest.fixture(scope="module")
def plain(gen):
    """Plain batch-1 TT greedy output of every prompt."""
    out = []
    for p in PROMPTS:
        out.append(gen.generate([torch.tensor(p)], N_NEW + 8)[0].tokens)
        gen.release_trace()
    return out


@pytest.fixture(scope="module")
def plain_one(gen):
    """Plain batch-1 TT greedy output of PROMPT (the one-user runs)."""
    out = gen.generate([PROMPT], MAX_NEW)[0].tokens
    gen.release_trace()
    return out


def users_drafter(plain, prompts=PROMPTS):
    """One host drafter for every user: the oracle drafter (deliberate misses) of the user whose prompt starts the
    history (``plain[i]`` is the plain greedy output of ``prompts[i]``)."""
    by_prompt = {tuple(p): oracle_drafter(p, pl) for p, pl in zip(prompts, plain)}

    def draft(hist, k):
        for p, d in by_prompt.items():
            if tuple(hist[: len(p)]) == p:
                return d(hist, k)
        raise KeyError("history of no known prompt")

    return draft


# ---- lossless -------------------------------------------------------------------------------------------------
# B = 1: the one-user layout on PROMPT at K = 1 (K = 3, 7 in the slow tier); B = 4: four slots at K = 3 (users
# with fewer drafts, a join mid-run; B = 2 would repeat it with fewer users; B = 8 is the slow test further down)
LOSSLESS = [(1, 1), pytest.param(1, 3, marks=pytest.mark.slow), pytest.param(1, 7, marks=pytest.mark.slow), (4, 3)]


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("b,k", LOSSLESS)
def test_speculative_greedy_is_lossless(gen, plain, plain_one, mech, b, k):
    """Every user's tokens equal its plain batch-1 greedy output; one target forward per step.
    B = 1 (one-user layout, oracle drafts of PROMPT at depth k): acceptance lengths are mixed, the mechanism's
    counters (GDN state copies per step, shadow-slot bytes) are its own.
    B = 4 (K = 3): prompts of lengths 5/12/3/9, depths 3/1/2/3 (users with fewer drafts have inert rows), the
    last user joining in round 2 while the others step (it sits its join round out); both commit branches
    (a = 0, a = k_b) ran; steps were shared; the whole run captured one verify and one commit trace (joins and
    leaves did not retrace)."""
    if b == 1:
        prompts, depths, arrivals, n, want = [PROMPT], [k], None, MAX_NEW, [plain_one]
        be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain_one), use_trace=True)
    else:
        prompts, depths, arrivals, n = PROMPTS[:b], [3, 1, 2, 3][:b], [0] * (b - 1) + [2], N_NEW
        want = [p[:N_NEW] for p in plain[:b]]
        be = TTSpecBackend(gen, mech, slots=b, k=k, drafter=users_drafter(plain))
    try:
        assert isinstance(be, SpecBackend)
        got = speculative_generate(be, prompts, n, depths, [SamplingParams()] * b, arrivals=arrivals)
    finally:
        be.close()
    for u, r in enumerate(got):
        assert r.tokens == want[u], f"user {u}"
    c = be.counters
    assert c.target_forwards == c.steps
    if b == 1:
        (r,) = got
        hist = r.stats.histogram()
        assert sum(1 for x in hist if x) >= 2, f"acceptance lengths not mixed: {hist}"
        n_gdn = len(gen.state.gdn_states())
        assert c.steps == r.stats.steps
        assert c.state_copies == {"shadow_commit": 0, "snapshot": 2 * n_gdn, "recompute": n_gdn}[mech] * c.steps
        assert (c.slot_bytes_written > 0) == (mech == "shadow_commit")
    else:
        steps = [(a, kb) for r in got for a, kb in zip(r.stats.accepted, r.stats.depths)]
        assert any(a == 0 for a, _ in steps) and any(a == kb for a, kb in steps), steps
        assert c.steps < sum(r.stats.steps for r in got)  # steps were shared
        assert be.captures == 2 and not be.users


# ---- one user: the traced step, verify vs decode, verify shapes ----------------------------------------------
def _run_recording(gen, plain_one, mech, k, steps, use_trace):
    """Run `steps` spec steps; record per-step verify logits + acceptor result (host reads after each step)."""
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain_one), use_trace=use_trace)
    be.join(0, PROMPT)
    logits, accs = [], []
    for _ in range(steps):
        d = be.draft({0: k})
        v = be.verify(d)
        logits.append(gen.model.to_host(v.out.logits).clone())
        acc = be.accept(d, v)[0]
        be.commit({0: acc})
        accs.append((acc.num_accepted, acc.tokens))
    pos = device_position(be)
    n_traces = len(be.traces)
    be.close()
    return logits, accs, pos, n_traces


@pytest.mark.parametrize("mech", ["shadow_commit", pytest.param("snapshot", marks=pytest.mark.slow)])
def test_traced_step_equals_untraced_bitwise(gen, plain_one, mech):
    steps = 22
    lt, at, pt, nt = _run_recording(gen, plain_one, mech, 2, steps, True)
    le, ae, pe, ne = _run_recording(gen, plain_one, mech, 2, steps, False)
    assert nt == 2 and ne == 0  # verify+accept and commit traces were captured and replayed
    assert at == ae and pt == pe
    assert len({a for a, _ in at}) >= 2, "acceptance lengths must be mixed"
    for x, y in zip(lt, le):
        assert torch.equal(x, y)
    # replays saw new inputs: the emitted tokens follow the plain sequence, not a frozen first step
    emitted = [t for _, ts in at for t in ts][: len(plain_one) - 1]
    assert emitted == plain_one[1:1 + len(emitted)]


def test_verify_vs_decode_shared_rows(gen):
    """Decode (1 row) and verify (K+1 rows) on the same rows: logits bit-equal on the emulator (tolerance
    stated: max abs <= 1e-6, PCC >= 0.99999), GDN per-token states PCC >= 0.99999."""
    from qwen36.probes.verify_tp import run_case

    c = run_case(gen, 3, PROMPT, [7, 99, 250, 3])
    assert c["logits_max_abs"] <= 1e-6 and c["logits_pcc_min"] >= 0.99999 and c["argmax_equal"]
    assert c["gdn_state_pcc_min"] >= 0.99999 and c["gdn_state_max_abs"] <= 1e-5


def test_state_bytes_formula_matches_the_allocated_state(gen):
    """The one GDN state-bytes formula (counters, probes) == the logical fp32 bytes of the allocated per-device state
    (the emulator's ``bytes_per_device`` also counts tile padding: 16x16 heads at the CI size pad to 32x32)."""
    ttnn, gdn = gen.ttnn, gen.state.gdn_states()
    nbytes = GDNStateBytes.of(gen.model.args, len(gdn))
    assert all(s.recurrent.dtype == s.conv.dtype == ttnn.float32 for s in gdn)
    assert nbytes.recurrent == sum(math.prod(s.recurrent.shape) * 4 for s in gdn) > 0
    assert nbytes.conv == sum(math.prod(s.conv.shape) * 4 for s in gdn) > 0


def test_refuses_shapes_the_kernel_cannot_run(gen):
    args = gen.model.args
    check_verify_shape(args, 7)
    from dataclasses import replace

    big = replace(args, cfg=replace(args.cfg, head_dim=256))
    with pytest.raises(VerifyShapeError, match="limit of 11"):
        check_verify_shape(big, 11)
    with pytest.raises(VerifyShapeError, match=">= 1"):
        check_verify_shape(args, 0)


@pytest.mark.slow
def test_probe_verify_tp_ci(gen):
    from qwen36.probes.verify_tp import run_matrix

    cells = run_matrix(gen, ks=(1, 3))
    assert all(c["pass"] for c in cells), cells


# ---- committed state vs the single-user TT run ------------------------------------------------------------------
def single_user_state(gen, plain, p, k, steps, prompts=PROMPTS):
    """TTSpecBackend (snapshot: the committed state is the live state) run ``steps`` steps at depth k with the
    oracle drafts: (history, [(recurrent, conv)] per GDN layer, KV rows)."""
    be = TTSpecBackend(gen, "snapshot", drafter=users_drafter(plain, prompts), use_trace=False)
    try:
        be.join(0, p)
        for _ in range(steps):
            d = be.draft({0: k})
            v = be.verify(d)
            be.commit(be.accept(d, v))
        return list(be.history), gdn_host_batch1(gen.ttnn, gen.state), kv_host(gen.ttnn, gen.state, 0, be.n)
    finally:
        be.close()
        gen.reset()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = float((got - want).abs().max())
    assert diff <= BATCH_VS_SINGLE_MAX_ABS, f"{what}: max abs {diff}"
    if want.abs().max() > 0:
        assert pcc(want, got) >= 0.9999, f"{what}: PCC {pcc(want, got)}"


@pytest.mark.parametrize("mech", MECHANISMS)
def test_committed_state_equals_single_user_run(gen, plain, mech):
    """Users 0 and 1 (depths 2 and 1) step 4 times together, user 2 sits out the last two steps (its state must
    stay bit-identical), slot 3 is free and NaN-poisoned throughout. Then each stepping user's GDN recurrent, conv
    and KV rows 0..n-1 equal its single-user TT speculative run of the same steps; every logit is finite."""
    depths = {0: 2, 1: 1, 2: 3}
    be = TTSpecBackend(gen, mech, slots=4, k=3, drafter=users_drafter(plain), use_trace=True)
    try:
        for s in depths:
            be.join(s, PROMPTS[s])
        poison_slot(be.decoder, 3)
        for step in range(4):
            step_depths = depths if step < 2 else {0: 2, 1: 1}
            if step == 2:
                before = be.committed_gdn(2)
            d = be.draft(step_depths)
            v = be.verify(d)
            assert be.verify_logits()[list(step_depths)].isfinite().all()
            be.commit(be.accept(d, v))
        after = be.committed_gdn(2)
        for (r0, c0), (r1, c1) in zip(before, after):
            assert torch.equal(r0, r1) and torch.equal(c0, c1), "a user sitting out had its GDN state changed"
        assert be.captures == 2
        ttnn, hv = gen.ttnn, gen.model.args.gdn_hv_d
        if not be.mechanism.ring:  # the free slot still holds its poison (only its own rows could write it)
            for st in be.decoder.state.gdn_states():
                assert ttnn.to_torch(ttnn.get_device_tensors(st.recurrent)[0])[3 * hv:].isnan().all()
        got = {s: (list(be.users[s].history), be.position(s), be.committed_gdn(s),
                   kv_host(ttnn, be.decoder.state, s, be.position(s))) for s in depths}
    finally:
        be.close()  # its traces are released before the single-user runs allocate
    for s, steps in ((0, 4), (1, 4), (2, 2)):
        hist, pos, gdn_b, kv_b = got[s]
        want_hist, gdn, kv = single_user_state(gen, plain, PROMPTS[s], depths[s], steps)
        assert hist == want_hist, f"user {s}"
        assert pos == len(hist) - 1
        for i, ((r, c), (rw, cw)) in enumerate(zip(gdn_b, gdn)):
            assert_close(r, rw, f"user {s} GDN layer {i} recurrent")
            assert_close(c, cw, f"user {s} GDN layer {i} conv")
        assert len(kv_b) == len(kv) > 0
        for i, (g, w) in enumerate(zip(kv_b, kv)):
            assert_close(g, w, f"user {s} KV tensor {i}")


# ---- B = 8: the widest batch the packed verify takes at K = 3 (8 x 4 = 32 rows) ----------------------------------
PROMPTS8 = PROMPTS + [prompt(7, 5), prompt(2, 6), prompt(15, 7), prompt(6, 8)]


@pytest.fixture(scope="module")
def plain8(gen, plain):
    """Plain batch-1 TT greedy output of every prompt of PROMPTS8."""
    out = list(plain)
    for p in PROMPTS8[len(plain):]:
        out.append(gen.generate([torch.tensor(p)], N_NEW + 8)[0].tokens)
        gen.release_trace()
    return out


@pytest.mark.slow
def test_batched_speculative_greedy_b8_is_lossless_and_matches_single_user_state(gen, plain8):
    """B = 8 users at K = 3 (32 verify rows: the bound of the decode-path attention), shadow_commit, prompts of
    2..15 tokens, depths 3/1/2/3/2/3/1/3, users 5..7 joining in rounds 1 and 2 while the others step: every user's
    tokens equal its plain batch-1 greedy output, and the run captured one verify and one commit trace. Then the
    same backend (no retrace) takes eight users again and steps them 3 times together: users 1 (depth 1) and 6
    (depth 3, the longest prompt) have GDN recurrent, conv and KV rows within BATCH_VS_SINGLE_MAX_ABS (and PCC
    >= 0.9999) of their own single-user TT speculative runs of the same steps."""
    b = len(PROMPTS8)
    depths = [3, 1, 2, 3, 2, 3, 1, 3]
    arrivals = [0, 0, 0, 0, 0, 1, 2, 2]
    be = TTSpecBackend(gen, "shadow_commit", slots=b, k=3, drafter=users_drafter(plain8, PROMPTS8))
    try:
        got = speculative_generate(be, PROMPTS8, N_NEW, depths, [SamplingParams()] * b, arrivals=arrivals)
        for u, r in enumerate(got):
            assert r.tokens == plain8[u][:N_NEW], f"user {u}"
        steps = [(a, k) for r in got for a, k in zip(r.stats.accepted, r.stats.depths)]
        assert any(a == 0 for a, _ in steps) and any(a == k for a, k in steps), steps
        assert be.counters.steps < sum(r.stats.steps for r in got)
        assert be.captures == 2 and not be.users

        for s, p in enumerate(PROMPTS8):
            be.join(s, p)
        for _ in range(3):
            d = be.draft(dict(enumerate(depths)))
            be.commit(be.accept(d, be.verify(d)))
        assert be.captures == 2
        checked = (1, 6)
        got_state = {s: (list(be.users[s].history), be.committed_gdn(s),
                         kv_host(gen.ttnn, be.decoder.state, s, be.position(s))) for s in checked}
    finally:
        be.close()  # its traces are released before the single-user runs allocate
    for s in checked:
        hist, gdn_b, kv_b = got_state[s]
        want_hist, gdn, kv = single_user_state(gen, plain8, PROMPTS8[s], depths[s], 3, PROMPTS8)
        assert hist == want_hist, f"user {s}"
        for i, ((r, c), (rw, cw)) in enumerate(zip(gdn_b, gdn)):
            assert_close(r, rw, f"user {s} GDN layer {i} recurrent")
            assert_close(c, cw, f"user {s} GDN layer {i} conv")
        assert len(kv_b) == len(kv) > 0
        for i, (g, w) in enumerate(zip(kv_b, kv)):
            assert_close(g, w, f"user {s} KV tensor {i}")


@pytest.mark.parametrize("b", [1, 4])
def test_abort_after_verify_restores(gen, plain, plain_one, b):
    """snapshot: a step aborted after verify (B = 1: one-user layout, depth 3) or after accept (B = 4 at K = 3:
    depths 3/1/2/3) leaves every user's committed GDN state bit-identical; B = 1 then goes on to its plain greedy output (the
    abort also rewound the device-held position); shadow_commit refuses an abort after verify."""
    if b == 1:
        be = TTSpecBackend(gen, "snapshot", drafter=oracle_drafter(PROMPT, plain_one), use_trace=False)
        prompts, depths = [PROMPT], {0: 3}
    else:
        be = TTSpecBackend(gen, "snapshot", slots=b, k=3, drafter=users_drafter(plain), use_trace=False)
        prompts, depths = PROMPTS[:b], {0: 3, 1: 1, 2: 2, 3: 3}
    try:
        for s, p in enumerate(prompts):
            be.join(s, p)
        before = [be.committed_gdn(s) for s in depths]
        d = be.draft(depths)
        v = be.verify(d)
        if b > 1:
            be.accept(d, v)
        be.abort()
        for s in depths:
            for (r0, c0), (r1, c1) in zip(before[s], be.committed_gdn(s)):
                assert torch.equal(r0, r1) and torch.equal(c0, c1), f"user {s}"
        if b == 1:
            r_tokens = []
            while len(r_tokens) < 12:
                d = be.draft(depths)
                acc = be.accept(d, be.verify(d))[0]
                be.commit({0: acc})
                r_tokens += acc.tokens
            assert r_tokens[:12] == plain_one[1:13]
    finally:
        be.close()
    if b == 1:
        sh = TTSpecBackend(gen, "shadow_commit", drafter=oracle_drafter(PROMPT, plain_one), use_trace=False)
    else:
        sh = TTSpecBackend(gen, "shadow_commit", slots=b, k=3, drafter=users_drafter(plain), use_trace=False)
    try:
        sh.join(0, prompts[0])
        sh.verify(sh.draft({0: 2}))
        with pytest.raises(RuntimeError, match="shadow_commit: abort after verify is impossible"):
            sh.abort()
    finally:
        sh.close()


def test_refuses_what_it_cannot_serve(gen, plain):
    be = TTSpecBackend(gen, slots=2, k=2, drafter=users_drafter(plain), use_trace=False)
    try:
        be.join(0, PROMPTS[0])
        with pytest.raises(BatchSpecError, match="outside 1..2"):
            be.draft({0: 3})
        with pytest.raises(ValueError, match="no user"):
            be.draft({1: 1})
        with pytest.raises(BatchSpecError, match="differ from the backend"):
            be.join(1, PROMPTS[1], SamplingParams(temperature=0.7))
    finally:
        be.close()
    with pytest.raises(BatchSpecError, match="host drafter"):
        TTSpecBackend(gen, slots=2, k=2)
    with pytest.raises(BatchSpecError, match="multiple of 8"):  # 3 x 4 = 12 rows: no per-row core grid
        TTSpecBackend(gen, slots=3, k=3, drafter=users_drafter(plain))
    with pytest.raises(BatchSpecError, match="at most 32"):
        TTSpecBackend(gen, slots=8, k=4, drafter=users_drafter(plain))
    # penalties and logprobs are per user now, and per-user params need stages (the per-user params tests below)


def test_capped_accept_verifies_the_callers_drafts(gen, plain):
    """capped_accept (the vLLM verify): the caller's drafts replace the step's, acceptance stops at their count even
    where the step's own drafts would have gone on, and the target's argmax ids of every row come back."""
    with pytest.raises(ValueError, match="capped_accept=True"):
        be = TTSpecBackend(gen, drafter=users_drafter(plain), use_trace=False)
        try:
            be.join(0, PROMPTS[0])
            be.draft({0: 3})
            be.cap_drafts({0: []})
        finally:
            be.close()
    with pytest.raises(NotImplementedError, match="one-user layout"):
        TTSpecBackend(gen, slots=2, k=2, drafter=users_drafter(plain), capped_accept=True)
    be = TTSpecBackend(gen, drafter=lambda history, k: [0] * k, use_trace=False, capped_accept=True)
    try:
        with pytest.raises(NotImplementedError, match="verifies greedily"):
            be.join(0, PROMPTS[0], SamplingParams(temperature=0.7))
        want = plain[0]
        assert be.join(0, PROMPTS[0]) == want[0]
        with pytest.raises(RuntimeError, match="between draft\\(\\) and verify"):
            be.cap_drafts({0: want[1:3]})
        d = be.draft({0: 3})
        assert be.draft_ids(0) == [0, 0, 0]  # the host drafter's
        with pytest.raises(RuntimeError, match="cap_drafts\\(\\) between"):
            be.verify(d)
        with pytest.raises(ValueError, match="4 drafts for a step of depth 3"):
            be.cap_drafts({0: want[1:5]})
        be.cap_drafts({0: want[1:3]})  # two right drafts of three: the third column must not be accepted
        acc = be.accept(d, be.verify(d))[0]
        assert (acc.num_accepted, acc.tokens) == (2, want[1:4])
        ids = be.verify_ids(0)
        assert ids.tolist()[:3] == want[1:4] and torch.equal(ids, be.verify_logits()[0].argmax(-1))
        be.commit({0: acc})
        with pytest.raises(NotImplementedError, match="capped_accept"):
            be.inject({0: [1]}, {0: 3})
    finally:
        be.close()


# ---- vs the reference batched backend ---------------------------------------------------------------------------
def test_verify_logits_track_reference_batch_backend(gen, ckpt):
    """The same prompts and forced drafts through one packed verify on TT and on the reference ReferenceBackend
    (users with depths 3 and 1, a third sitting out): PCC of every real row's logits >= TT_VS_REF_PCC.

    Both backends must first emit the same token at join, so these prompts (PROMPTS' lengths, other seeds) have a
    reference top-2 gap >= 0.3 at their last row; PROMPTS[0] and [1] have 0.013 and 0.016 there, near-ties that TT's
    bf16 arithmetic may order otherwise."""
    prompts = [prompt(5, 21), prompt(12, 20), prompt(3, 20)]
    forced = {0: [7, 8, 9], 1: [11]}
    be = TTSpecBackend(gen, "snapshot", slots=4, k=3, drafter=lambda h, k: forced[0 if len(h) == 6 else 1][:k],
                            use_trace=False)
    ref = ReferenceBackend(Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32), "snapshot", max_len=64, slots=4,
                           max_k=3)
    try:
        for s in range(3):
            assert be.join(s, prompts[s]) == ref.join(s, prompts[s])
        depths = {0: 3, 1: 1}
        be.verify(be.draft(depths))
        tt = be.verify_logits()
        ref.draft(depths)  # opens the reference step; its verify then runs the forced drafts (as its probe does)
        rv = ref.verify(RefBatchDraft(depths, {s: torch.tensor([forced[s]]) for s in depths}, {s: None for s in depths}))
        for s, k in depths.items():
            for j in range(k + 1):
                ok, msg = comp_pcc(rv.logits[s, j].float(), tt[s, j], TT_VS_REF_PCC)
                assert ok, f"user {s} row {j}: {msg}"
    finally:
        be.close()


# ---- stochastic -------------------------------------------------------------------------------------------------
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (bins with expected count < 5 are pooled)."""
    n = float(counts.sum())
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    ex = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = ex > 0
    stat = float(((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty normal approximation of the chi-square tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.slow
def test_stochastic_first_token_follows_each_users_target(gen, plain):
    """B = 4 users (temperature 1, top_k 6), depths 3/2/1/3 drafted by the greedy oracle: speculative sampling makes each
    user's first emitted token follow p_target(row 0) exactly, whatever the drafts. The same step is repeated
    N times from the same state (snapshot abort + a fresh uniform table each time) and each user's histogram is
    chi-square tested against its own p_target computed on the host from the verify logits (p > 1e-3)."""
    params = SamplingParams(temperature=1.0, top_k=6, seed=5)
    be = TTSpecBackend(gen, "snapshot", slots=4, k=3, drafter=users_drafter(plain), params=params, rng="host")
    n = 150
    try:
        for s in range(4):
            be.join(s, PROMPTS[s], params)
        # the drafts come from the history, which a join's sampled first token changes: fix it to the greedy one
        for s in range(4):
            be.users[s].history[-1] = plain[s][0]
        depths = {0: 3, 1: 2, 2: 1, 3: 3}
        counts = torch.zeros(4, 512)
        accepted = 0
        target = None
        for _ in range(n):
            d = be.draft(depths)
            v = be.verify(d)
            if target is None:
                logits = be.verify_logits()[:, 0]
                target = probs_from_logits(logits, params)
            acc = be.accept(d, v)
            for s, a in acc.items():
                counts[s, a.tokens[0]] += 1
                accepted += a.num_accepted
            be.abort()
            be.acceptor.refill_rng()
        assert accepted > 0
        for s in range(4):
            p = chi_square_p_value(counts[s], target[s])
            assert p > 1e-3, f"user {s}: chi-square p {p:.2e}; counts {counts[s][counts[s] > 0].tolist()}"
            assert counts[s][target[s] == 0].sum() == 0  # nothing outside the top-k support
    finally:
        be.close()


# ---- the batched TT transaction probe (gdn-transaction-tp --batch B) ----------------------------------------------
@pytest.mark.slow
def test_probe_tp_batch_cell_passes_and_catches_a_broken_commit(gen, monkeypatch):
    """One cell of `qwen36 probe gdn-transaction-tp --batch 4` (K = 3, snapshot: users at a = 0 and a = K, one with
    fewer drafts, one sitting out, NaN-poisoned free slots) passes against each user's batch-1 TT oracle; the same
    cell with the commit's masked re-advance dropped (live keeps the state after all K+1 rows) fails."""
    from qwen36.probes import gdn_transaction_tp as probe
    from qwen36.tt.spec import commit as commit_module

    cells, _ = probe.run_tp_batch_matrix(gen, batch=4, ks=(3,), mechanisms=("snapshot",))
    cell = cells[0]
    assert cell["pass"], cell["failed"]
    assert [u.get("accepted") for u in cell["users"]] == [0, 3, 2, None]
    assert cell["slots"] == 6 and cell["captures"] == 2
    real = commit_module.commit_gdn_layers
    monkeypatch.setattr(commit_module, "commit_gdn_layers", lambda st, records, idx, mask: real(st, records, idx, None))
    broken, _ = probe.run_tp_batch_matrix(gen, batch=4, ks=(3,), mechanisms=("snapshot",))
    # the drive steps already diverge from the plain greedy output (or, if not, the state check fails)
    assert not broken[0]["pass"], broken[0]
    assert any(f.startswith(("lossless:", "user0:gdn_recurrent", "continuation:")) for f in broken[0]["failed"])
    for f in broken[0]["failed"]:  # a token failure says whether it is a near tie (the reference's top-2 margin)
        if f.startswith(("lossless:", "continuation:")):
            assert "reference top-2 margin" in f, f


# ---- per-user params (stages) in one batch == each user alone at B = 1 -------------------------------------------
ROWS_N_NEW = 10
ROWS_PROMPTS = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(s)).tolist()
           for n, s in ((5, 1), (12, 2), (3, 3))]
ROWS_USERS = [SamplingParams(logprobs=1),
         SamplingParams(temperature=0.8, top_k=20, seed=11, draft="greedy"),
         SamplingParams(temperature=0.8, top_p=0.875, frequency_penalty=0.5, logprobs=2, seed=12, draft="greedy")]


def _rows_drafter(plain):
    """Host drafter: user i's oracle drafts (its plain greedy continuation with deliberate misses), by prompt."""
    by_prompt = {tuple(p): oracle_drafter(p, pl) for p, pl in zip(ROWS_PROMPTS, plain)}
    return lambda hist, k: next(d for p, d in by_prompt.items() if tuple(hist[: len(p)]) == p)(hist, k)


@pytest.mark.slow
def test_users_with_different_params_in_one_batch_equal_each_user_alone(gen):
    plain = []
    for p in ROWS_PROMPTS:
        plain.append(gen.generate([torch.tensor(p)], ROWS_N_NEW + 4)[0].tokens)
        gen.release_trace()
    drafter = _rows_drafter(plain)
    be = TTSpecBackend(gen, "snapshot", drafter=drafter, slots=3, k=1, stages=SamplerStages.of(ROWS_USERS, 512))
    try:
        # the penalised user joins in round 2 and sits that round out: its token counts must not take the inert
        # rows' tokens
        got = speculative_generate(be, ROWS_PROMPTS, ROWS_N_NEW, [1, 1, 1], ROWS_USERS, arrivals=[0, 0, 2])
        assert be.captures == 2  # one verify and one commit trace for the whole run
    finally:
        be.close()
    for u, (p, params) in enumerate(zip(ROWS_PROMPTS, ROWS_USERS)):
        alone = TTSpecBackend(gen, "snapshot", drafter=drafter, slots=1, k=1, params=params, rows="host")
        try:
            want = speculative_generate(alone, [p], ROWS_N_NEW, [1], [params])[0]
        finally:
            alone.close()
        r = got[u]
        assert r.tokens == want.tokens, f"user {u} ({params.describe()})"
        assert r.stats.accepted == want.stats.accepted, f"user {u}"
        assert r.logprobs == want.logprobs and (r.logprobs is None) == (params.logprobs is None), f"user {u}"
    assert got[0].tokens == plain[0][:ROWS_N_NEW]
    assert got[1].tokens != plain[1][:ROWS_N_NEW] and got[2].tokens != plain[2][:ROWS_N_NEW]  # the sampled users sampled
    assert any(a > 0 for r in got[1:] for a in r.stats.accepted)  # and accepted drafts
    assert all(lp.token == t for lp, t in zip(got[2].logprobs, got[2].tokens))


def test_per_user_params_refused_where_unsupported(gen):
    stages = SamplerStages.of([SamplingParams(temperature=0.8)], 512)
    be = TTSpecBackend(gen, drafter=lambda hist, k: [0] * k, slots=2, k=1, stages=stages, use_trace=False)
    try:
        with pytest.raises(BatchSpecError, match="needs greedy"):
            be.join(0, ROWS_PROMPTS[0], SamplingParams())
        with pytest.raises(BatchSpecError, match="needs top_k"):
            be.join(0, ROWS_PROMPTS[0], SamplingParams(temperature=0.8, top_k=5))
    finally:
        be.close()
    scalar = TTSpecBackend(gen, drafter=lambda hist, k: [0] * k, slots=2, k=1, use_trace=False)
    try:
        with pytest.raises(BatchSpecError, match="build it with stages"):
            scalar.join(0, ROWS_PROMPTS[0], SamplingParams(temperature=0.7))
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
            got = speculative_generate(be, MTP_PROMPTS, ROWS_N_NEW, [1, 1, 1], MTP_USERS)
        finally:
            be.close()
        for u, (p, params) in enumerate(zip(MTP_PROMPTS, MTP_USERS)):
            one = TTSpecBackend(g, "snapshot", drafter=TTMTPDrafter(reader))
            try:
                want = speculative_generate(one, [p], ROWS_N_NEW, [1], [params])[0]
            finally:
                one.close()
            r = got[u]
            assert r.tokens == want.tokens, f"user {u} ({params.describe()})"
            assert r.stats.accepted == want.stats.accepted, f"user {u}"
            assert r.logprobs == want.logprobs and (r.logprobs is None) == (params.logprobs is None), f"user {u}"
        assert any(a > 0 for r in got for a in r.stats.accepted)  # the device drafts were accepted
    finally:
        g.close()
