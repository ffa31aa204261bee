"""The plugin's calls of the 200-request soak at ``max_num_seqs`` 32 through the real engine, replayed without vLLM,
every returned logits row checked bit for bit against the row the engine got.

``tests/data/vllm_tt_plugin_soak32_trace.json.gz`` is the recording of the run in docs/soak.md (``scripts/soak_vllm.py
--requests 200 --max-num-seqs 32 --kv-blocks 40 --checkpoint ci --arrival-rate 2 --seed 32 --record F``; vLLM 0.25.1,
the vllm-tt plugin at e3fc849, the CI checkpoint, the emulated mesh) in the compact form of
``scripts/compact_soak_trace.py``: the calls with their arguments, the tokens the engine emitted, and per row the
engine got the sha256 of its fp32 bytes, its argmax and its max. 233 engine steps (every one a ``prefill_forward``;
up to 28 rows per call), 180 requests completed, 20 aborted, 23 preempted and resumed.

That dev run already checked every one of its 3120 rows against the resume-aware batch-1 oracle
(``support.soak_oracle``: all bit-equal, greedy tokens the oracle's argmax, seeded sampled tokens what vLLM's
``Sampler`` draws from the oracle's rows). Rerunning the oracle for all of them took 33 min on the 2-core host, so
this test checks the replay against the engine's own rows instead: equal hashes mean the adapter today returns
exactly the bits the engine got when the oracle passed. It also checks that every row continues its request with
the prompt and the tokens the engine emitted, and that each greedy request emitted its rows' argmax (sampled tokens
need vLLM's sampler, which CI does not have).

The replay feeds all 238 recorded calls (allocation, warm-up, the 233 engine steps) to ``Qwen36ForCausalLM`` and
checks all 3120 rows: the widest call (28 rows, bucket 32), the two aborts of running requests (r0 and r29, each
after one token; the other 18 aborts came before their request was scheduled and make no call), all 23 resumes,
rows condensing as requests finish and slots taken over. As a spot check of the oracle itself (cheap at this size)
three requests are also rerun on the batch-1 oracle: r1 (greedy, resumed), r3 (sampled, resumed after its first
token) and r29 (greedy, aborted while running)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from support.soak_oracle import check_request, request_rows, row_digest
from support.vllm_calls import feed_calls, load_trace
from support.vllm_replay import batch1_generator, load_on_mesh, open_env, served_model

SOAK = load_trace(Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_soak32_trace.json.gz")
ORACLE = {1: "greedy, resumed", 3: "sampled, resumed", 29: "greedy, aborted while running"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_soak32")
    yield ck, ctx
    ctx.close()


def mismatches(rows: dict[int, torch.Tensor], digests: dict[str, list]) -> list[tuple]:
    """(call, row, recorded digest, replayed digest) of every replayed row whose bits differ from the engine's."""
    bad = []
    for ci, r in rows.items():
        want = digests[str(ci)]
        assert len(want) == r.shape[0], ci
        bad += [(ci, i, w, g) for i, (w, g) in enumerate(zip(want, map(row_digest, r))) if w != g]
    return bad


def _replay(m, calls: list[dict]) -> dict[int, torch.Tensor]:
    """Feeds the recorded calls; returns call index -> the last-position logits rows each prefill returned."""
    rows = {}
    for ci, c, _, out in feed_calls(m, calls):
        if c["call"] == "prefill_forward":
            res = out[0] if isinstance(out, tuple) else out
            assert list(res.shape) == c["returned"]["shape"], ci
            rows[ci] = res[:, -1].float().clone()
    return rows


def test_a_one_ulp_change_of_a_row_changes_its_digest():
    r = torch.randn(512, generator=torch.Generator().manual_seed(0))
    s = r.clone()
    s[100] = torch.nextafter(s[100], torch.tensor(float("inf")))
    assert row_digest(s)[1:] == row_digest(r)[1:] and row_digest(s) != row_digest(r)


@pytest.mark.slow
def test_replay_of_the_32_sequence_soak_is_bit_equal_to_the_engines_rows(env):
    ck, ctx = env
    t = SOAK
    m = served_model(ck, ctx, t["max_num_seqs"], t["max_model_len"])
    calls = t["calls"]
    rows = _replay(m, calls)
    caps = [cnt for d in m.batch.dec.decs.values() for cnt in d.traces.captures.values()]
    m.release_persistent_capture()
    assert caps and max(caps) == 1, caps  # each bucket's step captured once

    assert mismatches(rows, t["row_digests"]) == []
    ci = min(rows)  # the check fails on one ulp of one element of one row
    bent = {**rows, ci: rows[ci].clone()}
    bent[ci][0, 7] = torch.nextafter(bent[ci][0, 7], torch.tensor(float("inf")))
    assert [b[:2] for b in mismatches(bent, t["row_digests"])] == [(ci, 0)]

    entries = request_rows(calls, rows, t["prompts"], t["outputs"])  # each row continues prompt + emitted tokens
    greedy = 0
    for u, e in enumerate(entries):
        if not e or t["requests"][u]["sampling"]["temperature"] != 0.0:
            continue
        p, out = len(t["prompts"][u]), t["outputs"][u]
        got = [int(row.argmax()) for n, _, row, *_ in e if n - p < len(out)]
        assert got == out[: len(got)], u  # the engine's greedy tokens are the argmax of the replayed rows
        greedy += 1

    # what the replayed calls cover
    assert max(r.shape[0] for r in rows.values()) == max(len(d) for d in t["row_digests"].values()) == 28
    resumed = sorted(f"r{u}" for u, e in enumerate(entries) if sum(x[1] for x in e) > 1)
    assert resumed == sorted(t["resumed"]) and len(resumed) == 23, resumed
    aborted_running = [r for r in t["aborted"] if entries[int(r[1:])]]
    assert len(aborted_running) == 2 and all(t["finished"][int(r[1:])] == "abort" for r in aborted_running)
    assert sum(len(e) for e in entries) == 3120 and greedy > 100

    # the batch-1 oracle on a few requests (the dev run checked all of them)
    hf = json.loads((ck / "config.json").read_text())
    ref = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, t["max_model_len"], optimizations="accuracy", checkpoint=ck))
    gen = batch1_generator(ctx, ref)
    for u, what in ORACLE.items():
        spec = t["requests"][u]["sampling"]
        assert (spec["temperature"] == 0.0) == what.startswith("greedy") and entries[u], u
        assert (sum(x[1] for x in entries[u]) > 1) == ("resumed" in what), u
        res = check_request(gen, t["prompts"][u], t["outputs"][u], spec, entries[u], sample_fn=None)
        print(f"oracle r{u} ({what}): {res['rows']} rows, max abs {res['max_abs']}, tokens {res['tokens_equal']}")
        assert res["max_abs"] == 0.0 and res["tokens_equal"] is not False, (u, res)
    ref.release_persistent_capture()
    print(f"{len(calls)} calls, {sum(r.shape[0] for r in rows.values())} rows bit-equal, resumed {resumed}, "
          f"aborted while running {aborted_running}, {greedy} greedy requests' tokens checked")
