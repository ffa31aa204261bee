"""Draft depth changing between steps on the TT path (``TTSpecBackend(depths=...)``, ``--spec-k auto``), emulated
1x2 P150a mesh: per-depth traces over one device state.

* a forced depth schedule (3, 1, 5, 2, 2, 5, ...) with a host drafter that makes acceptance lengths mixed: after
  every step the committed state (GDN recurrent: the ring slot the next verify starts from for shadow_commit; conv
  windows; target KV rows [0, n); position; pending token) is compared with the TT single-row decode replay of
  the same tokens (the oracle of probes/gdn_transaction_tp.py, same tolerances), and each per-depth trace is
  captured exactly once;
* the fitted depth controller with the device MTP on the shipped checkpoint: greedy output == TT plain greedy ==
  the torch reference's greedy, every commit mechanism, and the controller really switched depth;
* stochastic acceptance with the depth changing every step: chi-square of the emitted tokens against the target's
  own distribution (the end-to-end test of tests/tt/spec/test_spec_stochastic.py, shorter), also with penalties;
* penalties under auto K: every depth's acceptor reads and commits one token-count buffer; greedy with penalties
  == plain greedy with penalties (TT and reference), and the device counts == the host token history;
* refusals: a depth outside ``depths``, a draft at a depth the last commit did not prepare, a depth change
  without ``depths``.
"""
from __future__ import annotations

import pytest
import torch

from qwen36.probes.gdn_transaction_tp_checks import compare, kv_logical, kv_states, per_device
from qwen36.speculative.depth import DepthPolicy
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.generation.sampling import SamplingParams, probs_from_logits
from qwen36.testing.speculative import oracle_drafter
from qwen36.testing.tt import device_position, make_bf16_checkpoint, read_scalar, small_tt_generator
from qwen36.tt.spec.spec_backend import TTSpecBackend

PROMPT = list(range(5, 17))
SCHEDULE = [3, 1, 5, 2, 2, 5, 1, 3, 3, 1, 2, 5]
DEPTHS = (1, 2, 3, 5)
CKPT = "models/qwen36/default_checkpoint"


@pytest.fixture(scope="module")
def ci_ck(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("depth") / "ci", "ci")


@pytest.fixture(scope="module")
def ci_gen(ci_ck):
    g = small_tt_generator(ci_ck, prefill_chunk=64)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ci_plain(ci_gen):
    out = ci_gen.generate([PROMPT], sum(SCHEDULE) + len(SCHEDULE) + 2)[0].tokens
    ci_gen.release_trace()
    return out


def _state(gen, rec: list) -> dict:
    gdn = gen.state.gdn_states()
    return {"gdn_recurrent": [torch.cat(r, 1).float() for r in rec],
            "conv": [torch.cat(per_device(gen.ttnn, s.conv), 3).float() for s in gdn],
            "kv": [(per_device(gen.ttnn, s.k), per_device(gen.ttnn, s.v)) for s in kv_states(gen.state)]}


def _decode_oracle(gen, prompt: list[int], tokens: list[int]) -> dict[int, dict]:
    """Committed state after n tokens (n = len(prompt) .. len(prompt) + len(tokens)): TT prefill, then one eager
    single-row decode per token."""
    m = gen.model
    gen.reset()
    m.prefill_forward(torch.tensor(prompt), gen.state)
    live = lambda: [per_device(gen.ttnn, s.recurrent) for s in gen.state.gdn_states()]  # noqa: E731
    out = {len(prompt): _state(gen, live())}
    for i, tok in enumerate(tokens):
        m.copy_host_to_device(m.prepare_decode_inputs_host([int(tok)], len(prompt) + i), gen.inputs)
        m.decode_forward(gen.inputs, gen.state)
        out[len(prompt) + i + 1] = _state(gen, live())
    return out


