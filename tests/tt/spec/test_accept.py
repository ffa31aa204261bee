"""On-device acceptance (models/qwen36/tt/spec/accept.py ``DeviceAcceptor``, one user or B rows) on the emulated 1x2
P150a mesh vs the reference engine.

Gates:
* greedy == spec.acceptance.greedy_accept exactly (K in {1,2,3,7}, every forced acceptance length, argmax ties);
* probs_from_logits (temperature/top-k/top-p) vs spec.sampling.probs_from_logits: max abs error <= 1e-6;
* stochastic: chi-square (p > 1e-3, fixed seeds) of the first emitted token vs the target row 0, of the second
  emitted token (given a >= 1) vs target row 1, and of the accepted-count distribution vs its closed form,
  with one-hot and with sampled drafts; the reference rejection sampler passes the same closed form;
  a negative control (wrong expected distribution) is rejected;
* traced capture + replay with new inputs == eager (greedy bit-exact, B = 1 and 4; stochastic bit-exact from the
  same RNG state, across RNG-table refills); only the result tensor is read back;
* per-row sampling settings (``DeviceAcceptor(..., stages=SamplerStages)``): each row of a B=4 acceptor whose users
  differ (greedy, sampled with top-k/top-p, greedy with penalties and logprobs, sampled with min_p, a penalty and
  logprobs) gives, step after step, exactly what a batch-1 acceptor with that user's params and seed gives alone:
  tokens, accepted count, the RNG row (sampled rows), the logprobs rows, the token counts after the commit and the
  draft distributions (bit for bit); RNG tables refill mid-run; the traced replay equals the eager run;
* batch 1 with one set of params runs the programs it ran before per-row settings existed (pinned counts);
* a row whose params need a stage the acceptor lacks, and a scalar acceptor's row with other params, are refused.

Tests whose property is per user run at B = 1 and at B >= 4 users in one acceptor.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.speculative.acceptance import PLACEHOLDER_TOKEN_ID, greedy_accept, rejection_sample  # noqa: E402
from qwen36.generation.sampling import SamplingParams, probs_from_logits  # noqa: E402
from qwen36.testing.tt_hooks import acceptor_host_draft_probs, acceptor_host_drafts, acceptor_host_logits  # noqa: E402
from qwen36.tt.spec.accept import DeviceAcceptor  # noqa: E402
from qwen36.tt.runtime.sampler_transform import SamplerStages  # noqa: E402
from qwen36.tt.runtime.trace import TracedStep  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402

P_MIN = 1e-3  # chi-square acceptance threshold (fixed seeds: the tests are deterministic)
PROB_ATOL = 1e-6  # device probs_from_logits vs torch, fp32


@pytest.fixture(scope="module")
def ctx():
    c = open_mesh("emulated-p150x2", trace_region_size=10_000_000)
    yield c
    c.close()


def _acc(ctx, k, v, params=None, **kw):
    return DeviceAcceptor(ctx.ttnn, ctx.mesh_device, k, v, params, **kw).allocate()


def _dev(acc, host):
    return acc.ttnn.to_device(host, acc.mesh)


def _shard0(ctx, t):
    return ctx.ttnn.to_torch(ctx.ttnn.get_device_tensors(t)[0])


# ---------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------
def _forced_greedy_case(k, v, a, g):
    """logits [K+1, V] (bf16-exact) and drafts [K] whose greedy acceptance length is exactly a."""
    logits = torch.randn(k + 1, v, generator=g).bfloat16().float()
    am = logits.argmax(-1)
    drafts = torch.randint(0, v, (k,), generator=g)
    for i in range(k):
        if i < a:
            drafts[i] = am[i]
        elif i == a:
            drafts[i] = (am[i] + 1 + torch.randint(0, v - 1, (1,), generator=g)) % v  # != argmax
    return logits, drafts


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_greedy_matches_reference_every_acceptance_length(ctx, k):
    v = 40
    g = torch.Generator().manual_seed(100 + k)
    b = k + 1  # user a has acceptance length a
    cases = [_forced_greedy_case(k, v, a, g) for a in range(k + 1)]
    logits = torch.stack([c[0] for c in cases])
    drafts = torch.stack([c[1] for c in cases])
    ref_tokens, ref_a = greedy_accept(drafts, logits)
    assert ref_a.tolist() == list(range(k + 1))
    acc = _acc(ctx, k, v, batch=b)
    ttnn = ctx.ttnn
    res = acc.greedy(_dev(acc, acceptor_host_logits(acc, logits, dtype=ttnn.bfloat16)), _dev(acc, acceptor_host_drafts(acc, drafts)))
    got = acc.read_results(res)
    assert [r.tokens for r in got] == ref_tokens.tolist()
    assert [r.num_accepted for r in got] == ref_a.tolist()
    assert all(r.rng_row == -1 for r in got)
    assert _shard0(ctx, acc.count).flatten().tolist() == [float(a) for a in ref_a.tolist()]
    for r in got:  # placeholder after the a+1 emitted tokens
        assert r.tokens[r.num_accepted + 1:] == [PLACEHOLDER_TOKEN_ID] * (k - r.num_accepted)


@pytest.mark.parametrize("b", [1, 4])
def test_greedy_argmax_ties_resolve_to_lowest_index_like_torch(ctx, b):
    """B = 1: the three draft cases one call each (read_result); B = 4: all in one call (read_results), one case twice."""
    k, v = 3, 16
    logits = torch.zeros(k + 1, v)
    for row in range(k + 1):  # two maxima per row: lowest index wins in torch.argmax
        logits[row, 2 + row] = 5.0
        logits[row, 10 + row] = 5.0
    lo = torch.tensor([2, 3, 4])
    hi = torch.tensor([10, 11, 12])
    cases = ((lo, 3), (hi, 0), (torch.tensor([2, 3, 13]), 2))
    rows = [cases[i % len(cases)] for i in range(max(b, len(cases)))]
    acc = _acc(ctx, k, v, batch=b)
    for start in range(0, len(rows), b):
        drafts = torch.stack([d for d, _ in rows[start:start + b]])
        want_a = [w for _, w in rows[start:start + b]]
        ref_t, ref_a = greedy_accept(drafts, logits.expand(b, k + 1, v))
        assert ref_a.tolist() == want_a
        res = acc.greedy(_dev(acc, acceptor_host_logits(acc, logits.expand(b, k + 1, v))),
                         _dev(acc, acceptor_host_drafts(acc, drafts)))
        if b == 1:
            assert acc.read_result(res) == (ref_t[0].tolist(), want_a[0])
        else:
            assert [(r.tokens, r.num_accepted) for r in acc.read_results(res)] == list(zip(ref_t.tolist(), want_a))


def test_greedy_vocab_sharded_logits_equal_replicated(ctx):
    k, v, b = 3, 64, 4
    g = torch.Generator().manual_seed(7)
    cases = [_forced_greedy_case(k, v, a, g) for a in range(b)]
    logits = torch.stack([c[0] for c in cases])
    drafts = torch.stack([c[1] for c in cases])
    ref_t, ref_a = greedy_accept(drafts, logits)
    acc = _acc(ctx, k, v, batch=b, logits_layout="vocab_sharded")
    host = acceptor_host_logits(acc, logits)
    assert len(ctx.ttnn.get_device_tensors(_dev(acc, host))) == 2
    res = acc.greedy(_dev(acc, host), _dev(acc, acceptor_host_drafts(acc, drafts)))
    got = acc.read_results(res)
    assert [r.tokens for r in got] == ref_t.tolist() and [r.num_accepted for r in got] == ref_a.tolist()


# ---------------------------------------------------------------------------------------------------
# temperature / top-k / top-p transform
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.7),
    SamplingParams(temperature=0.5, top_k=32, top_p=0.95),  # top_k == V: off
    SamplingParams(temperature=2.0, top_p=0.05),  # only the top token survives
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("layout", ["replicated", "vocab_sharded"])
def test_probs_from_logits_matches_torch(ctx, params, layout):
    k, v, b = 3, 32, 2
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(b, k + 1, v, generator=g) * 3
    acc = _acc(ctx, k, v, params, batch=b, logits_layout=layout)
    probs = acc.probs_from_logits(_dev(acc, acceptor_host_logits(acc, logits)))
    ref = probs_from_logits(logits, params)
    for got in (ctx.ttnn.to_torch(s) for s in ctx.ttnn.get_device_tensors(probs)):  # full V on every device
        assert got.shape == (1, b, k + 1, v)
        err = (got[0] - ref).abs().max().item()
        assert err <= PROB_ATOL, f"max abs error {err}"
        assert torch.equal(got[0] > 0, ref > 0), "kept-token sets differ"


def test_probs_from_logits_top_k_keeps_ties_like_torch(ctx):
    k, v = 1, 16
    logits = torch.tensor([[0, 1, 2, 3, 3, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 5.0]] * 2)[None]  # ties at the k-th value
    params = SamplingParams(temperature=1.0, top_k=3)
    acc = _acc(ctx, k, v, params)
    got = _shard0(ctx, acc.probs_from_logits(_dev(acc, acceptor_host_logits(acc, logits))))[0]
    ref = probs_from_logits(logits, params)
    assert (got > 0).sum(-1).tolist() == [[4, 4]] == (ref > 0).sum(-1).tolist()
    assert (got - ref).abs().max().item() <= PROB_ATOL


# ---------------------------------------------------------------------------------------------------
# stochastic: distribution tests
# ---------------------------------------------------------------------------------------------------
def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected < 5 are pooled. p = Q(dof/2, stat/2)."""
    n = counts.sum().item()
    expected = probs.double() * n
    counts = counts.double()
    if (counts[expected == 0] > 0).any():
        return 0.0  # an impossible outcome happened
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)]) if (~big).any() else expected[big]
    o = torch.cat([counts[big], counts[~big].sum().reshape(1)]) if (~big).any() else counts[big]
    keep = e > 0
    e, o = e[keep], o[keep]
    stat = ((o - e) ** 2 / e).sum()
    dof = e.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def _expected(pt: torch.Tensor, q: torch.Tensor | None, drafts_fixed: torch.Tensor | None, k: int):
    """Closed forms for row-independent target/draft distributions.

    pt [K+1, V] target rows; q [K, V] draft rows (sampled drafts) or None with drafts_fixed [K] (one-hot).
    alpha_i = P(accept d_i | d_1..d_{i-1} accepted) = sum_x min(p_{i-1}(x), q_i(x)) (sampled) or p_{i-1}(d_i).
    -> (count distribution [K+1], first token distribution = pt[0], second token given a >= 1 = pt[1]).
    """
    if q is None:
        alpha = torch.stack([pt[i, drafts_fixed[i]] for i in range(k)])
    else:
        alpha = torch.minimum(pt[:k], q).sum(-1)
    count = torch.zeros(k + 1, dtype=torch.float64)
    run = 1.0
    for j in range(k):
        count[j] = run * (1 - alpha[j].item())
        run *= alpha[j].item()
    count[k] = run
    return count, pt[0], pt[1]


