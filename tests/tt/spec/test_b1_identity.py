"""The record of one user on the TT speculative step, frozen bit for bit: TTSpecBackend's two step layouts at one
slot, the one-user layout (``rows="device"``, the default: device-derived row inputs, no GDN row mask, n/pending
advanced on device, the one-user MTP head) and the B-slot layout at B = 1 (``rows="host"``: host-written row inputs,
the GDN row mask, the packed MTP head, three traces), run different programs (tests/tt/spec/test_program_golden.py)
and must give the same numbers.

Per step, ``torch.equal``: the device MTP's draft ids and fp32 draft logits, the verify's fp32 logits [K+1, V], the
accepted count and tokens, every GDN layer's committed recurrent state (through the ring index for shadow_commit)
and conv state, every attention layer's KV rows [0, n); and the prompt's last-row logits and first token. Why they
are equal: the host-written and device-derived row inputs hold the same integers, g * 1 and beta * 1 are exact, at
one user the layers take the same one-user branches, and the MTP's selected row is an exact row gather either way.
Trace captures per generation: 2 (verify, commit) vs 3 (draft, verify, commit).

Default checkpoint (trained, with MTP: its drafts are accepted, so commits of a > 0 are covered), 3 steps; every
mechanism, K = 1, 2, 3, greedy and sampled (T = 0.8: sampled drafts and stochastic acceptance draw the same).
"""
from __future__ import annotations

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.probes.gdn_transaction_tp_checks import kv_host
from qwen36.generation.sampling import SamplingParams
from qwen36.testing.tt import small_tt_generator
from qwen36.tt.spec.spec_backend import TTSpecBackend
from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
from qwen36.tt.spec.spec_backend import TTSpecBackend

pytestmark = pytest.mark.slow

CKPT = "models/qwen36/default_checkpoint"
PROMPT = [1734, 4064, 17, 279, 1076, 4064, 17, 279]
STEPS = 3
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=1)


@pytest.fixture(scope="module")
def gen():
    g = small_tt_generator(CKPT, prefill_chunk=64, require_mtp=True)
    yield g
    g.close()


@pytest.fixture(scope="module")
def reader():
    return load_checkpoint(CKPT, require_mtp=True)


def _dev(ttnn, x) -> list[torch.Tensor]:
    return [ttnn.to_torch(t) for t in ttnn.get_device_tensors(x)]


def _gdn_b1(be, state) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The single-user backend's committed GDN state per layer: (recurrent [Hv, Dk, Dv] over the mesh, conv)."""
    ttnn, hv = be.ttnn, be.model.args.gdn_hv_d
    ring = be.mechanism.ring
    idx = [i.reshape(-1).to(torch.int64) for i in _dev(ttnn, be.acceptor.block_idx)] if ring else None
    out = []
    for s in state.gdn_states():
        if ring:
            recs = [r[i[0:hv]] for r, i in zip(_dev(ttnn, be.step_state.layer_bufs[id(s)].ring), idx)]
        else:
            recs = [r[0:hv] for r in _dev(ttnn, s.recurrent)]
        convs = [c[0, 0] for c in _dev(ttnn, s.conv)]
        out.append((torch.cat([r.float() for r in recs], 0), torch.cat([c.float() for c in convs], -1)))
    return out


def run_b1(gen, reader, mech, K, params):
    d = TTMTPDrafter(reader)
    be = TTSpecBackend(gen, mech, drafter=d, use_trace=True)
    try:
        log = [{"first": be.join(0, PROMPT, params), "prefill_logits": be.prefill_logits.reshape(-1).clone()}]
        for _ in range(STEPS):
            dr = be.draft({0: K})
            ids, lg = d.head.read_drafts()
            v = be.verify(dr)
            vl = gen.model.to_host(v.out.logits).float().reshape(K + 1, -1)
            acc = be.accept(dr, v)[0]
            be.commit({0: acc})
            log.append({"drafts": list(map(int, ids)), "draft_logits": lg.float().reshape(K, -1), "verify_logits": vl,
                        "a": acc.num_accepted, "tokens": list(acc.tokens), "gdn": _gdn_b1(be, gen.state),
                        "kv": kv_host(be.ttnn, gen.state, 0, be.n)})
        return log, sum(be.traces.captures.values())
    finally:
        be.close()
        gen.reset()


def run_slots1(gen, reader, mech, K, params):
    d = TTMTPDrafter(reader)
    be = TTSpecBackend(gen, mech, drafter=d, use_trace=True, slots=1, k=K, params=params, rows="host")
    try:
        first = be.join(0, PROMPT, params)
        log = [{"first": first, "prefill_logits": be.decoder.prefills[0].logits.reshape(-1).clone()}]
        for _ in range(STEPS):
            dr = be.draft({0: K})
            ids, lg = be.drafter.read_drafts()  # the layout's B-slot drafter (d.for_slots())
            v = be.verify(dr)
            vl = be.verify_logits()[0]
            acc = be.accept(dr, v)[0]
            be.commit({0: acc})
            log.append({"drafts": ids[0].tolist(), "draft_logits": lg[0].float(), "verify_logits": vl,
                        "a": acc.num_accepted, "tokens": list(acc.tokens), "gdn": be.committed_gdn(0),
                        "kv": kv_host(be.ttnn, be.decoder.state, 0, be.position(0))})
        return log, be.captures
    finally:
        be.close()


@pytest.mark.parametrize("mech,K,params", [
    ("shadow_commit", 2, SamplingParams()), ("snapshot", 2, SamplingParams()), ("recompute", 3, SamplingParams()),
    ("shadow_commit", 1, SamplingParams()), ("shadow_commit", 2, SAMPLED)],
    ids=["shadow_commit-K2", "snapshot-K2", "recompute-K3", "shadow_commit-K1", "sampled-K2"])
def test_b1_step_equals_slots1_step_bitwise(gen, reader, mech, K, params):
    b1, caps_b1 = run_b1(gen, reader, mech, K, params)
    s1, caps_s1 = run_slots1(gen, reader, mech, K, params)
    assert b1[0]["first"] == s1[0]["first"]
    assert torch.equal(b1[0]["prefill_logits"], s1[0]["prefill_logits"])
    for i, (x, y) in enumerate(zip(b1[1:], s1[1:])):
        where = f"{mech} step {i}"
        assert (x["a"], x["tokens"]) == (y["a"], y["tokens"]), where
        assert x["drafts"] == y["drafts"], where
        assert torch.equal(x["draft_logits"], y["draft_logits"]), where
        assert torch.equal(x["verify_logits"], y["verify_logits"]), where
        assert len(x["gdn"]) == len(y["gdn"]) > 0 and len(x["kv"]) == len(y["kv"]) > 0, where
        for j, ((rx, cx), (ry, cy)) in enumerate(zip(x["gdn"], y["gdn"])):
            assert torch.equal(rx, ry), f"{where}: GDN layer {j} recurrent"
            assert torch.equal(cx, cy), f"{where}: GDN layer {j} conv"
        for j, (kx, ky) in enumerate(zip(x["kv"], y["kv"])):
            assert torch.equal(kx, ky), f"{where}: KV tensor {j}"
    if params.greedy:  # the trained drafts are accepted: commits of a > 0 are in the comparison
        assert any(x["a"] > 0 for x in b1[1:]), [x["a"] for x in b1[1:]]
    # traces per generation: verify | commit (+ reseed + chain) at B = 1; draft | verify | commit at slots = 1
    assert (caps_b1, caps_s1) == (2, 3)
