"""Dev-only: ``vllm.LLM`` end to end through the real vllm-tt plugin on the emulated 1x2 mesh, greedy tokens equal
to ``TTGenerator.greedy`` (the engine of ``qwen36 generate --device emulated-p150x2``). Skipped unless vLLM (empty
target) and the plugin are installed next to this project (docs/serving.md, scripts/install_vllm_tt.sh); CI
installs neither and runs tests/tt/serving/test_vllm_contract.py instead.

The plugin's worker opens a hardware mesh with ``ttnn.open_mesh_device``; here its ``open_mesh_device`` /
``close_mesh_device`` are replaced by this project's emulated mesh (in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and the model class is found through the repository's bundle directory
(``EXTRA_MODELS_DIR=vllm_models``). The device-sampling case launches with ``sample_on_device_mode`` "all" and a
seeded stochastic request with penalties: the plugin's runner builds the payload and the adapter samples on device,
so the tokens equal ``TTGenerator.generate`` with the same parameters and seed. The ``max_num_seqs=4`` cases run
several requests at once (greedy with host sampling, and seeded requests sampled on device) and record the
plugin's calls: they must equal ``tests/data/vllm_tt_plugin_batch_trace.json`` and
``vllm_tt_plugin_batch_sampled_trace.json``, which ``tests/tt/serving/test_vllm_batch.py`` replays in CI.

Run with this worktree's package importable in the vLLM environment (e.g. ``PYTHONPATH`` pointing at a
``sitecustomize`` that maps ``qwen36`` here, when that environment has another checkout installed editable)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (dev-only check; see docs/serving.md)")
plugin_worker = pytest.importorskip("vllm_tt_plugin.worker",
                                    reason="the vllm-tt plugin is not installed (dev-only check; see docs/serving.md)")

from qwen36.generation.sampling import SamplingParams  # noqa: E402
from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION, build_generator  # noqa: E402
from qwen36.testing.tt import make_bf16_checkpoint  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
PROMPT = list(range(5, 45))
N_NEW = 16
# vLLM's --block-size must equal the model's KV block size: the e3fc849 loader passes no vllm_config to
# initialize_vllm_model, so the model keeps its default (64) and allocate_kv_cache_per_layer refuses any other
BLOCK = 64


STOCHASTIC = dict(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.4, frequency_penalty=0.3,
                  repetition_penalty=1.3, seed=7)


def _engine_mesh(monkeypatch):
    """An emulated mesh the plugin's worker opens instead of cards, and the environment vLLM's engine reads."""
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    monkeypatch.setattr(plugin_worker, "open_mesh_device", lambda *a, **k: ctx.mesh_device)
    monkeypatch.setattr(plugin_worker, "close_mesh_device", lambda *a, **k: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("EXTRA_MODELS_DIR", str(REPO / "vllm_models"))
    monkeypatch.setenv("MESH_DEVICE", "P150x2")
    return ctx


@pytest.mark.parametrize("spec_k,on_device", [(None, False), (3, False), (None, True)])
def test_vllm_llm_equals_generate(tmp_path, monkeypatch, spec_k, on_device):
    if spec_k:
        pytest.importorskip("vllm_tt_plugin.spec_decode", reason="this plugin version has no speculative contract")
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    # vLLM reads _name_or_path = the model directory; the adapter loads weights from it
    assert json.loads((ck / "config.json").read_text())["architectures"]
    ref_gen = build_generator(ck, "emulated-p150x2", precision="accuracy", cache_dir=None, max_seq_len=256,
                             block_size=BLOCK, prefill_chunk=64)
    ref = (ref_gen.generate([PROMPT], N_NEW, SamplingParams(**STOCHASTIC))[0].tokens if on_device
           else ref_gen.generate([PROMPT], N_NEW)[0].tokens)
    ref_gen.close()

    ctx = _engine_mesh(monkeypatch)
    kw = {}
    if spec_k:
        kw["speculative_config"] = {"method": "custom_class", "model": "vllm_tt_plugin.model_owned_drafter",
                                    "num_speculative_tokens": spec_k}
    tt = {"trace_mode": "all", "optimizations": "accuracy"}
    if on_device:
        tt["sample_on_device_mode"] = "all"
        kw["generation_config"] = "vllm"  # vLLM's defaults, no checkpoint generation_config.json overrides
    llm = vllm.LLM(model=str(ck), max_num_seqs=1, max_model_len=256, block_size=BLOCK, skip_tokenizer_init=True,
                   enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=256,
                   async_scheduling=False, additional_config={"tt": tt}, **kw)
    try:
        sp = (vllm.SamplingParams(**STOCHASTIC, max_tokens=N_NEW, ignore_eos=True) if on_device
              else vllm.SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp)
        assert list(out[0].outputs[0].token_ids) == ref
    finally:
        del llm
        ctx.close()


def test_vllm_llm_host_logprobs_equal_generate(tmp_path, monkeypatch):
    """Logprobs through vLLM: the runner samples a logprobs request on the host (below 8 devices it never asks the
    model), from the logits the adapter returns; each emitted token's logprob and the top-3 equal the raw logprobs
    of ``TTGenerator.generate`` (greedy, so both emit the same tokens) to float tolerance."""
    n_top = 3
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ref_gen = build_generator(ck, "emulated-p150x2", precision="accuracy", cache_dir=None, max_seq_len=256,
                             block_size=BLOCK, prefill_chunk=64)
    ref = ref_gen.generate([PROMPT], N_NEW, SamplingParams(logprobs=n_top))[0]
    ref_gen.close()

    ctx = _engine_mesh(monkeypatch)
    llm = vllm.LLM(model=str(ck), max_num_seqs=1, max_model_len=256, block_size=BLOCK, skip_tokenizer_init=True,
                   enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=256,
                   async_scheduling=False, additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy",
                                                                     "sample_on_device_mode": "all"}})
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           vllm.SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=n_top))
        o = out[0].outputs[0]
        assert list(o.token_ids) == ref.tokens
        assert len(o.logprobs) == N_NEW
        for tok, got, want in zip(o.token_ids, o.logprobs, ref.logprobs):
            assert abs(got[tok].logprob - want.logprob) < 1e-3 and got[tok].rank == want.rank
            top = sorted(((lp.rank, t, lp.logprob) for t, lp in got.items() if lp.rank <= n_top))
            assert [t for _, t, _ in top] == [t for t, _ in want.top]
            assert max(abs(v - w) for (_, _, v), (_, w) in zip(top, want.top)) < 1e-3
    finally:
        del llm
        ctx.close()


def test_vllm_llm_min_tokens_switches_host_to_device(tmp_path, monkeypatch):
    """``max_num_seqs=1``, ``sample_on_device_mode`` "all", a greedy request with all three penalties and
    ``min_tokens``: the runner samples its first steps on the host (vLLM's MinTokensLogitsProcessor keeps
    ``has_active_logitsprocs`` true until ``min_tokens`` tokens are out) and the rest on device, within one sequence.
    Both kinds of step reach the model (recorded), and the tokens equal ``TTGenerator.generate`` with the same
    parameters: the device penalty row is rebuilt from the host-sampled tokens at the switch."""
    params = dict(temperature=0.0, presence_penalty=-1.5, frequency_penalty=0.5, repetition_penalty=0.7)
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ref_gen = build_generator(ck, "emulated-p150x2", precision="accuracy", cache_dir=None, max_seq_len=256,
                             block_size=BLOCK, prefill_chunk=64)
    ref = ref_gen.generate([PROMPT], N_NEW, SamplingParams(**params))[0].tokens
    plain = ref_gen.generate([PROMPT], N_NEW)[0].tokens
    ref_gen.close()
    assert ref != plain  # the penalties matter on this checkpoint

    ctx = _engine_mesh(monkeypatch)
    calls: list = []
    _recording(monkeypatch, calls)
    llm = vllm.LLM(model=str(ck), max_num_seqs=1, max_model_len=256, block_size=BLOCK, skip_tokenizer_init=True,
                   enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=256,
                   async_scheduling=False, generation_config="vllm",
                   additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy",
                                             "sample_on_device_mode": "all"}})
    try:
        calls.clear()  # warmup's calls
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           vllm.SamplingParams(**params, min_tokens=6, max_tokens=N_NEW, ignore_eos=True))
        steps = [c["args"].get("sampling_params") is not None for c in calls
                 if c["call"] in ("prefill_forward", "decode_forward")]
        assert steps[:2] == [False, False] and steps[-1] is True, steps  # host steps first, device steps last
        assert list(out[0].outputs[0].token_ids) == ref
    finally:
        del llm
        ctx.close()


# several sequences at once: prompts of different lengths and token budgets, one more request than state slots
# (the fifth waits for a slot and takes over one a finished request leaves)
BATCH_PROMPTS = [list(range(5, 45)), [7, 3, 11, 2, 9, 30, 4], list(range(60, 83)), [13] * 5 + list(range(90, 98)),
                 [41, 42, 43]]
BATCH_NEW = [12, 16, 6, 14, 9]
BATCH_SEQS = 4
TRACE = REPO / "tests/data/vllm_tt_plugin_batch_trace.json"
SAMPLED_TRACE = REPO / "tests/data/vllm_tt_plugin_batch_sampled_trace.json"


def _recording(monkeypatch, calls: list):
    """Record every call the plugin makes on the model class's serving methods (name, arguments by keyword)."""
    from qwen36.testing.vllm_calls import record_calls
    from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM

    record_calls(Qwen36ForCausalLM, calls, monkeypatch.setattr)