def _stats(tokens: torch.Tensor, a: torch.Tensor, v: int, k: int):
    count = torch.bincount(a, minlength=k + 1)
    first = torch.bincount(tokens[:, 0], minlength=v)
    second = torch.bincount(tokens[a >= 1, 1], minlength=v)
    return count, first, second


STOCH_V, STOCH_N = 12, 3000
STOCH_PARAMS = SamplingParams(temperature=0.9, top_k=9, top_p=0.95, seed=1234)


def _stoch_setup(k, seed):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, STOCH_V, generator=g) * 1.5
    draft_logits = target_logits[:k] + torch.randn(k, STOCH_V, generator=g)  # a related but different drafter
    pt = probs_from_logits(target_logits, STOCH_PARAMS)
    q = probs_from_logits(draft_logits, STOCH_PARAMS)
    return g, target_logits, draft_logits, pt, q


@pytest.mark.parametrize("k,mode", [(2, "one_hot"), (2, "sampled"), (3, "sampled")])
def test_stochastic_distribution_chi_square(ctx, k, mode):
    g, target_logits, draft_logits, pt, q = _stoch_setup(k, seed=20 + k)
    n, v = STOCH_N, STOCH_V
    acc = _acc(ctx, k, v, STOCH_PARAMS, batch=n, rng_rows=2)
    ttnn = ctx.ttnn
    logits_dev = _dev(acc, acceptor_host_logits(acc, target_logits.expand(n, k + 1, v)))
    if mode == "one_hot":
        drafts = q.argmax(-1).expand(n, k)  # argmax drafting: the same fixed drafts for every user
        draft_probs_dev = None
        exp_count, exp_first, exp_second = _expected(pt, None, drafts[0], k)
    else:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], dim=1)
        dl = _dev(acc, acceptor_host_logits(acc, torch.cat([draft_logits, draft_logits[:1]]).expand(n, k + 1, v)))
        draft_probs_dev = ttnn.slice(acc.probs_from_logits(dl), [0, 0, 0, 0], [1, n, k, v])  # device transform
        exp_count, exp_first, exp_second = _expected(pt, q, None, k)
    res = acc.stochastic(logits_dev, _dev(acc, acceptor_host_drafts(acc, drafts)), draft_probs_dev)
    got = acc.read_results(res)
    tokens = torch.tensor([r.tokens for r in got])
    a = torch.tensor([r.num_accepted for r in got])
    count, first, second = _stats(tokens, a, v, k)
    p_count = _chi2_pvalue(count, exp_count)
    p_first = _chi2_pvalue(first, exp_first)
    p_second = _chi2_pvalue(second, exp_second)
    assert min(p_count, p_first, p_second) > P_MIN, (p_count, p_first, p_second, count.tolist(), exp_count.tolist())
    # accepted drafts are the drafts; tokens after the emitted ones are placeholders
    for r, d in zip(got[:200], drafts[:200].tolist()):
        assert r.tokens[: r.num_accepted] == d[: r.num_accepted]
        assert r.tokens[r.num_accepted + 1:] == [PLACEHOLDER_TOKEN_ID] * (k - r.num_accepted)
    # negative control: the first token is NOT distributed like the draft row
    assert _chi2_pvalue(first, q[0]) < 1e-6
    # the reference rejection sampler satisfies the same closed forms (ties the device to the reference)
    ref_t, ref_a = rejection_sample(drafts, None if mode == "one_hot" else q.expand(n, k, v),
                                    pt.expand(n, k + 1, v), torch.Generator().manual_seed(5))
    rc, rf, rs = _stats(ref_t, ref_a, v, k)
    assert min(_chi2_pvalue(rc, exp_count), _chi2_pvalue(rf, exp_first), _chi2_pvalue(rs, exp_second)) > P_MIN


