"""TT MTP head on the emulated 1x2 mesh vs the reference MTP, including the reseed over verified rows.

Gates (models/qwen36/testing/pcc.py): MTP logits PCC >= 0.9999 with bf16 weights (accuracy preset), >= 0.99 with bf8
(performance); K=3 draft tokens == reference ``mtp_draft`` tokens on inputs whose reference top-2 gap is
>= MIN_MARGIN at every draft (asserted); per-step draft-logit PCC >= 0.9999; MTP KV rows 0..n+a after a reseed
vs the oracle cache (reference ``mtp_forward`` over every verified position) PCC >= 0.9999; reseed rows past a
are inert (poisoned rows give bit-identical drafts, KV and next step); traced replay == eager, bit for bit.

Test checkpoint: the CI preset written in bf16 (``testing.make_bf16_checkpoint``, the TT tests' convention: the
fp32 reference then runs on exactly the weights the TT loader converts, so differences are TT arithmetic).
"""
from __future__ import annotations

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.reference.model import Qwen36Model
from qwen36.testing.tt_hooks import acceptor_host_logits, mtp_kv_from_host, mtp_kv_to_host
from qwen36.tt.spec.accept import DeviceAcceptor
from qwen36.tt.model.model import TTQwen36Model
from qwen36.tt.model.model_config import PrecisionSetting, TensorGroup, TTModelArgs
from qwen36.tt.spec.mtp import TTMTPHead, load_tt_mtp
from qwen36.testing.pcc import PCC_GATES, comp_pcc
from qwen36.testing.tt import make_bf16_checkpoint
from qwen36.tt.runtime.trace import TracedStep
from qwen36.tt.model.weights import WeightLoader, load_mtp_weights
from qwen36.speculative.sampling import SamplingParams

