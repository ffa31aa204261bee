"""A recorded prefix-cached engine run replayed without vLLM: ``tests/data/vllm_tt_plugin_prefix_chat_trace.json.gz``,
recorded by ``tests/tt/serving/test_vllm_prefix_engine_dev.py`` (vLLM 0.25.1, the vllm-tt plugin at e3fc849,
``max_num_seqs`` 8, prefix caching on): three conversations sharing a system prompt, four turns each, every turn
resending the whole history (one keeping its replies, one dropping them and sampling with a seed, one keeping them
greedily). vLLM reported cached prefixes for the later turns; the adapter restored GDN checkpoints, reran rows below
the hits into scratch pages and rewrote the pages the conversations' own decode steps had written.

The replay feeds the recorded calls: every call returns the recorded argmax and is served as recorded (decode steps,
prefills and the checkpoint each restored), and every row of every turn equals the cold batch-1 run (each prompt
prefilled from position 0, the reply decoded), bit for bit; greedy turns emit the oracle's tokens (the seeded turns'
tokens were checked against vLLM's own sampler in the dev run)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen36.testing.soak_oracle import check_request, request_rows
from qwen36.testing.vllm_calls import feed_calls, load_trace
from qwen36.testing.vllm_replay import batch1_generator, load_on_mesh, open_env
from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from qwen36.tt.serving.vllm_prefix import PrefixConfig

TRACE = Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_prefix_chat_trace.json.gz"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_prefix_replay")
    yield ck, ctx
    ctx.close()


@pytest.mark.slow
def test_replay_of_prefix_cached_conversations(env):
    ck, ctx = env
    t = load_trace(TRACE)
    hf = json.loads((ck / "config.json").read_text())
    m = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], checkpoint=ck,
        optimizations="accuracy", prefill_chunk=t["prefill_chunk"], prefix=PrefixConfig(t["prefix_checkpoints"])))
    rows = {}
    for ci, c, _, out in feed_calls(m, t["calls"]):
        if c["call"] != "prefill_forward":
            continue
        res = out[0] if isinstance(out, tuple) else out
        assert res[:, -1].argmax(-1).tolist() == c["returned"]["tokens"], ci
        assert m.batch.prefix.served == c["served"], ci
        rows[ci] = res[:, -1].float().clone()
    stats = m.batch.prefix.stats
    m.release_persistent_capture()
    assert stats.hits >= 9 and stats.restores > 0 and stats.recomputed_tokens > 0 and stats.repaired_pages > 0
    entries = request_rows(t["calls"], rows, t["prompts"], t["outputs"])
    ref = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck,
        prefill_chunk=t["prefill_chunk"]))
    gen = batch1_generator(ctx, ref)
    results = [check_request(gen, p, o, s, e, sample_fn=None)
               for p, o, s, e in zip(t["prompts"], t["outputs"], t["sampling"], entries)]
    ref.release_persistent_capture()
    assert all(len(e) == len(o) for e, o in zip(entries, t["outputs"]))
    assert all(r["max_abs"] == 0.0 for r in results), results
    assert all(r["tokens_equal"] for r, s in zip(results, t["sampling"]) if s["temperature"] == 0.0), results