def test_stochastic_all_accepted_bonus_and_forced_rejection(ctx):
    """Deterministic corners: p_t(d_i) = 1 -> always accepted, bonus from row K; p_t(d_1) = 0 -> a = 0 and the
    recovered token comes from p_t(row 0) with d_1 removed (one-hot residual)."""
    k, v, n = 2, 8, 64
    params = SamplingParams(temperature=1.0, seed=3)
    big = 30.0
    logits = torch.zeros(k + 1, v)
    logits[0, 1] = big
    logits[1, 2] = big  # rows 0, 1 put all mass on drafts 1, 2
    logits[2, 5] = big  # bonus row: token 5
    acc = _acc(ctx, k, v, params, batch=n)
    drafts = torch.tensor([1, 2]).expand(n, k)
    got = acc.read_results(acc.stochastic(_dev(acc, acceptor_host_logits(acc, logits.expand(n, k + 1, v))),
                                          _dev(acc, acceptor_host_drafts(acc, drafts))))
    assert all(r.tokens == [1, 2, 5] and r.num_accepted == 2 for r in got)
    logits2 = torch.zeros(k + 1, v)
    logits2[0, 0] = -big  # p_t(d_1 = 0) ~ 0: rejected; residual = p_t(row 0) without token 0
    drafts2 = torch.tensor([0, 3]).expand(n, k)
    got2 = acc.read_results(acc.stochastic(_dev(acc, acceptor_host_logits(acc, logits2.expand(n, k + 1, v))),
                                           _dev(acc, acceptor_host_drafts(acc, drafts2))))
    assert all(r.num_accepted == 0 and r.tokens[0] != 0 and r.tokens[1:] == [-1, -1] for r in got2)
    assert len({r.tokens[0] for r in got2}) > 3  # spread over the remaining 7 tokens
    # host-provided draft probs (vocab_sharded acceptor: draft probs stay full-V replicated)
    acc2 = _acc(ctx, k, v, params, batch=n, logits_layout="vocab_sharded")
    q = torch.zeros(n, k, v)
    q[:, 0, 1] = 1.0
    q[:, 1, 2] = 1.0
    got3 = acc2.read_results(acc2.stochastic(_dev(acc2, acceptor_host_logits(acc2, logits.expand(n, k + 1, v))),
                                             _dev(acc2, acceptor_host_drafts(acc2, drafts)),
                                             _dev(acc2, acceptor_host_draft_probs(acc2, q))))
    assert all(r.tokens == [1, 2, 5] and r.num_accepted == 2 for r in got3)


