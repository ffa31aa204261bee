"""Batched speculative verify on the reference (``ReferenceBackend`` with B slots: one packed B x (K+1) forward per
step, per-user accept and commit): lossless against each user's batch-1 greedy output, per-user stochastic exactness
(chi-square), the masked-inert rows of ``packed_forward`` against batch-1 forwards (logits and states), and the
batched transaction probe (fast: B = 2; slow: B = 4)."""
from __future__ import annotations

import argparse

import pytest
import torch

from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.probes import gdn_transaction as probe
from qwen36.reference.batch import SlotDecoder, packed_forward
from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import SpecBackend, speculative_generate
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.speculative.reference_mechanisms import ShadowCommit
from qwen36.speculative.sampling import SamplingParams, probs_from_logits
from qwen36.testing.stats import P_VALUE_MIN, chi_square_p

# fp32 on CPU: a [B, T] forward may round differently from [1, T] (observed max abs ~1e-6 here)
ATOL = 1e-4
TEXTS = ["def add(a, b):\n", "import os\n", "class Point:\n    def __init__(self, x, y):\n", "x = [",
         "for i in range(10):\n    ", "# sum of squares\n", "def f(", "while True:\n"]


@pytest.fixture(scope="module")
def ci_model(ci_ckpt):
    return Qwen36Model.from_checkpoint(ci_ckpt, require_mtp=True)


@pytest.fixture(scope="module")
def default_model():
    return Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, require_mtp=True)


@pytest.fixture(scope="module")
def code_prompts():
    from qwen36.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    return [tok.encode(t) for t in TEXTS]


@torch.no_grad()
def plain_greedy(model, prompt, n, eos=()):
    """Batch-1 plain greedy through the scalar-position path (independent of the slot machinery)."""
    state = model.new_state(1, len(prompt) + n + 1)
    out = model(torch.tensor([prompt]), state)
    toks = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
        if tok in eos or len(toks) >= n:
            return toks
        out = model(torch.tensor([[tok]]), state)


# ---- the masked-inert packed forward -------------------------------------------------------------------
@torch.no_grad()
def test_packed_forward_inert_rows_leave_no_trace(ci_model):
    """Three users at different positions, 4 rows each, of which 4 / 2 / 0 are real: each user's logits of its
    real rows, GDN recurrent + conv state, KV rows and position equal a batch-1 forward of its real rows only;
    the user with none keeps its state exactly; a NaN-poisoned free slot leaks nowhere."""
    m, g = ci_model, torch.Generator().manual_seed(3)
    v = m.config.vocab_size
    dec = SlotDecoder(m, 4, 40)
    prompts = [torch.randint(0, v, (n,), generator=g).tolist() for n in (3, 9, 5)]
    for s, p in enumerate(prompts):
        dec.join(s, p)
    for st in dec.state.gdn_states():  # slot 3 is free and poisoned
        st.recurrent = st.recurrent.index_fill(0, torch.tensor([3]), float("nan"))
    for c in dec.state.kv_caches():
        c.k[3], c.v[3] = float("nan"), float("nan")
    rows = torch.randint(0, v, (4, 4), generator=g)
    n_valid = torch.tensor([4, 2, 0, 0])
    before = dec.state.clone()
    out = packed_forward(m, dec.state, rows, n_valid, dec.active)
    for s, p in enumerate(prompts):
        ref = m.new_state(1, 40)
        m(torch.tensor([p]), ref)
        ref_out = m(rows[s:s + 1, : int(n_valid[s])], ref, gdn_mode="recurrent") if n_valid[s] else None
        if ref_out is not None:
            assert (out.logits[s, : int(n_valid[s])] - ref_out.logits[0]).abs().max() < ATOL
        for x, y in zip(dec.state.gdn_states(), ref.gdn_states()):
            assert (x.recurrent[s] - y.recurrent[0]).abs().max() < ATOL
            assert (x.conv[s] - y.conv[0]).abs().max() < ATOL
        end = ref.pos
        for x, y in zip(dec.state.kv_caches(), ref.kv_caches()):
            assert (x.k[s, :, :end] - y.k[0, :, :end]).abs().max() < ATOL
        assert int(dec.state.pos[s]) == end
    for x, y in zip(dec.state.gdn_states(), before.gdn_states()):  # user 2 (no real rows): bit for bit
        assert torch.equal(x.recurrent[2], y.recurrent[2]) and torch.equal(x.conv[2], y.conv[2])
        assert x.recurrent[3].isnan().all()  # the free slot: put back, not advanced
    assert dec.state.pos.tolist()[2:] == before.pos.tolist()[2:]
    assert out.logits[:3].isfinite().all()
    with pytest.raises(ValueError, match="free slot"):
        packed_forward(m, dec.state, rows, torch.tensor([1, 1, 1, 1]), dec.active)


