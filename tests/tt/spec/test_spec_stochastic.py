"""Stochastic speculative decoding through the TT path (chi-square tests of the device acceptor and sampled drafts),
emulated 1x2 P150a mesh.

Two levels, because an end-to-end TT step costs ~0.1 s on a 2-core CPU (too slow for many thousands of samples):

* device level (many samples, traced replays): the sampled-draft pick
  (``tt/runtime/sampler_transform.py::SampledDraftPick``) draws K=2 drafts on device from fixed draft logits with
  the acceptor's transform, and ``DeviceAcceptor.stochastic`` accepts them against fixed target logits using the pick's draft probabilities. Chi-square of the joint
  draft distribution vs q1 x q2, of the first emitted token vs target row 0, of the second emitted token
  (given a >= 1) vs row 1, and of the accepted count vs its closed form. Negative control in the same replays:
  a second acceptor is handed draft probabilities from a *different* transform (T=0.4 instead of the T=1 the
  drafts were drawn with) -- a mismatched-transform bug -- and its first emitted token must be rejected.
* end to end (``TTSpecBackend`` on the shipped checkpoint, device MTP, traced verify+accept / commit+draft):
  over many consecutive steps, the first emitted token's rank among the step's kept target tokens and the second
  emitted token's rank (given a >= 1) vs the target's own sampling distribution computed from the verify logits
  the step read (T=1, top-k 3: 3 cells); P(a >= 1) vs the sum of the per-step closed forms. Sampled drafts and
  one-hot (argmax) drafts. Contexts differ per step, so the expected count of each cell is the sum of the
  per-step probabilities (Pearson statistic with summed expectations; valid by the martingale CLT, slightly
  conservative).

All seeds fixed: the tests are deterministic. Threshold: p > P_MIN = 1e-3 for the exact path; the negative
control must give p < P_NEG = 1e-6.
"""
from __future__ import annotations

import pytest
import torch

from qwen36.generation.sampling import SamplingParams, probs_from_logits
from qwen36.testing.stats import chi2_p, rank_cell
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.spec.accept import DeviceAcceptor
from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
from qwen36.tt.runtime.sampler_transform import SampledDraftPick
from qwen36.tt.spec.spec_backend import TTSpecBackend
from qwen36.tt.runtime.trace import TracedStep

P_MIN = 1e-3
P_NEG = 1e-6
CKPT = "models/qwen36/default_checkpoint"
TOP_K = 3


@pytest.fixture(scope="module")
def gen():
    g = small_tt_generator(CKPT, prefill_chunk=64)
    yield g
    g.close()


@pytest.fixture(scope="module")
def drafter():
    from qwen36.checkpoint import load_checkpoint

    return TTMTPDrafter(load_checkpoint(CKPT, require_mtp=True))


# ---------------------------------------------------------------------------------------------------------------
# device level: SampledDraftPick + DeviceAcceptor.stochastic, fixed logits, traced replays
# ---------------------------------------------------------------------------------------------------------------
V, K = 64, 2


def _row(spec: dict[int, float]) -> torch.Tensor:
    x = torch.full((V,), -5.0)  # below the top-3: masked by top-k
    for t, v in spec.items():
        x[t] = v
    return x


TARGET = torch.stack([_row({3: 1.0, 7: 0.5, 11: 0.0}), _row({5: 0.8, 7: 0.6, 20: 0.0}), _row({9: 0.3, 3: 0.2, 1: 0.0})])
DRAFT = torch.stack([_row({7: 1.2, 3: 0.2, 30: 0.0}), _row({5: 0.0, 20: 0.9, 7: 0.3})])


def _first_token_dist(p0, q_draw, q_accept):
    """Closed form of the first emitted token when d1 ~ q_draw but acceptance uses q_accept (== p0 iff consistent)."""
    ratio = torch.where(q_accept > 0, p0 / q_accept.clamp_min(1e-30), torch.ones_like(p0)).clamp(max=1.0)
    acc = q_draw * ratio
    res = (p0 - q_accept).clamp_min(0)
    res = res / res.sum() if res.sum() > 0 else p0
    return acc + (1 - acc.sum()) * res


