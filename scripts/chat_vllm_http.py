#!/usr/bin/env python
"""A multi-turn conversation over ``vllm serve`` ``/v1/chat/completions`` (the ``openai`` client, streamed) with
vLLM's automatic prefix caching on this hybrid model, on the emulated mesh (dev-only: vLLM 0.25.1, the vllm-tt plugin
and ``openai``; docs/chat.md "vLLM").

The server is the real ``vllm serve`` (API process + engine core) started by ``qwen36 serve --device
emulated-p150x2`` (prefix caching on, its default for a plain launch; ``--enable-prompt-tokens-details`` passed on to
vLLM) inside ``scripts/soak_vllm_http.py --serve`` (the plugin's calls and returned rows recorded), serving the
embedded checkpoint with its chat template (``--checkpoint chat-ci``: the CI shapes with the embedded tokenizer). The
conversation: a long system prompt (the start of a source file of this repository, ``--system-tokens`` tokens) and
``--turns`` user messages of code; each reply is appended as the assistant's message, so every turn resends the
whole conversation. Per turn it records the prompt's tokens and vLLM's cached tokens (the response's
``prompt_tokens_details.cached_tokens`` and the deltas of ``vllm:prefix_cache_queries`` / ``_hits``), how the adapter
served the prefill (the checkpoint it restored, rows rerun below the hit), and the time to first token on the
client's clock: emulator wall time, on whatever host runs it (not a card figure; the modelled one is
``qwen36 probe prefill-cost --prefix-hits``). With ``--compare-cold`` the same conversation runs again on a server
with prefix caching off: every reply's token ids must be equal and the TTFTs are printed side by side.

Afterwards every logits row the server's model returned is compared with the cold batch-1 run (each turn's prompt
prefilled from position 0, the reply decoded), or with ``--compare-cold`` with the rows the cold server returned: bit
for bit. ``--record F`` writes the plugin's calls of the warm run and the sha256 of every row it returned.

    python scripts/chat_vllm_http.py --turns 5 --out chat.json --compare-cold
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

REPO = Path(__file__).resolve().parents[1]
BLOCK = 64
TURNS = ("def add(a, b):", "import os\nimport sys", "class Stack:\n    def __init__(self):",
         "for i in range(10):", "def main():\n    args = parse()", "with open(path) as f:", "try:\n    run()")
SOURCE = REPO / "models/qwen36/prefix_cache.py"  # the system prompt's text: a file a coding assistant is asked about


def system_prompt(tok, n_tokens: int) -> str:
    ids = tok.encode(SOURCE.read_text(), add_special_tokens=False)[:n_tokens]
    return "You review this Python module and answer with code.\n\n" + tok.decode(ids)


def scrape(url: str) -> dict:
    import httpx

    out: dict = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def start_server(args, ck: Path, record: Path, prefix_caching: bool, port: int, log: Path) -> subprocess.Popen:
    """``qwen36 serve --device emulated-p150x2`` (prefix caching on unless ``prefix_caching`` is false) with the
    soak's recorder installed first (``scripts/soak_vllm_http.py --serve``)."""

    budget = args.max_model_len * args.max_num_seqs
    cmd = [sys.executable, str(REPO / "scripts/soak_vllm_http.py"), "--serve", str(record), str(budget), "0",
           str(args.prefill_chunk or 0), "--", "--device", "emulated-p150x2", "--checkpoint", str(ck),
           *([] if prefix_caching else ["--no-prefix-caching"]),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--precision", "accuracy", "--reasoning-parser", "none", "--tool-call-parser", "none",
           "--host", "127.0.0.1", "--port", str(port), "--",
           "--generation-config", "vllm", "--enable-prompt-tokens-details"]
    record.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(server, url, "chat_vllm_http", log)
    return server


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def converse(url: str, system: str, turns: list[str], max_tokens: int) -> list[dict]:
    """The conversation, one streamed chat completion per user turn (greedy); per turn the client's figures."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "system", "content": system}]
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        before = scrape(url)
        t0 = time.time()
        ttft, reply, ids, usage = None, "", [], None
        stream = client.chat.completions.create(
            model="qwen36", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                delta = ch.delta
                piece = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
                got = getattr(ch, "token_ids", None) or []
                if ttft is None and (piece or got):
                    ttft = time.time() - t0
                reply += piece
                ids += got
        total = time.time() - t0
        after = scrape(url)
        messages.append({"role": "assistant", "content": reply})
        cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        out.append(dict(user=text, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                        cached_tokens=cached, vllm_queries=d.get("vllm:prefix_cache_queries_total"),
                        vllm_hits=d.get("vllm:prefix_cache_hits_total"),
                        server_ttft_s=(d.get("vllm:time_to_first_token_seconds_sum", 0.0)
                                       / max(1.0, d.get("vllm:time_to_first_token_seconds_count", 0.0))),
                        ttft_s=round(ttft, 3), total_s=round(total, 3), reply=reply, token_ids=ids))
        print(f"turn {len(out)}: prompt {usage.prompt_tokens} tokens, cached {cached}, TTFT {ttft:.2f} s "
              f"(client clock, emulator), {usage.completion_tokens} tokens in {total:.1f} s", flush=True)
    return out


def recorded(record: Path, warm: int) -> tuple[list, dict]:
    import torch

    calls = [json.loads(x) for x in (record / "calls.jsonl").read_text().splitlines()]
    rows = {i - warm: torch.load(record / "rows" / f"{i}.pt") for i in range(warm, len(calls))
            if (record / "rows" / f"{i}.pt").exists()}
    return calls[warm:], rows


def requests_of(calls: list) -> list[list[int]]:
    """The prompts of the requests, in order: every row the adapter served as a prefill from a new sequence (a
    turn's prompt) is one (the conversation runs one request at a time)."""
    from support.vllm_calls import restore

    prompts = []
    for c in calls:
        if c["call"] != "prefill_forward":
            continue
        tokens, lens = restore(c["args"]["tokens"]), restore(c["args"]["prompt_lens"])
        for i, r in enumerate(c.get("served") or []):
            if r["kind"] == "prefill":
                prompts.append(tokens[i, : int(lens[i])].tolist())
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1400, help="tokens of source text in the system prompt")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per reply (greedy)")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the model's prefill chunk (checkpoint grid)")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--checkpoint", default=None,
                    help="served checkpoint: a directory, or 'chat-ci' (the CI shapes with the embedded tokenizer, "
                         "random weights: fast, its replies noise); default the embedded checkpoint")
    ap.add_argument("--compare-cold", action="store_true",
                    help="run the conversation again with prefix caching off and compare")
    ap.add_argument("--record", type=Path, help="write the warm run's plugin calls here (JSON, gzip if .gz)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not 1 <= args.turns <= len(TURNS):
        sys.exit(f"chat_vllm_http: --turns must be 1..{len(TURNS)}")

    from transformers import PreTrainedTokenizerFast

    from qwen36 import DEFAULT_CHECKPOINT
    from support.chat_api import CHAT_CHECKPOINT, make_chat_checkpoint
    from support.soak_oracle import check_request, oracle_generator, request_rows, row_digest
    from support.vllm_replay import LOGITS_TOL

    tmp = Path(tempfile.mkdtemp(prefix="chat-http-"))
    if args.checkpoint == CHAT_CHECKPOINT:
        ck = make_chat_checkpoint(tmp / CHAT_CHECKPOINT)
    else:
        ck = Path(args.checkpoint or DEFAULT_CHECKPOINT)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(ck / "tokenizer.json"))
    system = system_prompt(tok, args.system_tokens)
    turns = list(TURNS[: args.turns])
    runs = {}
    for mode in (["warm", "cold"] if args.compare_cold else ["warm"]):
        record = tmp / f"record-{mode}"
        t0 = time.time()
        server = start_server(args, ck, record, mode == "warm", args.port, tmp / f"server-{mode}.log")
        t_up = time.time() - t0
        time.sleep(2.5)  # the recorder flushes every second: the warmup calls are on disk
        warm_calls = len((record / "calls.jsonl").read_text().splitlines())
        print(f"[{mode}] vllm serve up in {t_up:.0f} s (prefix caching {'on' if mode == 'warm' else 'off'})",
              flush=True)
        try:
            turns_out = converse(f"http://127.0.0.1:{args.port}", system, turns, args.max_tokens)
            time.sleep(3)
        finally:
            stop_server(server)
        calls, rows = recorded(record, warm_calls)
        runs[mode] = dict(turns=turns_out, calls=calls, rows=rows, server_up_s=round(t_up, 1), warm_calls=warm_calls,
                          all_calls=[json.loads(x) for x in (record / "calls.jsonl").read_text().splitlines()],
                          model_args=json.loads((record / "model_args.json").read_text()))

    # every row of the warm run against the cold run, bit for bit: the cold server's rows (--compare-cold), else the
    # cold batch-1 oracle (each prompt prefilled from position 0 on its own mesh, the reply decoded)
    warm = runs["warm"]
    prompts = requests_of(warm["calls"])
    if len(prompts) != len(turns):
        sys.exit(f"chat_vllm_http: {len(prompts)} prefills recorded for {len(turns)} turns")
    outputs = [t["token_ids"] for t in warm["turns"]]
    entries = request_rows(warm["calls"], warm["rows"], prompts, outputs)
    if "cold" in runs:
        cold = runs["cold"]
        c_prompts = requests_of(cold["calls"])
        c_entries = request_rows(cold["calls"], cold["rows"], c_prompts, [t["token_ids"] for t in cold["turns"]])
        if c_prompts != prompts:
            sys.exit("chat_vllm_http: the cold run's prompts differ from the warm run's")
        checks = []
        for e, ce in zip(entries, c_entries):
            diffs = [float((a[2] - b[2]).abs().max()) for a, b in zip(e, ce)]
            checks.append(dict(rows=len(e), max_abs=max(diffs, default=0.0), tokens_equal=len(e) == len(ce)
                               and all(d == 0.0 for d in diffs), against="the cold server's rows"))
    else:
        gen = oracle_generator(ck, warm["model_args"])
        checks = [check_request(gen, p, o, {"temperature": 0.0}, e) | {"against": "the cold batch-1 oracle"}
                  for p, o, e in zip(prompts, outputs, entries)]
        gen.close()
    served = [r for c in warm["calls"] if c.get("served") for r in c["served"] if r["kind"] == "prefill"]
    per_turn = []
    for i, (t, p, chk, s) in enumerate(zip(warm["turns"], prompts, checks, served)):
        row = {k: t[k] for k in ("prompt_tokens", "cached_tokens", "vllm_queries", "vllm_hits", "completion_tokens",
                                 "ttft_s", "server_ttft_s", "total_s")}
        row.update(turn=i + 1, reuse=round((t["cached_tokens"] or 0) / t["prompt_tokens"], 4),
                   ran_from=s["ran_from"], restored=s["restored"], rows=chk["rows"], max_abs=chk["max_abs"],
                   tokens_equal=chk["tokens_equal"])
        if "cold" in runs:
            c = runs["cold"]["turns"][i]
            row.update(cold_ttft_s=c["ttft_s"], cold_server_ttft_s=c["server_ttft_s"],
                       same_reply=c["token_ids"] == t["token_ids"])
        per_turn.append(row)
    summary = dict(backend="emulated-p150x2 (ttnn goldens on CPU, no hardware) behind vllm serve",
                   timing="client wall clock of an emulated mesh (not card time); "
                          "on a loaded shared host unless stated otherwise",
                   checkpoint=args.checkpoint or "embedded default", max_num_seqs=args.max_num_seqs,
                   max_model_len=args.max_model_len,
                   prefill_chunk=warm["model_args"]["prefill_chunk"], system_tokens=args.system_tokens,
                   server_up_s=warm["server_up_s"], turns=per_turn,
                   later_turns_min_reuse=min((r["reuse"] for r in per_turn[1:]), default=None),
                   rows_checked=sum(c["rows"] for c in checks), worst_max_abs=max(c["max_abs"] for c in checks),
                   logits_tol=LOGITS_TOL, args={k: str(v) for k, v in vars(args).items()})
    summary["checked_against"] = checks[0]["against"]
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary | {"replies": [t["reply"] for t in warm["turns"]]}, indent=1))
    if args.record:  # every call from the KV allocation on (what a replay feeds), digests by that call index
        w = warm["warm_calls"]
        rec = {"vllm": "0.25.1", "checkpoint": args.checkpoint or "default", "max_num_seqs": args.max_num_seqs,
               "max_model_len": args.max_model_len, "prefill_chunk": warm["model_args"]["prefill_chunk"],
               "launch": "qwen36 serve --device emulated-p150x2 (prefix caching on)",
               "prompts": prompts, "outputs": outputs, "calls": warm["all_calls"], "warm_calls": w,
               "row_digests": {str(i + w): [row_digest(r[j]) for j in range(r.shape[0])]
                               for i, r in warm["rows"].items()}}
        data = json.dumps(rec, separators=(",", ":")).encode()
        args.record.write_bytes(gzip.compress(data, mtime=0) if args.record.suffix == ".gz" else data)
    ok = (all(c["max_abs"] == 0.0 and c["tokens_equal"] for c in checks)
          and all(r.get("same_reply", True) for r in per_turn))
    print("chat over vllm serve", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
