#!/usr/bin/env python
"""The OpenAI chat API feature table, live (dev-only: vLLM 0.25.1, the vllm-tt plugin and the openai client;
docs/serving.md, "The chat API").

Starts ``qwen36 serve --device emulated-p150x2`` (its launcher, run by this script with ``--serve``, with the model
class's plugin calls recorded into a folder), sends every row of ``support.chat_api.ROWS`` with the ``openai``
client, one after the other, checks each response, stops the server (SIGINT) and checks that it exited cleanly.
Prints one line per row (status, what it showed) and with ``--out`` writes the recording the CI replay reads:
every row's request, response (streamed rows: the chunks, and the answer they add up to) and the range of plugin
calls it caused, after the launch's own calls (KV allocation, warmup).

    python scripts/chat_api_table.py --out tests/data/vllm_chat_api_trace.json      # the chat-ci checkpoint
    python scripts/chat_api_table.py --checkpoint models/qwen36/default_checkpoint   # the embedded model
"""
from __future__ import annotations

import argparse
import gzip
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



def serve(argv: list[str]) -> None:
    """The server process: ``--serve RECORD_DIR -- <qwen36 serve arguments>``."""
    record, serve_args = Path(argv[0]), argv[2:]
    from qwen36.cli import build_parser
    from qwen36.commands.serve import check_launch, launch

    args = build_parser().parse_args(["serve", *serve_args])

    def recorder():
        from support.vllm_calls import record_into
        from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM

        record_into(record, Qwen36ForCausalLM)

    launch(args, check_launch(args), prepare=recorder)


def settled(record: Path, quiet: float = 2.5, timeout: float = 60.0) -> int:
    """The number of recorded calls once the recorder has written nothing new for ``quiet`` seconds."""
    from support.vllm_calls import read_recording

    n, since, t0 = -1, time.time(), time.time()
    while time.time() - t0 < timeout:
        m = len(read_recording(record))
        if m != n:
            n, since = m, time.time()
        elif time.time() - since >= quiet:
            return n
        time.sleep(0.5)
    return n


def streamed(client, request: dict) -> tuple[dict, list[dict]]:
    """A streamed request's chunks, and the response they add up to (content, reasoning, tool calls, token ids,
    finish reason, usage) in the non-streamed response's shape."""
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **request)]
    msg, calls, ids, finish, usage = {"content": None, "reasoning": None}, {}, [], None, None
    for c in chunks:
        usage = c.get("usage") or usage
        for ch in c["choices"]:
            d = ch["delta"]
            for key in ("content", "reasoning"):
                if d.get(key):
                    msg[key] = (msg[key] or "") + d[key]
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                slot["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                slot["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            ids += ch.get("token_ids") or []
            finish = ch.get("finish_reason") or finish
    msg["tool_calls"] = [calls[i] for i in sorted(calls)] or None
    return {"choices": [{"message": msg, "finish_reason": finish, "token_ids": ids}], "usage": usage,
            "prompt_token_ids": next((c.get("prompt_token_ids") for c in chunks if c.get("prompt_token_ids")), None)}, \
        chunks


def drive(url: str, record: Path, checkpoint: Path, only: list[str] | None = None) -> list[dict]:
    import openai
    from transformers import AutoTokenizer

    from support.chat_api import ROWS, prompt_failures

    tok = AutoTokenizer.from_pretrained(str(checkpoint))

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    results, rows = {}, []
    for row in ROWS:
        if only and row.name not in only:
            continue
        request = row.build(results)
        start = settled(record)
        t0 = time.time()
        chunks = None
        try:
            if row.stream:
                response, chunks = streamed(client, request)
            else:
                response = client.chat.completions.create(**request).model_dump()
            status = 200
        except openai.APIStatusError as e:
            status, response = e.status_code, e.body if isinstance(e.body, dict) else {"error": str(e.body)}
        end = settled(record)
        results[row.name] = response
        try:
            fails = ([] if status == row.status else [f"HTTP {status}, expected {row.status}"]) or \
                row.expect(response, results) + (prompt_failures(tok, request, response) if status == 200 else [])
        except Exception as e:  # an answer the check cannot read is a failure of the row, not of the run
            fails = [f"the check raised {e!r}"]
        rows.append(dict(name=row.name, feature=row.feature, request=request, status=status, response=response,
                         chunks=chunks, calls=[start, end], seconds=round(time.time() - t0, 1), failures=fails,
                         plumbing=row.plumbing))
        print(f"{row.name:34s} HTTP {status}  {'ok' if not fails else 'FAILED: ' + '; '.join(fails)}"
              f"{'  (plumbing-only)' if row.plumbing else ''}  [{rows[-1]['seconds']} s, calls {start}..{end}]",
              flush=True)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        serve(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="served checkpoint (default: the chat-ci checkpoint, made in a temporary folder)")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--out", type=Path, help="write the recording here (JSON, gzipped when the name ends in .gz)")
    ap.add_argument("--rows", default=None, help="only these rows (comma-separated names; a row that reads an "
                                                  "earlier row's answer needs that row too)")
    args = ap.parse_args(argv)


    from support.chat_api import CHAT_CHECKPOINT, make_chat_checkpoint
    from support.vllm_calls import read_recording

    tmp = Path(tempfile.mkdtemp(prefix="chat-api-"))
    ck = args.checkpoint or make_chat_checkpoint(tmp / CHAT_CHECKPOINT)
    record = tmp / "record"
    record.mkdir()
    url = f"http://127.0.0.1:{args.port}"
    serve_args = ["--device", "emulated-p150x2", "--checkpoint", str(ck), "--max-num-seqs", str(args.max_num_seqs),
                  "--max-model-len", str(args.max_model_len), "--precision", "accuracy", "--port", str(args.port)]
    log = open(tmp / "server.log", "w")
    t0 = time.time()
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(record), "--",
                               *serve_args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"chat_api_table: qwen36 serve {' '.join(serve_args)}\n  pid {server.pid}, log {tmp / 'server.log'}",
          flush=True)
    clean = False
    try:
        wait_until_healthy(server, url, "chat_api_table", tmp / "server.log")
        print(f"server up in {time.time() - t0:.0f} s", flush=True)
        rows = drive(url, record, ck, args.rows.split(",") if args.rows else None)
    finally:
        os.kill(server.pid, signal.SIGINT)  # qwen36 serve's own process: vLLM stops its engine core
        try:
            clean = server.wait(120) == 0
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        try:  # nothing of the server's process group may outlive it
            os.killpg(server.pid, 0)
            clean = False
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"server stopped by SIGINT: {'exit 0, no process left' if clean else 'NOT CLEAN'}", flush=True)
    calls = read_recording(record)
    if args.out:
        from importlib.metadata import version

        trace = dict(vllm=version("vllm"), checkpoint=CHAT_CHECKPOINT if args.checkpoint is None else str(ck),
                     serve_args=serve_args, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                     model_args=json.loads((record / "model_args.json").read_text()), calls=calls,
                     rows=[{k: v for k, v in r.items() if k not in ("seconds", "failures")} for r in rows])
        data = json.dumps(trace, indent=None, separators=(",", ":")).encode()
        args.out.write_bytes(gzip.compress(data, mtime=0) if args.out.suffix == ".gz" else data)
        print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, {len(calls)} calls)")
    bad = [r["name"] for r in rows if r["failures"]]
    print("chat API table", "PASSED" if clean and not bad else f"FAILED ({', '.join(bad) or 'shutdown'})")
    return 0 if clean and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