# ---- lossless --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,mechanism", [(2, "snapshot"), (4, "shadow_commit"),
                                         pytest.param(8, "recompute", marks=pytest.mark.slow)])
def test_packed_speculative_greedy_is_lossless(default_model, code_prompts, b, mechanism):
    """B users in one ReferenceBackend: prompts of different lengths, different depths (users with fewer
    valid drafts than the step's K), one user joining mid-run while the others sit in their steps and, with
    fewer slots than users, a late user reusing the slot of one that stopped early at an EOS. Each user's tokens
    equal its plain batch-1 greedy output, and tokens + per-step accepted counts equal its own single-user
    speculative run."""
    m, n = default_model, 16
    prompts = code_prompts[:b]
    depths = [3, 2, 3, 1, 3, 2, 1, 3][:b]
    arrivals = [0] * (b - 1) + [8 if b >= 4 else 2]
    eos = (plain_greedy(m, prompts[1], n)[2],)  # user 1 stops within 3 rounds and frees its slot
    slots = b - 1 if b >= 4 else b
    be = ReferenceBackend(m, mechanism, max_len=max(map(len, prompts)) + n + 4, slots=slots, max_k=3)
    assert isinstance(be, SpecBackend)
    got = speculative_generate(be, prompts, n, depths, [SamplingParams()] * b, eos, arrivals)
    for p, k, r in zip(prompts, depths, got):
        assert r.tokens == plain_greedy(m, p, n, eos)
        alone = speculative_generate(ReferenceBackend(m, mechanism, max_len=len(p) + n + 4), [p], n, [k],
                                     eos_ids=eos)[0]
        assert (r.tokens, r.stats.accepted) == (alone.tokens, alone.stats.accepted)
    steps = [(a, k) for r in got for a, k in zip(r.stats.accepted, r.stats.depths)]
    assert any(a == 0 for a, _ in steps) and any(a == k for a, k in steps), steps  # both commit branches ran
    assert len({r.stats.steps for r in got}) > 1
    assert be.counters.steps < sum(r.stats.steps for r in got)  # steps really were shared
    assert be.counters.target_forwards >= be.counters.steps and not be.users  # everyone left at the end


def test_packed_speculative_refuses_misuse(ci_model):
    be = ReferenceBackend(ci_model, max_len=16, slots=2, max_k=2)
    be.join(0, [1, 2, 3])
    with pytest.raises(ValueError, match="holds no user"):
        be.draft({1: 1})
    with pytest.raises(ValueError, match=r"draft depth must be in \[1, 2\]"):
        be.draft({0: 3})
    d = be.draft({0: 2})
    with pytest.raises(RuntimeError, match="open step"):
        be.join(1, [4])
    v = be.verify(d)
    with pytest.raises(ValueError, match="one acceptance per user"):
        be.commit({})
    be.commit(be.accept(d, v))
    with pytest.raises(ValueError, match="no slot is free"):
        speculative_generate(ReferenceBackend(ci_model, max_len=16, max_k=1), [[1], [2]], 4, [1, 1],
                             [SamplingParams()] * 2)


# ---- stochastic --------------------------------------------------------------------------------------------
def test_packed_speculative_stochastic_equals_each_users_batch1_run(default_model, code_prompts):
    """Stochastic, with a penalty and logprobs on some users: each user samples from its own generator, so its
    tokens, accepted counts and logprobs equal its batch-1 run with the same params."""
    prompts, n, k = code_prompts[:3], 12, 2
    params = [SamplingParams(temperature=0.8, top_k=50, seed=10, presence_penalty=0.5),
              SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.2, draft="greedy"),
              SamplingParams(temperature=0.7, top_p=0.9, seed=12, logprobs=2)]
    be = ReferenceBackend(default_model, "recompute", max_len=64, slots=3, max_k=k)
    got = speculative_generate(be, prompts, n, [k] * 3, params)
    for p, pr, r in zip(prompts, params, got):
        alone = speculative_generate(ReferenceBackend(default_model, "recompute", max_len=64), [p], n, [k], [pr])[0]
        assert (r.tokens, r.stats.accepted) == (alone.tokens, alone.stats.accepted)
        if pr.logprobs is not None:
            assert [x.token for x in r.logprobs] == r.tokens
            for x, y in zip(r.logprobs, alone.logprobs):
                assert x.token == y.token and abs(x.logprob - y.logprob) < ATOL