def _committed_rec(be: TTSpecBackend) -> list:
    """The recurrent state the next verify starts from: shadow_commit's ring slots (ring index of the next depth),
    laid out like the live state [Hv, Dk, Dv]."""
    ttnn = be.ttnn
    if not be.mechanism.ring:
        return [per_device(ttnn, s.recurrent) for s in be.state.gdn_states()]
    nxt = be._by_k[be.next_depth]
    idx = per_device(ttnn, nxt.acceptor.block_idx)
    return [[r[i.reshape(-1).long()] for r, i in zip(per_device(ttnn, nxt.step_state.layer_bufs[id(s)].ring),
                                                            idx)]
            for s in be.state.gdn_states()]


@pytest.mark.slow  # 12 traced steps over 4 depths + a decode oracle per mechanism
@pytest.mark.parametrize("mech", MECHANISMS)
def test_forced_depth_schedule_commits_the_decode_oracle_state(ci_gen, ci_plain, mech):
    gen = ci_gen
    steps = []
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, ci_plain), depths=DEPTHS, use_trace=True)
    be.join(0, PROMPT)
    for i, k in enumerate(SCHEDULE):
        d = be.draft({0: k})
        acc = be.accept(d, be.verify(d))[0]
        be.plan_next_depths({0: SCHEDULE[i + 1] if i + 1 < len(SCHEDULE) else k})
        be.commit({0: acc})
        n = device_position(be)
        assert n == be.n and int(read_scalar(be.step_state, be.step_state.pending)) == be.history[-1]
        steps.append((k, acc.num_accepted, n, _state(gen, _committed_rec(be))))
    captures = dict(be.traces.captures)
    be.close()
    emitted = be.history[len(PROMPT):]
    assert emitted == ci_plain[:len(emitted)]
    assert len({a for _, a, _, _ in steps}) >= 3, "acceptance lengths must be mixed"
    assert len({(k, k2) for (k, *_), (k2, *_) in zip(steps, steps[1:]) if k != k2}) >= 5, "depth switches"
    # every per-depth trace captured exactly once (later uses replay it)
    names = {f"{w}:{k}" for w in ("verify", "commit") for k in set(SCHEDULE)}
    if be.mechanism.ring:  # switching depth moves the committed recurrent state between the per-depth rings
        names |= {f"leave:{k}" for k, k2 in zip(SCHEDULE, SCHEDULE[1:]) if k != k2}
        names |= {f"enter:{k2}" for k, k2 in zip(SCHEDULE, SCHEDULE[1:]) if k != k2}
    assert captures == {name: 1 for name in names}
    oracle = _decode_oracle(gen, PROMPT, [be.history[len(PROMPT)]] + emitted[1:])  # rows = pending + emitted
    table = gen.state.page_table_host[0]
    for k, a, n, got in steps:
        want = oracle[n]
        for name in ("gdn_recurrent", "conv"):
            r = compare(got[name], want[name], name)
            assert r["pass"], (mech, k, a, n, name, r)
        kv_got = [kv_logical(p, table, n) for kv in got["kv"] for p in kv]
        kv_want = [kv_logical(p, table, n) for kv in want["kv"] for p in kv]
        r = compare(kv_got, kv_want, "target_kv")
        assert r["pass"], (mech, k, a, n, "target_kv", r)


def test_refuses_depths_it_was_not_built_for(ci_gen, ci_plain):
    be = TTSpecBackend(ci_gen, "snapshot", drafter=oracle_drafter(PROMPT, ci_plain), depths=(1, 2), use_trace=False)
    be.join(0, PROMPT)
    with pytest.raises(ValueError, match="not one of this backend's depths"):
        be.draft({0: 3})
    d = be.draft({0: 2})
    acc = be.accept(d, be.verify(d))[0]
    with pytest.raises(ValueError, match="not one of this backend's depths"):
        be.plan_next_depths({0: 4})
    be.commit({0: acc})  # nothing planned: the next step drafts at the same depth
    with pytest.raises(ValueError, match="plan_next_depth"):
        be.draft({0: 1})
    with pytest.raises(RuntimeError, match="between accept"):
        be.plan_next_depths({0: 1})
    be.close()
    fixed = TTSpecBackend(ci_gen, "snapshot", drafter=oracle_drafter(PROMPT, ci_plain), use_trace=False)
    fixed.join(0, PROMPT)
    d = fixed.draft({0: 2})
    acc = fixed.accept(d, fixed.verify(d))[0]
    with pytest.raises(ValueError, match="within one generation"):
        fixed.plan_next_depths({0: 1})
    fixed.close()


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=-1.5, frequency_penalty=0.7)  # as tests/tt/runtime/test_device_sampler.py


