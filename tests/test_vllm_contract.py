"""vllm-tt plugin contract (models/qwen36/tt/qwen36_vllm.py) on the emulated 1x2 mesh, CI checkpoint (bf16).
Exactness: all comparisons are token ids (exact equality), no tolerance."""
from __future__ import annotations

import json

import pytest
import torch

from qwen36.checkpoint import load_checkpoint
from qwen36.tt.generator import DEFAULT_TRACE_REGION
from qwen36.tt.mtp import load_tt_mtp
from qwen36.tt.qwen36_vllm import Qwen36ForCausalLM
from qwen36.testing.tt import make_bf16_checkpoint
from qwen36.tt_ops.device import open_mesh

PROMPT = list(range(5, 17))
P = len(PROMPT)
K = 3
N_NEW = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp("vllm") / "ci", "ci")
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    hf = json.loads((ck / "config.json").read_text())
    m = Qwen36ForCausalLM.initialize_vllm_model(hf, ctx.mesh_device, max_batch_size=1, max_seq_len=256,
                                                optimizations="accuracy", checkpoint=ck, block_size=32,
                                                prefill_chunk=64)
    kv = m.allocate_kv_cache()
    ref = m.gen.greedy(PROMPT, N_NEW + 2 * (K + 1))  # TTGenerator.greedy on the same weights / mesh
    m.gen.release_trace()
    yield m, kv, ref, ck
    m.close()
    ctx.close()


def _prefill(m, kv):
    return m.prefill_forward(torch.tensor([PROMPT]), m.state.page_table_host.clone(), kv, torch.tensor([P]))


def test_prefill_and_decode_equal_greedy(env):
    m, kv, ref, _ = env
    logits = _prefill(m, kv)
    assert logits.shape == (1, 1, m.model.args.cfg.vocab_size)
    out = [int(logits[0, -1].argmax())]
    while len(out) < N_NEW:  # eager step, capture, replays
        lg = m.decode_forward(torch.tensor([[out[-1]]]), None, kv, torch.tensor([P + len(out) - 1]),
                              enable_trace=True, read_from_device=True)
        assert lg.shape == (1, 1, m.model.args.cfg.vocab_size)
        out.append(int(lg[0, -1].argmax()))
    assert out == ref[:N_NEW]
    with pytest.raises(RuntimeError, match="cannot be mixed"):
        m.propose_draft_tokens(K, torch.tensor([[out[-1]]]), torch.tensor([P + N_NEW - 1]), torch.tensor([1]))


def test_verify_one_wrong_draft_then_mtp_steps(env):
    m, kv, ref, _ = env
    first = int(_prefill(m, kv)[0, -1].argmax())
    assert first == ref[0]
    drafts = list(ref[1:K + 1])
    drafts[1] = (drafts[1] + 1) % m.model.args.cfg.vocab_size  # d_2 wrong -> a = 1
    ids = m.decode_forward(torch.tensor([[first] + drafts]), None, kv, torch.tensor([P]),
                           num_valid_drafts=torch.tensor([K]), accepted_counts=torch.tensor([1]), spec_mode=True)
    assert ids.shape == (1, K + 1)
    assert ids[0, :2].tolist() == ref[1:3]  # accepted d_1, bonus at column a = 1
    emitted, accepted, pos = [first, ref[1], int(ids[0, 1])], 2, P + 2
    # wrong accepted_counts (slot other than the one committed) fails fast
    with pytest.raises(ValueError, match="accepted_counts"):
        m.propose_draft_tokens(K, torch.tensor([emitted[-2:]]), torch.tensor([pos]), torch.tensor([1]))
    n_a = set()
    while len(emitted) < N_NEW + 1:  # MTP drafts -> verify (eager, capture, replays)
        d, nv = m.propose_draft_tokens(K, torch.tensor([emitted[-accepted:]]), torch.tensor([pos]),
                                       torch.tensor([accepted]))
        assert d.shape == (1, K) and nv.tolist() == [K]
        ids = m.decode_forward(torch.cat([torch.tensor([[emitted[-1]]]), d], 1), None, kv, torch.tensor([pos]),
                               num_valid_drafts=nv, accepted_counts=torch.tensor([accepted]), spec_mode=True)
        a = 0
        while a < K and int(d[0, a]) == int(ids[0, a]):
            a += 1
        n_a.add(a)
        emitted += d[0, :a].tolist() + [int(ids[0, a])]
        accepted, pos = a + 1, pos + a + 1
    assert emitted[:N_NEW + 1] == ref[:N_NEW + 1]
    assert len(m.spec_backend._traces) == 2  # verify and commit traces captured and replayed


def test_propose_equals_tt_mtp_head(env):
    m, kv, ref, ck = env
    first = int(_prefill(m, kv)[0, -1].argmax())
    d, nv = m.propose_draft_tokens(K, torch.tensor([[first]]), torch.tensor([P]), torch.tensor([1]))
    assert d.shape == (1, K) and nv.tolist() == [K]
    # independent: the TT MTP head itself over the same prompt hidden states
    m.gen.reset()
    hs: list = []
    m.model.prefill_forward(torch.tensor(PROMPT), m.state, hidden_out=hs)
    head = load_tt_mtp(m.model, load_checkpoint(ck, require_mtp=True), K)
    want, _ = head.prefill_draft(torch.tensor(PROMPT[1:] + [first]), hs[0])
    assert d[0].tolist() == want


def test_unsupported_fail_fast(env):
    m, kv, ref, ck = env
    with pytest.raises(NotImplementedError, match="batch 2 > 1"):
        Qwen36ForCausalLM.initialize_vllm_model({}, None, max_batch_size=2, max_seq_len=256)
    with pytest.raises(NotImplementedError, match="batch 2 > 1"):
        m.prefill_forward(torch.tensor([PROMPT, PROMPT]), None, kv, torch.tensor([P, P]))
    _prefill(m, kv)
    with pytest.raises(NotImplementedError, match="batch 2 > 1"):
        m.decode_forward(torch.tensor([[ref[0]], [ref[0]]]), None, kv, torch.tensor([P, P]))
    with pytest.raises(NotImplementedError, match="num_valid_drafts"):
        m.decode_forward(torch.tensor([[ref[0]] + ref[1:K + 1]]), None, kv, torch.tensor([P]),
                         num_valid_drafts=torch.tensor([K - 1]), accepted_counts=torch.tensor([1]), spec_mode=True)
    with pytest.raises(NotImplementedError, match="read_from_device"):
        m.decode_forward(torch.tensor([[ref[0]]]), None, kv, torch.tensor([P]), read_from_device=False)
    with pytest.raises(NotImplementedError, match="page_table"):
        m.decode_forward(torch.tensor([[ref[0]]]), torch.full((1, 8), 5), kv, torch.tensor([P]))
    with pytest.raises(ValueError, match="optimizations"):
        Qwen36ForCausalLM.initialize_vllm_model({}, None, max_batch_size=1, max_seq_len=256, optimizations="fast")
