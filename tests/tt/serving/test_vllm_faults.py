"""An op failing on the device in the middle of a step, through the vLLM adapter driven as the plugin drives it.

The emulator's fault hook (``qwen36.tt_ops.emulator.faults``) makes the Nth executed call of a named op raise,
eagerly or inside a replayed trace; the ops before it in the step have run. The adapter then fails that call with
``DeviceStepFailed`` (naming the call, its rows and the op's error), refuses every later call with the same reason
(the device state of the step's sequences is half updated, and on cards a fault inside a trace cannot be undone),
and a restarted model on the same mesh serves the recorded engine run exactly. Refusals of bad calls (ValueError)
are not device failures: the model goes on serving after them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen36.tt.serving.qwen36_vllm import DeviceStepFailed, Qwen36ForCausalLM
from qwen36.tt_ops.emulator.faults import InjectedDeviceFault, clear_fault, inject_fault
from support.vllm_calls import feed_calls, replay_calls as replay, restore as _arg
from support.vllm_replay import load_on_mesh as _load, open_env, served_model

TRACE = json.loads((Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_batch_trace.json").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_faults")
    yield ck, ctx
    clear_fault(ctx.mesh_device)
    ctx.close()


def _calls(m, calls, kv=None):
    """Feed recorded calls to ``m``; returns the KV list (allocated by the first call)."""
    for _, c, _, out in feed_calls(m, calls, kv):
        if c["call"] == "allocate_kv_cache_per_layer":
            kv = out
    return kv


def _call(m, c, kv):
    return getattr(m, c["call"])(kv_cache=kv, **{k: _arg(v) for k, v in c["args"].items()})


@pytest.mark.slow
def test_fault_inside_a_traced_batch_step_stops_the_model_and_a_restart_serves(env):
    ck, ctx = env
    calls = TRACE["calls"]
    m = served_model(ck, ctx, TRACE["max_num_seqs"], TRACE["max_model_len"])
    kv = _calls(m, calls[:9])
    # a bad call is refused by name and is no device failure: the model goes on serving
    bad = dict(calls[9], args={**calls[9]["args"]})
    with pytest.raises(ValueError, match="no state slot holds"):
        t = _arg(bad["args"]["tokens"]).clone()
        t[0, 0] += 1
        m.prefill_forward(t, _arg(bad["args"]["page_table"]), kv, _arg(bad["args"]["prompt_lens"]),
                          start_pos=_arg(bad["args"]["start_pos"]), empty_slots=bad["args"]["empty_slots"])
    assert m.batch.dec.decs[4].traces.captures  # the 4-row step was captured before: the next one is a replay
    # the first GDN layer's recurrent update of the step runs (its state is written in place), the second fails
    op = "ttnn.transformer.fused_recurrent_gated_delta_rule"
    plan = inject_fault(ctx.mesh_device, op, nth=2)
    with pytest.raises(DeviceStepFailed, match=r"prefill_forward \(4 rows, start_pos \[\d+, \d+, \d+, \d+\], "
                                               r"empty_slots \[0, 1, 2, 3\]\): InjectedDeviceFault: "
                                               rf"{op} call 2") as e:
        _call(m, calls[9], kv)
    assert isinstance(e.value.__cause__, InjectedDeviceFault)
    assert plan.fired == [(op, 2)]
    clear_fault(ctx.mesh_device)
    # every later call is refused with the first failure's reason, also the calls that would not touch the device
    for c in (calls[10], calls[11]):
        with pytest.raises(DeviceStepFailed, match=f"an earlier step failed on the device .*{op} call 2"):
            _call(m, c, kv)
    with pytest.raises(DeviceStepFailed, match="earlier step failed"):
        m.warmup_model_prefill(kv_cache=kv, enable_trace=False)
    m.release_persistent_capture()  # cleanup still works (the worker's shutdown)

    # a restart (a new model on the same mesh) serves the whole recorded run, each request as recorded
    fresh = served_model(ck, ctx, TRACE["max_num_seqs"], TRACE["max_model_len"])
    got = replay(fresh, TRACE)
    assert [[t for t, _ in g] for g in got] == TRACE["outputs"]
    fresh.release_persistent_capture()


def test_fault_inside_an_eager_prefill_and_a_one_sequence_decode(env):
    """One sequence (``max_num_seqs`` 1): a fault in the eager prefill fails that prefill; in a fresh model a fault
    inside the traced decode step fails the decode; both then refuse the next call."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    prompt = TRACE["prompts"][1]
    for where in ("prefill", "decode"):
        m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
            hf, ctx.mesh_device, 1, TRACE["max_model_len"], optimizations="accuracy", checkpoint=ck))
        kv = m.allocate_kv_cache()
        m.warmup_model_decode(kv_cache=kv, enable_trace=True)
        table = torch.tensor([[1, 0, 0, 0]], dtype=torch.int32)
        toks = torch.tensor([prompt], dtype=torch.int32)
        if where == "prefill":
            inject_fault(ctx.mesh_device, "ttnn.linear", nth=3)
            with pytest.raises(DeviceStepFailed, match=r"prefill_forward \(1 rows\): InjectedDeviceFault"):
                m.prefill_forward(toks, table, kv, torch.tensor([len(prompt)]))
        else:
            out = m.prefill_forward(toks, table, kv, torch.tensor([len(prompt)]))
            first = int((out[0] if isinstance(out, tuple) else out).reshape(-1).argmax())  # (logits, deltas): mrope
            inject_fault(ctx.mesh_device, "ttnn.linear", nth=2)
            with pytest.raises(DeviceStepFailed, match=r"decode_forward \(1 rows, start_pos \[7\]\)"):
                m.decode_forward(torch.tensor([[first]]), table, kv, torch.tensor([len(prompt)]))
        clear_fault(ctx.mesh_device)
        with pytest.raises(DeviceStepFailed, match="earlier step failed"):
            m.prefill_forward(toks, table, kv, torch.tensor([len(prompt)]))
        m.release_persistent_capture()