@pytest.mark.slow  # 400 packed steps
@torch.no_grad()
def test_packed_speculative_stochastic_chi_square_per_user(ci_model):
    """B = 4 users with different sampling params in one packed step: the first emitted token of each user
    (accepted draft or residual sample) follows that user's own target distribution (chi-square), over many
    steps re-seeded each time (draft -> verify -> accept -> abort)."""
    m, trials, k = ci_model, 400, 2
    v = m.config.vocab_size
    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=t, top_k=tk, seed=0) for t, tk in ((1.0, 6), (0.7, 8), (1.3, 5), (1.0, 10))]
    params[3] = SamplingParams(temperature=1.0, top_k=10, seed=0, draft="greedy")
    be = ReferenceBackend(m, "shadow_commit", max_len=32, slots=4, max_k=k)
    targets = []
    for s, p in enumerate(params):
        prompt = torch.randint(0, v, (4 + 3 * s,), generator=g).tolist()
        be.join(s, prompt, p)
        alone = ReferenceBackend(m, "shadow_commit", max_len=32)  # the user's own target row 0, batch 1
        alone.join(0, prompt, p)
        live = alone.live(0)
        row0 = m(torch.tensor([[live.pending]]), live.state).logits[:, -1]
        targets.append(probs_from_logits(row0, p)[0])
    counts = torch.zeros(4, v)
    depths = {s: k for s in range(4)}
    for t in range(trials):
        for s in range(4):
            be.users[s].generator.manual_seed(1000 + 7 * t + s)
        d = be.draft(depths)
        acc = be.accept(d, be.verify(d))
        for s in range(4):
            counts[s, acc[s].tokens[0]] += 1
        be.abort()
    for s in range(4):
        p_val = chi_square_p(counts[s], targets[s])
        assert p_val > P_VALUE_MIN, f"user {s}: chi-square p={p_val:.2e}"
    # the test can fail: user 0's counts against user 1's distribution
    assert chi_square_p(counts[0], targets[1]) < 1e-6


# ---- the batched transaction probe --------------------------------------------------------------------------
def batch_args(b: int, ks: str) -> argparse.Namespace:  # what `probe gdn-transaction --batch B` passes
    return argparse.Namespace(device="reference", full=False, checkpoint=None, ks=ks, seed=0, batch=b)