K = 3
PROMPT = 80  # MTP prefill in two chunks (64 + 16), the second partial
SEQ_SEED = 57  # reference min top-2 gap over every draft these tests check: 0.10 (asserted per test; of seeds 0-59,
# half keep every gap >= MIN_MARGIN, 57 has the widest)
MIN_MARGIN = 0.02  # same floor as tests/tt/model/test_model.py (TT top-2 difference error is far below it)
PRESET_GATE = {"accuracy": "layer_bf16", "performance": "layer_bf8"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bf16_checkpoint(tmp_path_factory.mktemp("tt-mtp-ci"), "ci", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def mesh():
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150x2", trace_region_size=16 * 1024 * 1024) as ctx:
        yield ctx


def build(ckpt, mesh, preset: str, k: int = K, pick=None) -> TTMTPHead:
    """Target embedding/LM head/RoPE (no decoder layers) + the MTP head on the mesh."""
    reader = load_checkpoint(ckpt)
    args = TTModelArgs.from_config(reader.config, mesh.num_devices, PrecisionSetting.named(preset), max_seq_len=256,
                                   block_size=32, prefill_chunk=64)
    w = WeightLoader(reader, args, mesh.ttnn, mesh.mesh_device, progress=False).load(layers=[])
    target = TTQwen36Model(args, w, mesh.ttnn, mesh.mesh_device)
    return load_tt_mtp(target, reader, k, pick=pick)


@pytest.fixture(scope="module")
def mtp_acc(ckpt, mesh):
    return build(ckpt, mesh, "accuracy")


@pytest.fixture(scope="module")
def seq(ref):
    """Token sequence and the reference target's post-norm hidden at every position (teacher forced)."""
    g = torch.Generator().manual_seed(SEQ_SEED)
    ids = torch.randint(0, ref.config.vocab_size, (PROMPT + 2 * (K + 1) + 2,), generator=g)
    with torch.no_grad():
        hidden = ref(ids[None], ref.new_state(1, 256)).hidden[0]
    return ids, hidden


@pytest.fixture(scope="module")
def ref_mtp0(ref, seq):
    """Reference MTP state after the prompt rows t = 0..PROMPT-1 (x_{t+1}, h_t)."""
    ids, hidden = seq
    st = ref.new_mtp_state(1, 256)
    with torch.no_grad():
        ref.mtp_forward(ids[None, 1:PROMPT + 1], hidden[None, :PROMPT], 0, st)
    return st


@pytest.fixture(scope="module")
def tt_s0(mtp_acc, seq):
    """TT MTP KV after the same prompt rows (host snapshot, restored before each reseed test)."""
    ids, hidden = seq
    mtp_acc.prefill(ids[1:PROMPT + 1], hidden[:PROMPT])
    return mtp_kv_to_host(mtp_acc)


def margins(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, -1).values
    return top2[..., 0] - top2[..., 1]


def spec_inputs(seq, n: int, a: int):
    """Reseed inputs of a spec step at n with a accepted: emitted [x_{n+1}..x_{n+a+1}, -1...], verify rows h_n..h_{n+K}."""
    ids, hidden = seq
    emitted = ids[n + 1:n + a + 2].tolist() + [-1] * (K - a)
    return emitted, hidden[n:n + K + 1]


def ref_spec_draft(ref, st, seq, n: int, a: int, pick=None):
    ids, hidden = seq
    with torch.no_grad():
        return ref.mtp_draft(st, ids[None, n + 1:n + a + 2], hidden[None, n:n + a + 1], n, K, pick=pick)


def run_draft(mtp: TTMTPHead, inputs, seq, n: int, a: int, hidden_override=None, tokens_override=None):
    emitted, rows = spec_inputs(seq, n, a)
    host = mtp.host_draft_inputs(tokens_override or emitted, rows if hidden_override is None else hidden_override, n, a)
    mtp.copy_host_to_device(host, inputs)
    mtp.draft(inputs.tokens, inputs.hidden, inputs.pos, inputs.select)
    return mtp.read_drafts()


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["accuracy", "performance"])
def test_mtp_logits_pcc_vs_reference(ckpt, mesh, ref, seq, preset):
    """All PROMPT rows of the MTP head (prefill path, 2 chunks) vs reference mtp_forward on the same inputs."""
    ids, hidden = seq
    mtp = build(ckpt, mesh, preset)
    got = mtp.prefill(ids[1:PROMPT + 1], hidden[:PROMPT], all_logits=True)
    with torch.no_grad():
        exp, _ = ref.mtp_forward(ids[None, 1:PROMPT + 1], hidden[None, :PROMPT], 0, ref.new_mtp_state(1, 256))
    ok, msg = comp_pcc(exp[0], got, PCC_GATES[PRESET_GATE[preset]])
    print(f"MTP logits {preset}: {msg}")
    assert ok, f"MTP logits ({preset}): {msg}"


def test_prefill_draft_chain_matches_reference(mtp_acc, ref, seq):
    """First draft after the prompt: K=3 tokens == reference mtp_draft, per-step logits PCC."""
    ids, hidden = seq
    toks, logits = mtp_acc.prefill_draft(ids[1:PROMPT + 1], hidden[:PROMPT])
    with torch.no_grad():
        exp = ref.mtp_draft(ref.new_mtp_state(1, 256), ids[None, 1:PROMPT + 1], hidden[None, :PROMPT], 0, K)
    m = margins(exp.logits[0])
    assert float(m.min()) >= MIN_MARGIN, f"inputs have a near-tie (reference top-2 gaps {m.tolist()}): pick others"
    assert toks == exp.tokens[0].tolist()
    for i in range(K):
        ok, msg = comp_pcc(exp.logits[0, i], logits[i], PCC_GATES["layer_bf16"])
        print(f"prefill draft step {i}: {msg}")
        assert ok, f"draft step {i}: {msg}"


@pytest.mark.parametrize("a", range(K + 1))
def test_spec_step_draft_matches_reference(mtp_acc, ref, seq, ref_mtp0, tt_s0, a):
    """Reseed over all K+1 verify rows (rows past a are placeholders), select row a on device, chain K-1 steps:
    tokens == reference mtp_draft over the a+1 verified rows; per-step logits PCC; MTP KV rows 0..n+a vs the oracle
    cache (reference mtp_forward over every verified position, the definition of the MTP cache)."""
    ids, hidden = seq
    n = PROMPT
    mtp_kv_from_host(mtp_acc, *tt_s0)
    toks, logits = run_draft(mtp_acc, mtp_acc.allocate_draft_inputs(), seq, n, a)
    exp = ref_spec_draft(ref, ref_mtp0.clone(), seq, n, a)
    m = margins(exp.logits[0])
    assert float(m.min()) >= MIN_MARGIN, f"a={a}: near-tie in the reference drafts (gaps {m.tolist()})"
    assert toks == exp.tokens[0].tolist(), f"a={a}"
    for i in range(K):
        ok, msg = comp_pcc(exp.logits[0, i], logits[i], PCC_GATES["layer_bf16"])
        print(f"a={a} draft step {i}: {msg}")
        assert ok, f"a={a} draft step {i}: {msg}"
    # oracle MTP cache: entry t = f(h_t, embed(x_{t+1})) for every verified position t = 0..n+a
    oracle = ref.new_mtp_state(1, 256)
    with torch.no_grad():
        ref.mtp_forward(ids[None, 1:n + a + 2], hidden[None, :n + a + 1], 0, oracle)
    k_tt, v_tt = mtp_kv_to_host(mtp_acc)
    for name, tt, rf in (("K", k_tt, oracle.kv.k[0]), ("V", v_tt, oracle.kv.v[0])):
        for lo, what in ((0, "0..n+a"), (n, "n..n+a (this reseed)")):
            ok, msg = comp_pcc(rf[:, lo:n + a + 1], tt[:, lo:n + a + 1], PCC_GATES["layer_bf16"])
            print(f"a={a} MTP {name} rows {what} vs oracle: {msg}")
            assert ok, f"a={a} MTP {name} cache rows {what}: {msg}"


@pytest.mark.parametrize("a", [0, 1])
def test_reseed_rows_past_a_are_inert(mtp_acc, seq, tt_s0, a):
    """Rows past a write garbage MTP KV at positions > n+a. Poison them (random tokens, hidden x100 + noise): the
    drafts, logits and KV rows 0..n+a+K-1 are bit-identical, and so is the next spec step (whose reseed and chain
    read positions that the garbage occupied)."""
    ids, hidden = seq
    n, r = PROMPT, K + 1
    inputs = mtp_acc.allocate_draft_inputs()
    results = []
    for poison in (False, True):
        mtp_kv_from_host(mtp_acc, *tt_s0)
        emitted, rows = spec_inputs(seq, n, a)
        if poison:
            g = torch.Generator().manual_seed(11)
            emitted = emitted[:a + 1] + torch.randint(0, ids.max().item() + 1, (r - a - 1,), generator=g).tolist()
            rows = rows.clone()
            rows[a + 1:] = 100.0 * rows[a + 1:] + 30.0 * torch.randn(rows[a + 1:].shape, generator=g)
        first = run_draft(mtp_acc, inputs, seq, n, a, hidden_override=rows, tokens_override=emitted)
        kv_after_first = mtp_kv_to_host(mtp_acc)
        n2 = n + a + 1  # next step: a2 = 1 accepted
        second = run_draft(mtp_acc, inputs, seq, n2, 1)
        results.append((first, kv_after_first, second))
    (f0, kv0, s0), (f1, kv1, s1) = results
    assert f0[0] == f1[0] and torch.equal(f0[1], f1[1]), "first-step drafts changed with garbage rows past a"
    assert s0[0] == s1[0] and torch.equal(s0[1], s1[1]), "next-step drafts changed with garbage rows past a"
    live = n + a + K  # rows 0..n+a verified + chain rows n+a+1..n+a+K-1
    for x0, x1 in zip(kv0, kv1):
        assert torch.equal(x0[:, :live], x1[:, :live])
    if a == 0:  # position n+K keeps the garbage (no chain row reaches it): the poison really landed
        assert not torch.equal(kv0[0][:, n + K], kv1[0][:, n + K])


def test_traced_draft_equals_eager_bit_exact(ckpt, mesh, seq):
    """Eager draft on inputs A and B (KV restored in between), then capture once and replay with A and B written via
    copy_host_to_device_tensor: drafts, logits and MTP KV bit-identical; capture itself writes nothing."""
    ids, hidden = seq
    mtp = build(ckpt, mesh, "accuracy")
    mtp.prefill(ids[1:PROMPT + 1], hidden[:PROMPT])
    s0 = mtp_kv_to_host(mtp)
    inputs = mtp.allocate_draft_inputs()
    cases = [(PROMPT, 2), (PROMPT + 1, 0), (PROMPT - 5, 3)]
    eager = []
    for n, a in cases:
        mtp_kv_from_host(mtp, *s0)
        eager.append((run_draft(mtp, inputs, seq, n, a), mtp_kv_to_host(mtp)))
    mtp_kv_from_host(mtp, *s0)
    ttnn = mesh.ttnn
    trace = TracedStep(ttnn, mesh.mesh_device, name="mtp draft",
                       fn=lambda: mtp.draft(inputs.tokens, inputs.hidden, inputs.pos, inputs.select))
    trace.capture()
    try:
        assert all(torch.equal(x, y) for x, y in zip(mtp_kv_to_host(mtp), s0)), "capture wrote the MTP KV cache"
        for (n, a), (exp, exp_kv) in zip(cases, eager):
            mtp_kv_from_host(mtp, *s0)
            emitted, rows = spec_inputs(seq, n, a)
            mtp.copy_host_to_device(mtp.host_draft_inputs(emitted, rows, n, a), inputs)
            trace.replay(blocking=True)
            got = mtp.read_drafts()
            assert got[0] == exp[0] and torch.equal(got[1], exp[1]), f"replay n={n} a={a} != eager"
            assert all(torch.equal(x, y) for x, y in zip(mtp_kv_to_host(mtp), exp_kv)), f"replay KV n={n} a={a}"
    finally:
        trace.release()
    assert not ttnn.is_trace_capture_active(mesh.mesh_device)


def test_pick_hook_and_acceptor_contract(ckpt, mesh, ref, seq):
    """A device pick function replaces argmax (here: argmin, i.e. argmax of -logits); the draft buffers feed
    DeviceAcceptor.greedy and .stochastic(probs_from_logits(draft_logits)) with the shapes they require."""
    ids, hidden = seq
    ttnn = mesh.ttnn
    mtp = build(ckpt, mesh, "accuracy", pick=lambda lg: ttnn.argmax(ttnn.neg(lg), dim=3, keepdim=True))
    toks, _ = mtp.prefill_draft(ids[1:PROMPT + 1], hidden[:PROMPT])
    with torch.no_grad():
        exp = ref.mtp_draft(ref.new_mtp_state(1, 256), ids[None, 1:PROMPT + 1], hidden[None, :PROMPT], 0, K,
                            pick=lambda lg: (-lg).argmax(-1))
    assert float(margins(-exp.logits[0]).min()) >= MIN_MARGIN
    assert toks == exp.tokens[0].tolist()
    v = ref.config.vocab_size
    acc = DeviceAcceptor(ttnn, mesh.mesh_device, k=K, vocab=v, sampling_params=SamplingParams(temperature=1.0),
                         rng="host").allocate()
    target_logits = ttnn.to_device(acceptor_host_logits(acc, torch.randn(1, K + 1, v)), acc.mesh)
    acc.greedy(target_logits, mtp.draft_tokens)
    greedy_tokens, a = acc.read_result()
    assert 0 <= a <= K and greedy_tokens[:a] == toks[:a]
    acc.stochastic(target_logits, mtp.draft_tokens, acc.probs_from_logits(mtp.draft_logits))
    stoch_tokens, a = acc.read_result()
    assert 0 <= a <= K and stoch_tokens[:a] == toks[:a]


def test_bad_inputs_fail_clearly(mtp_acc, seq):
    _, hidden = seq
    with pytest.raises(ValueError, match="K\\+1"):
        mtp_acc.host_draft_inputs([1, 2], hidden[:K + 1], PROMPT, 0)
    with pytest.raises(ValueError, match="accepted count"):
        mtp_acc.host_draft_inputs([1] * (K + 1), hidden[:K + 1], PROMPT, K + 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        mtp_acc.host_draft_inputs([1] * (K + 1), hidden[:K + 1], 255, 0)
    with pytest.raises(ValueError, match="draft depth"):
        TTMTPHead(mtp_acc.target, mtp_acc.w, 0)


def test_load_mtp_weights_requires_mtp_tensors(ckpt_factory, mesh):
    reader = load_checkpoint(ckpt_factory("ci", with_mtp=False))
    args = TTModelArgs.from_config(reader.config, mesh.num_devices, PrecisionSetting.accuracy(), max_seq_len=64,
                                   block_size=32, prefill_chunk=64)
    loader = WeightLoader(reader, args, mesh.ttnn, mesh.mesh_device, progress=False)
    with pytest.raises(ValueError, match="no 'mtp"):
        load_mtp_weights(loader)


def test_mtp_head_precision_of_its_own(ckpt, mesh, ref, seq):
    """``performance+mtp=accuracy``: the MTP head's fc and layer in bf16 (bit-identical to the accuracy head's
    weights), the shared LM head in bf8 (the performance preset's), the head's args (its compute configs) the
    head's, and its logits within the bf8 gate of the reference (the LM head is still bf8)."""
    ttnn = mesh.ttnn
    mixed, acc = (build(ckpt, mesh, p) for p in ("performance+mtp=accuracy", "accuracy"))
    w, layer = mixed.w, mixed.w.layer
    own = {"fc": w.fc, "qkv": layer.mixer.qkv, "gate": layer.mixer.gate, "o_proj": layer.mixer.o_proj,
           "mlp.gate": layer.mlp.gate, "mlp.up": layer.mlp.up, "mlp.down": layer.mlp.down}
    assert {n: t.dtype for n, t in own.items()} == {n: ttnn.bfloat16 for n in own}
    host = mixed.target.to_host
    for n, t in own.items():
        ref_t = {"fc": acc.w.fc, "qkv": acc.w.layer.mixer.qkv, "gate": acc.w.layer.mixer.gate,
                 "o_proj": acc.w.layer.mixer.o_proj, "mlp.gate": acc.w.layer.mlp.gate, "mlp.up": acc.w.layer.mlp.up,
                 "mlp.down": acc.w.layer.mlp.down}[n]
        assert torch.equal(host(t), host(ref_t)), n
    assert mixed.target.args.dtype(TensorGroup.LM_HEAD, ttnn) == ttnn.bfloat8_b
    assert mixed.args.dtype_name(TensorGroup.LM_HEAD) == "bfloat8_b"
    assert mixed.target.w.lm_head.dtype == ttnn.bfloat8_b
    assert mixed.args.dtype_name(TensorGroup.MLP_DOWN) == "bfloat16"  # the layer's compute configs follow
    ids, hidden = seq
    got = mixed.prefill(ids[1:PROMPT + 1], hidden[:PROMPT], all_logits=True)
    with torch.no_grad():
        exp, _ = ref.mtp_forward(ids[None, 1:PROMPT + 1], hidden[None, :PROMPT], 0, ref.new_mtp_state(1, 256))
    ok, msg = comp_pcc(exp[0], got, PCC_GATES["layer_bf8"])
    assert ok, f"MTP logits (performance+mtp=accuracy): {msg}"