def _batch_engine_run(ck, monkeypatch, prompts, sps, tt_config: dict, **llm_kw) -> tuple[list, list]:
    """``prompts`` through ``vllm.LLM(max_num_seqs=BATCH_SEQS)`` and the real plugin (``tt_config`` added to its
    additional_config); returns each request's token ids and the plugin's recorded calls."""
    calls: list = []
    _recording(monkeypatch, calls)
    ctx = _engine_mesh(monkeypatch)
    llm = vllm.LLM(model=str(ck), max_num_seqs=BATCH_SEQS, max_model_len=256, block_size=BLOCK,
                   skip_tokenizer_init=True, enable_prefix_caching=False, enable_chunked_prefill=False,
                   max_num_batched_tokens=256, async_scheduling=False,
                   additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy", **tt_config}},
                   **llm_kw)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        return [list(o.outputs[0].token_ids) for o in out], calls
    finally:
        del llm
        ctx.close()


def test_vllm_llm_batch_equals_batch1_generate(tmp_path, monkeypatch):
    """``max_num_seqs=4`` through the real plugin: five greedy prompts of different lengths and budgets decode
    together (the fifth joining when a slot frees), each request's tokens == its own batch-1 ``TTGenerator.greedy``
    output. The plugin's calls are recorded; they must equal ``tests/data/vllm_tt_plugin_batch_trace.json``, which
    ``tests/tt/serving/test_vllm_contract.py`` replays without vLLM (a changed plugin or vLLM shows up here first)."""
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ref_gen = build_generator(ck, "emulated-p150x2", precision="accuracy", cache_dir=None, max_seq_len=256,
                             block_size=BLOCK, prefill_chunk=64)
    refs = [ref_gen.generate([p], n)[0].tokens for p, n in zip(BATCH_PROMPTS, BATCH_NEW)]
    ref_gen.close()

    sps = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in BATCH_NEW]
    got, calls = _batch_engine_run(ck, monkeypatch, BATCH_PROMPTS, sps, {})
    rec = {"vllm": vllm.__version__, "max_num_seqs": BATCH_SEQS, "block_size": BLOCK, "max_model_len": 256,
           "prompts": BATCH_PROMPTS, "max_tokens": BATCH_NEW, "outputs": got, "calls": calls}
    (tmp_path / TRACE.name).write_text(json.dumps(rec))
    assert got == refs
    assert max(len(c["args"]["tokens"]["values"]) for c in calls if c["call"] == "prefill_forward") > 1
    want = json.loads(TRACE.read_text())
    assert rec == want, (f"the engine's calls differ from {TRACE}; if the plugin / vLLM changed on purpose, "
                         f"replace it with {tmp_path / TRACE.name}")


