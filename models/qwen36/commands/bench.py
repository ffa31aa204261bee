"""qwen36 bench decode | compare: decode benchmark against an OpenAI-compatible server (``vllm serve`` with the
vllm-tt plugin, docs/serving.md).

``bench decode`` builds, for each rung, a prompt of that many tokens with the checkpoint's tokenizer, streams one
greedy ``/v1/completions`` request per rung (``max_tokens = --tokens``, ``ignore_eos``) and records, per rung:
the server's own ``usage.prompt_tokens`` and its deviation from the target (within 5 % or not), the time to the
first streamed token, decode tokens/s after it, the server's ``max_model_len`` (``GET /v1/models``), a sha256
of the generated text, and what the server's own counters added during the rung (``GET /metrics``, vLLM's
Prometheus names): speculative verify steps, mean accepted drafts and tokens emitted per step, prefix-cache hits.
One run = one record (qwen36.probes.records format) appended to ``--out``.

``bench compare A.jsonl B.jsonl`` compares the last record of each file rung by rung (generated text hash and
token counts): a plain and a speculative server must produce the same greedy bytes.

Timings are client-side wall clock over HTTP (labelled ``measured`` against that server); the record names the
server URL and the model id the server reports; it cannot know what hardware is behind the endpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from ..errors import UserError
from .common import add_checkpoint_arg, positive_int, resolve_checkpoint

PROBE = "decode-bench"
WITHIN = 0.05  # |server prompt tokens - target| / target
# Deterministic filler (plain prose, no special tokens): the same rung gives the same prompt on every run.
FILLER = ("The river bends twice before it reaches the old mill, where the water slows and the light turns green "
          "under the willows. Each morning the miller counts the sacks, writes the number in a ledger, and walks "
          "the length of the race to clear the leaves from the grate. ")


def _rungs(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rungs {text!r}: comma-separated integers expected") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--rungs {text!r}: positive token counts expected")
    return out


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="decode benchmark against an OpenAI-compatible endpoint (vllm serve)")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    d = bsub.add_parser("decode", help="prompt-length rungs: TTFT, decode tok/s, usage, output hash -> records")
    d.add_argument("--url", required=True, help="server base URL including /v1, e.g. http://HOST:8000/v1")
    d.add_argument("--rungs", type=_rungs, default=[4096, 8192, 16384], help="prompt lengths in tokens")
    d.add_argument("--tokens", type=positive_int, default=256, help="tokens to generate per rung")
    d.add_argument("--model", default=None, help="model id to request (default: the server's first model)")
    d.add_argument("--label", default="", help="free text stored in the record (e.g. 'plain' or 'spec K=3')")
    d.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout in seconds")
    d.add_argument("--out", type=Path, default=None, help="records file (default bench/runs/decode-bench-*.jsonl)")
    add_checkpoint_arg(d)
    d.set_defaults(run=run_decode)
    c = bsub.add_parser("compare", help="compare two decode-bench records files rung by rung (greedy bytes)")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.set_defaults(run=run_compare)


# ---- prompt construction ---------------------------------------------------------------------------------------
def build_prompt(tok, n: int) -> tuple[str, int]:
    """Text that the tokenizer encodes to ``n`` tokens when it can (BPE merges across the cut can move the count
    by a token or two; the count actually reached is returned, and the server's own count is recorded too)."""
    base = tok.encode(FILLER, add_special_tokens=False)
    ids = (base * (n // len(base) + 2))[:n]
    text, got = tok.decode(ids), -1
    for _ in range(8):
        got = len(tok.encode(text, add_special_tokens=False))
        if got == n:
            break
        ids = ids[: len(ids) - (got - n)] if got > n else ids + (base * (1 + (n - got) // len(base)))[: n - got]
        text = tok.decode(ids)
    return text, got


# ---- one streamed request ---------------------------------------------------------------------------------------
def server_models(client) -> list[dict]:
    r = client.get("/models")
    r.raise_for_status()
    return list(r.json().get("data") or [])


# vLLM 0.25.1's Prometheus counters (GET /metrics at the server root; prometheus_client adds "_total"): speculative
# decoding (vllm/v1/spec_decode/metrics.py: one "draft" = one verify step of a request) and the prefix cache
# (vllm/v1/metrics/loggers.py; queried and hit tokens)
METRICS = {"spec_drafts": "vllm:spec_decode_num_drafts_total",
           "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
           "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
           "prefix_cache_queries": "vllm:prefix_cache_queries_total",
           "prefix_cache_hits": "vllm:prefix_cache_hits_total"}


def server_metrics(client, url: str, model: str) -> dict | None:
    """The counters above, summed over engines, for ``model`` (label ``model_name``); None when the server has no
    /metrics. A counter the server does not export is absent from the result."""
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    try:
        r = client.get(f"{root}/metrics")
    except Exception:  # noqa: BLE001 - a server without the endpoint or refusing it: no metrics
        return None
    if r.status_code != 200:
        return None
    wanted = {v: k for k, v in METRICS.items()}
    got: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else (line.split(" ", 1)[0], "", "")
        if name not in wanted:
            continue
        labels, value = (rest.rsplit("}", 1) if rest else ("", line.split(" ", 1)[1]))
        if 'model_name="' in labels and f'model_name="{model}"' not in labels:
            continue
        got[wanted[name]] = got.get(wanted[name], 0.0) + float(value.split()[0])
    return got


def metric_deltas(before: dict | None, after: dict | None) -> dict:
    """What one rung added: acceptance (mean accepted drafts and tokens emitted per verify step, per-draft
    acceptance rate) and prefix-cache hits; None where the server exports no such counter."""
    if before is None or after is None:
        return {"server_metrics": False}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {"server_metrics": True, **{k: d.get(k) for k in METRICS}}
    steps, acc, offered = d.get("spec_drafts"), d.get("spec_accepted_tokens"), d.get("spec_draft_tokens")
    out["mean_accepted_per_step"] = acc / steps if steps else None
    out["emitted_per_step"] = (acc + steps) / steps if steps else None  # accepted drafts + the bonus/correction
    out["acceptance_rate"] = acc / offered if offered else None
    return out


def stream_completion(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streamed completion; returns text, usage, TTFT and decode rate measured on this client."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    pieces, usage, t_first, t_last, chunks = [], None, None, None, 0
    t0 = time.perf_counter()
    with client.stream("POST", "/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"POST /completions -> HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                usage = msg["usage"]
            for ch in msg.get("choices") or []:
                if ch.get("text"):
                    now = time.perf_counter()
                    t_first = now if t_first is None else t_first
                    t_last = now
                    chunks += 1
                    pieces.append(ch["text"])
    text = "".join(pieces)
    completion = (usage or {}).get("completion_tokens")
    rate = None
    if completion and completion > 1 and t_first is not None and t_last > t_first:
        rate = (completion - 1) / (t_last - t_first)
    return {"text": text, "usage": usage, "ttft_s": None if t_first is None else t_first - t0,
            "decode_tok_s": rate, "chunks": chunks, "total_s": time.perf_counter() - t0}


def rung_cell(target: int, tokens: int, local_tokens: int, res: dict, max_model_len) -> dict:
    usage = res["usage"] or {}
    server_prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    dev = None if server_prompt is None else (server_prompt - target) / target
    within = dev is not None and abs(dev) <= WITHIN
    failed = []
    if server_prompt is None:
        failed.append("server sent no usage (stream_options.include_usage)")
    elif not within:
        failed.append(f"prompt tokens {server_prompt} deviate {dev:+.1%} from {target}")
    if completion != tokens:
        failed.append(f"completion_tokens {completion} != {tokens}")
    return {"cell": f"rung-{target}", "target_prompt_tokens": target, "local_prompt_tokens": local_tokens,
            "server_prompt_tokens": server_prompt, "deviation": dev, "within_5pct": within,
            "completion_tokens": completion, "ttft_s": res["ttft_s"], "decode_tok_s": res["decode_tok_s"],
            "total_s": res["total_s"], "stream_chunks": res["chunks"], "max_model_len": max_model_len,
            "output_sha256": hashlib.sha256(res["text"].encode("utf-8")).hexdigest(),
            "output_chars": len(res["text"]), "failed": failed, "pass": not failed}


def run_decode(args: argparse.Namespace) -> int:
    import httpx
    from loguru import logger

    from ..probes.records import ProbeReport, append_record, default_records_path, to_record
    from ..tokenizer import load_tokenizer

    ckpt = resolve_checkpoint(args.checkpoint)
    tok = load_tokenizer(ckpt)
    url = args.url.rstrip("/")
    with httpx.Client(base_url=url, timeout=args.timeout) as client:
        models = server_models(client)
        if not models:
            raise UserError(f"{url}/models lists no model")
        entry = next((m for m in models if m.get("id") == args.model), None) if args.model else models[0]
        if entry is None:
            raise UserError(f"model {args.model!r} not served at {url} (has {[m.get('id') for m in models]})")
        model, max_len = entry["id"], entry.get("max_model_len")
        cells = []
        for n in args.rungs:
            if max_len is not None and n + args.tokens > int(max_len):
                cells.append({"cell": f"rung-{n}", "target_prompt_tokens": n, "max_model_len": max_len,
                              "failed": [f"{n} + {args.tokens} tokens > server max_model_len {max_len}"],
                              "pass": False, "skipped": True})
                logger.warning(f"rung {n}: skipped, {n} + {args.tokens} > max_model_len {max_len}")
                continue
            prompt, local = build_prompt(tok, n)
            before = server_metrics(client, url, model)
            res = stream_completion(client, model, prompt, args.tokens)
            cell = rung_cell(n, args.tokens, local, res, max_len)
            cell.update(metric_deltas(before, server_metrics(client, url, model)))
            cells.append(cell)
            logger.info(f"rung {n}: server prompt tokens {cell['server_prompt_tokens']} ({cell['deviation']:+.2%}), "
                        f"TTFT {cell['ttft_s']:.3f} s, decode {cell['decode_tok_s'] or float('nan'):.1f} tok/s, "
                        f"sha256 {cell['output_sha256'][:12]}")
    report = ProbeReport(
        probe=PROBE, backend=f"openai-compatible server {url} (model {model})",
        config={"url": url, "model": model, "rungs": args.rungs, "tokens": args.tokens, "label": args.label,
                "checkpoint_tokenizer": str(ckpt), "max_model_len": max_len},
        cells=cells, gate_complete=all(not c.get("skipped") for c in cells),
        performance={"label": "measured", "method": "client wall clock over streamed /v1/completions (HTTP "
                     "included); TTFT = request start to first text chunk, decode tok/s = (completion_tokens - 1) / "
                     "(last chunk - first chunk)"})
    record = to_record(report)
    path = append_record(record, args.out or default_records_path(record))
    print(f"{len(cells)} rungs, verdict {record['verdict']}; record appended to {path}")
    for c in cells:
        print(f"  {c['cell']}: " + ("skipped: " + c["failed"][0] if c.get("skipped") else
              f"prompt {c['server_prompt_tokens']} ({c['deviation']:+.2%}, within 5%: {c['within_5pct']}), "
              f"TTFT {c['ttft_s']:.3f} s, decode {c['decode_tok_s'] or float('nan'):.1f} tok/s, "
              f"sha256 {c['output_sha256'][:16]}" + _server_stats(c)))
    return 0 if record["verdict"] == "pass" else 1


# ---- comparison -------------------------------------------------------------------------------------------------
COMPARED = ("server_prompt_tokens", "completion_tokens", "output_sha256")


def compare_records(a: dict, b: dict) -> list[str]:
    """Differences between two decode-bench records, rung by rung (empty = byte-identical outputs)."""
    for r in (a, b):
        if r.get("probe") != PROBE:
            raise ValueError(f"not a {PROBE} record: probe={r.get('probe')!r}")
    ca = {c["cell"]: c for c in a["cells"]}
    cb = {c["cell"]: c for c in b["cells"]}
    diffs = [f"{name}: only in {'A' if name in ca else 'B'}" for name in sorted(set(ca) ^ set(cb))]
    for name in sorted(set(ca) & set(cb)):
        if ca[name].get("skipped") or cb[name].get("skipped"):
            diffs.append(f"{name}: skipped in {'A' if ca[name].get('skipped') else 'B'}")
            continue
        for key in COMPARED:
            if ca[name].get(key) != cb[name].get(key):
                diffs.append(f"{name}: {key} {ca[name].get(key)} != {cb[name].get(key)}")
    return diffs


def run_compare(args: argparse.Namespace) -> int:
    from ..probes.records import read_records

    recs = []
    for f in (args.a, args.b):
        if not f.is_file():
            raise UserError(f"records file {f} does not exist")
        rs = [r for r in read_records(f) if r.get("probe") == PROBE]
        if not rs:
            raise UserError(f"no {PROBE} record in {f}")
        recs.append(rs[-1])
    diffs = compare_records(*recs)
    for name, r in zip("AB", recs):
        print(f"{name}: {r['config'].get('label') or '-'}  {r['backend']}  run {r['run_id']} ({r['time_utc']})")
    rows = sorted({c["cell"] for r in recs for c in r["cells"]}, key=lambda s: int(s.split("-")[-1]))
    for cell in rows:
        ca = next((c for c in recs[0]["cells"] if c["cell"] == cell), {})
        cb = next((c for c in recs[1]["cells"] if c["cell"] == cell), {})
        same = ca.get("output_sha256") is not None and ca.get("output_sha256") == cb.get("output_sha256")
        print(f"  {cell}: output {'identical' if same else 'DIFFERENT'}; decode tok/s A "
              f"{_fmt(ca.get('decode_tok_s'))} B {_fmt(cb.get('decode_tok_s'))}; TTFT s A {_fmt(ca.get('ttft_s'))} "
              f"B {_fmt(cb.get('ttft_s'))}")
    if diffs:
        print("differences:\n  " + "\n  ".join(diffs))
        return 1
    print("greedy outputs byte-identical on every rung")
    return 0


def _server_stats(c: dict) -> str:
    """The server's own counters for the rung, when it exports them."""
    if not c.get("server_metrics"):
        return "; server exports no /metrics"
    parts = []
    if c.get("spec_drafts"):
        parts.append(f"verify steps {c['spec_drafts']:.0f}, mean accepted {c['mean_accepted_per_step']:.2f}, "
                     f"emitted/step {c['emitted_per_step']:.2f}, acceptance {c['acceptance_rate']:.1%}")
    if c.get("prefix_cache_queries") is not None:
        parts.append(f"prefix cache hits {c['prefix_cache_hits'] or 0:.0f}/{c['prefix_cache_queries']:.0f} tokens")
    return "; " + ", ".join(parts) if parts else "; server exports neither acceptance nor prefix-cache counters"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"