@pytest.mark.slow  # chi-square over many device samples
def test_device_sampled_drafts_and_acceptance_chi_square(gen):
    ttnn, mesh = gen.ttnn, gen.mesh
    n = 1200
    params = SamplingParams(1.0, TOP_K, 1.0, seed=11)
    acc = DeviceAcceptor(ttnn, mesh, K, V, params).allocate()
    acc_bad = DeviceAcceptor(ttnn, mesh, K, V, params, seed=12).allocate()
    cold = DeviceAcceptor(ttnn, mesh, K, V, SamplingParams(0.4, TOP_K, 1.0)).allocate()  # only its transform
    pick = SampledDraftPick(ttnn, mesh, K, V, acc.probs_from_logits, seed=13, rng_rows=500).allocate()
    rep = ttnn.ReplicateTensorToMesh(mesh)
    tgt = ttnn.from_torch(TARGET.reshape(1, 1, K + 1, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh,
                          mesh_mapper=rep)
    dl = ttnn.from_torch(DRAFT.reshape(1, 1, K, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh,
                         mesh_mapper=rep)
    drafts = ttnn.from_torch(torch.zeros(1, 1, 1, K, dtype=torch.int32), dtype=ttnn.uint32,
                             layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh, mesh_mapper=rep)

    def step():  # the chain's pick protocol (TTMTPHead.chain) on fixed rows, then both acceptances
        pick.begin_chain()
        toks = [ttnn.to_layout(pick(ttnn.slice(dl, [0, 0, i, 0], [1, 1, i + 1, V])), ttnn.ROW_MAJOR_LAYOUT)
                for i in range(K)]
        ttnn.copy(ttnn.concat(toks, dim=3), drafts)
        pick.end_chain()
        acc.stochastic(tgt, drafts, pick.draft_probs)
        acc_bad.stochastic(tgt, drafts, cold.probs_from_logits(dl))

    def read():
        d = ttnn.to_torch(ttnn.get_device_tensors(drafts)[0]).reshape(-1).long().tolist()
        return d, acc.read_result(), acc_bad.read_result()

    pick.before_chain()
    step()  # eager: compiles; also a valid sample
    samples = [read()]
    # the pick's draft distributions == the torch transform of the draft logits
    qd = ttnn.to_torch(ttnn.get_device_tensors(pick.draft_probs)[0]).reshape(K, V)
    q = probs_from_logits(DRAFT, params)
    assert float((qd - q).abs().max()) <= 1e-6 and torch.equal(qd > 0, q > 0)
    trace = TracedStep(ttnn, mesh, step)
    trace.capture()
    for _ in range(n - 1):
        pick.before_chain()  # refills the draft table (rng_rows=500 < n: exercised) outside the trace
        trace.replay(blocking=True)
        samples.append(read())
    trace.release()
    assert pick.refills >= 3

    p = probs_from_logits(TARGET, params)
    joint = torch.zeros(V, V)
    first, second, counts, bad_first = torch.zeros(V), torch.zeros(V), torch.zeros(K + 1), torch.zeros(V)
    for d, (toks, a), (btoks, _) in samples:
        joint[d[0], d[1]] += 1
        first[toks[0]] += 1
        counts[a] += 1
        if a >= 1:
            assert toks[0] == d[0]
            second[toks[1]] += 1
        bad_first[btoks[0]] += 1
    alpha = torch.minimum(p[:K], q).sum(-1)  # per-position acceptance probability (target rows fixed)
    p_count = torch.tensor([1 - alpha[0], alpha[0] * (1 - alpha[1]), alpha[0] * alpha[1]])
    pv = {"drafts": chi2_p(joint, torch.outer(q[0], q[1]) * n), "first": chi2_p(first, p[0] * n),
          "second|a>=1": chi2_p(second, p[1] * second.sum()), "count": chi2_p(counts, p_count * n)}
    assert second.sum() >= 200, second.sum()
    for name, v in pv.items():
        assert v > P_MIN, (name, v, pv)
    # negative control: the mismatched transform is biased (closed form differs), and the test sees it
    q_cold = probs_from_logits(DRAFT[0], SamplingParams(0.4, TOP_K))
    biased = _first_token_dist(p[0], q[0], q_cold)
    assert torch.allclose(_first_token_dist(p[0], q[0], q[0]), p[0], atol=1e-6)
    assert float((biased - p[0]).abs().max()) > 0.05
    p_bad = chi2_p(bad_first, p[0] * n)
    print(f"device level n={n}: p-values {pv}; negative control p={p_bad:.3g}")
    assert p_bad < P_NEG, p_bad
    assert chi2_p(bad_first, biased * n) > P_MIN  # ... and matches its own (biased) closed form


# ---------------------------------------------------------------------------------------------------------------
# end to end: TTSpecBackend (device MTP drafts, traced steps) on the shipped checkpoint
# ---------------------------------------------------------------------------------------------------------------
PROMPTS = [[5, 100, 7, 300, 12], [44, 901, 17, 3, 250], [201, 5, 4064, 273], [28, 700, 277, 346]]
K_E2E = 2


def _e2e(gen, drafter, draft: str, steps: int, seed: int):
    be = TTSpecBackend(gen, "shadow_commit", drafter=drafter)
    params = SamplingParams(1.0, TOP_K, 1.0, seed, draft=draft)
    obs1, exp1, obs2, exp2 = torch.zeros(TOP_K + 1), torch.zeros(TOP_K + 1), torch.zeros(TOP_K + 1), torch.zeros(TOP_K + 1)
    a_ge1, alpha_sum, alpha_var, hist = 0, 0.0, 0.0, [0] * (K_E2E + 1)
    done, seg, max_len = 0, 0, gen.model.args.max_seq_len
    while done < steps:
        if seg:
            be.leave(0)  # the next segment is a new user
        be.join(0, PROMPTS[seg % len(PROMPTS)], params)
        seg += 1
        while done < steps and be.n + 2 * (K_E2E + 1) < max_len:
            d = be.draft({0: K_E2E})
            dr = be.drafter.head.read_drafts()[0]
            q = (gen.model.to_host(be.drafter.sampler.draft_probs).float().reshape(K_E2E, -1)
                 if draft == "sample" else None)
            v = be.verify(d)
            p = probs_from_logits(gen.model.to_host(v.out.logits).float().reshape(K_E2E + 1, -1), params)
            acc = be.accept(d, v)[0]
            be.commit({0: acc})
            done += 1
            hist[acc.num_accepted] += 1
            srt = p.sort(dim=-1, descending=True).values[:, :TOP_K]
            obs1[rank_cell(p[0], acc.tokens[0], TOP_K)] += 1
            exp1[:TOP_K] += srt[0].double()
            if acc.num_accepted >= 1:
                obs2[rank_cell(p[1], acc.tokens[1], TOP_K)] += 1
                exp2[:TOP_K] += srt[1].double()
            al = float(torch.minimum(p[0], q[0]).sum()) if q is not None else float(p[0, dr[0]])
            a_ge1 += acc.num_accepted >= 1
            alpha_sum += al
            alpha_var += al * (1 - al)
    be.close()
    assert obs1[TOP_K] == 0 and obs2[TOP_K] == 0, "emitted a token the target's transform gives probability 0"
    z = (a_ge1 - alpha_sum) / max(alpha_var, 1e-9) ** 0.5
    return {"p_first": chi2_p(obs1, exp1), "p_second": chi2_p(obs2, exp2), "z_accept1": z, "hist": hist,
            "n_second": int(obs2.sum())}


@pytest.mark.slow  # chi-square over many seeded TT runs
@pytest.mark.parametrize("draft,seed", [("sample", 3), ("greedy", 4)])
def test_end_to_end_tt_spec_chi_square(gen, drafter, draft, seed):
    r = _e2e(gen, drafter, draft, steps=120, seed=seed)
    print(f"end to end draft={draft}: {r}")
    assert r["p_first"] > P_MIN and r["p_second"] > P_MIN, r
    assert abs(r["z_accept1"]) < 3.3, r  # two-sided p ~ 1e-3
    assert r["n_second"] >= 50 and sum(1 for c in r["hist"] if c) >= 2, r  # acceptance is exercised, mixed


@pytest.mark.slow  # repeated seeded TT generations
def test_seeded_runs_are_deterministic(gen, drafter):
    from qwen36.speculative.engine import speculative_generate

    def run(seed, draft="sample"):
        be = TTSpecBackend(gen, "shadow_commit", drafter=drafter)
        r = speculative_generate(be, [PROMPTS[0]], 24, [3], [SamplingParams(0.8, 20, 1.0, seed, draft=draft)])[0]
        be.close()
        return r.tokens, r.stats.accepted

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c


@pytest.mark.slow  # two CLI runs that load the TT model
def test_cli_generate_stochastic_prints_stats_and_is_deterministic(capsys):
    from qwen36.cli import main

    argv = ["generate", "--device", "emulated-p150x2", "--spec-k", "3", "--temperature", "0.8", "--top-k", "20",
            "--seed", "1", "-c", CKPT, "--prompt", "def ", "--max-new-tokens", "16"]
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert "mean accepted/step" in outs[0] and "accepted-count histogram" in outs[0], outs[0]
    ids = [next(l for l in o.splitlines() if l.startswith("ids:")) for o in outs]
    assert ids[0] == ids[1]
    stats = [[l for l in o.splitlines() if "accepted" in l] for o in outs]
    assert stats[0] == stats[1]
