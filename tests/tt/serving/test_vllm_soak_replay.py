"""The plugin's calls of a short soak through the real engine, replayed without vLLM.

``tests/data/vllm_tt_plugin_soak_trace.json`` was recorded by ``scripts/soak_vllm.py`` (vLLM 0.25.1, the vllm-tt
plugin at e3fc849, the CI checkpoint; command in docs/soak.md): 10 requests with random prompt lengths, arrival
steps, budgets, greedy and seeded sampled settings, one abort, ``max_num_seqs=4`` and a 7-block KV pool, so the
scheduler preempted requests and resumed them later (a prefill from position 0 of prompt + generated tokens into
another slot), rows condensed as requests finished, and slots were taken over without a finish signal.

The replay feeds the recorded arguments to the adapter and checks: every call returns the recorded argmax; every
row continues its request with the tokens the engine emitted; each bucket's step was captured once; and every request
against the resume-aware batch-1 oracle (``support.soak_oracle``, the soak's own): the batch-1 run that
prefills what the engine prefilled (the prompt, and at a resume the prompt + the tokens generated so far) and decodes
the rest. Every logits row (greedy, sampled, aborted, before and after a resume) equals that run's row (max abs <=
1e-4; the tokens of a seeded sampled request then follow, vLLM's sampler drawing from equal rows with the same
generator: the soak script checks them with vLLM's own ``Sampler``, which CI does not have), and every greedy
request emits the argmax of its batch-1 rows. A resumed greedy request need not equal the request never preempted
(its state after the resume is a prefill's); r1 of this recording does not, at its resume row, and the oracle
accounts for it without an exception."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from support.soak_oracle import check_request, oracle_generator, request_rows
from support.vllm_calls import feed_calls, load_trace
from support.vllm_replay import LOGITS_TOL, batch1_generator, load_on_mesh as _load, open_env
from qwen36.tt.serving.vllm_prefix import PrefixConfig

DATA = Path(__file__).resolve().parents[2] / "data"
SOAK = json.loads((DATA / "vllm_tt_plugin_soak_trace.json").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_soak")
    yield ck, ctx
    ctx.close()


def _replay(m: Qwen36ForCausalLM, trace: dict):
    """Feeds the recorded calls; returns (call index -> the logits rows the prefill returned, widest call). Where
    the recording says how each row was served (a decode step, or a prefill and from where), the replay serves it
    the same way."""
    rows, widest = {}, 0
    for ci, c, args, out in feed_calls(m, trace["calls"]):
        if c["call"] != "prefill_forward":
            continue
        res = out[0] if isinstance(out, tuple) else out
        assert res[:, -1].argmax(-1).tolist() == c["returned"]["tokens"]
        if c.get("served"):
            assert m.batch.prefix.served == c["served"], ci
        widest = max(widest, args["tokens"].shape[0])
        rows[ci] = res[:, -1].float().clone()
    return rows, widest


@pytest.mark.slow
def test_replay_of_a_soak_with_preemption_and_aborts(env):
    ck, ctx = env
    t = SOAK
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], tt_data_parallel=1, checkpoint=ck,
        optimizations="accuracy"))
    rows, widest = _replay(m, t)
    assert widest == t["max_num_seqs"]
    caps = [cnt for d in m.batch.dec.decs.values() for cnt in d.traces.captures.values()]
    assert caps and max(caps) == 1, caps
    m.release_persistent_capture()
    entries = request_rows(t["calls"], rows, t["prompts"], t["outputs"])  # checks each row's tokens
    # the recording exercises what it is for
    resumed = [u for u, e in enumerate(entries) if sum(x[1] for x in e) > 1]
    assert resumed and [f"r{u}" for u in resumed] == t["resumed"]
    assert t["aborted"] and all(t["finished"][int(r[1:])] == "abort" for r in t["aborted"])

    ref = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck))
    gen = batch1_generator(ctx, ref)
    results = {}
    for u, (prompt, out, spec) in enumerate(zip(t["prompts"], t["outputs"], t["requests"])):
        if entries[u]:
            assert len(entries[u]) == len(out), u  # a row for every token the engine emitted
            results[u] = check_request(gen, prompt, out, spec["sampling"], entries[u], sample_fn=None)
    ref.release_persistent_capture()
    print({u: {k: x[k] for k in ("rows", "resumes", "max_abs", "min_pcc", "tokens_equal")} for u, x in results.items()})
    assert all(x["max_abs"] <= LOGITS_TOL for x in results.values()), results
    greedy = [u for u in results if t["requests"][u]["sampling"]["temperature"] == 0.0]
    assert greedy and all(results[u]["tokens_equal"] for u in greedy), results
    assert any(results[u]["resumes"] for u in greedy)  # a resumed greedy request (r1) is among them


# request r163 of the 200-request soak at max_num_seqs 8 (docs/soak.md): a 100-token prompt whose last row rounds
# differently when prefilled in chunks of 64 than in the adapter's one chunk of 256 (0.023 max abs)
R163 = [164, 139, 97, 448, 178, 61, 232, 247, 65, 350, 219, 335, 54, 445, 339, 287, 425, 467, 82, 472, 80, 364, 160, 7, 62,
        154, 155, 510, 34, 222, 53, 286, 193, 375, 41, 322, 124, 83, 399, 101, 299, 306, 236, 17, 34, 149, 32, 294,
        372, 70, 165, 143, 323, 357, 286, 272, 450, 368, 443, 281, 456, 154, 221, 203, 188, 331, 158, 127, 95, 112,
        83, 35, 470, 140, 456, 15, 110, 456, 462, 457, 482, 254, 386, 189, 118, 413, 397, 408, 451, 426, 340, 95,
        194, 334, 149, 139, 305, 170, 48, 174]


@pytest.mark.slow
def test_the_oracle_prefills_in_the_engines_chunks(env):
    """The soak oracle's batch-1 generator takes the engine model's prefill chunk: with the chunk the soak used to
    hard-code (64) it disagreed with the adapter (one chunk of 256) on this prompt's last row, which read as a
    batch-variance of the engine."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, 256, optimizations="accuracy", checkpoint=ck))
    gen = batch1_generator(ctx, m)  # the engine model's weights and args (a plain launch has no generator)
    engine = gen.prefill(R163).float().reshape(-1).clone()
    gen.release_trace()
    m.release_persistent_capture()
    assert m.model.args.prefill_chunk > len(R163)
    same = oracle_generator(ck, m.model.args)
    other = oracle_generator(ck, dict(max_seq_len=256, block_size=m.model.args.block_size, prefill_chunk=64))
    try:
        assert same.model.args.prefill_chunk == m.model.args.prefill_chunk
        assert float((same.prefill(R163).float().reshape(-1) - engine).abs().max()) <= LOGITS_TOL
        assert float((other.prefill(R163).float().reshape(-1) - engine).abs().max()) > 1e-2
    finally:
        same.close()
        other.close()