def _counts_match(be: TTSpecBackend, hist) -> None:
    """The device's one penalty context (shared by every depth's acceptor) == the host's token history."""
    shared = {id(b.acceptor.token_counts) for b in be._by_k.values()}
    assert len(shared) == 1, "every depth must read and commit the same token counts"
    seen, counts = be.acceptor.token_counts.read()
    assert torch.equal(counts, hist.counts), (counts.nonzero().flatten(), hist.counts.nonzero().flatten())
    assert torch.equal(seen > 0, hist.now().seen)


@pytest.mark.slow  # reference + TT plain + a traced auto-depth run per mechanism
@pytest.mark.parametrize("mech", MECHANISMS)
def test_auto_depth_greedy_with_penalties_is_plain_greedy_with_penalties(ci_ck, ci_gen, mech):
    """Penalties under ``--spec-k auto`` on TT: the fitted controller changes K between steps, every depth's
    acceptor reads and commits one token-count buffer (updated in place inside the commit traces), and the output
    equals plain greedy with penalties on TT and on the reference. Drafts are the answer with 30% wrong tokens, so
    that acceptance lengths (and so the controller's choices) vary."""
    from qwen36.reference.model import Qwen36Model
    from qwen36.reference.batch import generate
    from qwen36.generation.sampling import TokenHistory

    n, params = 24, SamplingParams(**PENALTIES)
    ref = Qwen36Model.from_checkpoint(ci_ck)
    want = generate(ref, [PROMPT], n, params)[0].tokens
    assert want != generate(ref, [PROMPT], n)[0].tokens, "the penalties must decide something on this prompt"
    assert ci_gen.generate([PROMPT], n, params)[0].tokens == want  # TT plain greedy with penalties
    ci_gen.release_trace()
    g = torch.Generator().manual_seed(0)
    vocab = ref.config.vocab_size

    def drafter(history, k):
        i = len(history) - len(PROMPT)
        toks = (want[i:i + k] + [0] * k)[:k]
        return [(t + 1) % vocab if torch.rand(1, generator=g).item() < 0.3 else t for t in toks]

    controller = _controller()
    be = TTSpecBackend(ci_gen, mech, drafter=drafter, depths=controller.depths)
    emitted: list[int] = []
    leave = be.leave

    def keep_history_then_leave(slot):  # the driver frees the slot when the user is done, which clears history
        emitted[:] = be.history[len(PROMPT):]
        leave(slot)

    be.leave = keep_history_then_leave
    r = speculative_generate(be, [PROMPT], n, [controller], [params])[0]
    assert r.tokens == want
    hist = TokenHistory(PROMPT, vocab)
    hist.add(emitted)  # every emitted token, the last step's past n included
    assert len(emitted) >= n
    _counts_match(be, hist)
    captures = dict(be.traces.captures)
    be.close()
    assert len(set(r.stats.depths)) > 1, f"the controller never changed K: {r.stats.depths}"
    assert len(set(r.stats.accepted)) >= 3, r.stats.accepted
    assert all(c == 1 for c in captures.values()), captures


# ---- the fitted controller with the device MTP, shipped checkpoint -------------------------------------------
@pytest.fixture(scope="module")
def gen():
    g = small_tt_generator(CKPT, prefill_chunk=64, require_mtp=True)
    yield g
    g.close()


