#!/usr/bin/env python
"""Soak ``vllm serve`` over HTTP (dev-only: vLLM 0.25.1 and the vllm-tt plugin, docs/soak.md) on the emulated mesh.

The real server (``vllm serve``, its API process and its engine-core process) serves this model through the plugin,
launched by ``qwen36 serve --device emulated-p150x2`` (its launcher, run by this script with ``--serve``), with two
changes made before vLLM's CLI runs, inherited by the engine core: the KV pool is ``--kv-blocks`` blocks (small: the
scheduler preempts), and the model class records the plugin's calls and the logits rows it returns into a folder
(``support.vllm_calls.record_into``).

The client sends N requests with random prompts, budgets, greedy or seeded sampled settings at random arrival times
(``/v1/completions``, streamed, token ids in and out) as concurrent connections, and closes some connections after
a random number of tokens (a client disconnect: the server aborts the request). While it runs it samples the
server's ``/metrics`` (running, waiting, KV usage, preemptions), the RSS of the server's processes and the slots
the model holds. Afterwards every request is checked with the soak's resume-aware batch-1 oracle
(``support.soak_oracle``) against the rows the server's model returned, and the tokens each client received
must be what the engine emitted.

    python scripts/soak_vllm_http.py --requests 48 --max-num-seqs 8 --kv-blocks 12 --out http48.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import support_path  # noqa: F401  (tests/ on sys.path: the test-support package `support`)
from support.scripts import wait_until_healthy

BLOCK = 64


def serve(argv: list[str]) -> None:
    """The server process: ``--serve RECORD_DIR BUDGET_TOKENS CARRY(0|1) PREFILL_CHUNK(0: the model's) -- <qwen36 serve
    arguments>``: ``qwen36 serve`` (its launcher, in this process) with the soak's instruments installed first, which
    vLLM's forked engine core inherits: the recorder, the KV budget, with CARRY the lost-finishes patch, with
    PREFILL_CHUNK the model's prefill chunk (its checkpoint grid, docs/vllm_prefix.md)."""
    if len(argv) < 5 or argv[4] != "--":
        raise SystemExit("soak_vllm_http --serve RECORD_DIR BUDGET_TOKENS CARRY PREFILL_CHUNK -- <qwen36 serve args>")
    record, budget, carry, chunk, serve_args = Path(argv[0]), int(argv[1]), argv[2] == "1", int(argv[3]), argv[5:]
    from qwen36.cli import build_parser
    from qwen36.commands.serve import check_launch, launch

    args = build_parser().parse_args(["serve", *serve_args])

    def instruments():
        from support.vllm_calls import record_into
        from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM

        from support.scripts import load_script

        soak = load_script("soak_vllm")
        if carry:  # the plugin's lost finishes (docs/soak.md): the same patch as scripts/soak_vllm.py --carry-finishes
            from vllm_tt_plugin.scheduler import TTScheduler

            soak.carry_discarded_finishes(TTScheduler)
        if chunk:
            soak.use_chunk(Qwen36ForCausalLM, chunk)

        def status(models):
            held = sum(f is not None for f in models[0].batch.fed) if models else None
            rss = next(int(x.split()[1]) / 1024 for x in Path("/proc/self/status").read_text().splitlines()
                       if x.startswith("VmRSS:"))
            return dict(slots_held=held, rss_mb=round(rss, 1))

        record_into(record, Qwen36ForCausalLM, rows=True, status=status)
        Qwen36ForCausalLM.get_max_tokens_all_users = classmethod(lambda cls, *a, **k: budget)

    launch(args, check_launch(args), prepare=instruments)


async def one_request(client, url: str, r: dict, t0: float, got: dict) -> None:
    import httpx

    await asyncio.sleep(max(0.0, t0 + r["arrival"] - time.time()))
    body = dict(model="qwen36", prompt=r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True, stream=True,
                return_token_ids=True, **r["sampling"])
    toks, status = [], "length"
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as resp:
            if resp.status_code != 200:
                got[r["id"]] = dict(tokens=[], status=f"http {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "choices" not in event:  # an error event: the server failed the request
                    status = f"error: {str(event)[:200]}"
                    break
                ch = event["choices"]
                if ch:
                    toks += ch[0].get("token_ids") or []
                    if ch[0].get("finish_reason"):
                        status = ch[0]["finish_reason"]
                if r["disconnect_after"] is not None and len(toks) >= r["disconnect_after"] \
                        and len(toks) < r["max_tokens"]:
                    status = "disconnected"
                    break  # leaving the block closes the connection: the server aborts the request
    except httpx.HTTPError as e:
        status = f"error: {e!r}"
    got[r["id"]] = dict(tokens=toks, status=status, t_end=round(time.time() - t0, 2))


def metrics(text: str) -> dict:
    want = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
            "vllm:kv_cache_usage_perc": "kv_usage", "vllm:num_preemptions_total": "preemptions"}
    out = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want and not line.startswith("#"):
            out[want[name]] = out.get(want[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def tree_rss_mb(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    return round(sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20, 1)


def last_status(record: Path) -> dict:
    try:
        return json.loads((record / "status.jsonl").read_text().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return {}


async def drive(args, reqs, url: str, server: subprocess.Popen, record: Path) -> tuple[dict, list]:
    import httpx

    got: dict = {}
    curve: list = []
    t0 = time.time()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.requests + 4)) as client:
        tasks = [asyncio.create_task(one_request(client, url, r, t0, got)) for r in reqs]
        while not all(t.done() for t in tasks):
            try:
                m = metrics((await client.get(f"{url}/metrics")).text)
            except httpx.HTTPError as e:  # the server is gone: fail the run with what it has
                print(f"soak_vllm_http: /metrics failed ({e!r}); stopping", flush=True)
                for t in tasks:
                    t.cancel()
                break
            st = last_status(record)
            curve.append(dict(t=round(time.time() - t0, 1), done=len(got), **m, slots_held=st.get("slots_held"),
                              rss_mb=tree_rss_mb(server.pid), engine_rss_mb=st.get("rss_mb")))
            print(" ".join(f"{k}={v}" for k, v in curve[-1].items()), flush=True)
            await asyncio.wait(tasks, timeout=args.sample_every)
        await asyncio.sleep(3.0)  # the engine notices the last disconnects
        try:
            m = metrics((await client.get(f"{url}/metrics")).text)
        except httpx.HTTPError:
            m = {"server": "down"}
        st = last_status(record)
        curve.append(dict(t=round(time.time() - t0, 1), done=len(got), **m, slots_held=st.get("slots_held"),
                          rss_mb=tree_rss_mb(server.pid), engine_rss_mb=st.get("rss_mb")))
    return got, curve


def engine_outputs(calls: list[dict], prompts: list[list[int]]) -> list[list[int]]:
    """Per request the generated tokens the engine fed back (the longest row of each request): every emitted token
    but the last one, whatever the client received."""
    from support.vllm_calls import restore

    out: list[list[int]] = [[] for _ in prompts]
    for c in calls:
        if c["call"] != "prefill_forward":
            continue
        tokens, lens = restore(c["args"]["tokens"]), restore(c["args"]["prompt_lens"])
        for i in range(tokens.shape[0]):
            u = next((j for j, p in enumerate(prompts) if tokens[i, : len(p)].tolist() == p), None)
            if u is not None and int(lens[i]) - len(prompts[u]) > len(out[u]):
                out[u] = tokens[i, len(prompts[u]): int(lens[i])].tolist()
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        serve(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=12)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=3)
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--min-new", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--sampled-frac", type=float, default=0.3)
    ap.add_argument("--abort-frac", type=float, default=0.15, help="share of requests whose client disconnects")
    ap.add_argument("--arrival-rate", type=float, default=1.0, help="arrivals per second (exponential gaps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between resource samples")
    ap.add_argument("--carry-finishes", action="store_true",
                    help="patch the server's TTScheduler as scripts/soak_vllm.py --carry-finishes does (docs/soak.md)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="vLLM's prefix caching on (qwen36 serve's default; off otherwise, as the soaks before it)")
    ap.add_argument("--shared-prefix-frac", type=float, default=0.0,
                    help="share of requests whose prompt starts with part of an earlier one")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the model's prefill chunk (checkpoint grid)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)


    from qwen36.tiny import make_bf16_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="soak-http-"))
    ck = make_bf16_checkpoint(tmp / "ci", "ci")
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    if args.max_prompt + args.max_new > args.max_model_len:
        sys.exit("soak_vllm_http: --max-prompt + --max-new must fit --max-model-len")
    budget = (args.kv_blocks - args.max_num_seqs) * BLOCK
    if budget < args.max_model_len:
        sys.exit(f"soak_vllm_http: --kv-blocks {args.kv_blocks} leaves {budget} tokens after one block per sequence")
    from support.scripts import load_script

    reqs = load_script("soak_vllm").make_requests(args, vocab, steps=False)  # the same draws as the vLLM.LLM soak
    record = tmp / "record"
    record.mkdir()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(record), str(budget),
           "1" if args.carry_finishes else "0", str(args.prefill_chunk or 0), "--", "--device", "emulated-p150x2",
           "--checkpoint", str(ck), *([] if args.prefix_caching else ["--no-prefix-caching"]),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--precision", "accuracy", "--reasoning-parser", "none", "--tool-call-parser", "none",
           "--host", "127.0.0.1", "--port", str(args.port), "--", "--generation-config", "vllm"]
    t0 = time.time()
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"soak_vllm_http: server pid {server.pid}, log {tmp / 'server.log'}", flush=True)
    try:
        wait_until_healthy(server, url, "soak_vllm_http", tmp / "server.log")
        t_up = time.time() - t0
        time.sleep(2.5)  # the recorder flushes every second: every warmup call is on disk
        warm_calls = len((record / "calls.jsonl").read_text().splitlines())
        print(f"server up in {t_up:.0f} s ({warm_calls} warmup calls)", flush=True)
        t_soak = time.time()
        got, curve = asyncio.run(drive(args, reqs, url, server, record))
        t_soak = time.time() - t_soak
        time.sleep(3)  # the recorder flushes every second
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    calls = [json.loads(x) for x in (record / "calls.jsonl").read_text().splitlines()][warm_calls:]
    rows = {i - warm_calls: __import__("torch").load(record / "rows" / f"{i}.pt")
            for i in range(warm_calls, warm_calls + len(calls)) if (record / "rows" / f"{i}.pt").exists()}

    # the oracle, after the server is gone
    from support.soak_oracle import check_request, oracle_generator, request_rows
    from support.vllm_replay import LOGITS_TOL

    prompts = [r["prompt"] for r in reqs]
    fed = engine_outputs(calls, prompts)
    bad, outputs = [], []
    for r, f in zip(reqs, fed):
        c = got.get(r["id"], {}).get("tokens", [])
        if c[: len(f)] != f[: len(c)]:  # what the client received is what the engine emitted
            bad.append((r["id"], "client tokens differ from the engine's"))
        outputs.append(c if len(c) > len(f) else f)
    t_check = time.time()
    entries = request_rows(calls, rows, prompts, outputs)
    gen = oracle_generator(ck, json.loads((record / "model_args.json").read_text()))  # the served model's args
    results = {}
    for u, r in enumerate(reqs):
        if entries[u]:
            results[r["id"]] = check_request(gen, r["prompt"], outputs[u], r["sampling"], entries[u])
    gen.close()
    t_check = time.time() - t_check
    bad += [(k, "tokens differ from the resume-aware batch-1 oracle", x) for k, x in results.items()
            if not x["tokens_equal"]]
    worst = max((x["max_abs"] for x in results.values()), default=0.0)
    status = {}
    for g in got.values():
        key = g["status"] if not g["status"].startswith(("http", "error")) else "failed"
        if key == "failed":
            bad.append((next(k for k, v in got.items() if v is g), g["status"]))
        status[key] = status.get(key, 0) + 1
    completed = [r for r in reqs if got.get(r["id"], {}).get("status") == "length"]
    n = len(curve)
    first, last = curve[: max(1, n // 4)], curve[-max(1, n // 4):]
    flat = dict(
        slots_held=all(c["slots_held"] is None or c["slots_held"] <= args.max_num_seqs for c in curve),
        kv_usage_back=curve[-1].get("kv_usage", 1.0) == 0.0 and curve[-1].get("running", 1) == 0,
        rss=max(c["rss_mb"] for c in last) <= max(c["rss_mb"] for c in first) * 1.10 + 50)
    summary = dict(
        backend="emulated-p150x2 (ttnn goldens on CPU, no hardware) behind vllm serve", requests=args.requests,
        max_num_seqs=args.max_num_seqs, kv_blocks=args.kv_blocks, server_up_s=round(t_up, 1),
        soak_s=round(t_soak, 1), check_s=round(t_check, 1), client_status=status,
        completed_full=sum(len(got[r["id"]]["tokens"]) == r["max_tokens"] for r in completed),
        preemptions=curve[-1].get("preemptions"), resumed=sorted(k for k, x in results.items() if x["resumes"]),
        requests_checked=len(results), rows_checked=sum(x["rows"] for x in results.values()),
        tokens_equal=sum(bool(x["tokens_equal"]) for x in results.values()), worst_max_abs=worst,
        min_pcc=min((x["min_pcc"] for x in results.values()), default=1.0), logits_tol=LOGITS_TOL,
        plugin_calls=len(calls), carry_finishes=args.carry_finishes, mismatches=bad, flat=flat, args={k: str(v) for k, v in vars(args).items()},
        curve=curve)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "args")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    ok = (not bad and all(flat.values()) and worst <= LOGITS_TOL and len(got) == len(reqs)
          and summary["completed_full"] == len(completed))
    print("http soak", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
