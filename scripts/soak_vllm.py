#!/usr/bin/env python
"""Soak the vLLM adapter through the real engine (dev-only: needs vLLM 0.25.1 and the vllm-tt plugin, see
docs/soak.md) on the emulated 1x2 mesh.

N requests with random prompt lengths, arrival steps, max_tokens, sampling settings and seeds, and random aborts,
go through ``vllm.LLM``'s engine (``add_request`` / ``step`` / ``abort_request``: arrivals and aborts land between
engine steps), at ``--max-num-seqs``, with a KV pool of ``--kv-blocks`` blocks (small: the scheduler preempts and
later resumes requests). Then:

- every request is checked against the batch-1 run that does the same thing (``qwen36.testing.soak_oracle``: a
  ``TTGenerator`` on its own emulated mesh prefills what the engine prefilled, the prompt and at each resume the
  prompt + the tokens generated so far, and decodes the rest): every logits row the engine returned within
  ``LOGITS_TOL`` of the batch-1 row (max abs; PCC reported), a greedy request's tokens the argmax of the batch-1
  rows, a seeded sampled request's tokens what vLLM's ``Sampler`` draws from the batch-1 rows with the request's
  generator advanced as the plugin advances it; resumed greedy requests are also compared with the request never
  preempted, for the record (a near tie may flip there: the resumed state is a prefill's);
- slots held, free KV blocks, live traces, captures and host RSS are sampled every ``--sample-every`` engine steps
  and printed as a curve (they must stay flat: the script fails when the last quarter's maximum exceeds the first
  quarter's by more than the stated allowances).

The plugin's calls are recorded (``--record``, JSON as tests/data/vllm_tt_plugin_*_trace.json) so a short run can be
replayed in CI (tests/tt/serving/test_vllm_soak_replay.py; a long one in the compact form of
scripts/compact_soak_trace.py, tests/tt/serving/test_vllm_soak32_replay.py). Everything runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the plugin's worker gets the emulated mesh instead of cards.

    python scripts/soak_vllm.py --requests 200 --max-num-seqs 8 --kv-blocks 14 --out soak8.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 64  # the model's KV block; the e3fc849 loader passes no vllm_config, so vLLM's block size must equal it


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_requests(args, vocab: int, steps: bool = True) -> list[dict]:
    """Request specs, all drawn from ``args.seed``: prompt, max_tokens, sampling, arrival, abort point. ``steps``:
    arrivals are engine steps and ``abort`` the step a request is aborted at (``vllm.LLM``); otherwise arrivals are
    seconds and ``disconnect_after`` the streamed tokens after which the client hangs up (``vllm serve``)."""
    rng = random.Random(args.seed)
    reqs, clock = [], 0
    for i in range(args.requests):
        gap = rng.expovariate(args.arrival_rate) if args.arrival_rate > 0 else 0
        clock += int(gap) if steps else gap
        n = rng.randint(args.min_prompt, args.max_prompt)
        # distinct first tokens per request index keep every prompt from being a prefix of another
        prompt = [1 + (i % (vocab - 1))] + [rng.randrange(1, vocab) for _ in range(n - 1)]
        sampled = rng.random() < args.sampled_frac
        sp = (dict(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 20, 50]),
                   top_p=rng.choice([1.0, 0.9, 0.8]), seed=rng.randrange(1 << 30)) if sampled
              else dict(temperature=0.0))
        max_tokens = rng.randint(args.min_new, args.max_new)
        cut = rng.randint(1, max_tokens + 4) if rng.random() < args.abort_frac else None
        if steps:
            reqs.append(dict(id=f"r{i}", prompt=prompt, max_tokens=max_tokens, sampling=sp, arrival=clock,
                             abort=None if cut is None else clock + cut))
        else:
            reqs.append(dict(id=f"r{i}", prompt=prompt, max_tokens=max_tokens, sampling=sp, arrival=round(clock, 2),
                             disconnect_after=cut))
    return reqs


def carry_discarded_finishes(scheduler_cls) -> list:
    """Workaround for the plugin's lost finishes (docs/soak.md): in DEFAULT mode
    ``TTScheduler.schedule`` (e3fc849) runs a prefill-only pass, and when it schedules nothing while decodes run it
    throws that pass's ``SchedulerOutput`` away and returns a decode-only pass; but the base scheduler already
    cleared its ``finished_req_ids`` (and preempted ids) into the discarded output, so the runner never hears of
    those requests and keeps their device state slots until ``_alloc_prefill_state_slots`` runs out. This carries
    the discarded pass's finished / preempted ids onto the decode-only pass (what the plugin's lane scheduler does
    for its own fallback). Returns the list of carried id sets, appended to as it happens."""
    carried: list = []
    prefill_only, decode_only = scheduler_cls._schedule_prefill_only, scheduler_cls._schedule_decode_only

    def prefill_pass(self):
        self._soak_prefill_pass = out = prefill_only(self)
        return out

    def decode_pass(self):
        out = decode_only(self)
        dropped, self._soak_prefill_pass = getattr(self, "_soak_prefill_pass", None), None
        if dropped is not None and dropped.total_num_scheduled_tokens == 0:
            if dropped.finished_req_ids:
                carried.append(sorted(dropped.finished_req_ids))
            out.finished_req_ids |= dropped.finished_req_ids
            if dropped.preempted_req_ids:
                out.preempted_req_ids = (out.preempted_req_ids or set()) | dropped.preempted_req_ids
        return out

    scheduler_cls._schedule_prefill_only, scheduler_cls._schedule_decode_only = prefill_pass, decode_pass
    return carried


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=14,
                    help="KV pool in blocks of 64 tokens, vLLM's null block included (small: forces preemption)")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=3)
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--min-new", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--sampled-frac", type=float, default=0.3, help="share of seeded sampled requests")
    ap.add_argument("--abort-frac", type=float, default=0.1, help="share of requests aborted at a random step")
    ap.add_argument("--arrival-rate", type=float, default=0.5, help="arrivals per engine step (exponential gaps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", default="default",
                    help="checkpoint dir, 'default' (the embedded one) or 'ci' (the CI test preset, bf16)")
    ap.add_argument("--sample-every", type=int, default=20, help="engine steps between resource samples")
    ap.add_argument("--carry-finishes", action="store_true",
                    help="patch the plugin's TTScheduler so a discarded prefill pass's finished ids reach the runner "
                         "(workaround for the lost finishes, docs/soak.md); off: the plugin as is")
    ap.add_argument("--record", type=Path, help="write the plugin's calls here (JSON, replayable in CI)")
    ap.add_argument("--out", type=Path, help="write the run's summary and resource curve here (JSON)")
    args = ap.parse_args(argv)

    import torch

    import vllm
    from vllm_tt_plugin import worker as plugin_worker

    from qwen36 import DEFAULT_CHECKPOINT
    from qwen36.testing.tt import make_bf16_checkpoint
    from qwen36.testing.soak_oracle import check_request, oracle_generator, request_rows
    from qwen36.testing.vllm_calls import record_calls
    from qwen36.testing.vllm_replay import LOGITS_TOL
    from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
    from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
    from qwen36.tt_ops.device import open_mesh

    torch.set_num_threads(1)
    carried = None
    if args.carry_finishes:
        from vllm_tt_plugin.scheduler import TTScheduler
        carried = carry_discarded_finishes(TTScheduler)
        print("soak_vllm: TTScheduler patched to carry a discarded prefill pass's finished ids (--carry-finishes)",
              flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    ck = (DEFAULT_CHECKPOINT if args.checkpoint == "default"
          else make_bf16_checkpoint(tmp / "ci", "ci") if args.checkpoint == "ci" else Path(args.checkpoint))
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    if args.max_prompt + args.max_new > args.max_model_len:
        sys.exit("soak_vllm: --max-prompt + --max-new must fit --max-model-len")
    reqs = make_requests(args, vocab)
    t0 = time.time()

    # the engine: in-process, the emulated mesh instead of cards, a KV pool of --kv-blocks blocks (the worker sizes
    # it from the model's token budget plus one block per sequence)
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    plugin_worker.open_mesh_device = lambda *a, **k: ctx.mesh_device
    plugin_worker.close_mesh_device = lambda *a, **k: None
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", EXTRA_MODELS_DIR=str(REPO / "vllm_models"),
                      MESH_DEVICE="P150x2")
    budget = (args.kv_blocks - args.max_num_seqs) * BLOCK
    if budget < args.max_model_len:
        sys.exit(f"soak_vllm: --kv-blocks {args.kv_blocks} leaves {budget} tokens after one block per sequence; "
                 f"vLLM needs one max_model_len ({args.max_model_len}) request to fit")
    Qwen36ForCausalLM.get_max_tokens_all_users = classmethod(lambda cls, *a, **k: budget)
    calls: list = []
    models: list = []
    rows: dict = {}  # call index -> the logits rows a prefill returned (the oracle compares every one)
    record_calls(Qwen36ForCausalLM, calls, instances=models, rows=rows)
    llm = vllm.LLM(model=str(ck), max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   block_size=BLOCK, skip_tokenizer_init=True, enable_prefix_caching=False,
                   enable_chunked_prefill=False, max_num_batched_tokens=args.max_model_len, async_scheduling=False,
                   generation_config="vllm", additional_config={"tt": {"trace_mode": "all",
                                                                      "optimizations": "accuracy"}})
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    model = models[0]
    n_blocks = sched.kv_cache_manager.block_pool.num_gpu_blocks
    print(f"engine up in {time.time() - t0:.0f} s: max_num_seqs {args.max_num_seqs}, {n_blocks} KV blocks "
          f"of {BLOCK}", flush=True)
    warm_calls = len(calls)
    # the batch-1 oracle (docs/soak.md): a TTGenerator on its own emulated mesh, same weights, preset and model args
    ref_gen = oracle_generator(ck, model.model.args)

    def sample(step: int) -> dict:
        dec = model.batch.dec  # a plain launch: the batch server at any max_num_seqs (1 is bucket 1)
        return dict(step=step, running=len(sched.running), waiting=len(sched.waiting),
                    free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                    slots_held=sum(f is not None for f in model.batch.fed),
                    slots_busy=sum(p >= 0 for p in dec.pos),
                    live_traces=len(ctx.mesh_device.trace.live_trace_ids()),
                    captures=sum(c for d in dec.decs.values() for c in d.traces.captures.values()),
                    rss_mb=round(rss_mb(), 1), t=round(time.time() - t0, 1))

    pending = sorted(reqs, key=lambda r: r["arrival"])
    by_id = {r["id"]: r for r in reqs}
    out_tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    preempted: set[str] = set()
    preempt = sched._preempt_request  # vLLM 0.25.1's scheduler: every preemption passes here

    def counted(request, *a, **k):
        preempted.add(request.request_id)
        return preempt(request, *a, **k)

    sched._preempt_request = counted
    curve = [sample(0)]
    step = 0
    t_soak = time.time()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]},
                               vllm.SamplingParams(**r["sampling"], max_tokens=r["max_tokens"], ignore_eos=True))
        for r in reqs:
            if r["abort"] == step and r["id"] not in finished and r["arrival"] <= step:
                engine.abort_request([r["id"]])
                aborted.add(r["id"])
                finished[r["id"]] = "abort"  # the engine emits no final output for an aborted request
        for o in engine.step():
            out_tokens[o.request_id] = list(o.outputs[0].token_ids)
            if o.finished:
                finished[o.request_id] = str(o.outputs[0].finish_reason)
        step += 1
        if step % args.sample_every == 0:
            curve.append(sample(step))
            print(" ".join(f"{k}={v}" for k, v in curve[-1].items()), flush=True)
        if step > 100 * (args.requests + 10) * max(1, args.max_new):
            sys.exit("soak_vllm: the engine does not finish (step limit)")
    curve.append(sample(step))
    t_soak = time.time() - t_soak
    soak_calls = len(calls)  # the batch-1 reruns below are not part of the recording
    # resumed requests, from the calls: a prefill from position 0 of a request's prompt plus generated tokens
    resumed = set()
    for c in calls[warm_calls:soak_calls]:
        if c["call"] != "prefill_forward":
            continue
        toks, lens = c["args"]["tokens"]["values"], c["args"]["prompt_lens"]
        lens = lens["values"] if isinstance(lens, dict) else lens
        starts = c["args"].get("start_pos")
        starts = (starts["values"] if isinstance(starts, dict) else starts) or [0] * len(toks)
        for row, n, s in zip(toks, lens, starts):
            if s == 0:
                r = next((x for x in reqs if row[: len(x["prompt"])] == x["prompt"]), None)
                if r is not None and n > len(r["prompt"]):
                    resumed.add(r["id"])

    # checks: the resume-aware batch-1 oracle (qwen36.testing.soak_oracle) on every request that emitted a token
    t_check = time.time()
    entries = request_rows(calls[warm_calls:soak_calls], {i - warm_calls: r for i, r in rows.items()
                                                          if warm_calls <= i < soak_calls},
                           [r["prompt"] for r in reqs], [out_tokens.get(r["id"], []) for r in reqs])
    results = {}
    for u, r in enumerate(reqs):
        if entries[u]:
            results[r["id"]] = check_request(ref_gen, r["prompt"], out_tokens[r["id"]], r["sampling"], entries[u])
    done = [r for r in reqs if finished.get(r["id"]) == "length" and r["abort"] is None]
    bad = [(rid, by_id[rid]["sampling"]["temperature"] > 0, x) for rid, x in results.items() if not x["tokens_equal"]]
    worst = max((x["max_abs"] for x in results.values()), default=0.0)
    worst_rid = max(results, key=lambda k: results[k]["max_abs"]) if results else None
    resumed_res = {k: x for k, x in results.items() if x["resumes"] > 0}
    # for the record: resumed greedy requests against the request never preempted (a near tie may flip there; the
    # oracle above is the run with the same resumes)
    flips = []
    for rid in sorted(resumed_res):
        r = by_id[rid]
        if r["sampling"]["temperature"] == 0.0 and finished.get(rid) == "length" and r["abort"] is None:
            alone = ref_gen.generate([r["prompt"]], r["max_tokens"])[0].tokens
            if alone != out_tokens[rid]:
                d = next(i for i, (x, y) in enumerate(zip(alone, out_tokens[rid])) if x != y)
                top = ref_gen.prefill(r["prompt"] + alone[:d]).float().reshape(-1).topk(2).values
                flips.append((rid, d, round(float(top[0] - top[1]), 4)))
    t_check = time.time() - t_check
    greedy_done = [r for r in done if r["sampling"]["temperature"] == 0.0]
    sampled_done = [r for r in done if r["sampling"]["temperature"] > 0]
    greedy_ok = sum(results.get(r["id"], {}).get("tokens_equal", False) for r in greedy_done)
    sampled_ok = sum(results.get(r["id"], {}).get("tokens_equal", False) for r in sampled_done)
    n = len(curve)
    first, last = curve[: max(1, n // 4)], curve[-max(1, n // 4):]
    flat = {
        # a finished request's slot stays held until a new prompt takes it (no finish signal), so at most every slot
        "slots_held": max(c["slots_held"] for c in curve) <= args.max_num_seqs,
        "free_blocks_back": curve[-1]["free_blocks"] == curve[0]["free_blocks"],
        "live_traces": max(c["live_traces"] for c in last) <= max(c["live_traces"] for c in curve[:2]) + 2,
        "captures": curve[-1]["captures"] is None or max(c["captures"] for c in last) <= max(
            1, max(c["captures"] for c in first)) + 3,
        "rss": max(c["rss_mb"] for c in last) <= max(c["rss_mb"] for c in first) * 1.10 + 50,
    }
    summary = dict(
        backend="emulated-p150x2 (ttnn goldens on CPU, no hardware)", vllm=vllm.__version__, checkpoint=str(ck),
        requests=args.requests, max_num_seqs=args.max_num_seqs, kv_blocks=n_blocks, steps=step,
        soak_s=round(t_soak, 1), completed=len(done), aborted=len(aborted), preempted_seen=len(preempted),
        resumed=len(resumed), greedy_equal=greedy_ok, greedy_checked=len(greedy_done),
        sampled_equal=sampled_ok, sampled_checked=len(sampled_done), requests_checked=len(results),
        rows_checked=sum(x["rows"] for x in results.values()), worst_max_abs=worst, worst_request=worst_rid,
        worst_detail=results.get(worst_rid), logits_tol=LOGITS_TOL,
        resumed_checked={k: {f: x.get(f) for f in ("resumes", "resume_row", "resume_max_abs", "resume_min_pcc",
                                                    "tokens_equal", "first_diff", "margin")}
                         for k, x in sorted(resumed_res.items())},
        over_tol={k: {f: x.get(f) for f in ("max_abs", "worst_row", "worst_pcc", "worst_call", "worst_call_row",
                                             "worst_call_rows", "resumes", "tokens_equal")}
                  for k, x in sorted(results.items()) if x["max_abs"] > LOGITS_TOL},
        flips_vs_uninterrupted=flips, check_s=round(t_check, 1), mismatches=bad,
        flat=flat, plugin_calls=soak_calls, carried_finishes=carried,
        args={k: str(v) for k, v in vars(args).items()}, curve=curve)
    print("\nstep  running waiting free_blocks slots_held slots_busy live_traces captures rss_mb  t")
    for c in curve:
        print(f"{c['step']:5d} {c['running']:7d} {c['waiting']:7d} {c['free_blocks']:11d} {c['slots_held']:10d} "
              f"{str(c['slots_busy']):>10} {c['live_traces']:11d} {str(c['captures']):>8} {c['rss_mb']:7.1f} "
              f"{c['t']:6.0f}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "args")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.record:
        args.record.write_text(json.dumps({
            "vllm": vllm.__version__, "max_num_seqs": args.max_num_seqs, "block_size": BLOCK,
            "max_model_len": args.max_model_len, "kv_blocks": n_blocks, "checkpoint": args.checkpoint,
            "prompts": [r["prompt"] for r in reqs], "requests": [
                {k: r[k] for k in ("id", "max_tokens", "sampling", "arrival", "abort")} for r in reqs],
            "outputs": [out_tokens.get(r["id"], []) for r in reqs],
            "finished": [finished.get(r["id"]) for r in reqs], "aborted": sorted(aborted),
            "resumed": sorted(resumed), "calls": calls[:soak_calls]}))
        # the logits rows the engine got (call index in the recording -> [B, V]), for diagnosis; not for CI
        torch.save({i: r for i, r in rows.items() if i < soak_calls}, args.record.with_suffix(".rows.pt"))
    ok = (not bad and all(flat.values()) and greedy_ok + sampled_ok == len(done) and worst <= LOGITS_TOL
          and set(resumed) == set(resumed_res))
    print("soak", "PASSED" if ok else "FAILED", flush=True)
    del llm
    ref_gen.close()
    ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
