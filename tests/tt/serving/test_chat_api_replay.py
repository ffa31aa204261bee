"""The OpenAI chat API feature table as the real server answered it, replayed without vLLM.

``tests/data/vllm_chat_api_trace.json.gz`` was recorded by ``scripts/chat_api_table.py`` (vLLM 0.25.1, the vllm-tt
plugin at e3fc849, the openai client against ``qwen36 serve --device emulated-p150x2`` serving the chat-ci
checkpoint; command in docs/serving.md): every row of ``qwen36.testing.chat_api.ROWS``, its request, the server's
response (streamed rows: the chunks and what they add up to) and the plugin calls it caused.

What CI checks from it:
- the prompt the server rendered for every answered row (its ``prompt_token_ids``) is ``qwen36.chat.render`` of the
  request tokenized, i.e. the tokenizer's chat template run by vLLM is the one this project ships: tools in the
  system turn, the tool-call turn and its tool result, thinking on and off; the unknown role's 400 is the template's
  own refusal;
- every response is the tokens the engine emitted: the reasoning or content is their text, a tool call is the
  ``<tool_call>`` block the tokens spell (``qwen36.chat.parse_tool_calls``; vLLM's parser gave the values their
  schema's JSON types);
- the plugin's calls replayed on the model class return the recorded argmax at every call; every token the engine
  fed back is the one the client received; where the engine picked by argmax alone (greedy, no grammar, no logit
  bias) each emitted token is the argmax of the replayed row; the logprobs the client received are the log-softmax
  of the replayed rows (vLLM's raw logprobs: the emitted token's and the top 3).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen36.chat import ChatFormatError, THINK_START, TOOL_RESPONSE_START, TOOLS_HEAD, parse_tool_calls, render
from qwen36.testing.chat_api import (CHAT_CHECKPOINT, ROWS, log_softmax_at, make_chat_checkpoint, message,
                                     prompt_failures, rendered_prompt, template_input)
from qwen36.testing.vllm_calls import feed_calls, load_trace, restore
from qwen36.testing.vllm_replay import load_on_mesh, served_model
from qwen36.tt_ops.device import open_mesh
from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION

TRACE = load_trace(Path(__file__).resolve().parents[2] / "data" / "vllm_chat_api_trace.json.gz")
ROW = {r["name"]: r for r in TRACE["rows"]}
ANSWERED = [r for r in TRACE["rows"] if r["status"] == 200]
# rows whose every token the engine picked by argmax of the model's row alone: greedy, no grammar, no logit bias,
# and the json_schema row with thinking on, whose grammar never started (vLLM applies it after </think>)
ARGMAX_ROWS = [r["name"] for r in ANSWERED if r["request"].get("temperature") == 0.0
               and not r["request"].get("logit_bias") and not r["request"].get("tool_choice")
               and (not r["request"].get("response_format") or r["name"] == "json_schema thinking on")
               and "structured_outputs" not in r["request"]["extra_body"]]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from qwen36 import DEFAULT_CHECKPOINT

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))  # chat-ci carries the embedded tokenizer


def test_the_recording_is_the_table():
    """The recording holds today's rows (each request is what ``ROWS`` builds now) and each recorded answer still
    shows what its row expects."""
    assert TRACE["checkpoint"] == CHAT_CHECKPOINT and TRACE["vllm"].startswith("0.25.1")
    assert [r["name"] for r in TRACE["rows"]] == [r.name for r in ROWS]
    results = {}
    for row, rec in zip(ROWS, TRACE["rows"]):
        assert rec["request"] == json.loads(json.dumps(row.build(results))), row.name
        results[row.name] = rec["response"]
        assert rec["status"] == row.status and row.expect(rec["response"], results) == [], row.name
    assert set(ARGMAX_ROWS) == {"chat", "stream", "reasoning off", "tools auto", "tool result",
                                "json_schema thinking on", "logprobs", "stop", "max_tokens", "still serving"}


def test_the_server_rendered_the_shipped_template(tok):
    for r in ANSWERED:
        assert prompt_failures(tok, r["request"], r["response"]) == [], r["name"]
    prompt = {r["name"]: rendered_prompt(r["request"]) for r in ANSWERED}
    assert prompt["tools auto"].startswith("<|im_start|>system\n" + TOOLS_HEAD)  # tools reach the model
    assert "get_weather" in prompt["tools auto"] and "get_time" in prompt["tools auto"]
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt["tool result"]
    assert "<|im_start|>user\n" + TOOL_RESPONSE_START + "\n22 C and sunny\n</tool_response><|im_end|>" in prompt[
        "tool result"]
    assert prompt["chat"].endswith("<|im_start|>assistant\n" + THINK_START + "\n")
    assert prompt["reasoning off"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the unknown role: the server's 400 is the template's own refusal
    bad = ROW["unknown role"]
    with pytest.raises(ChatFormatError) as e:
        render(*template_input(bad["request"])[:2])
    assert str(e.value) in bad["response"]["message"]


def test_responses_are_the_emitted_tokens(tok):
    for r in ANSWERED:
        for i, ch in enumerate(r["response"]["choices"]):
            m, ids = message(r["response"], i), ch["token_ids"]
            text = tok.decode(ids, skip_special_tokens=True)
            if m.get("tool_calls"):
                _, calls = parse_tool_calls(text)
                got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
                want = [(c["name"], c["arguments"]) for c in calls]
                assert [(n, {k: str(v) for k, v in a.items()}) for n, a in got] == want, r["name"]
            elif m.get("reasoning") is not None:
                assert m["reasoning"] == text and not m.get("content"), r["name"]
            else:
                stop = ch.get("stop_reason")
                assert m["content"] == (text[: text.index(stop)] if isinstance(stop, str) else text), r["name"]


@pytest.mark.slow  # the whole table's engine calls (the chat-ci model: tool prompts of 408 tokens, ~390 calls)
def test_replay_of_the_servers_calls(tmp_path_factory):
    ck = make_chat_checkpoint(tmp_path_factory.mktemp("chat_api") / CHAT_CHECKPOINT)
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    ctx.models = []
    try:
        m = served_model(ck, ctx, TRACE["max_num_seqs"], TRACE["max_model_len"])
        a = m.model.args
        assert {f: getattr(a, f) for f in TRACE["model_args"]} == TRACE["model_args"]
        rows = {}  # call index -> the last-position logits rows the replayed prefill returned
        for i, c, args, out in feed_calls(m, TRACE["calls"]):
            if c["call"] != "prefill_forward":
                continue
            res = out[0] if isinstance(out, tuple) else out
            assert res[:, -1].argmax(-1).tolist() == c["returned"]["tokens"], i
            rows[i] = res[:, -1].float().clone()
        m.release_persistent_capture()
    finally:
        ctx.close()

    for r in ANSWERED:
        prompt = r["response"]["prompt_token_ids"]
        emitted = [ch["token_ids"] for ch in r["response"]["choices"]]
        steps: dict[tuple[int, int], torch.Tensor] = {}  # (choice, tokens emitted before) -> the row that picked
        for i in range(*r["calls"]):
            c = TRACE["calls"][i]
            if c["call"] != "prefill_forward":
                continue
            tokens, lens = restore(c["args"]["tokens"]), restore(c["args"]["prompt_lens"])
            for b in range(tokens.shape[0]):
                seq = tokens[b, : int(lens[b])].tolist()
                assert seq[: len(prompt)] == prompt, (r["name"], i)
                fed = seq[len(prompt):]
                # the choice this row continues (choices sharing the prefix take the rows in turn); a row may
                # continue a whole choice: its pick completed a stop string, which vLLM leaves out of the answer
                choice = next(j for j, e in enumerate(emitted)
                              if e[: len(fed)] == fed and (j, len(fed)) not in steps)
                steps[choice, len(fed)] = rows[i][b]
        for j, e in enumerate(emitted):  # a row for every emitted token: the engine fed back what the client got
            assert all((j, k) in steps for k in range(len(e))), r["name"]
        if r["name"] in ARGMAX_ROWS:
            assert all(int(steps[j, k].argmax()) == t for j, e in enumerate(emitted) for k, t in enumerate(e)), \
                r["name"]
    lp = ROW["logprobs"]
    content = lp["response"]["choices"][0]["logprobs"]["content"]
    for k, (t, entry) in enumerate(zip(lp["response"]["choices"][0]["token_ids"], content)):
        row = _row_of(lp, k, rows)
        assert abs(entry["logprob"] - log_softmax_at(row, t)) < 1e-4
        top = torch.log_softmax(row.double(), -1).topk(3).values.tolist()
        assert max(abs(x["logprob"] - y) for x, y in zip(entry["top_logprobs"], top)) < 1e-4


def _row_of(rec: dict, k: int, rows: dict) -> torch.Tensor:
    """The replayed logits row that picked the k-th token of ``rec``'s only choice."""
    prompt = rec["response"]["prompt_token_ids"]
    for i in range(*rec["calls"]):
        c = TRACE["calls"][i]
        if c["call"] == "prefill_forward" and int(restore(c["args"]["prompt_lens"])[0]) == len(prompt) + k:
            return rows[i][0]
    raise AssertionError(f"no call picked token {k}")
