"""Dev-only: the adapter's speculative side against the vllm-tt plugin's own speculative contract code, installed
next to this project (docs/serving_contract.md, "Speculative serving: which plugin sources exist"). Skipped unless the
installed ``vllm_tt_plugin`` has ``spec_decode`` (the e3fc849 plugin does not; CI installs no plugin and runs the
replay in tests/tt/serving/test_vllm_contract.py instead).

What runs here is the plugin's code, not our reading of it:
- the value types the adapter builds and returns are the plugin's classes (the runner checks them with
  ``isinstance``), and the adapter checks the verify / propose side tensors with the plugin's own
  ``check_spec_side_tensors``;
- the plugin's ``accept_greedy_drafts`` equals the accept walk the CI replay uses (``greedy_accept``) on random
  blocks, and the stand-in side-tensor check (what the adapter uses without the plugin) takes the same decisions;
- the speculative loop on the emulated 1x2 mesh with the plugin's ``accept_greedy_drafts`` doing the walk: tokens
  equal ``TTGenerator.greedy``, acceptance counts recorded;
- the inputs the plugin's contract-conformance tests (tests/spec/test_contract_conformance.py) feed its reference
  model to show a model refuses them, fed to ours on a live sequence;
- with vLLM importable too, the plugin's config-time admission (``spec_admission.resolve_speculative_plan``)
  resolves our class's plan, and refuses what it refuses for any model.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

spec_decode = pytest.importorskip(
    "vllm_tt_plugin.spec_decode",
    reason="no vllm-tt plugin with spec_decode installed (dev-only check; see docs/serving.md)")

import support.vllm_replay as harness  # noqa: E402
from qwen36.tt.serving import vllm_types as vt  # noqa: E402
from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM  # noqa: E402
from support.vllm_replay import K, N_NEW, P, PROMPT, PluginReplay, load_on_mesh, open_env, reference_greedy  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm")
    yield ck, ctx
    ctx.close()


@pytest.fixture(scope="module")
def reference(env):
    """TTGenerator.greedy on its own identity table (as the CI replay's fixture of the same name)."""
    return reference_greedy(*env)


@pytest.fixture(scope="module")
def spec(env):
    ck, ctx = env
    r = load_on_mesh(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=K))
    yield r
    r.m.close()


def test_adapter_uses_the_plugins_contract_code():
    assert vt.SOURCE == "vllm_tt_plugin.spec_decode"
    for name in ("SpecPlan", "SpecReject", "VerifyOutput", "DraftOutput", "check_spec_side_tensors"):
        assert getattr(vt, name) is getattr(spec_decode, name), name
    assert vt.PLACEHOLDER_TOKEN_ID == spec_decode.PLACEHOLDER_TOKEN_ID
    caps = Qwen36ForCausalLM.model_capabilities
    for key, known in (("spec_requirements", spec_decode.SPEC_REQUIREMENTS),
                       ("spec_hidden_handoff", spec_decode.HIDDEN_HANDOFFS)):
        assert spec_decode.normalize_declared_values(caps[key], known, key)  # known values, no typo, no repeat


def test_plan_against_the_plugins_types(spec):
    plan = Qwen36ForCausalLM.spec_plan(spec.vllm_config, 1, K)
    assert isinstance(plan, spec_decode.SpecPlan)
    assert plan.accepted_counts_range == (1, 1 + K) and plan.block_width == 1 + K
    assert plan.lanes_per_request == plan.block_width
    if hasattr(plan, "draft_cap"):  # newer sources: the per-batch draft cap the runner truncates drafts to
        assert plan.draft_cap(1) == K
    rej = Qwen36ForCausalLM.spec_plan(spec.vllm_config, 2, K)
    assert isinstance(rej, spec_decode.SpecReject) and rej.reason.strip()


