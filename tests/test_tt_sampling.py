"""Plain TT decoding with the sampling parameters, on the emulated 1x2 P150a mesh: the device pick
(``tt/sampler.py::DeviceSampler``) against the torch transform given the same uniforms, penalties from the
device-resident counts, raw logprobs, and the generator's traced decode reading back only the pick's result."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.model import Qwen36Model
from qwen36.speculative.acceptance import greedy_accept
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.plain import plain_generate
from qwen36.speculative.sampling import SamplingParams, TokenHistory, penalize, probs_from_logits
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.accept import DeviceAcceptor
from qwen36.tt.spec_backend import TTSpecBackend
from qwen36.tt.sampler import DeviceSampler
from qwen36.tt.trace import TracedStep

from test_sampling import prompts
from test_tt_spec_stochastic import chi2_p

V = 64
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=-1.5, frequency_penalty=0.7)


@pytest.fixture(scope="module")
def mesh():
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2", trace_region_size=8 << 20) as ctx:
        yield ctx


def _host_uniforms(sampler: DeviceSampler, n: int) -> list[float]:
    """The uniforms a rng="host" sampler uses: column 0 of each row of its seeded table, refills included."""
    u = sampler.uniforms
    g = torch.Generator().manual_seed(u.host_seed)
    rows = []
    while len(rows) < n:
        rows += torch.rand(u.rows, u.width, generator=g)[:, 0].tolist()
    return rows[:n]


def _host_draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.double().cumsum(-1)
    total = cdf[-1]
    return int(((cdf <= u * total) & (cdf < total)).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_k=12, min_p=0.02, seed=5, **PENALTIES),
    SamplingParams(temperature=1.2, top_p=0.8, seed=6, repetition_penalty=2.0),
    SamplingParams(**PENALTIES),  # greedy with penalties: argmax of the penalised logits
], ids=["min_p+top_k+penalties", "top_p+repetition", "greedy+penalties"])
def test_device_pick_equals_the_torch_transform_given_the_same_uniforms(mesh, params):
    """A traced replay per step over one logits buffer the host rewrites: the device token equals the host
    inverse-CDF draw from ``speculative.sampling.probs_from_logits`` with the same uniform and the same penalty
    history (counts updated on device in place), step after step, across a table refill."""
    ttnn, m = mesh.ttnn, mesh.mesh_device
    s = DeviceSampler(ttnn, m, V, params, rng="host", rng_rows=8).allocate()
    g = torch.Generator().manual_seed(1)
    prompt = [1, 2, 3, 40]
    logits_buf = ttnn.from_torch(torch.zeros(1, 1, 1, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=m,
                                 mesh_mapper=ttnn.ReplicateTensorToMesh(m))
    first = 2
    s.start(prompt, first)
    hist = TokenHistory(prompt, V)
    hist.add([first])
    steps = 20  # > rng_rows: the table is refilled on the way
    us = _host_uniforms(s, steps) if not params.greedy else [None] * steps
    trace = TracedStep(ttnn, m, lambda: s.pick(logits_buf), name="pick")
    got, want = [], []
    for i in range(steps):
        lg = torch.randn(V, generator=g) * 2
        lg[torch.tensor(prompt)] += 2.0  # make the seen tokens likely, so that the penalties decide
        host = ttnn.from_torch(lg.reshape(1, 1, 1, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(m))
        ttnn.copy_host_to_device_tensor(host, logits_buf)
        s.before_step()
        if i == 0:
            s.pick(logits_buf)
        else:
            if i == 1:
                trace.capture()
            trace.replay()
        tok, _ = s.read()
        got.append(tok)
        if params.greedy:
            want.append(int(penalize(lg[None], params, hist.now()).argmax()))
        else:
            want.append(_host_draw(probs_from_logits(lg[None], params, hist.now())[0], us[i]))
        hist.add([got[-1]])  # follow the device's token so that one mismatch does not cascade
    trace.release()
    assert got == want
    assert len(set(got)) > 3


def test_device_pick_distribution_chi_square(mesh):
    """Many replays over fixed logits with device uniforms (``rng="device"``): the token histogram matches the
    transformed distribution (min_p and top-k on; no penalties, so every step draws from the same law)."""
    ttnn, m = mesh.ttnn, mesh.mesh_device
    params = SamplingParams(temperature=0.8, top_k=10, min_p=0.05, seed=9)
    lg = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    s = DeviceSampler(ttnn, m, V, params, rng="device", rng_rows=256).allocate()
    buf = ttnn.from_torch(lg.reshape(1, 1, 1, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=m,
                          mesh_mapper=ttnn.ReplicateTensorToMesh(m))
    s.start([0], 0)
    s.before_step()
    s.pick(buf)
    trace = TracedStep(ttnn, m, lambda: s.pick(buf), name="pick")
    trace.capture()
    counts = torch.zeros(V)
    n = 600
    for _ in range(n):
        s.before_step()
        trace.replay()
        counts[s.read()[0]] += 1
    trace.release()
    probs = probs_from_logits(lg[None], params)[0].double()
    assert chi2_p(counts, probs * n) > 1e-3


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("ci")


@pytest.fixture(scope="module")
def gen(ckpt):
    g = small_tt_generator(ckpt)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ref(ckpt):
    return Qwen36Model.from_checkpoint(ckpt)


def test_plain_tt_greedy_with_penalties_and_logprobs_vs_reference(gen, ref, monkeypatch):
    """Greedy with penalties on TT == the reference's plain greedy with penalties; raw logprobs within the TT
    model's numerics of the reference's; and no decode step reads the logits row back (only the small result)."""
    prompt = prompts(ref.config.vocab_size)[0]  # (prompt 1 meets a near-tie, margin 0.02, at token 7 without penalties)
    params = SamplingParams(logprobs=3, **PENALTIES)
    want = plain_generate(ref, prompt, 16, params)
    assert want.tokens != plain_generate(ref, prompt, 16).tokens  # the penalties decide something here
    reads = []
    real_to_torch = gen.ttnn.to_torch

    def counting_to_torch(t, *a, **kw):
        out = real_to_torch(t, *a, **kw)
        reads.append(out.numel())
        return out

    # the emulating namespace is read-only; its per-name cache is where attribute lookups resolve
    monkeypatch.setitem(gen.ttnn._cache, "to_torch", counting_to_torch)
    got = gen.generate(prompt, 16, params)
    monkeypatch.undo()
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs):
        assert abs(a.logprob - b.logprob) < 0.05 and a.rank == b.rank and a.top[0][0] == b.top[0][0]
    assert max(lp.rank for lp in got.logprobs) > 1  # a penalty picked a token that is not the raw argmax
    # one readback of the prompt's last logits row (prefill), then one small result per decode step
    assert reads[0] == ref.config.vocab_size and len(reads) == 16
    assert max(reads[1:]) == 3 + 2 * 3  # token, logprob, rank, 3 ids, 3 logprobs


def test_plain_tt_sampling_is_seeded_and_greedy_is_unchanged(gen, ref):
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.9, top_k=40, min_p=0.01, seed=4, **PENALTIES)
    a, b = gen.generate(prompt, 10, params).tokens, gen.generate(prompt, 10, params).tokens
    c = gen.generate(prompt, 10, SamplingParams(temperature=0.9, top_k=40, min_p=0.01, seed=5, **PENALTIES)).tokens
    assert a == b and a != c
    assert gen.greedy(prompt, 10) == plain_generate(ref, prompt, 10).tokens


def _dev(ttnn, m, x, dtype=None, layout=None):
    return ttnn.from_torch(x, dtype=dtype or ttnn.float32, layout=layout or ttnn.TILE_LAYOUT, device=m,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(m))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_acceptor_rows_see_the_drafts_before_them_and_commit_counts(mesh, temperature):
    """Device acceptance with penalties: verify row j's penalty context is the committed counts plus d_1..d_j.
    Greedy: the device result equals ``greedy_accept`` on the host-penalised rows. Stochastic: the device's target
    distribution rows equal ``probs_from_logits`` with the host's per-row contexts. ``commit_counts`` then adds
    exactly the emitted tokens."""
    ttnn, m = mesh.ttnn, mesh.mesh_device
    k, prompt = 3, [4, 9, 17]
    params = SamplingParams(temperature=temperature, top_k=20, seed=3, **PENALTIES)
    acc = DeviceAcceptor(ttnn, m, k, V, params, rng="host").allocate()
    history = prompt + [9, 30]  # pending token 30, one earlier output token 9
    acc.start_penalties(len(prompt), history)
    host = TokenHistory(prompt, V)
    host.add(history[len(prompt):])
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, k + 1, V, generator=g) * 0.5
    drafts = torch.tensor([[9, 30, 9]])
    # raw argmax vs penalised argmax per row (repetition 1.3, presence -1.5, frequency 0.7):
    # row 0: 9 (count 1) 3.0 -> 3.11 beats unseen 50 at 3.05: d1 = 9 accepted only with penalties;
    # row 1: 30 (count 1) 3.0 -> 3.11 beats 51 at 3.05: d2 = 30 accepted;
    # row 2: 9 now counts 2 (d1 included): 3.0 -> 2.41 loses to 52 at 2.9, so d3 = 9 is rejected and 52 emitted;
    #        a row context without d1 (count 1: 3.11) would have accepted it
    for row, (tok, other, v_other) in enumerate([(9, 50, 3.05), (30, 51, 3.05), (9, 52, 2.9)]):
        logits[0, row, tok], logits[0, row, other] = 3.0, v_other
    pen = host.rows(drafts[0])
    logits_dev = _dev(ttnn, m, logits[None])
    drafts_dev = _dev(ttnn, m, drafts.reshape(1, 1, 1, k).to(torch.int32), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)
    if params.greedy:
        toks, a = acc.read_result(acc.greedy(logits_dev, drafts_dev))
        want, n = greedy_accept(drafts, penalize(logits, params, type(pen)(pen.seen[None], pen.counts[None])))
        assert (toks[: a + 1], a) == (want[0, : int(n[0]) + 1].tolist(), int(n[0])) == ([9, 30, 52], 2)
        assert greedy_accept(drafts, logits)[0].tolist() == [[50, -1, -1, -1]]  # without penalties
    else:
        _, drafts_col = acc._drafts_f32(drafts_dev)
        pt = acc.probs_from_logits(logits_dev, acc.row_penalties(drafts_col))
        got = ttnn.to_torch(ttnn.get_device_tensors(pt)[0]).reshape(k + 1, V)
        want = probs_from_logits(logits[0], params, pen)
        assert (got - want).abs().max() < 1e-5
        assert (want - probs_from_logits(logits[0], params, host.now())).abs().max() > 0.05  # rows differ
        toks, a = acc.read_result(acc.stochastic(logits_dev, drafts_dev))
    acc.commit_counts()
    host.add(toks[: a + 1])
    counts = ttnn.to_torch(ttnn.get_device_tensors(acc.counts)[0]).reshape(V)
    seen = ttnn.to_torch(ttnn.get_device_tensors(acc.seen)[0]).reshape(V)
    assert torch.equal(counts, host.counts) and torch.equal(seen > 0, host.now().seen)


@pytest.fixture(scope="module")
def mtp_gen(ckpt):
    g = small_tt_generator(ckpt, require_mtp=True)
    yield g
    g.close()


@pytest.mark.parametrize("mechanism", ["shadow_commit", "snapshot"])
def test_tt_speculative_greedy_with_penalties_is_plain_greedy_with_penalties(mtp_gen, ref, mechanism):
    """Lossless on TT with penalties: traced verify+accept / commit with the token counts updated in the commit
    trace; drafts from the plain answer with 30% wrong tokens so that every acceptance length occurs."""
    gen = mtp_gen
    prompt = prompts(ref.config.vocab_size)[0]
    params = SamplingParams(**PENALTIES)
    plain = gen.generate(prompt, 16, params).tokens
    assert plain != gen.greedy(prompt, 16)  # the penalties decide something here
    g = torch.Generator().manual_seed(0)

    def drafter(history, k):
        i = len(history) - len(prompt)
        toks = (plain[i:i + k] + [0] * k)[:k]
        return [(t + 1) % ref.config.vocab_size if torch.rand(1, generator=g).item() < 0.3 else t for t in toks]

    be = TTSpecBackend(gen, mechanism, drafter=drafter)
    out = speculative_generate(be, [prompt], 16, [3], [params])[0]
    be.release()
    assert out.tokens == plain
    assert sum(out.stats.accepted) > 0 and min(out.stats.accepted) == 0


def test_tt_speculative_sampling_with_penalties_is_seeded(mtp_gen, ckpt):
    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.mtp_drafter import TTMTPDrafter

    prompt = [5, 6, 7, 8, 9]
    be = TTSpecBackend(mtp_gen, "shadow_commit", drafter=TTMTPDrafter(load_checkpoint(ckpt, require_mtp=True)))
    params = SamplingParams(temperature=0.9, top_k=30, min_p=0.02, seed=2, **PENALTIES)
    a = speculative_generate(be, [prompt], 12, [2], [params])[0].tokens
    b = speculative_generate(be, [prompt], 12, [2], [params])[0].tokens
    be.release()
    assert a == b and len(a) == 12


def test_tt_speculative_logprobs_equal_plain(mtp_gen, ref):
    """Raw logprobs of TT speculative greedy (the verify rows, read for the emitted tokens only) equal TT plain
    decoding's (the decode row) within the TT model's row-count numerics; same ranks and top ids."""
    gen = mtp_gen
    prompt = prompts(ref.config.vocab_size)[0]
    params = SamplingParams(logprobs=2, **PENALTIES)
    plain = gen.generate(prompt, 12, params)
    g = torch.Generator().manual_seed(1)

    def drafter(history, k):
        i = len(history) - len(prompt)
        toks = (plain.tokens[i:i + k] + [0] * k)[:k]
        return [(t + 1) % ref.config.vocab_size if torch.rand(1, generator=g).item() < 0.3 else t for t in toks]

    be = TTSpecBackend(gen, "shadow_commit", drafter=drafter)
    spec = speculative_generate(be, [prompt], 12, [3], [params])[0]
    be.release()
    assert spec.tokens == plain.tokens and sum(spec.stats.accepted) > 0
    assert [lp.token for lp in spec.logprobs] == spec.tokens
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert abs(a.logprob - b.logprob) < 2e-2 and a.rank == b.rank, (a, b)
        assert a.top[0][0] == b.top[0][0] and abs(a.top[0][1] - b.top[0][1]) < 2e-2
