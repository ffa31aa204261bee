"""`qwen36 chat`, `qwen36 generate --messages / --thinking-budget` and `qwen36 probe prefix-cache` on the reference
with the embedded default checkpoint (its tokenizer carries the chat format)."""
from __future__ import annotations

import json

import pytest

from qwen36.chat import STOP_THINKING_PHRASE
from qwen36.cli import main
from qwen36.errors import UserError

from support.cli import assert_one_line_error, run_cli

CONV = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "(replaced by the model's answer)"}, {"role": "user", "content": "import os"},
        {"role": "user", "content": "class Stack:"}]


def write(tmp_path, obj, name="conv.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_chat_messages_mode_reuses_the_history(tmp_path, capsys):
    path = write(tmp_path, CONV)
    assert main(["chat", "--messages", path, "--max-new-tokens", "6", "--prefix-block", "16",
                 "--thinking-budget", "0"]) == 0
    out = capsys.readouterr()
    turns = [json.loads(line) for line in out.out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["timing"] == "measured" for t in turns)
    assert turns[0]["reused"] == 0 and turns[0]["computed"] == turns[0]["prompt_tokens"]
    for t in turns[1:]:  # every later turn resumes from a cached block boundary
        assert t["reused"] > 0 and t["reused"] % 16 == 0 and t["reused"] + t["computed"] == t["prompt_tokens"]
    assert "prefill reused" in out.err and "TTFT" in out.err


def ids_of(out: str) -> list[int]:
    line = next(l for l in out.splitlines() if l.startswith("ids:"))
    return [int(x) for x in line.split(":", 1)[1].split(",")]


def test_generate_messages_thinking_budget_plain_equals_speculative(tmp_path, capsys):
    from transformers import AutoTokenizer

    from qwen36 import DEFAULT_CHECKPOINT

    path = write(tmp_path, CONV[:2])
    base = ["generate", "--messages", path, "--max-new-tokens", "45", "--thinking-budget", "4"]
    assert main(base) == 0
    plain = ids_of(capsys.readouterr().out)
    assert main(base + ["--spec-k", "2"]) == 0
    spec = ids_of(capsys.readouterr().out)
    assert plain == spec
    phrase = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT)).encode(STOP_THINKING_PHRASE)
    assert plain[4:4 + len(phrase)] == phrase  # injected at exactly 4 thinking tokens


def test_chat_refusals(tmp_path, capsys):
    bad = write(tmp_path, [{"role": "function", "content": "x"}])
    assert_one_line_error(*run_cli(capsys, "chat", "--messages", bad), "role")
    ok = write(tmp_path, CONV[:2], "ok.json")
    assert_one_line_error(*run_cli(capsys, "generate", "--messages", ok, "--thinking-budget", "2", "--logprobs", "1"),
                          "logprobs")


def test_probe_prefix_cache_reference(tmp_path, capsys):
    rec = tmp_path / "r.jsonl"
    assert main(["probe", "prefix-cache", "--device", "reference", "--turns", "2", "--max-new-tokens", "4",
                 "--block", "16", "--records", str(rec)]) == 0
    r = json.loads(rec.read_text().splitlines()[-1])
    assert r["verdict"] == "pass" and [c["turn"] for c in r["cells"]] == [1, 2]
    c2 = r["cells"][1]
    assert c2["reused"] > 0 and c2["exact_tokens"] and c2["exact_logits"] and c2["computed_within_new_plus_one_block"]
    assert "ttft_modelled" not in r["performance"]  # only with --ttft-preset
    assert not r["gate_complete"]  # fewer than 5 turns