@pytest.fixture(scope="module")
def drafter():
    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.spec.mtp_drafter import TTMTPDrafter

    return TTMTPDrafter(load_checkpoint(CKPT, require_mtp=True))


AUTO_PROMPT = [1734, 4064, 17, 279, 1076, 4064, 17, 279]  # token ids of the shipped tokenizer (any ids would do)
AUTO_NEW = 28


def _controller():
    # the reference step costs make the best K small (3-4), so the controller moves between depths on this text
    return DepthPolicy.load().controller("reference", k_max=5)


@pytest.fixture(scope="module")
def auto_plain(gen):
    from qwen36.reference.batch import generate
    from qwen36.reference.model import Qwen36Model

    tt = gen.generate([AUTO_PROMPT], AUTO_NEW)[0].tokens
    gen.release_trace()
    ref_model = Qwen36Model.from_checkpoint(CKPT, dtype=torch.float32)
    ref = generate(ref_model, [torch.tensor([AUTO_PROMPT])], AUTO_NEW)[0].tokens
    return tt, [int(t) for t in torch.as_tensor(ref).reshape(-1)[-AUTO_NEW:]]


@pytest.mark.slow  # device MTP + every depth's traces, per mechanism
@pytest.mark.parametrize("mech", MECHANISMS)
def test_auto_depth_greedy_equals_plain_and_reference(gen, drafter, auto_plain, mech):
    tt_plain, ref_plain = auto_plain
    assert tt_plain == ref_plain, "TT plain greedy differs from the reference on this prompt"
    controller = _controller()
    be = TTSpecBackend(gen, mech, drafter=drafter, depths=controller.depths)
    r = speculative_generate(be, [AUTO_PROMPT], AUTO_NEW, [controller])[0]
    captures = dict(be.traces.captures)
    be.close()
    assert r.tokens == tt_plain
    assert r.stats.depths == controller.chosen[:len(r.stats.depths)]
    used = set(r.stats.depths)
    assert len(used) > 1, f"the controller never changed K: {r.stats.depths}"
    assert max(r.stats.accepted) >= 2, r.stats.accepted  # the device MTP's drafts are accepted
    assert all(c == 1 for c in captures.values()), captures
    assert {f"verify:{k}" for k in used} <= set(captures) and {f"chain:{k}" for k in used} <= set(captures)


@pytest.mark.slow  # device MTP + every depth's traces
def test_auto_depth_greedy_with_penalties_device_mtp(gen, drafter):
    """The CLI's ``--spec-k auto --repetition-penalty ...`` path on the shipped checkpoint: device MTP drafts, the
    fitted controller, the shared token counts; output == TT plain greedy with penalties == the reference's."""
    from qwen36.reference.model import Qwen36Model
    from qwen36.reference.batch import generate

    params = SamplingParams(**PENALTIES)
    ref = generate(Qwen36Model.from_checkpoint(CKPT, dtype=torch.float32), [AUTO_PROMPT], AUTO_NEW, params)[0].tokens
    tt = gen.generate([AUTO_PROMPT], AUTO_NEW, params)[0].tokens
    gen.release_trace()
    assert tt == ref
    controller = _controller()
    be = TTSpecBackend(gen, "shadow_commit", drafter=drafter, depths=controller.depths)
    r = speculative_generate(be, [AUTO_PROMPT], AUTO_NEW, [controller], [params])[0]
    be.close()
    assert r.tokens == tt
    assert len(set(r.stats.depths)) > 1, f"the controller never changed K: {r.stats.depths}"
    assert max(r.stats.accepted) >= 1, r.stats.accepted  # (penalised text accepts fewer of the MTP's drafts)


# ---- stochastic acceptance with the depth changing every step --------------------------------------------------
STOCH_PROMPTS = [[5, 100, 7, 300, 12], [44, 901, 17, 3, 250], [201, 5, 4064, 273]]
STOCH_DEPTHS = (1, 2, 3)
TOP_K = 3