def test_batch_probe_b2_passes(tmp_path, capsys):
    """`qwen36 probe gdn-transaction --batch 2` through the command line: one JSONL record, labelled by what ran,
    every cell passing with the two users at a = 0 and a = K in the same step."""
    from qwen36.cli import main
    from qwen36.probes.records import read_records

    argv = ["probe", "gdn-transaction", "--device", "reference", "--batch", "2", "--ks", "3"]
    assert main(argv + ["--records-dir", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("gdn-transaction-*.jsonl")
    (report,) = read_records(f)
    assert report["backend"] == "reference (torch CPU)" and report["config"]["batch"] == 2
    assert len(report["cells"]) == len(MECHANISMS)
    assert report["verdict"] == "pass", [(c["cell"], c["failed"]) for c in report["cells"] if not c["pass"]]
    assert not report["gate_complete"]  # K = 2 did not run
    for c in report["cells"]:
        assert [u["accepted"] for u in c["users"]] == [0, 3]
    assert report["counters"]["shadow_commit"]["state_copies"] == 0
    capsys.readouterr()
    try:
        rc = main(argv[:-4] + ["--batch", "0", "--records-dir", str(tmp_path)])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--batch must be >= 1" in capsys.readouterr().err


@pytest.mark.slow  # 6 cells at B = 4
def test_batch_probe_b4_passes():
    report = probe.run(batch_args(4, ",".join(map(str, probe.BATCH_KS))))
    assert report.verdict == "pass", [(c["cell"], c["failed"]) for c in report.cells if not c["pass"]]
    assert report.gate_complete and len(report.cells) == len(MECHANISMS) * len(probe.BATCH_KS)
    for c in report.cells:
        k = c["k"]
        assert [u.get("accepted") for u in c["users"]] == [0, k, k - 1, None]
        assert c["users"][3]["pass"] and all(c["users"][3]["untouched"].values())


class ShadowIgnoresInertRows(ShadowCommit):
    """Broken: points a user that drafted fewer rows than the step's K at the state after the step's last row."""

    def commit(self, be, txn, a):
        super().commit(be, txn, a)
        rows, wrong = torch.arange(be.slots), torch.where(a == txn.kvec, txn.k, a)
        for i in be.gdn_ids:
            g, s = be.state.layers[i], txn.verify.slots[i]
            g.recurrent = torch.where(txn.part[:, None, None, None], s.recurrent[rows, wrong], g.recurrent)


class ShadowCommitsEveryone(ShadowCommit):
    """Broken: commits every slot, also the one sitting the step out."""

    def commit(self, be, txn, a):
        txn.part = txn.part | be.occupied
        super().commit(be, txn, a)


@pytest.mark.parametrize("broken,must_fail", [(ShadowIgnoresInertRows, "user2:gdn_recurrent"),
                                              (ShadowCommitsEveryone, "user3:touched")])
def test_broken_batch_mechanisms_fail_the_probe(ci_model, monkeypatch, broken, must_fail):
    """The probe catches a user committed past its own valid rows, and a user moved although it sat out."""
    import qwen36.probes.gdn_transaction as mod

    real = mod.ReferenceBackend
    monkeypatch.setattr(mod, "ReferenceBackend", lambda model, mechanism, **kw: real(model, broken(), **kw))
    cells, _ = probe.run_batch_matrix(ci_model, batch=4, ks=(3,), mechanisms=("shadow_commit",))
    assert not cells[0]["pass"] and must_fail in cells[0]["failed"], cells[0]["failed"]


def test_packed_speculative_with_depth_controllers(default_model, code_prompts):
    """`--spec-k auto` with several users: one depth controller per user, so users draft different K in the same
    packed step; each user's tokens, accepted counts and chosen depths equal its single-user run."""
    from qwen36.speculative.depth import DepthPolicy, cost_key

    def ctrl():
        return DepthPolicy.load().controller(cost_key("reference"))

    prompts, n = code_prompts[:3], 12
    ctrls = [ctrl() for _ in prompts]
    be = ReferenceBackend(default_model, "shadow_commit", max_len=64, slots=3, max_k=ctrls[0].k_max)
    got = speculative_generate(be, prompts, n, ctrls, [SamplingParams()] * 3)
    for p, r in zip(prompts, got):
        alone = speculative_generate(ReferenceBackend(default_model, "shadow_commit", max_len=64), [p], n, [ctrl()])[0]
        assert (r.tokens, r.stats.accepted, r.stats.depths) == (alone.tokens, alone.stats.accepted, alone.stats.depths)
    assert len({k for r in got for k in r.stats.depths}) > 1  # K differed between users / steps


def test_plan_next_depths_is_called_between_accept_and_commit(ci_model):
    """A batched backend that drafts the next step inside its commit is told the next depths first: one call per
    step, after accept and before commit, naming every user that goes on (not the ones that just finished)."""
    calls: list[tuple[str, dict]] = []

    class Planning(ReferenceBackend):
        def accept(self, draft, verify):
            calls.append(("accept", {}))
            return super().accept(draft, verify)

        def plan_next_depths(self, depths):
            calls.append(("plan", dict(depths)))

        def commit(self, acceptances):
            calls.append(("commit", {}))
            super().commit(acceptances)

    be = Planning(ci_model, max_len=32, slots=2, max_k=2)
    got = speculative_generate(be, [[1, 2, 3], [4, 5]], 6, [2, 1], [SamplingParams()] * 2)
    assert [c[0] for c in calls] == ["accept", "plan", "commit"] * be.counters.steps
    plans = [c[1] for c in calls if c[0] == "plan"]
    assert all(set(p.values()) <= {1, 2} and p.get(0, 2) == 2 and p.get(1, 1) == 1 for p in plans)
    assert plans[-1] == {} and all(len(r.tokens) == 6 for r in got)  # the last step finishes whoever was left