# ---------------------------------------------------------------------------------------------------
# traces
# ---------------------------------------------------------------------------------------------------
def _step_inputs(k, v, b, steps, seed):
    """Per step: logits [B, K+1, V] and drafts [B, K]; user u of step s has greedy acceptance length (s + u) % (K+1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        cases = [_forced_greedy_case(k, v, (s + u) % (k + 1), g) for u in range(b)]
        out.append((torch.stack([c[0] for c in cases]), torch.stack([c[1] for c in cases])))
    return out


@pytest.mark.parametrize("b", [1, 4])
def test_greedy_traced_replay_equals_eager_and_reference(ctx, b):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    k, v, hv = 3, 48, 4
    inputs = _step_inputs(k, v, b, steps=8, seed=31)
    acc = _acc(ctx, k, v, batch=b, ring_heads=hv)
    logits_buf = _dev(acc, acceptor_host_logits(acc, inputs[0][0]))
    drafts_buf = _dev(acc, acceptor_host_drafts(acc, inputs[0][1]))

    def read(res=None):
        return [(r.tokens, r.num_accepted) for r in acc.read_results(res)]

    eager = []
    for logits, drafts in inputs:  # eager (also compiles every program before capture)
        ttnn.copy_host_to_device_tensor(acceptor_host_logits(acc, logits), logits_buf)
        ttnn.copy_host_to_device_tensor(acceptor_host_drafts(acc, drafts), drafts_buf)
        acc.greedy(logits_buf, drafts_buf)
        acc.ring_block_idx()
        eager.append((read(), _shard0(ctx, acc.block_idx).flatten().tolist()))
    trace = TracedStep(ttnn, mesh, lambda: (acc.greedy(logits_buf, drafts_buf), acc.ring_block_idx()))
    res, blk = trace.capture()
    assert res is acc.result and blk is acc.block_idx
    for (logits, drafts), (want, want_blk) in zip(inputs, eager):
        ttnn.copy_host_to_device_tensor(acceptor_host_logits(acc, logits), logits_buf)
        ttnn.copy_host_to_device_tensor(acceptor_host_drafts(acc, drafts), drafts_buf)
        trace.replay(blocking=True)
        got = read(res)
        ref_t, ref_a = greedy_accept(drafts, logits)
        assert got == want == list(zip(ref_t.tolist(), ref_a.tolist()))
        # ring slot of user u's accepted state, head h: a_u * B*HV + u*HV + h
        assert _shard0(ctx, blk).flatten().tolist() == want_blk == \
            [int(ref_a[u]) * b * hv + u * hv + h for u in range(b) for h in range(hv)]
        if b == 1:
            assert acc.read_result(res) == (ref_t[0].tolist(), int(ref_a))
    assert len({a for rows, _ in eager for _, a in rows}) == k + 1  # every acceptance length was replayed
    trace.release()


@pytest.mark.parametrize("rng", ["device", "host"])
def test_stochastic_traced_replay_equals_eager_same_rng_state(ctx, rng, monkeypatch):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    k, v, b, steps = 2, 16, 4, 7
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=77)
    g = torch.Generator().manual_seed(41)
    inputs = [(torch.randn(b, k + 1, v, generator=g) * 2, torch.randint(0, v, (b, k), generator=g),
               torch.randn(b, k + 1, v, generator=g)) for _ in range(steps)]
    acc = _acc(ctx, k, v, params, batch=b, rng=rng, rng_rows=3)  # refills inside the run (every 3 steps)
    bufs = [_dev(acc, acceptor_host_logits(acc, inputs[0][0])), _dev(acc, acceptor_host_drafts(acc, inputs[0][1])),
            _dev(acc, acceptor_host_logits(acc, inputs[0][2]))]

    def write(step):
        logits, drafts, dlogits = inputs[step]
        ttnn.copy_host_to_device_tensor(acceptor_host_logits(acc, logits), bufs[0])
        ttnn.copy_host_to_device_tensor(acceptor_host_drafts(acc, drafts), bufs[1])
        ttnn.copy_host_to_device_tensor(acceptor_host_logits(acc, dlogits), bufs[2])

    def step_ops():
        pd = ttnn.slice(acc.probs_from_logits(bufs[2]), [0, 0, 0, 0], [1, b, k, v])  # drafter probs, same transform
        return acc.stochastic(bufs[0], bufs[1], pd)

    def reset_rng():
        acc.restart_rng()

    eager = []
    for s in range(steps):
        write(s)
        step_ops()
        eager.append(acc.read_results())
    assert [r.rng_row for r in eager[-1]] == [(steps - 1) % 3] * b
    reset_rng()
    trace = TracedStep(ttnn, mesh, step_ops)
    res = trace.capture()
    reads = []
    real_fn = ttnn.to_torch.fn
    monkeypatch.setattr(ttnn.to_torch, "fn", lambda m, t, *a, **kw: (reads.append(t.logical_shape_list),
                                                                    real_fn(m, t, *a, **kw))[1])
    for s in range(steps):
        write(s)
        trace.replay(blocking=True)
        assert acc.read_results(res) == eager[s], f"step {s}"
    assert reads and all(shape == [1, b, 1, k + 3] for shape in reads), "only the result tensor is read back"
    assert len({tuple(tuple(r.tokens) for r in e) for e in eager}) > 1  # replays saw new inputs / new uniforms
    trace.release()


# ---------------------------------------------------------------------------------------------------
# RNG emulation and input validation
# ---------------------------------------------------------------------------------------------------
def test_uniform_emulation_in_place_seeded_replicated(ctx):
    ttnn, mesh = ctx.ttnn, ctx.mesh_device
    t = ttnn.from_torch(torch.zeros(64, 64), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh,
                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    out = ttnn.uniform(t, 0.0, 1.0, 9)
    assert out is t
    s = [ttnn.to_torch(x) for x in ttnn.get_device_tensors(t)]
    assert torch.equal(s[0], s[1]), "replicated uniform must give the same values on every device"
    assert 0.0 <= s[0].min() and s[0].max() < 1.0 and abs(s[0].mean().item() - 0.5) < 0.02
    first = s[0].clone()
    ttnn.uniform(t, 0.0, 1.0, 9)
    assert torch.equal(_shard0(ctx, t), first)  # same seed -> same values
    ttnn.uniform(t, 0.0, 1.0, 10)
    assert not torch.equal(_shard0(ctx, t), first)


def test_bad_inputs_fail_with_named_problem(ctx):
    ttnn = ctx.ttnn
    with pytest.raises(ValueError, match="k .draft depth."):
        DeviceAcceptor(ttnn, ctx.mesh_device, 0, 16)
    with pytest.raises(ValueError, match="at most 31 drafts"):
        DeviceAcceptor(ttnn, ctx.mesh_device, 32, 16)
    with pytest.raises(ValueError, match="logits_layout"):
        DeviceAcceptor(ttnn, ctx.mesh_device, 2, 16, logits_layout="sharded")
    acc = DeviceAcceptor(ttnn, ctx.mesh_device, 2, 16)
    with pytest.raises(RuntimeError, match="allocate"):
        acc.greedy(None, None)
    acc.allocate()
    with pytest.raises(ValueError, match="drafts shape"):
        acceptor_host_drafts(acc, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft token ids must be in"):
        acceptor_host_drafts(acc, torch.tensor([[0, 16]]))
    wrong = _dev(acc, ttnn.from_torch(torch.zeros(1, 1, 4, 16), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                                      mesh_mapper=ttnn.ReplicateTensorToMesh(ctx.mesh_device)))
    drafts = _dev(acc, acceptor_host_drafts(acc, torch.tensor([[1, 2]])))
    with pytest.raises(ValueError, match=r"greedy logits: device shape \[1, 1, 4, 16\] != \[1, 1, 3, 16\]"):
        acc.greedy(wrong, drafts)
    with pytest.raises(ValueError, match="temperature > 0"):
        acc.probs_from_logits(_dev(acc, acceptor_host_logits(acc, torch.zeros(1, 3, 16))))


# ---------------------------------------------------------------------------------------------------
# per-row sampling settings (stages): B = 4 rows with different params == each user alone at B = 1
# ---------------------------------------------------------------------------------------------------
K, V = 3, 64
PEN = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
# The users' parameters are exact in fp32 where the batch-1 acceptor takes them as scalars (1/T, 1/repetition,
# log(min_p), top_p, the penalties): the emulator computes a scalar operand in fp64, a per-row operand is its fp32
# rounding, so an inexact value could differ in the last bit between the two forms on the emulator. (A card packs
# a float scalar as fp32 for fp32 operands: both forms see the same number there.)
USERS = [SamplingParams(),
         SamplingParams(temperature=0.8, top_k=10, top_p=0.875, seed=3),
         SamplingParams(logprobs=2, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
         SamplingParams(temperature=0.5, min_p=math.exp(-3.0), frequency_penalty=0.25, logprobs=1, seed=4)]
PROMPT_LEN, HISTORIES = 3, [[1, 2, 3, 7], [5, 5, 9, 11], [1, 2, 3, 7, 7, 9], [4, 8, 15, 16, 23]]


def _row_inputs(steps: int, b: int, seed: int):
    """Per step: target logits [B, R, V], drafts [B, K] (every other one the target's argmax, so greedy rows
    accept some), draft logits [B, K, V]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = torch.randn(b, K + 1, V, generator=g) * 2
        drafts = torch.randint(0, V, (b, K), generator=g)
        take = torch.rand(b, K, generator=g) < 0.6
        drafts = torch.where(take, logits[:, :K].argmax(-1), drafts)
        out.append((logits, drafts, torch.randn(b, K, V, generator=g) * 2))
    return out


