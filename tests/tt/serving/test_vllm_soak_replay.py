"""The plugin's calls of a short soak through the real engine, replayed without vLLM.

``tests/data/vllm_tt_plugin_soak_trace.json`` was recorded by ``scripts/soak_vllm.py`` (vLLM 0.25.1, the vllm-tt
plugin at e3fc849, the CI checkpoint; command in docs/serving.md): 10 requests with random prompt lengths, arrival
steps, budgets, greedy and seeded sampled settings, one abort, ``max_num_seqs=4`` and a 7-block KV pool, so the
scheduler preempted requests and resumed them later (a prefill from position 0 of prompt + generated tokens into
another slot), rows condensed as requests finished, and slots were taken over without a finish signal.

The replay feeds the recorded arguments to the adapter and checks: every call returns the recorded argmax; every
row continues its request with the tokens the engine emitted; every logits row of every request (greedy, sampled,
aborted, before and after its resume) equals the same request served alone at batch 1 with the same tokens fed
(max abs <= 1e-4), which is what makes a seeded request reproduce its batch-1 output under vLLM's host sampler;
every completed greedy request equals its batch-1 greedy output; each bucket's step was captured once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from qwen36.testing.vllm_calls import restore as _arg
from qwen36.testing.vllm_replay import LOGITS_TOL, batch1_generator, load_on_mesh as _load, open_env

SOAK = json.loads((Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_soak_trace.json").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_soak")
    yield ck, ctx
    ctx.close()


def _replay(m: Qwen36ForCausalLM, trace: dict):
    """Returns per request a list of segments: (tokens prefilled, [logits row of each emitted token])."""
    prompts, outputs = trace["prompts"], trace["outputs"]
    segs: list[list] = [[] for _ in prompts]
    kv, widest = None, 0
    for c in trace["calls"]:
        name, args = c["call"], {k: _arg(v) for k, v in c["args"].items()}
        if name == "allocate_kv_cache_per_layer":
            specs = [(tuple(s), getattr(torch, d.replace("torch.", "")), i) for s, d, i in c["args"]["per_layer_specs"]]
            kv = m.allocate_kv_cache_per_layer(specs)
            continue
        out = getattr(m, name)(kv_cache=kv, **args)
        if name != "prefill_forward":
            continue
        res = out[0] if isinstance(out, tuple) else out
        assert res[:, -1].argmax(-1).tolist() == c["returned"]["tokens"]
        tokens, lens, starts = args["tokens"], args["prompt_lens"], args["start_pos"]
        widest = max(widest, tokens.shape[0])
        for i in range(tokens.shape[0]):
            u = next(j for j, p in enumerate(prompts) if tokens[i, : len(p)].tolist() == p)
            n = int(lens[i])
            # the row is the request's prompt + what the engine emitted so far
            assert tokens[i, :n].tolist() == prompts[u] + outputs[u][: n - len(prompts[u])]
            if int(starts[i]) == 0:
                segs[u].append((tokens[i, :n].tolist(), []))
            segs[u][-1][1].append(res[i, -1].clone())
    return segs, widest


@pytest.mark.slow
def test_replay_of_a_soak_with_preemption_and_aborts(env):
    ck, ctx = env
    t = SOAK
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], tt_data_parallel=1, checkpoint=ck,
        optimizations="accuracy"))
    segs, widest = _replay(m, t)
    assert widest == t["max_num_seqs"]
    caps = [cnt for d in m.batch.dec.decs.values() for cnt in d.traces.captures.values()]
    assert caps and max(caps) == 1, caps
    m.release_persistent_capture()
    # the recording exercises what it is for
    resumed = [u for u, s in enumerate(segs) if len(s) > 1]
    assert resumed and [f"r{u}" for u in resumed] == t["resumed"]
    assert t["aborted"] and all(t["finished"][int(r[1:])] == "abort" for r in t["aborted"])

    ref = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck))
    gen = batch1_generator(ctx, ref)
    worst, flips = 0.0, []
    for u, (prompt, out, spec) in enumerate(zip(t["prompts"], t["outputs"], t["requests"])):
        for fed, rows in segs[u]:
            # batch 1, the same tokens fed: prefill what the segment prefilled, then the tokens the engine emitted
            emitted = out[len(fed) - len(prompt):]
            want = [gen.prefill(fed).float().reshape(-1).clone()]
            for tok in emitted[: len(rows) - 1]:
                lg, _ = gen.decode_step(tok)
                want.append(lg.float().reshape(-1).clone())
            worst = max(worst, max(float((g - w).abs().max()) for g, w in zip(rows, want)))
        if spec["sampling"]["temperature"] == 0.0 and t["finished"][u] == "length":
            alone = gen.greedy(prompt, spec["max_tokens"])  # the request served alone, never preempted
            if len(segs[u]) == 1:
                assert out == alone, u
            elif out != alone:
                # after a resume the rows are a prefill's rows, not decode rows (rounding differs, rows above equal
                # the batch-1 prefill of the same tokens): a greedy token may flip where the two best logits of the
                # uninterrupted run nearly tie. Only such a flip, after the resume, is accepted here.
                d = next(i for i, (a, b) in enumerate(zip(out, alone)) if a != b)
                assert len(prompt) + d >= len(segs[u][1][0]) - 1, (u, d)
                lg = gen.prefill(prompt + alone[:d]).float().reshape(-1)
                top = lg.topk(2).values
                flips.append((u, d, float(top[0] - top[1])))
    print(f"greedy flips after a resume (request, token index, top-2 logit margin of the batch-1 prefill of the same tokens): {flips}")
    assert all(margin < 0.05 for _, _, margin in flips), flips
    assert worst <= LOGITS_TOL, worst
    ref.release_persistent_capture()