def test_vllm_llm_batch_sampled_on_device_equals_generate(tmp_path, monkeypatch):
    """``max_num_seqs=4`` with ``sample_on_device_mode`` "all": four seeded requests with different sampling
    parameters (top-k / top-p, min_p-free penalties, greedy) decode together and the runner hands every step's
    ``sampling_params`` rows to the adapter, which samples all rows on device in one traced step; each request's
    tokens equal its own batch-1 ``TTGenerator.generate`` with the same parameters and seed."""
    reqs = [dict(temperature=0.8, top_k=20, top_p=0.9, seed=7),
            dict(temperature=1.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, seed=11),
            dict(temperature=0.0),
            dict(temperature=1.2, top_k=50, seed=7)]
    prompts, n_new = BATCH_PROMPTS[:4], BATCH_NEW[:4]
    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ref_gen = build_generator(ck, "emulated-p150x2", precision="accuracy", cache_dir=None, max_seq_len=256,
                             block_size=BLOCK, prefill_chunk=64)
    refs = [ref_gen.generate([p], n, SamplingParams(**r))[0].tokens for p, n, r in zip(prompts, n_new, reqs)]
    ref_gen.close()

    sps = [vllm.SamplingParams(**r, max_tokens=n, ignore_eos=True) for r, n in zip(reqs, n_new)]
    got, calls = _batch_engine_run(ck, monkeypatch, prompts, sps, {"sample_on_device_mode": "all"},
                                   generation_config="vllm")
    rec = {"vllm": vllm.__version__, "max_num_seqs": BATCH_SEQS, "block_size": BLOCK, "max_model_len": 256,
           "prompts": prompts, "max_tokens": n_new, "requests": reqs, "outputs": got, "calls": calls}
    (tmp_path / SAMPLED_TRACE.name).write_text(json.dumps(rec))
    assert got == refs
    # the steps really were sampled on device, several rows at once
    sampled = [c for c in calls if c["call"] == "prefill_forward" and c["args"].get("sampling_params")]
    assert sampled and max(len(c["args"]["tokens"]["values"]) for c in sampled) == 4
    assert rec == json.loads(SAMPLED_TRACE.read_text()), (
        f"the engine's calls differ from {SAMPLED_TRACE}; if the plugin / vLLM changed on purpose, replace it "
        f"with {tmp_path / SAMPLED_TRACE.name}")


