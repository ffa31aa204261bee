"""A minimal OpenAI-compatible endpoint on 127.0.0.1 for testing ``qwen36 bench decode`` without vLLM: GET
/v1/models and streamed POST /v1/completions (greedy only), backed by this project's torch reference model
(plain greedy, or the reference speculative engine with the MTP head). Test-only; the serving engine is vLLM."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from qwen36.reference.model import Qwen36Model
from qwen36.speculative.engine import speculative_generate
from qwen36.speculative.reference_backend import ReferenceBackend
from qwen36.tokenizer import load_tokenizer


class StubServer:
    """``mode``: "plain" (token-by-token greedy, streamed as produced), "spec" (speculative greedy with K drafts,
    streamed per accepted block) or "corrupt" (plain with the last token changed: a server whose output differs)."""

    def __init__(self, ckpt: Path, mode: str = "plain", k: int = 3, max_model_len: int = 4096,
                 model_id: str = "qwen36-stub"):
        self.tok = load_tokenizer(ckpt)
        self.model = Qwen36Model.from_checkpoint(ckpt, dtype=torch.float32, device="cpu", require_mtp=mode == "spec")
        self.mode, self.k, self.max_model_len, self.model_id = mode, k, max_model_len, model_id
        self.lock = threading.Lock()  # one request at a time on the model
        # vLLM's Prometheus counters (GET /metrics): speculative verify steps / offered / accepted drafts (exported
        # only by a speculative server, as vLLM does), prefix-cache queried / hit tokens (no cache: no hits)
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                         "spec_decode_num_accepted_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- generation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def tokens(self, prompt: list[int], n: int):
        """Yield lists of new token ids as the backend produces them."""
        if self.mode == "spec":
            backend = ReferenceBackend(self.model, "shadow_commit", max_len=len(prompt) + n + self.k + 2)
            res = speculative_generate(backend, [prompt], n, [self.k])[0]
            c = self.counters
            c["spec_decode_num_drafts"] += res.stats.steps
            c["spec_decode_num_draft_tokens"] += sum(res.stats.depths)
            c["spec_decode_num_accepted_tokens"] += sum(res.stats.accepted)
            self.last_stats = res.stats
            yield res.tokens[:n]
            return
        state = self.model.new_state(1, len(prompt) + n + 1)
        out = self.model(torch.tensor([prompt]), state)
        for i in range(n):
            tok = int(out.logits[0, -1].argmax())
            if self.mode == "corrupt" and i == n - 1:
                tok = (tok + 1) % self.model.config.vocab_size
            yield [tok]
            if i + 1 < n:
                out = self.model(torch.tensor([[tok]]), state)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _json(self, code: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    lines = []
                    for name, v in server.counters.items():
                        if name.startswith("spec_") and server.mode != "spec":
                            continue
                        lines += [f"# TYPE vllm:{name}_total counter",
                                  f'vllm:{name}_total{{engine="0",model_name="{server.model_id}"}} {float(v)}']
                    body = ("\n".join(lines) + "\n").encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path != "/v1/models":
                    return self._json(404, {"error": f"no route {self.path}"})
                self._json(200, {"object": "list", "data": [{"id": server.model_id, "object": "model",
                                                             "max_model_len": server.max_model_len}]})

            def do_POST(self):
                if self.path != "/v1/completions":
                    return self._json(404, {"error": f"no route {self.path}"})
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not req.get("stream") or req.get("temperature", 1.0) != 0.0 or req.get("model") != server.model_id:
                    return self._json(400, {"error": "this stub serves streamed greedy requests for its model only"})
                prompt = server.tok.encode(req["prompt"], add_special_tokens=False)
                n = int(req["max_tokens"])
                server.counters["prefix_cache_queries"] += len(prompt)
                if len(prompt) + n > server.max_model_len:
                    return self._json(400, {"error": f"{len(prompt)} + {n} > max_model_len {server.max_model_len}"})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def send(obj) -> None:
                    self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                    self.wfile.flush()

                out: list[int] = []
                emitted = ""
                with server.lock:
                    for new in server.tokens(prompt, n):
                        out += new
                        text = server.tok.decode(out)
                        if text.startswith(emitted) and len(text) > len(emitted):
                            send({"object": "text_completion", "model": server.model_id,
                                  "choices": [{"index": 0, "text": text[len(emitted):], "finish_reason": None}]})
                            emitted = text
                text = server.tok.decode(out)
                send({"object": "text_completion", "model": server.model_id,
                      "choices": [{"index": 0, "text": text[len(emitted):] if text.startswith(emitted) else "",
                                   "finish_reason": "length"}]})
                if req.get("stream_options", {}).get("include_usage"):
                    send({"object": "text_completion", "model": server.model_id, "choices": [],
                          "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                                    "total_tokens": len(prompt) + len(out)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler
