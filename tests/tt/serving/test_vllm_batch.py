"""Several sequences through the vLLM adapter (``max_num_seqs`` > 1): the plugin's calls of a real engine run,
replayed without vLLM.

``tests/data/vllm_tt_plugin_batch_trace.json`` was recorded by ``tests/tt/serving/test_vllm_engine_dev.py``
(``test_vllm_llm_batch_equals_batch1_generate``: vLLM 0.25.1, the vllm-tt plugin at e3fc849, ``max_num_seqs=4``,
five greedy prompts of different lengths and budgets, the fifth waiting for a slot), which also checks that a
fresh engine run still makes exactly these calls. What the recording shows about the synchronous runner: every
decode step of every request arrives as one ``prefill_forward`` over all running requests, each row a one-token
continuation (``start_pos`` = n, ``prompt_lens`` = n + 1) with a destination state slot in ``empty_slots``; rows
(and with them destination slots) change order when a request finishes and the batch is condensed, and a request
that joins while others decode is prefilled alone into a free slot. The replay feeds those exact arguments to the
adapter and checks what it returns: the argmax of every row equals the recorded one (the token the engine
then emitted), every request's tokens equal its own batch-1 ``TTGenerator`` greedy output, and every logits row
equals that batch-1 run's row (max abs <= 1e-4; the emulator gives bit-equal rows).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen36.generation.sampling import SamplingParams
from qwen36.tt.serving.qwen36_vllm import DecodeHandle, Qwen36ForCausalLM
from qwen36.testing.vllm_calls import replay_calls as replay
from qwen36.testing.vllm_replay import LOGITS_TOL, batch1_generator, load_on_mesh as _load, open_env, served_model

TRACE = json.loads((Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_batch_trace.json").read_text())
SAMPLED = json.loads((Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_batch_sampled_trace.json").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_batch")
    yield ck, ctx
    ctx.close()


@pytest.fixture(scope="module")
def batch1(env):
    """Each prompt's batch-1 greedy run on the same weights and mesh: tokens and the logits behind each token."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, TRACE["max_model_len"], optimizations="accuracy", checkpoint=ck))
    runs = []
    gen = batch1_generator(ctx, m)
    for prompt, n in zip(TRACE["prompts"], TRACE["max_tokens"]):
        logits = [gen.prefill(prompt)]
        toks = [int(logits[-1].argmax())]
        while len(toks) < n:
            lg, _ = gen.decode_step(toks[-1])
            logits.append(lg.float().reshape(-1).clone())
            toks.append(int(lg.argmax()))
        runs.append((toks, logits))
    gen.release_trace()
    m.close()
    return runs


def test_replay_of_the_engines_calls(env, batch1):
    ck, ctx = env
    assert [t for t, _ in batch1] == TRACE["outputs"]  # the engine's own output was each prompt's batch-1 output
    m = served_model(ck, ctx, TRACE["max_num_seqs"], TRACE["max_model_len"])
    # a plain launch allocates no one-sequence generator and no speculative backend (it used neither): its
    # sequences, vLLM's KV pool included, live in the batched decoder's state
    assert m.gen is None and m.spec_backend is None and m.state is m.batch.kv_state
    got = replay(m, TRACE)
    kv_ids = [i for i, st in enumerate(m.state.layers) if hasattr(st, "k")]
    assert kv_ids and all(d.state.layers[i].k is k and d.state.layers[i].v is v  # the pool the plugin holds
                          for d in m.batch.dec.decs.values() for i, (k, v) in zip(kv_ids, m._kv_cache))
    worst = 0.0
    for user, (toks, ref_logits) in enumerate(batch1):
        assert [t for t, _ in got[user]] == toks, user
        for (_, row), ref in zip(got[user], ref_logits):
            worst = max(worst, float((row - ref).abs().max()))
    assert worst <= LOGITS_TOL, worst
    # the decoder grew from bucket 1 (warmup) to the launch's 4 when the prompts arrived; each bucket's step was
    # captured once: users joined, left and moved between slots and buckets without a new capture
    assert m.batch.dec.moves[:1] == [(1, 4)]
    caps = [c for d in m.batch.dec.decs.values() for c in d.traces.captures.values()]
    assert caps and max(caps) == 1, caps
    m.release_persistent_capture()