@pytest.mark.slow  # chi-square over ~100 seeded TT steps
@pytest.mark.parametrize("draft,seed,penalties", [("sample", 5, False), ("greedy", 6, False), ("sample", 7, True)],
                         ids=["sample", "greedy", "sample+penalties"])
def test_auto_depth_stochastic_chi_square(gen, drafter, draft, seed, penalties):
    """Depth cycles 1, 2, 3 step after step (every step switches). First emitted token's rank cell vs the target's
    T=1 top-3 distribution of verify row 0, second (given a >= 1) vs row 1, summed over steps (as in
    tests/tt/spec/test_spec_stochastic.py); P(a >= 1) vs the sum of the per-step closed forms. With penalties the
    target distribution of row j is the one plain sampling would use there (host token history of the committed
    tokens plus d_1..d_j), and after every step the device's shared token counts equal the host history's."""
    from qwen36.testing.stats import P_VALUE_MIN as P_MIN, chi2_p, rank_cell

    from qwen36.generation.sampling import TokenHistory

    params = SamplingParams(1.0, TOP_K, 1.0, seed, draft=draft, **(PENALTIES if penalties else {}))
    be = TTSpecBackend(gen, "shadow_commit", drafter=drafter, depths=STOCH_DEPTHS)
    obs1, exp1, obs2, exp2 = (torch.zeros(TOP_K + 1) for _ in range(4))
    a_ge1, alpha_sum, alpha_var, seen = 0, 0.0, 0.0, set()
    done, seg, steps, max_len = 0, 0, 96, gen.model.args.max_seq_len
    while done < steps:
        prompt = STOCH_PROMPTS[seg % len(STOCH_PROMPTS)]
        hist = TokenHistory(prompt, gen.model.args.cfg.vocab_size)
        if seg:
            be.leave(0)  # the next segment is a new user
        hist.add([be.join(0, prompt, params)])
        seg += 1
        k = STOCH_DEPTHS[done % len(STOCH_DEPTHS)]
        while done < steps and be.n + 2 * (max(STOCH_DEPTHS) + 1) < max_len:
            d = be.draft({0: k})
            dr = be.drafter.head.read_drafts()[0]
            q = (gen.model.to_host(be.drafter.sampler.draft_probs).float().reshape(k, -1) if draft == "sample"
                 else None)
            v = be.verify(d)
            pen = hist.rows(torch.as_tensor(dr)) if penalties else None
            p = probs_from_logits(gen.model.to_host(v.out.logits).float().reshape(k + 1, -1), params, pen)
            acc = be.accept(d, v)[0]
            nxt = STOCH_DEPTHS[(done + 1) % len(STOCH_DEPTHS)]
            be.plan_next_depths({0: nxt})
            be.commit({0: acc})
            hist.add(acc.tokens)
            if penalties:
                _counts_match(be, hist)
            seen.add((k, acc.num_accepted))
            done, k = done + 1, nxt
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
    captures = dict(be.traces.captures)
    be.close()
    assert obs1[TOP_K] == 0 and obs2[TOP_K] == 0, "emitted a token the target's transform gives probability 0"
    assert all(c <= seg for c in captures.values()), captures  # once per generation (a prefill releases traces)
    assert {a for _, a in seen} >= {0, 1, 2}, seen
    p1, p2 = chi2_p(obs1, exp1), chi2_p(obs2, exp2)
    z = (a_ge1 - alpha_sum) / max(alpha_var, 1e-9) ** 0.5
    print(f"auto-depth stochastic draft={draft}: p_first {p1:.3g} p_second {p2:.3g} z {z:.2f} n2 {int(obs2.sum())}")
    assert p1 > P_MIN and p2 > P_MIN, (p1, p2)
    assert abs(z) < 3.3, z
