"""Recorded prefix-cached engine runs replayed without vLLM (the conversations below; the 32-sequence soak and the chat
over ``qwen36 serve`` in their own tests): ``tests/data/vllm_tt_plugin_prefix_chat_trace.json.gz``,
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

from support.soak_oracle import check_request, request_rows, row_digest
from support.vllm_calls import feed_calls, load_trace
from support.chat_api import CHAT_CHECKPOINT, make_chat_checkpoint
from support.vllm_replay import batch1_generator, load_on_mesh, open_env
from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
from qwen36.tt_ops.device import open_mesh
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


SOAK32 = Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_soak_apc32_trace.json.gz"


@pytest.mark.slow
def test_replay_of_a_prefix_caching_soak_at_32_sequences(env):
    """``tests/data/vllm_tt_plugin_soak_apc32_trace.json.gz``: ``scripts/soak_vllm.py --prefix-caching
    --max-num-seqs 32`` through the real engine (command in docs/vllm_prefix.md; compacted by
    ``scripts/compact_soak_trace.py``): 48 requests, 60 % starting with part of an earlier prompt, a 48-block pool,
    grid 128. That dev run checked every row against the resume-aware batch-1 oracle (all bit-equal). Here the
    replay must return the engine's rows bit for bit (sha256 of each row's fp32 bytes), serve every prefill as
    recorded (hit, restore point, repairs), and two requests are rerun on the cold batch-1 oracle: the first that
    restored a checkpoint and the first that was resumed."""
    ck, ctx = env
    t = load_trace(SOAK32)
    assert t["prefix_caching"] and t["max_num_seqs"] == 32
    hf = json.loads((ck / "config.json").read_text())
    m = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], checkpoint=ck,
        optimizations="accuracy", prefill_chunk=t["prefill_chunk"], prefix=PrefixConfig(t["prefix_checkpoints"])))
    rows = {}
    for ci, c, _, out in feed_calls(m, t["calls"]):
        if c["call"] != "prefill_forward":
            continue
        res = out[0] if isinstance(out, tuple) else out
        assert m.batch.prefix.served == c["served"], ci
        rows[ci] = res[:, -1].float().clone()
    stats = m.batch.prefix.stats
    m.release_persistent_capture()
    bad = [(ci, j) for ci, r in rows.items() for j, want in enumerate(t["row_digests"][str(ci)])
           if row_digest(r[j]) != want]
    assert not bad and sorted(map(int, t["row_digests"])) == sorted(rows), bad[:5]
    assert max(r.shape[0] for r in rows.values()) > 16  # bucket 32 ran
    assert stats.hits >= 15 and stats.restores >= 3 and stats.repaired_pages >= 1 and stats.unsafe_repairs == 0
    entries = request_rows(t["calls"], rows, t["prompts"], t["outputs"])
    served = [(ci, r) for ci, c in enumerate(t["calls"]) for r in c.get("served") or [] if r["kind"] == "prefill"]
    assert any(r["restored"] for _, r in served) and t["resumed"]
    restored_call = next(ci for ci, r in served if r["restored"])
    pick = {next(u for u, e in enumerate(entries) if e and any(x[3] == restored_call for x in e)),
            int(sorted(t["resumed"])[0][1:].split("-")[0])}
    ref = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck,
        prefill_chunk=t["prefill_chunk"]))
    gen = batch1_generator(ctx, ref)
    results = {u: check_request(gen, t["prompts"][u], t["outputs"][u], t["requests"][u]["sampling"], entries[u],
                                sample_fn=None) for u in sorted(pick)}
    ref.release_persistent_capture()
    assert all(x["max_abs"] == 0.0 for x in results.values()), results
    assert all(x["tokens_equal"] is not False for x in results.values()), results


DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.slow
@pytest.mark.parametrize("trace,seqs", [("vllm_tt_plugin_prefix_http_chat1_trace.json.gz", 1),
                                        ("vllm_tt_plugin_prefix_http_chat_trace.json.gz", 8)])
def test_replay_of_a_conversation_over_vllm_serve(tmp_path_factory, trace, seqs):
    """``tests/data/vllm_tt_plugin_prefix_http_chat{1,}_trace.json.gz``: ``scripts/chat_vllm_http.py --checkpoint
    chat-ci --turns 5 --max-num-seqs 1 | 8`` (``qwen36 serve`` on the emulated mesh, prefix caching on, five
    streamed chat turns through the ``openai`` client, each resending the conversation; every call of the server's
    model recorded, from the KV allocation on). The dev run checked every row against the cold batch-1 oracle.
    Here: every call is served as recorded (the later turns restore a checkpoint and prefill from it), every row the
    replay returns has the bits the server returned (sha256), and the turn whose hit lies above its restore point is
    rerun on the cold oracle."""
    t = load_trace(DATA / trace)
    assert t["max_num_seqs"] == seqs and t["checkpoint"] == CHAT_CHECKPOINT
    ck = make_chat_checkpoint(tmp_path_factory.mktemp("prefix_http_chat") / CHAT_CHECKPOINT)
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    ctx.models = []
    try:
        hf = json.loads((ck / "config.json").read_text())
        m = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
            hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], checkpoint=ck,
            optimizations="accuracy", prefill_chunk=t["prefill_chunk"],
            prefix=PrefixConfig.from_tt_options({}, True, t["max_num_seqs"])))  # a launch's default checkpoints
        rows = {}
        for ci, c, _, out in feed_calls(m, t["calls"]):
            if c["call"] != "prefill_forward":
                continue
            res = out[0] if isinstance(out, tuple) else out
            assert res[:, -1].argmax(-1).tolist() == c["returned"]["tokens"], ci
            if "served" in c:
                assert m.batch.prefix.served == c["served"], ci
            rows[ci] = res[:, -1].float().clone()
        m.release_persistent_capture()
        bad = [(ci, j) for ci, want in t["row_digests"].items() for j, w in enumerate(want)
               if row_digest(rows[int(ci)][j]) != w]
        assert not bad, bad[:5]
        conv = t["calls"][t["warm_calls"]:]
        turns = [r for c in conv for r in c.get("served") or [] if r["kind"] == "prefill"]
        assert len(turns) == len(t["prompts"]) == 5 and all(r["restored"] for r in turns[1:])
        assert all(r["cached"] >= 0.9 * len(p) for r, p in zip(turns[1:], t["prompts"][1:]))  # >= 90 % reused
        u = next(i for i, r in enumerate(turns) if r["cached"] > r["ran_from"] > 0)  # rows rerun below the hit
        local = {i - t["warm_calls"]: r for i, r in rows.items() if i >= t["warm_calls"]}
        entries = request_rows(conv, local, t["prompts"], t["outputs"])
        ref = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
            hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck,
            prefill_chunk=t["prefill_chunk"]))
        gen = batch1_generator(ctx, ref)
        res = check_request(gen, t["prompts"][u], t["outputs"][u], {"temperature": 0.0}, entries[u], sample_fn=None)
        ref.release_persistent_capture()
        assert res["rows"] == len(t["outputs"][u]) and res["max_abs"] == 0.0 and res["tokens_equal"], res
    finally:
        ctx.close()