def test_vllm_llm_device_fault_stops_the_engine(tmp_path, monkeypatch):
    """An op failing inside a decode step, through the real engine: ``generate`` fails with the adapter's
    ``DeviceStepFailed`` naming the op (vLLM 0.25.1 has no per-request failure path from the model: the exception
    ends the step), and a later request is refused with the same reason instead of being served from half-updated
    device state."""
    from qwen36.tt.serving.qwen36_vllm import DeviceStepFailed
    from qwen36.tt_ops.emulator.faults import clear_fault, inject_fault

    ck = make_bf16_checkpoint(tmp_path / "ci", "ci")
    ctx = _engine_mesh(monkeypatch)
    llm = vllm.LLM(model=str(ck), max_num_seqs=1, max_model_len=256, block_size=BLOCK, skip_tokenizer_init=True,
                   enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=256,
                   async_scheduling=False, additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy"}})
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    try:
        op = "ttnn.transformer.fused_recurrent_gated_delta_rule"
        # the prefill runs this op once per GDN layer (chunked form is another op); fail inside a decode step
        plan = inject_fault(ctx.mesh_device, op, nth=5)
        with pytest.raises(DeviceStepFailed, match=f"InjectedDeviceFault: {op} call 5"):
            llm.generate([{"prompt_token_ids": PROMPT}], sp)
        assert plan.fired
        clear_fault(ctx.mesh_device)
        with pytest.raises(Exception, match="earlier step failed on the device"):
            llm.generate([{"prompt_token_ids": PROMPT}], sp)
    finally:
        clear_fault(ctx.mesh_device)
        del llm
        ctx.close()