class _RowRun:
    """One acceptor with persistent input buffers and one step's device ops (accept, then the count commit)."""

    def __init__(self, ctx, acc: DeviceAcceptor, users: list[SamplingParams], rows: list[int]):
        self.ttnn, self.acc, self.users, self.rows = ctx.ttnn, acc, users, rows
        z = _row_inputs(1, acc.batch, 0)[0]
        self.bufs = [acc.ttnn.to_device(h, acc.mesh) for h in (acceptor_host_logits(acc, z[0]),
                                                                acceptor_host_drafts(acc, z[1]),
                                                                acceptor_host_draft_probs(acc, z[2]))]
        self.sampled = acc.stages.sampled if acc.stages is not None else not acc.params.greedy
        self.probs = None
        self.start()

    def start(self):
        for row, p in enumerate(self.users):
            self.acc.set_row(row, p)
            self.acc.start_penalties(PROMPT_LEN, HISTORIES[self.rows[row]], row)

    def write(self, logits, drafts, dlogits):
        t, acc = self.ttnn, self.acc
        t.copy_host_to_device_tensor(acceptor_host_logits(acc, logits), self.bufs[0])
        t.copy_host_to_device_tensor(acceptor_host_drafts(acc, drafts), self.bufs[1])
        t.copy_host_to_device_tensor(acceptor_host_draft_probs(acc, dlogits), self.bufs[2])

    def ops(self):
        acc = self.acc
        pd = None
        if self.sampled:
            pd = acc.probs_from_logits(self.bufs[2], acc.draft_penalties() if acc.penalized else None)
        res = acc.accept(self.bufs[0], self.bufs[1], pd)
        if acc.penalized:
            acc.commit_counts()
        self.probs = pd
        return res, pd

    def read(self, pd=None):
        """Per row: (tokens, a, rng_row, logprobs, (seen, counts), draft probs) on the host."""
        acc, out = self.acc, []
        results = acc.read_results()
        pd = self.probs if pd is None else pd
        probs = None if pd is None else self.ttnn.to_torch(self.ttnn.get_device_tensors(pd)[0]).reshape(acc.batch, K, V)
        for row, (p, r) in enumerate(zip(self.users, results)):
            lps = acc.read_logprobs(r.emitted, row) if p.logprobs is not None else None
            counts = [t.tolist() for t in acc.token_counts.read(row)] if p.penalized else None
            out.append((r.tokens, r.num_accepted, None if p.greedy else r.rng_row, lps, counts,
                        None if p.greedy else probs[row].tolist()))
        return out