@pytest.mark.slow  # the emulated mesh: TT model + device MTP, 2 turns served warm and cold
def test_probe_prefix_cache_emulated_speculative(tmp_path, capsys):
    rec = tmp_path / "r.jsonl"
    assert main(["probe", "prefix-cache", "--device", "emulated-p150x2", "--spec-k", "2", "--turns", "3",
                 "--max-new-tokens", "6", "--records", str(rec)]) == 0
    r = json.loads(rec.read_text().splitlines()[-1])
    assert r["verdict"] == "pass" and "emulated" in r["backend"] and "speculative" in r["backend"]
    assert r["cells"][2]["reused"] > 0 and all(c["exact_tokens"] for c in r["cells"])
    # with a thinking budget: the phrase forced through TTSpecBackend.inject at exactly 2 thinking tokens, warm == cold
    assert main(["probe", "prefix-cache", "--device", "emulated-p150x2", "--spec-k", "2", "--turns", "2",
                 "--max-new-tokens", "12", "--thinking-budget", "2", "--records", str(rec)]) == 0
    r = json.loads(rec.read_text().splitlines()[-1])
    assert r["verdict"] == "pass" and all(c["exact_tokens"] for c in r["cells"])
    assert [c["thinking_phrase_at"] for c in r["cells"]] == [2, 2]


def test_generate_thinking_budget_several_prompts_batched(tmp_path, capsys):
    """Two prompts with a budget, speculative (the batched reference backend) and plain (the reference slot
    decoder): each user's ids equal its single-prompt plain run with the budget."""
    ids = ["--ids", "5,11,12,4094", "--ids", "7,8,9,10,4094"]  # both end inside an open <think> block
    assert main(["generate", *ids, "--max-new-tokens", "44", "--thinking-budget", "3", "--spec-k", "2"]) == 0
    out = capsys.readouterr().out
    got = [[int(x) for x in l.split(":", 1)[1].split(",")] for l in out.splitlines() if l.startswith("ids[")]
    want = []
    for prompt in ("5,11,12,4094", "7,8,9,10,4094"):
        assert main(["generate", "--ids", prompt, "--max-new-tokens", "44", "--thinking-budget", "3"]) == 0
        want.append(ids_of(capsys.readouterr().out))
    assert got == want and len(got) == 2
    # plain (no --spec-k): the reference slot decoder, each user's budget counted on its own
    assert main(["generate", *ids, "--max-new-tokens", "44", "--thinking-budget", "3"]) == 0
    assert [[int(x) for x in l.split(":", 1)[1].split(",")] for l in capsys.readouterr().out.splitlines()
            if l.startswith("ids[")] == want


def test_prefix_cache_modelled_ttft_is_the_calibrated_prefill_term():
    """--ttft-preset: cold = prefill-cost's calibrated figure for the whole prompt, warm = its figure from the hit
    plus the restore copies; the ci preset's shapes keep it fast (the 27b preset runs the same code). The prefill is
    charged as an untraced region, where a chunk's host dispatch does not shrink with its rows: a hit saves whole
    chunks, so the prompt here is two chunks cold and one warm."""
    from qwen36.probes.decode_cost import build_config
    from qwen36.probes.prefill_cost import default_chunk, figures, measure_units
    from qwen36.probes.prefix_cache import ttft_modelled
    from qwen36.tt_ops.cost_model import CALIBRATED_LABEL

    chunk = default_chunk()
    m = ttft_modelled("ci", chunk, 256)
    cfg, base = build_config("ci", 4096)
    unit = measure_units("emulated-p150x2", cfg, "performance", 0, base.vocab_size, rows={chunk, 256})
    n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)
    assert m["label"] == CALIBRATED_LABEL and m["tokens_reused"] == chunk
    assert m["cold_ms"]["ms"] == round(figures(unit, n_gdn, n_attn, chunk + 256)["ms"], 1)
    rest = figures(unit, n_gdn, n_attn, 256, start=chunk)["ms"]
    assert m["restore_ms"]["ms"] > 0 and abs(m["warm_ms"]["ms"] - (rest + m["restore_ms"]["ms"])) <= 0.06
    assert m["cold_ms"]["ms_low"] <= m["cold_ms"]["ms"] <= m["cold_ms"]["ms_high"]
    assert m["warm_ms"]["ms"] < m["cold_ms"]["ms"]
    with pytest.raises(UserError, match="multiple of the KV page"):
        ttft_modelled("ci", 500, 256)