def test_ci_accept_walk_equals_the_plugins():
    """The walk tests/tt/serving/test_vllm_contract.py replays in CI vs ``spec_decode.accept_greedy_drafts`` on random blocks
    (rows with and without drafts, matches that stop early, full acceptance, padding rows)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows, k = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        nv = torch.randint(0, k + 1, (rows,), generator=g, dtype=torch.int32)
        drafts = torch.randint(0, 6, (rows, k), generator=g, dtype=torch.int32)
        drafts[torch.arange(k).unsqueeze(0) >= nv.unsqueeze(1)] = spec_decode.PLACEHOLDER_TOKEN_ID
        ids = torch.randint(0, 6, (rows, k + 1), generator=g, dtype=torch.int32)
        agree = torch.rand(rows, k, generator=g) < 0.7  # mostly matching drafts, so long accepts occur
        ids[:, :k] = torch.where(agree & (drafts >= 0), drafts, ids[:, :k])
        want = spec_decode.accept_greedy_drafts(ids, drafts, nv)
        got = harness.greedy_accept(ids, drafts, nv)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_stand_in_side_tensor_check_matches_the_plugins():
    """The adapter's stand-in (what it checks with when the plugin is absent) takes the plugin's decisions."""
    stand_in = vt.check_spec_side_tensors_stand_in
    cases = [(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32)),
             (torch.tensor([4, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)),
             (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)),
             (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 5], dtype=torch.int32)),
             (torch.tensor([0, 0]), torch.tensor([1, 1], dtype=torch.int32)),
             (torch.tensor([0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)),
             (torch.tensor([0, 0], dtype=torch.int32), None), (None, torch.tensor([1, 1], dtype=torch.int32))]
    for nv, ac in cases:
        outcomes = []
        for check in (spec_decode.check_spec_side_tensors, stand_in):
            try:
                check(nv, ac, 2, 3)
                outcomes.append("ok")
            except ValueError as e:
                outcomes.append(str(e).split(" must")[0].split(" entries")[0])
        assert outcomes[0] == outcomes[1], (nv, ac, outcomes)


def test_spec_loop_with_the_plugins_accept_walk(reference, spec, monkeypatch):
    """The runner's speculative loop (verify -> accept walk -> propose, the first verify draftless) on the emulated
    mesh, the walk done by the plugin's ``accept_greedy_drafts``: tokens == ``TTGenerator.greedy``. The CI
    checkpoint's MTP drafts are (almost) never accepted, so two steps carry drafts the scheduler could have sent
    from elsewhere: the greedy continuation (all K accepted) and one with its second draft wrong (one accepted)."""
    monkeypatch.setattr(contract, "greedy_accept", spec_decode.accept_greedy_drafts)
    r, (ref, _) = spec, reference
    emitted = [r.prefill(PROMPT)]
    pos = P
    block = r.verify(emitted[-1], pos, [], 1)
    emitted += block
    pos += 1
    counts, v = [], r.m.model.args.cfg.vocab_size
    while len(emitted) < N_NEW:
        drafts = r.propose(block, pos)
        i = len(emitted)
        if len(counts) == 1:
            drafts = ref[i: i + K]
        if len(counts) == 3:
            drafts = [ref[i], (ref[i + 1] + 1) % v] + ref[i + 2: i + K]
        block = r.verify(emitted[-1], pos, drafts, len(block))
        counts.append(len(block))
        emitted += block
        pos += len(block)
    assert emitted[:N_NEW] == ref[:N_NEW]
    assert counts[1] == 1 + K and counts[3] == 2 and all(1 <= c <= 1 + K for c in counts), counts
    r.finish()


def test_contract_conformance_inputs_are_refused(spec):
    """The inputs the plugin's conformance tests show its reference model refusing, fed to ours on a live sequence
    right after a draftless verify (each invalid in one way; the well-formed call runs afterwards)."""
    r, m = spec, spec.m
    first = r.prefill(PROMPT)
    block = r.verify(first, P, [], 1)
    committed, counts, vpos = r.last
    cp = harness.committed_positions(vpos, 1 + K)
    i32 = dict(dtype=torch.int32)
    tok = torch.tensor([[block[0]] + [vt.PLACEHOLDER_TOKEN_ID] * K], **i32)
    pos = torch.tensor([[P + 1] + [-1] * K], **i32)

    def verify(nv, ac, t=tok, p=pos, **kw):
        return m.decode_forward(tokens=t, start_pos=p, num_valid_drafts=nv, accepted_counts=ac, **kw)

    ones, zeros = torch.ones(1, **i32), torch.zeros(1, **i32)
    with pytest.raises(TypeError):  # side tensors without spec_mode
        verify(zeros, ones)
    for nv, ac in ((zeros, torch.zeros(1, **i32)), (zeros, torch.full((1,), K + 2, **i32)),  # count outside [1, 1+K]
                   (zeros, torch.ones(1, dtype=torch.int64)), (zeros, None),  # not int32 / absent
                   (torch.full((1,), -1, **i32), ones), (torch.full((1,), K + 1, **i32), ones),  # drafts outside [0, K]
                   (torch.zeros(2, **i32), ones)):  # mis-sized
        with pytest.raises(ValueError):
            verify(nv, ac, spec_mode="argmax_ids")
    with pytest.raises(ValueError, match="at least one row"):
        verify(torch.zeros(0, **i32), torch.zeros(0, **i32), tok[:0], pos[:0], spec_mode="argmax_ids")
    with pytest.raises(ValueError):  # tokens and positions of different shapes
        verify(zeros, ones, tok, pos[:, :K], spec_mode="argmax_ids")
    for ct, p in ((committed[0], cp[0]), (committed, cp[:, :K]), (committed[:, :K], cp[:, :K]),
                  (committed[:0], cp[:0])):
        with pytest.raises(ValueError):  # 1-D, shapes differ, not 1+K wide, no row
            m.propose_draft_tokens(K, ct, p, counts)
    out = verify(zeros, ones, spec_mode="argmax_ids")  # well formed: still served
    assert isinstance(out, spec_decode.VerifyOutput) and tuple(out.argmax_ids.shape) == (1, 1 + K)
    r.finish()


def test_plugins_admission_resolves_our_plan(spec):
    """``spec_admission.resolve_speculative_plan`` (the platform's config-time step) with our class: the
    model-owned drafter method with its sentinel is admitted with our plan; the plugin's generic refusals hold."""
    pytest.importorskip("vllm.config.speculative",
                        reason="vLLM is not installed (the admission reads its method names)")
    adm = pytest.importorskip("vllm_tt_plugin.spec_admission")
    vc = spec.vllm_config

    def config(**spec_kw):
        sc = SimpleNamespace(**{"method": adm.MODEL_OWNED_DRAFT_METHOD, "model": adm.MODEL_OWNED_DRAFT_SENTINEL,
                                "num_speculative_tokens": K, **spec_kw})
        return SimpleNamespace(**{**vars(vc), "speculative_config": sc})

    caps = Qwen36ForCausalLM.model_capabilities
    plan = adm.resolve_speculative_plan(config(), Qwen36ForCausalLM, caps, 1)
    assert isinstance(plan, spec_decode.SpecPlan) and plan.effective_k == K
    with pytest.raises(ValueError, match="model_owned_drafter"):
        adm.resolve_speculative_plan(config(model="my.drafter"), Qwen36ForCausalLM, caps, 1)
    with pytest.raises(ValueError, match="max_num_seqs=2"):  # our SpecReject, reported by the plugin
        adm.resolve_speculative_plan(config(), Qwen36ForCausalLM, caps, 2)
    with pytest.raises(ValueError, match="supported draft lengths"):
        adm.resolve_speculative_plan(config(num_speculative_tokens=99), Qwen36ForCausalLM, caps, 1)
    lane = adm.classify_spec_decode_lane
    assert lane(SimpleNamespace(temperature=0.0))[0] == adm.SPEC_DECODE_LANE_SPECULATIVE
    assert lane(SimpleNamespace(temperature=0.7))[0] == adm.SPEC_DECODE_LANE_ORDINARY  # refused for our class


def test_runner_builds_what_the_ci_replay_builds(reference, spec):
    """With the plugin's whole runner installed: the speculative loop for one request with every runner-side tensor
    built by ``TTModelRunner``'s own helpers (``_spec_row_state`` with the plan's ``draft_cap``,
    ``_spec_candidate_block``, ``_committed_positions``) and the walk by ``accept_greedy_drafts``, one step keeping
    a single scheduled draft; each block equals what the CI replay builds and the tokens equal
    ``TTGenerator.greedy``."""
    mr = pytest.importorskip("vllm_tt_plugin.model_runner",
                             reason="the plugin's runner is not installed (only its contract modules are)")
    runner = mr.TTModelRunner
    for name in ("_spec_row_state", "_spec_candidate_block", "_committed_positions"):
        if not hasattr(runner, name):
            pytest.skip(f"this plugin's runner has no {name}")
    r, m, ref = spec, spec.m, reference[0]
    plan = Qwen36ForCausalLM.spec_plan(r.vllm_config, 1, K)
    emitted = [r.prefill(PROMPT)]
    accepted, proposed, step, seen, v = {}, [], 0, [], m.model.args.cfg.vocab_size
    while len(emitted) < N_NEW:
        n = P + len(emitted)  # tokens so far; the pending one sits at n - 1
        i = len(emitted)
        if step == 2:  # drafts from elsewhere (the CI MTP's are rarely accepted): the greedy continuation
            proposed = ref[i: i + K]
        if step == 4:  # its second draft wrong
            proposed = [ref[i], (ref[i + 1] + 1) % v] + ref[i + 2: i + K]
        sched = {"r": proposed[: 1 if step == 6 else K]}  # the scheduler keeps fewer than proposed
        drafts, nv, counts = runner._spec_row_state(accepted, sched, ["r"], K, plan.draft_cap(1))
        tokens, positions = runner._spec_candidate_block(drafts, nv, torch.tensor([[emitted[-1]]], dtype=torch.int32),
                                                         torch.tensor([n - 1]))
        nvi = int(nv[0])
        want = [emitted[-1]] + sched["r"][:nvi] + [vt.PLACEHOLDER_TOKEN_ID] * (K - nvi)
        assert tokens[0].tolist() == want
        assert positions[0].tolist() == [n - 1 + j if j <= nvi else -1 for j in range(K + 1)]
        out = m.decode_forward(tokens=tokens, start_pos=positions, page_table=r.table(n + 2 * K + 2), kv_cache=r.kv,
                               **r._rope(), enable_trace=True, read_from_device=True, num_valid_drafts=nv,
                               accepted_counts=counts, spec_mode="argmax_ids")
        committed, counts = spec_decode.accept_greedy_drafts(out.argmax_ids, drafts, nv)
        cp = runner._committed_positions(positions, K + 1)
        assert torch.equal(cp, harness.committed_positions(positions.to(torch.int32), K + 1))
        a = int(counts[0])
        seen.append(a)
        emitted += committed[0, :a].tolist()
        accepted["r"] = a
        d = m.propose_draft_tokens(K, committed, cp, counts, hidden=out.hidden)
        proposed = d.draft_token_ids[0, : int(d.num_valid[0])].tolist()
        step += 1
    assert emitted[:N_NEW] == ref[:N_NEW]
    assert seen[2] == 1 + K and seen[4] == 2, seen
    r.finish()


HELPER_TRACE = Path(__file__).resolve().parents[2] / "data" / "vllm_tt_plugin_spec_helpers.json"


def _helper_cases(runner) -> dict:
    """Inputs -> outputs of the plugin's pure speculative helpers, on cases the CI replay also builds: a draftless
    verify, short / full / truncated proposals (``draft_cap``), padding rows for the drafter positions, and accept
    walks that stop at every column."""
    def t(x):
        return x.tolist()

    blocks = []
    for tok, pos, drafts, k, accepted, cap in ((9, 40, [], 3, 1, 3), (11, 41, [5, 6], 3, 1, 3),
                                               (12, 43, [7, 8, 9], 3, 2, 3), (13, 47, [1, 2, 3], 3, 4, 2),
                                               (14, 50, [4, 5, 6, 7, 8], 5, 3, 5)):
        d, nv, counts = runner._spec_row_state({"r": accepted}, {"r": drafts}, ["r"], k, cap)
        tokens, positions = runner._spec_candidate_block(d, nv, torch.tensor([[tok]], dtype=torch.int32),
                                                         torch.tensor([pos]))
        blocks.append({"tok": tok, "pos": pos, "drafts": drafts, "k": k, "accepted": accepted, "draft_cap": cap,
                       "tokens": t(tokens), "positions": t(positions), "draft_token_ids": t(d),
                       "num_valid_drafts": t(nv), "accepted_counts": t(counts)})
    positions = torch.tensor([[40, 41, 42, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    committed = {"verify_positions": t(positions), "width": 4, "out": t(runner._committed_positions(positions, 4))}
    walks = []
    ids = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 8], [0, 0, 0, 0]], dtype=torch.int32)
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, -1], [-1, -1, -1]], dtype=torch.int32)
    nv = torch.tensor([3, 3, 3, 2, 0], dtype=torch.int32)
    c, n = spec_decode.accept_greedy_drafts(ids, drafts, nv)
    walks.append({"argmax_ids": t(ids), "draft_token_ids": t(drafts), "num_valid_drafts": t(nv),
                  "committed": t(c), "counts": t(n)})
    return {"blocks": blocks, "committed_positions": committed, "accept_walks": walks}


def test_plugin_helper_cases_equal_the_recorded_trace(tmp_path):
    """Records what the plugin's runner helpers and accept walk return on fixed cases and compares it with
    tests/data/vllm_tt_plugin_spec_helpers.json, which tests/tt/serving/test_vllm_contract.py replays against the CI
    replay's own constructors (a changed plugin shows up here first)."""
    import json

    mr = pytest.importorskip("vllm_tt_plugin.model_runner",
                             reason="the plugin's runner is not installed (only its contract modules are)")
    got = _helper_cases(mr.TTModelRunner)
    (tmp_path / HELPER_TRACE.name).write_text(json.dumps(got))
    want = json.loads(HELPER_TRACE.read_text())
    assert got == want["cases"], (f"the plugin's helpers return something else than {HELPER_TRACE}; if the plugin "
                                  f"changed on purpose, replace its cases with {tmp_path / HELPER_TRACE.name}")