def test_rows_with_different_params_equal_each_user_alone_traced_and_eager(ctx):
    ttnn, b, steps = ctx.ttnn, len(USERS), 5
    inputs = _row_inputs(steps, b, 17)
    batch = _RowRun(ctx, DeviceAcceptor(ttnn, ctx.mesh_device, K, V, batch=b, rng_rows=3,
                                     stages=SamplerStages.of(USERS, V)).allocate(), USERS, list(range(b)))
    alone = [_RowRun(ctx, DeviceAcceptor(ttnn, ctx.mesh_device, K, V, p, rng_rows=3).allocate(), [p], [row])
             for row, p in enumerate(USERS)]
    eager = []
    for logits, drafts, dlogits in inputs:
        batch.write(logits, drafts, dlogits)
        batch.ops()
        got = batch.read()
        for row, run in enumerate(alone):
            run.write(logits[row:row + 1], drafts[row:row + 1], dlogits[row:row + 1])
            run.ops()
            assert got[row] == run.read()[0], f"row {row} ({USERS[row].describe()})"
        eager.append(got)
    accepted = {(row, e[row][1]) for e in eager for row in range(b)}
    assert {a for _, a in accepted} >= {0, K} and {row for row, a in accepted if a > 0} == set(range(b)), accepted
    assert all(r[2] is not None for r in eager[-1][1::2])  # sampled rows report their RNG rows (refilled: 3 rows)
    # traced: the same steps again from the same streams and penalty state
    batch.acc.restart_rng()
    batch.start()
    trace = TracedStep(ttnn, ctx.mesh_device, batch.ops)
    _, pd = trace.capture()
    for (logits, drafts, dlogits), want in zip(inputs, eager):
        batch.write(logits, drafts, dlogits)
        trace.replay(blocking=True)
        assert batch.read(pd) == want
    trace.release()


