"""Dev-only: vLLM's automatic prefix caching through the real engine (``vllm.LLM``, the vllm-tt plugin, the emulated
mesh; docs/vllm_prefix.md): conversations whose turns resend the whole history served with prefix caching on and
off, every returned row bit-equal. Skipped unless vLLM and the plugin are installed (as
tests/tt/serving/test_vllm_engine_dev.py).

Three conversations share a 200-token system prompt and run four turns each, all three turns of a round submitted
together: A keeps each reply in the next prompt (completions style: its next turn hits the pages its own decode steps
wrote), B drops it (the chat template's way: the next turn's hit ends a few tokens before the last prompt's end) and
samples with a seed, C keeps it and is greedy. At ``max_num_seqs`` 1 the turns run one at a time, at 8 together. The
plugin's calls of the ``max_num_seqs`` 8 run are ``tests/data/vllm_tt_plugin_prefix_chat_trace.json.gz``, replayed in
CI by tests/tt/serving/test_vllm_prefix_replay.py."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (dev-only check; see docs/serving.md)")
plugin_worker = pytest.importorskip("vllm_tt_plugin.worker",
                                    reason="the vllm-tt plugin is not installed (dev-only check; see docs/serving.md)")

from support.soak_oracle import request_rows  # noqa: E402
from qwen36.tiny import make_bf16_checkpoint  # noqa: E402
from support.vllm_calls import record_calls  # noqa: E402
from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION  # noqa: E402
from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "tests/data/vllm_tt_plugin_prefix_chat_trace.json.gz"
BLOCK, MAX_LEN, TURNS, REPLY = 64, 640, 4, 40  # a 40-token reply crosses a page: A and C hit decode-written pages
SAMPLING = {"A": dict(temperature=0.0), "B": dict(temperature=0.8, top_k=20, seed=5), "C": dict(temperature=0.0)}
KEEPS_REPLY = {"A": True, "B": False, "C": True}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _conversations(llm) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Every turn's prompt and output in submission order, and which conversation each was."""
    system = _tokens(200, 0)
    history = {c: system + [1 + i] for i, c in enumerate(SAMPLING)}
    prompts, outputs, names = [], [], []
    for turn in range(TURNS):
        batch = {c: history[c] + _tokens(30 + 7 * turn, 100 * turn + i) + [2] for i, c in enumerate(SAMPLING)}
        outs = llm.generate([{"prompt_token_ids": p} for p in batch.values()],
                            [vllm.SamplingParams(**SAMPLING[c], max_tokens=REPLY, ignore_eos=True) for c in batch])
        for (c, p), o in zip(batch.items(), outs):
            reply = list(o.outputs[0].token_ids)
            prompts.append(p)
            outputs.append(reply)
            names.append(c)
            history[c] = p + (reply if KEEPS_REPLY[c] else [1])
    return prompts, outputs, names


def _run(tmp_path, monkeypatch, seqs: int, prefix_caching: bool):
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    with monkeypatch.context() as mp:
        mp.setattr(plugin_worker, "open_mesh_device", lambda *a, **k: ctx.mesh_device)
        mp.setattr(plugin_worker, "close_mesh_device", lambda *a, **k: None)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("EXTRA_MODELS_DIR", str(REPO / "vllm_models"))
        mp.setenv("MESH_DEVICE", "P150x2")
        calls, models, rows = [], [], {}
        record_calls(Qwen36ForCausalLM, calls, mp.setattr, instances=models, rows=rows)
        # vLLM requires chunked prefill on with prefix caching for a hybrid architecture; the plugin turns it off
        llm = vllm.LLM(model=str(ck), max_num_seqs=seqs, max_model_len=MAX_LEN, block_size=BLOCK,
                       skip_tokenizer_init=True, enable_prefix_caching=prefix_caching,
                       enable_chunked_prefill=prefix_caching, max_num_batched_tokens=MAX_LEN * seqs,
                       async_scheduling=False, generation_config="vllm", disable_log_stats=False,
                       additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy"}})
        try:
            prompts, outputs, names = _conversations(llm)
            metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache")}
            stats = models[0].batch.prefix.stats.as_dict()
            # every call, the KV allocation and warmup included (a replay allocates the pool where the engine did)
            return dict(prompts=prompts, outputs=outputs, names=names, calls=list(calls), rows=dict(rows),
                        metrics=metrics, stats=stats,
                        prefill_chunk=models[0].model.args.prefill_chunk,
                        prefix_checkpoints=models[0].batch.prefix.config.checkpoints)
        finally:
            del llm
            ctx.close()


@pytest.mark.parametrize("seqs", [1, 8])
def test_prefix_cached_conversations_equal_cold(tmp_path, monkeypatch, seqs):
    warm = _run(tmp_path / "on", monkeypatch, seqs, True)
    cold = _run(tmp_path / "off", monkeypatch, seqs, False)
    assert warm["outputs"] == cold["outputs"] and warm["prompts"] == cold["prompts"]
    w = request_rows(warm["calls"], warm["rows"], warm["prompts"], warm["outputs"])
    c = request_rows(cold["calls"], cold["rows"], cold["prompts"], cold["outputs"])
    assert [len(x) for x in w] == [len(x) for x in c] == [REPLY] * len(warm["prompts"])
    assert all(torch.equal(a[2], b[2]) for x, y in zip(w, c) for a, b in zip(x, y))  # every row, bit for bit
    s = warm["stats"]
    assert warm["metrics"]["vllm:prefix_cache_hits"] > 0 and s["hits"] >= 3 * (TURNS - 1)
    assert s["restores"] > 0 and s["repaired_pages"] > 0  # A and C hit pages their decode steps wrote
    assert cold["stats"]["hits"] == 0
    if seqs == 8:
        rec = {"vllm": vllm.__version__, "max_num_seqs": seqs, "block_size": BLOCK, "max_model_len": MAX_LEN,
               "prefill_chunk": warm["prefill_chunk"], "prefix_checkpoints": warm["prefix_checkpoints"],
               "prompts": warm["prompts"], "outputs": warm["outputs"], "names": warm["names"],
               "sampling": [SAMPLING[n] for n in warm["names"]], "calls": warm["calls"]}
        data = gzip.compress(json.dumps(rec).encode(), mtime=0)
        (tmp_path / TRACE.name).write_bytes(data)
        assert TRACE.exists() and json.loads(gzip.decompress(TRACE.read_bytes())) == rec, (
            f"the engine's calls differ from {TRACE}; if the plugin, vLLM or the adapter changed on purpose, replace "
            f"it with {tmp_path / TRACE.name}")