@pytest.mark.slow
def test_replay_of_a_prefix_caching_soak(env):
    """``tests/data/vllm_tt_plugin_soak_apc_trace.json.gz``: ``scripts/soak_vllm.py --prefix-caching`` (command in
    docs/soak.md): 14 requests, 60 % of them starting with part of an earlier prompt, ``max_num_seqs=4``, a 10-block
    pool, the model's prefill chunk (its checkpoint grid) 128. vLLM reported cached prefixes for 7 prefills: they
    restored GDN checkpoints or reran from position 0 on vLLM's cached pages, one of them a preempted request whose
    resume hit a page its own decode steps wrote (rewritten with the prefill's rows). Every row the engine returned
    equals the batch-1 run that prefills each prompt (and the resume) from position 0 and decodes the rest,
    bit for bit: a hit is the cold computation."""
    ck, ctx = env
    t = load_trace(DATA / "vllm_tt_plugin_soak_apc_trace.json.gz")
    assert t["prefix_caching"] and t["prefill_chunk"] == 128
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, t["max_num_seqs"], max_seq_len=t["max_model_len"], tt_data_parallel=1, checkpoint=ck,
        optimizations="accuracy", prefill_chunk=t["prefill_chunk"], prefix=PrefixConfig(t["prefix_checkpoints"])))
    rows, widest = _replay(m, t)
    stats = m.batch.prefix.stats
    m.release_persistent_capture()
    # what the recording exercises: hits, a restored checkpoint, a rerun below a hit, a rewritten decode page, a resume
    assert stats.hits >= 5 and stats.restores >= 1 and stats.recomputed_tokens > 0 and stats.repaired_pages >= 1
    assert stats.unsafe_repairs == 0 and t["resumed"]
    entries = request_rows(t["calls"], rows, t["prompts"], t["outputs"])
    ref = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck,
        prefill_chunk=t["prefill_chunk"]))
    gen = batch1_generator(ctx, ref)
    results = {}
    for u, (prompt, out, spec) in enumerate(zip(t["prompts"], t["outputs"], t["requests"])):
        if entries[u]:
            results[u] = check_request(gen, prompt, out, spec["sampling"], entries[u], sample_fn=None)
    ref.release_persistent_capture()
    assert all(x["max_abs"] == 0.0 for x in results.values()), results
    greedy = [u for u in results if t["requests"][u]["sampling"]["temperature"] == 0.0]
    assert greedy and all(results[u]["tokens_equal"] for u in greedy), results
