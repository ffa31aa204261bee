#!/usr/bin/env python
"""A long prompt arriving while other sequences decode, through the real engine with chunked prefill (dev-only: vLLM
0.25.1 + the vllm-tt plugin, docs/serving.md "Chunked prefill"), on the emulated mesh: how many prefill chunks run
between two decode steps of the running sequences, and whether the chunked prompt's rows equal its one-call prefill.

The plugin (e3fc849) chunks prompts only for the model types it lists (Gemma 4): this script adds Qwen3.5/3.6's to
that list (``soak_vllm.allow_chunked_prefill``), as a plugin that read the model's ``supports_chunked_prefill`` would.
Its scheduler (``TTScheduler``, default mode) runs a prefill step whenever prefill work is pending, a partial prompt
included, so the prompt's chunks run back to back while the others wait; ``--interleave`` patches it to run one
decode step of the running sequences after every prefill step that leaves a prompt partial
(``interleave_prefill_chunks``), which is what "at most one chunk per step" needs from a scheduler whose steps are
all-prefill or all-decode.

Checks: every row of every request equals the batch-1 run that prefills each prompt in one call and decodes the rest
(the soak's oracle): the chunked prompt's last row and every row after it bit for bit.

    python scripts/chunked_stall_vllm.py --decoders 8 --long-prompt 1500 --chunk 256 [--interleave] --out stall.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import support_path  # noqa: F401  (tests/ on sys.path: the test-support package `support`)

REPO = Path(__file__).resolve().parents[1]
BLOCK = 64


def interleave_prefill_chunks(scheduler_cls) -> list:
    """Dev-only scheduler patch: after a prefill step that left a prompt partial, while sequences are decoding, the
    next step is a decode step (``_schedule_decode_only``), so a long prompt's chunks alternate with the running
    sequences' steps. Returns the list of (step, kind) decisions it made."""
    decisions: list = []
    schedule = scheduler_cls.schedule

    def alternating(self, throttle_prefills: bool = False):
        decoding = {r.request_id for r in self.running if not r.is_prefill_chunk}
        partial = any(r.is_prefill_chunk for r in self.running)
        if partial and decoding and getattr(self, "_last_was_prefill", False):
            out = self._finalize_scheduler_output(self._schedule_decode_only())
            decisions.append("decode (interleaved)")
        else:
            out = schedule(self, throttle_prefills)
            decisions.append("scheduler")
        self._last_was_prefill = any(rid not in decoding for rid in out.num_scheduled_tokens)
        return out

    scheduler_cls.schedule = alternating
    return decisions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", type=int, default=8, help="sequences decoding when the long prompt arrives")
    ap.add_argument("--decode-prompt", type=int, default=40)
    ap.add_argument("--decode-tokens", type=int, default=60)
    ap.add_argument("--long-prompt", type=int, default=1500)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens: the token budget of a step")
    ap.add_argument("--arrive-at", type=int, default=6, help="engine step at which the long prompt arrives")
    ap.add_argument("--interleave", action="store_true", help="patch TTScheduler to alternate (see above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    import vllm
    from vllm_tt_plugin import worker as plugin_worker
    from vllm_tt_plugin.scheduler import TTScheduler

    from support.scripts import load_script
    from support.soak_oracle import check_request, oracle_generator, request_rows
    from qwen36.tiny import make_bf16_checkpoint
    from support.vllm_calls import record_calls
    from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
    from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
    from qwen36.tt_ops.device import open_mesh

    torch.set_num_threads(1)
    soak = load_script("soak_vllm")
    added = soak.allow_chunked_prefill()
    decisions = interleave_prefill_chunks(TTScheduler) if args.interleave else None
    ck = make_bf16_checkpoint(Path(tempfile.mkdtemp(prefix="stall-")) / "ci", "ci")
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [[1 + i] + torch.randint(1, vocab, (args.decode_prompt - 1,), generator=g).tolist()
               for i in range(args.decoders)]
    long = [1 + args.decoders] + torch.randint(1, vocab, (args.long_prompt - 1,), generator=g).tolist()
    max_len = max(args.long_prompt + args.long_tokens, args.decode_prompt + args.decode_tokens) + BLOCK
    max_len = -(-max_len // BLOCK) * BLOCK
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    plugin_worker.open_mesh_device = lambda *a, **k: ctx.mesh_device
    plugin_worker.close_mesh_device = lambda *a, **k: None
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", EXTRA_MODELS_DIR=str(REPO / "vllm_models"),
                      MESH_DEVICE="P150x2")
    calls, models, rows = [], [], {}
    record_calls(Qwen36ForCausalLM, calls, instances=models, rows=rows)
    seqs = args.decoders + 1 if args.decoders + 1 <= 8 else -(-(args.decoders + 1) // 8) * 8  # a decode bucket
    llm = vllm.LLM(model=str(ck), max_num_seqs=seqs, max_model_len=max_len, block_size=BLOCK,
                   skip_tokenizer_init=True, enable_prefix_caching=False, enable_chunked_prefill=True,
                   max_num_batched_tokens=args.chunk, async_scheduling=False, generation_config="vllm",
                   additional_config={"tt": {"trace_mode": "all", "optimizations": "accuracy"}})
    engine = llm.llm_engine
    warm = len(calls)
    sp = lambda n: vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", {"prompt_token_ids": p}, sp(args.decode_tokens))
    outs: dict = {}
    step, steps = 0, []
    t0 = time.time()
    while engine.has_unfinished_requests():
        if step == args.arrive_at:
            engine.add_request("long", {"prompt_token_ids": long}, sp(args.long_tokens))
        n = len(calls)
        for o in engine.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
        kinds = [r["kind"] for c in calls[n:] if c.get("served") for r in c["served"]]
        steps.append("decode" if kinds and all(k == "decode" for k in kinds) else "prefill" if kinds else "none")
        step += 1
    t_run = time.time() - t0
    soak_calls = calls[warm:]
    # the long prompt's prefill steps, and the longest run of them with no decode step of the others in between
    run, worst, chunks = 0, 0, 0
    for c in soak_calls:
        if c["call"] != "prefill_forward" or not c.get("served"):
            continue
        rows_long = [i for i, r in enumerate(c["args"]["tokens"]["values"]) if r[0] == 1 + args.decoders]
        if any(c["served"][i]["kind"] == "prefill" for i in rows_long):
            chunks += 1
            run += 1
            worst = max(worst, run)
        elif any(r["kind"] == "decode" for r in c["served"]):
            run = 0
    all_prompts = prompts + [long]
    outputs = [outs.get(f"d{i}", []) for i in range(args.decoders)] + [outs.get("long", [])]
    entries = request_rows(soak_calls, {i - warm: r for i, r in rows.items() if i >= warm}, all_prompts, outputs)
    gen = oracle_generator(ck, models[0].model.args)
    res = [check_request(gen, p, o, {"temperature": 0.0}, e) for p, o, e in zip(all_prompts, outputs, entries)]
    gen.close()
    summary = dict(backend="emulated-p150x2 (ttnn goldens on CPU, no hardware)", vllm=vllm.__version__,
                   plugin_gate_patched=added, interleave=args.interleave, decoders=args.decoders,
                   long_prompt=args.long_prompt, chunk_tokens=args.chunk, long_prompt_chunks=chunks,
                   most_chunks_between_decode_steps=worst, steps=len(steps), run_s=round(t_run, 1),
                   step_kinds="".join("D" if k == "decode" else "P" if k == "prefill" else "." for k in steps),
                   rows_checked=sum(r["rows"] for r in res), worst_max_abs=max(r["max_abs"] for r in res),
                   tokens_equal=all(r["tokens_equal"] for r in res), scheduler_decisions=decisions)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.record:
        args.record.write_text(json.dumps({
            "vllm": vllm.__version__, "max_num_seqs": seqs, "max_model_len": max_len,
            "max_num_batched_tokens": args.chunk, "chunked_prefill": True, "interleave": args.interleave,
            "prompts": all_prompts, "outputs": outputs, "calls": soak_calls}))
    del llm
    ctx.close()
    ok = summary["worst_max_abs"] == 0.0 and summary["tokens_equal"]
    print("chunked stall", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
