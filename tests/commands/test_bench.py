"""qwen36 bench decode / compare against a local OpenAI-compatible endpoint (qwen36.testing.openai_stub) backed by
the reference model on the embedded default checkpoint: records written through qwen36.probes.records, the
server's usage honoured, greedy output hashes equal to an independent reference greedy run, plain vs speculative
servers byte-identical, a differing server detected."""
from __future__ import annotations

import hashlib

import pytest
import torch

from qwen36.testing.openai_stub import StubServer
from qwen36.cli import main
from qwen36.commands.bench import build_prompt
from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.probes.records import read_records
from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model
from qwen36.tokenizer import load_tokenizer

RUNGS = [48, 160]
NEW = 12


def _bench(url: str, out, *extra) -> int:
    return main(["bench", "decode", "--url", url, "--rungs", ",".join(map(str, RUNGS)), "--tokens", str(NEW),
                 "--checkpoint", str(DEFAULT_CHECKPOINT), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "plain.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "plain", max_model_len=1024) as srv:
        assert _bench(srv.url, out, "--label", "plain") == 0
    return out


@pytest.mark.slow  # a local server round trip
def test_build_prompt_hits_target():
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    for n in (1, 48, 160, 333):
        text, got = build_prompt(tok, n)
        assert got == len(tok.encode(text, add_special_tokens=False))
        assert abs(got - n) <= max(1, 0.05 * n), (n, got)


@pytest.mark.slow  # a local server round trip
def test_decode_record_fields_and_hash(plain_run):
    rec = read_records(plain_run)[-1]
    assert rec["probe"] == "decode-bench" and rec["verdict"] == "pass" and rec["gate_complete"]
    assert rec["backend"].startswith("openai-compatible server http://127.0.0.1:")
    assert rec["performance"]["label"] == "measured"
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, device="cpu")
    for n, cell in zip(RUNGS, rec["cells"]):
        text, local = build_prompt(tok, n)
        assert cell["target_prompt_tokens"] == n and cell["local_prompt_tokens"] == local
        assert cell["server_prompt_tokens"] == local and cell["within_5pct"] is True
        assert cell["deviation"] == pytest.approx((local - n) / n)
        assert cell["completion_tokens"] == NEW and cell["max_model_len"] == 1024
        assert cell["ttft_s"] > 0 and cell["decode_tok_s"] > 0
        # independent: the reference greedy continuation of the same prompt, hashed the same way
        ids = generate(model, [torch.tensor(tok.encode(text, add_special_tokens=False))], NEW)[0].tokens
        assert cell["output_sha256"] == hashlib.sha256(tok.decode(ids).encode("utf-8")).hexdigest()


@pytest.mark.slow  # a local server round trip
def test_plain_vs_spec_identical_and_difference_detected(plain_run, tmp_path, capsys):
    spec = tmp_path / "spec.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "spec", k=3, max_model_len=1024) as srv:
        assert _bench(srv.url, spec, "--label", "spec K=3") == 0
    assert main(["bench", "compare", str(plain_run), str(spec)]) == 0
    assert "byte-identical on every rung" in capsys.readouterr().out
    bad = tmp_path / "corrupt.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "corrupt", max_model_len=1024) as srv:
        assert _bench(srv.url, bad) == 0
    assert main(["bench", "compare", str(plain_run), str(bad)]) == 1
    assert "output_sha256" in capsys.readouterr().out


def test_rung_past_max_model_len_is_skipped_and_fails(tmp_path):
    out = tmp_path / "short.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "plain", max_model_len=100) as srv:
        assert _bench(srv.url, out) == 1
    rec = read_records(out)[-1]
    assert rec["verdict"] == "fail" and rec["gate_complete"] is False
    first, second = rec["cells"]
    assert first["pass"] and second.get("skipped") and "max_model_len 100" in second["failed"][0]


@pytest.mark.slow  # a local server round trip
def test_server_acceptance_and_prefix_cache_counters_reported(tmp_path, capsys):
    """A speculative server's counters (vLLM's Prometheus names at /metrics) become per-rung acceptance figures:
    verify steps, mean accepted drafts and emitted tokens per step equal what the server's engine recorded; a
    plain server reports its prefix-cache counters (no hits) and no acceptance; a server without /metrics says so."""
    out = tmp_path / "spec.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "spec", k=3, max_model_len=1024) as srv:
        assert main(["bench", "decode", "--url", srv.url, "--rungs", "48", "--tokens", str(NEW),
                     "--checkpoint", str(DEFAULT_CHECKPOINT), "--out", str(out)]) == 0
        stats = srv.last_stats
    cell = read_records(out)[-1]["cells"][0]
    assert cell["server_metrics"] is True and cell["spec_drafts"] == stats.steps
    assert cell["spec_accepted_tokens"] == sum(stats.accepted) and cell["spec_draft_tokens"] == sum(stats.depths)
    assert cell["mean_accepted_per_step"] == pytest.approx(sum(stats.accepted) / stats.steps)
    assert cell["emitted_per_step"] == pytest.approx(1 + sum(stats.accepted) / stats.steps)
    assert cell["prefix_cache_hits"] == 0 and cell["prefix_cache_queries"] == cell["server_prompt_tokens"]
    assert "mean accepted" in capsys.readouterr().out

    plain = tmp_path / "plain.jsonl"
    with StubServer(DEFAULT_CHECKPOINT, "plain", max_model_len=1024) as srv:
        assert main(["bench", "decode", "--url", srv.url, "--rungs", "48", "--tokens", "4",
                     "--checkpoint", str(DEFAULT_CHECKPOINT), "--out", str(plain)]) == 0
    cell = read_records(plain)[-1]["cells"][0]
    assert cell["spec_drafts"] is None and cell["mean_accepted_per_step"] is None
    assert cell["prefix_cache_queries"] == cell["server_prompt_tokens"] and cell["prefix_cache_hits"] == 0
    assert "prefix cache hits 0/" in capsys.readouterr().out
    from qwen36.commands.bench import metric_deltas

    assert metric_deltas(None, None) == {"server_metrics": False}  # GET /metrics failed: recorded as such
