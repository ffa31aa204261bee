"""TT speculative step on the emulated 1x2 mesh: packed K+1 verify, on-device commit (3 mechanisms),
traced step == untraced step bit for bit, verify vs decode agreement, probes at CI size, CLI."""
from __future__ import annotations

import math

import pytest
import torch

from qwen36.speculative.engine import speculative_generate
from qwen36.tt.runtime.generator import TTGenerator
from qwen36.tt.spec.spec_backend import TTSpecBackend
from qwen36.speculative.mechanisms import MECHANISMS
from qwen36.testing.speculative import oracle_drafter
from qwen36.testing.tt import device_position, make_bf16_checkpoint
from qwen36.tt.spec.mechanisms import GDNStateBytes
from qwen36.tt.spec.verify import VerifyShapeError, check_verify_shape

PROMPT = list(range(5, 17))
MAX_NEW = 24


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("spec") / "ci", "ci")
    g = TTGenerator.from_checkpoint(ck, "emulated-p150x2", precision="accuracy", max_seq_len=256, progress=False,
                                    block_size=32, prefill_chunk=64)
    yield g
    g.close()


@pytest.fixture(scope="module")
def plain(gen):
    out = gen.greedy(PROMPT, MAX_NEW)
    gen.release_trace()
    return out


# the fast tier keeps K=1 for every mechanism; deeper K in the slow tier
@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("k", [1, pytest.param(3, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_spec_greedy_lossless_vs_plain(gen, plain, mech, k):
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain), use_trace=True)
    r = speculative_generate(be, [PROMPT], MAX_NEW, [k])[0]
    be.close()
    assert r.tokens == plain
    hist = r.stats.histogram()
    assert sum(1 for c in hist if c) >= 2, f"acceptance lengths not mixed: {hist}"
    c = be.counters
    n_gdn = len(gen.state.gdn_states())
    assert c.steps == r.stats.steps and c.target_forwards == c.steps
    assert c.state_copies == {"shadow_commit": 0, "snapshot": 2 * n_gdn, "recompute": n_gdn}[mech] * c.steps
    assert (c.slot_bytes_written > 0) == (mech == "shadow_commit")


def _run_recording(gen, plain, mech, k, steps, use_trace):
    """Run `steps` spec steps; record per-step verify logits + acceptor result (host reads after each step)."""
    be = TTSpecBackend(gen, mech, drafter=oracle_drafter(PROMPT, plain), use_trace=use_trace)
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
def test_traced_step_equals_untraced_bitwise(gen, plain, mech):
    steps = 22
    lt, at, pt, nt = _run_recording(gen, plain, mech, 2, steps, True)
    le, ae, pe, ne = _run_recording(gen, plain, mech, 2, steps, False)
    assert nt == 2 and ne == 0  # verify+accept and commit traces were captured and replayed
    assert at == ae and pt == pe
    assert len({a for a, _ in at}) >= 2, "acceptance lengths must be mixed"
    for x, y in zip(lt, le):
        assert torch.equal(x, y)
    # replays saw new inputs: the emitted tokens follow the plain sequence, not a frozen first step
    emitted = [t for _, ts in at for t in ts][: len(plain) - 1]
    assert emitted == plain[1:1 + len(emitted)]


def test_verify_vs_decode_shared_rows(gen):
    """Decode (1 row) and verify (K+1 rows) on the same rows: logits bit-equal on the emulator (tolerance
    stated: max abs <= 1e-6, PCC >= 0.99999), GDN per-token states PCC >= 0.99999."""
    from qwen36.probes.verify_tp import run_case

    c = run_case(gen, 3, PROMPT, [7, 99, 250, 3])
    assert c["logits_max_abs"] <= 1e-6 and c["logits_pcc_min"] >= 0.99999 and c["argmax_equal"]
    assert c["gdn_state_pcc_min"] >= 0.99999 and c["gdn_state_max_abs"] <= 1e-5


def test_abort_after_verify_restores(gen, plain):
    be = TTSpecBackend(gen, "snapshot", drafter=oracle_drafter(PROMPT, plain), use_trace=False)
    be.join(0, PROMPT)
    d = be.draft({0: 3})
    be.verify(d)
    be.abort()
    r_tokens = []
    while len(r_tokens) < 12:
        d = be.draft({0: 3})
        acc = be.accept(d, be.verify(d))[0]
        be.commit({0: acc})
        r_tokens += acc.tokens
    assert r_tokens[:12] == plain[1:13]
    sh = TTSpecBackend(gen, "shadow_commit", drafter=oracle_drafter(PROMPT, plain), use_trace=False)
    sh.join(0, PROMPT)
    sh.verify(sh.draft({0: 2}))
    with pytest.raises(RuntimeError, match="shadow_commit"):
        sh.abort()


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