def test_replay_of_the_engines_device_sampled_calls(env):
    """``sample_on_device_mode`` "all" with four requests of different sampling parameters and seeds (recorded
    from the real engine): the runner's per-row ``sampling_params`` in every call, the adapter sampling all rows
    in one traced step; the returned ids equal the recorded ones and every request's tokens its own batch-1
    ``TTGenerator.generate`` with the same parameters and seed."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    ref = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, SAMPLED["max_model_len"], optimizations="accuracy", checkpoint=ck))
    gen = batch1_generator(ctx, ref)
    want = [gen.generate([p], n, SamplingParams(**r))[0].tokens
            for p, n, r in zip(SAMPLED["prompts"], SAMPLED["max_tokens"], SAMPLED["requests"])]
    gen.release_trace()
    ref.close()
    assert want == SAMPLED["outputs"]
    m = served_model(ck, ctx, SAMPLED["max_num_seqs"], TRACE["max_model_len"])
    got = replay(m, SAMPLED)
    assert [[t for t, _ in g] for g in got] == want
    caps = [c for d in m.batch.dec.decs.values() for c in d.traces.captures.values()]
    assert caps and max(caps) == 1, caps
    m.release_persistent_capture()


def test_decode_calls_with_slot_remap(env, batch1):
    """The runner's decode path (``decode_forward`` with ``slot_remap``, padded rows at position -1), which the
    async decode controller uses: two requests prefilled into slots 0 and 1, then decoded with their rows
    swapped (remap [1, 0, 2, 3]: row 0 reads slot 1) and a padding row, each still equal to its batch-1 run."""
    ck, ctx = env
    m = served_model(ck, ctx, 4, TRACE["max_model_len"])
    kv = m.allocate_kv_cache_per_layer([((20, 1, 64, m.model.args.cfg.head_dim), torch.bfloat16, 0)])
    m.warmup_model_prefill(kv_cache=kv, enable_trace=False)
    m.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=4)
    prompts = TRACE["prompts"][:2]
    width = max(map(len, prompts))
    toks = torch.zeros(2, width, dtype=torch.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p)
    table = torch.tensor([[1, 0, 0, 0], [2, 0, 0, 0]], dtype=torch.int32)
    first = m.prefill_forward(toks, table, kv, np.array([len(p) for p in prompts]), start_pos=np.array([0, 0]),
                              empty_slots=[0, 1])[0]
    emitted = [[int(first[i, -1].argmax())] for i in range(2)]
    order = [1, 0]  # row r serves request order[r]
    pad_table = torch.zeros(4, 4, dtype=torch.int32)
    remap = torch.tensor([1, 0, 2, 3], dtype=torch.int32)
    for step in range(4):
        tokens = torch.zeros(4, 1, dtype=torch.int32)
        pos = torch.full((4,), -1, dtype=torch.int32)
        pt = pad_table.clone()
        for r, u in enumerate(order):
            tokens[r, 0] = emitted[u][-1]
            pos[r] = len(prompts[u]) + len(emitted[u]) - 1
            pt[r] = table[u]
        h = m.decode_forward(tokens, pt, kv, pos, enable_trace=True, read_from_device=False,
                             slot_remap=remap if step == 0 else None)
        assert isinstance(h, DecodeHandle)
        logits = m.process_decode_output_host(m.read_decode_output(h))
        for r, u in enumerate(order):
            assert float((logits[r, 0] - batch1[u][1][len(emitted[u])]).abs().max()) <= LOGITS_TOL
            emitted[u].append(int(logits[r, 0].argmax()))
    for u in range(2):
        assert emitted[u] == batch1[u][0][: len(emitted[u])]
    # a row claiming a position its slot does not hold is refused (e.g. a remap the model never applied)
    tokens[0, 0], pos[0] = 1, 3
    with pytest.raises(ValueError, match="state slot 0"):
        m.decode_forward(tokens, pt, kv, pos)
    m.release_persistent_capture()


def test_refusals_of_a_multi_sequence_launch(env):
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="max-num-seqs"):
        Qwen36ForCausalLM.initialize_vllm_model(hf, ctx.mesh_device, 64, max_seq_len=256, checkpoint=ck)
    with pytest.raises(NotImplementedError, match="speculative"):
        Qwen36ForCausalLM.initialize_vllm_model(hf, ctx.mesh_device, 2, max_seq_len=256, checkpoint=ck, spec_k=2)
    m = served_model(ck, ctx, 2, TRACE["max_model_len"])
    kv = m.allocate_kv_cache_per_layer([((12, 1, 64, m.model.args.cfg.head_dim), torch.bfloat16, 0)])
    table = torch.tensor([[1, 0, 0, 0]], dtype=torch.int32)
    m.prefill_forward(torch.tensor([[5, 6, 7]]), table, kv, np.array([3]), start_pos=np.array([0]), empty_slots=[1])
    # a continuation of a sequence no slot holds, and a real chunked prefill, fail by name
    with pytest.raises(ValueError, match="no state slot holds"):
        m.prefill_forward(torch.tensor([[5, 6, 8, 9]]), table, kv, np.array([4]), start_pos=np.array([3]),
                          empty_slots=[0])
    with pytest.raises(NotImplementedError, match="cached prefix"):
        m.prefill_forward(torch.tensor([[5, 6, 7, 9, 9]]), table, kv, np.array([5]), start_pos=np.array([3]),
                          empty_slots=[1])
    with pytest.raises(ValueError, match="permutation"):
        m.decode_forward(torch.tensor([[1], [2]]), None, kv, torch.tensor([-1, -1]), slot_remap=torch.tensor([1, 1]))
    m.release_persistent_capture()