# Programs of one step at B=1 with one set of params (acceptance; sampled: the draft probabilities too; penalties:
# the count commit too), counted per op on the code before per-row settings existed: a batch-1 acceptor without
# stages runs none of the per-row code.
PROGRAMS = {
    "greedy": (SamplingParams(), 35),
    "T0.8": (SamplingParams(temperature=0.8), 73),
    "T0.8+top_k+top_p": (SamplingParams(temperature=0.8, top_k=10, top_p=0.9), 101),
    "T0.8+min_p": (SamplingParams(temperature=0.8, min_p=0.05), 81),
    "greedy+penalties": (SamplingParams(**PEN), 66),
    "T0.8+penalties": (SamplingParams(temperature=0.8, **PEN), 114),
    "greedy+logprobs": (SamplingParams(logprobs=3), 63),
    "T0.8+logprobs": (SamplingParams(temperature=0.8, logprobs=3), 101),
}


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_batch1_programs_per_acceptance_unchanged(ctx, case):
    params, want = PROGRAMS[case]
    acc = DeviceAcceptor(ctx.ttnn, ctx.mesh_device, K, V, params).allocate()
    run = _RowRun(ctx, acc, [params], [0])
    run.write(*_row_inputs(1, 1, 5)[0])
    run.ops()  # the first call compiles; count the second
    acc.read_results()
    with ctx.mesh_device.counters.scope(case) as c:
        run.ops()
    assert c.programs == want, dict(c.programs_per_op)


def test_rows_refused_with_named_problem(ctx):
    ttnn, m = ctx.ttnn, ctx.mesh_device
    acc = DeviceAcceptor(ttnn, m, K, V, batch=2, stages=SamplerStages.of([SamplingParams(temperature=0.8)], V))
    acc.allocate()
    with pytest.raises(ValueError, match="needs greedy"):
        acc.set_row(0, SamplingParams())
    with pytest.raises(ValueError, match="needs top_k"):
        acc.set_row(1, SamplingParams(temperature=0.8, top_k=5))
    rows_in_dim2 = ttnn.from_torch(torch.zeros(1, 1, 2, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=m,
                                   mesh_mapper=ttnn.ReplicateTensorToMesh(m))  # the MTP chain's [1, 1, B, V] rows
    with pytest.raises(ValueError, match="users in dim 1"):
        acc.probs_from_logits(rows_in_dim2)
    scalar = DeviceAcceptor(ttnn, m, K, V, SamplingParams(temperature=0.8), batch=2).allocate()
    scalar.set_row(1, SamplingParams(temperature=0.8, seed=9))  # only the seed differs: fine
    with pytest.raises(ValueError, match="per-row params need"):
        scalar.set_row(0, SamplingParams(temperature=0.5))
