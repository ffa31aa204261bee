"""The OpenAI chat API feature table (docs/serving.md, "The chat API"): the checkpoint it is served from, one request
per row, what each row's response must show, and the checks a recording of the rows must pass when replayed
against the model class without vLLM.

``scripts/chat_api_table.py`` drives the rows with the ``openai`` client against ``qwen36 serve`` and records each
row's request, response and the plugin calls it caused (``tests/data/vllm_chat_api_trace.json.gz``);
``tests/tt/serving/test_chat_api_replay.py`` replays that recording in CI, and
``tests/tt/serving/test_chat_api_dev.py`` runs the table live.

A row's request is the keyword arguments of ``client.chat.completions.create`` (vLLM's own fields under
``extra_body``); every 200 row asks for ``return_token_ids`` so that the response carries the prompt the server
rendered and the tokens it emitted. A row may depend on an earlier row's response (``stop`` cuts the answer the
``reasoning off`` row received).
"""
from __future__ import annotations

import functools
import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .. import DEFAULT_CHECKPOINT
from ..chat import render

# ---- the checkpoint ------------------------------------------------------------------------------------------------
# The CI config's shapes (fast on the emulated mesh) with the embedded checkpoint's vocabulary and tokenizer, which
# carries the chat format: prompts render and tokenize exactly as for the embedded model, at a fraction of its step
# time. Random weights: the answers are noise, every mechanism around them is real.
CHAT_CHECKPOINT = "chat-ci"


def make_chat_checkpoint(out_dir: str | Path) -> Path:
    from ..tiny import PRESETS, random_weights, write_checkpoint

    import torch

    cfg = replace(PRESETS["ci"], vocab_size=4096)
    out = write_checkpoint(out_dir, cfg, random_weights(cfg, seed=0, dtype=torch.bfloat16), tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEFAULT_CHECKPOINT / name, out / name)
    return out


# ---- the rows ------------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CODE = [{"role": "user", "content": "def add(a, b):"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "enum": ["Ada", "Alan"]},
                                           "age": {"type": "integer", "enum": [36, 41]}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["yes", "no", "maybe"]
# tool_choice auto: a call the model writes itself, forced by a regex over the answer (the parser then finds it in
# generated text, as it would a call the model chose)
FORCED_CALL = r"<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n</function>\n</tool_call>"


@functools.cache
def no_whitespace_bias() -> dict[str, int]:
    """``logit_bias`` against the embedded tokenizer's whitespace-only tokens: -100, and -50 for the newline token.
    The tool call grammar vLLM 0.25.1 builds (xgrammar's ``qwen_xml`` parameters, no ``max_whitespace_cnt``) allows
    any whitespace around a call's parameters and before its closing tags, and an untrained model fills it until
    ``max_tokens`` (the embedded model and the chat-ci one both do). With the bias the model leaves whitespace
    whenever the grammar allows anything else, and where it must write whitespace (the layout's newlines) the newline
    alone is the least penalised: the call comes out in the canonical layout and completes. The grammar matches the
    markers as text, so a model that never saw the ``<tool_call>`` token (the embedded one) spells them out in
    several tokens: a call takes it about 75 tokens, the chat-ci model 40, hence 96 for the tool rows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    return {str(i): -50 if tok.decode([i]) == "\n" else -100
            for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()}


def _body(max_tokens: int, extra: dict | None = None, **kw) -> dict:
    return dict(model="qwen36", temperature=0.0, max_tokens=max_tokens,
                extra_body={"return_token_ids": True, **(extra or {})}, **kw)


def _tool_turn() -> list[dict]:
    return ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "22 C and sunny"}]


@dataclass
class Row:
    """One feature: its request (``build(answers so far by row name)`` -> ``create`` kwargs), and what its answer
    must show (``expect(answer, answers so far)`` -> the failures, one sentence each; none when it holds)."""
    name: str
    feature: str
    build: Callable[[dict], dict]
    expect: Callable[[dict, dict], list[str]]
    status: int = 200
    stream: bool = False
    plumbing: str = ""  # why the row shows the plumbing and not the model's own choice ("" = the feature itself)


def message(resp: dict, i: int = 0) -> dict:
    return resp["choices"][i]["message"]


def _fails(*checks: tuple[bool, str]) -> list[str]:
    return [what for ok, what in checks if not ok]


def _calls(resp: dict) -> list[tuple[str, dict | str]]:
    """(name, arguments) of each call; arguments that are not a JSON object stay text (a call cut off mid-value)."""
    out = []
    for c in message(resp).get("tool_calls") or []:
        try:
            out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
        except ValueError:
            out.append((c["function"]["name"], c["function"]["arguments"]))
    return out


def _valid_call(name: str, args: dict | str) -> bool:
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == name), None)
    if tool is None or not isinstance(args, dict):
        return False
    props, req = tool["parameters"]["properties"], tool["parameters"]["required"]
    return set(req) <= set(args) and all(k in props and v in props[k]["enum"] for k, v in args.items())


def _expect_chat(resp, _):
    m = message(resp)
    return _fails((bool(m.get("reasoning")) and not m.get("content"),
                   "thinking on: the whole answer is reasoning (this model never writes </think>)"),
                  (resp["choices"][0]["finish_reason"] == "length", "finish_reason length"))


def _expect_stream(resp, results):
    want = message(results["chat"])
    return _fails((message(resp).get("reasoning") == want.get("reasoning"),
                   "the streamed reasoning equals the non-streamed answer to the same request"),
                  (resp.get("usage", {}).get("completion_tokens") == 8, "the final chunk's usage"))


def _expect_no_think(resp, _):
    m = message(resp)
    return _fails((bool(m.get("content")) and m.get("reasoning") is None, "thinking off: content, no reasoning"))


def _expect_auto(resp, _):
    m = message(resp)
    return _fails((not m.get("tool_calls") and bool(m.get("content")), "no call: the model answers in text"))


def _expect_required(resp, _):
    calls = _calls(resp)
    return _fails((len(calls) >= 1 and all(_valid_call(n, a) for n, a in calls),
                   "at least one call, each to a listed tool with arguments its schema allows"))


def _expect_named(resp, _):
    calls = _calls(resp)
    return _fails((len(calls) == 1 and calls[0][0] == "get_time" and _valid_call(*calls[0]),
                   "exactly one call, to get_time, with arguments its schema allows"))


def _expect_stream_required(resp, results):
    return _fails((_calls(resp) == _calls(results["tools required"]),
                   "the streamed call equals the non-streamed call of the same request"))


def _expect_forced_auto(resp, _):
    calls = _calls(resp)
    return _fails((len(calls) == 1 and calls[0][0] == "get_time" and _valid_call(*calls[0]),
                   "the call the answer holds is parsed into tool_calls"),
                  (not (message(resp).get("content") or "").strip(), "no call markup left in the content"))


def _expect_tool_result(resp, _):
    return _fails((bool(message(resp).get("content")), "an answer after the tool result"))


def _expect_json(resp, _):
    try:
        obj = json.loads(message(resp)["content"])
    except (TypeError, ValueError):
        return ["content is JSON"]
    return _fails((set(obj) == {"name", "age"} and obj["name"] in ("Ada", "Alan") and obj["age"] in (36, 41),
                   "content is valid against the schema"))


def _expect_json_thinking(resp, _):
    m = message(resp)
    return _fails((not m.get("content") and bool(m.get("reasoning")),
                   "the grammar waits for </think>: no content, the answer is all reasoning"))


def _expect_regex(resp, _):
    return _fails((re.fullmatch(DATE, message(resp).get("content") or "") is not None, "content matches the regex"))


def _expect_choice(resp, _):
    return _fails((message(resp).get("content") in CHOICES, "content is one of the choices"))


def _expect_logprobs(resp, _):
    lp = resp["choices"][0].get("logprobs") or {}
    content = lp.get("content") or []
    ok = len(content) == 6 and all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 and
                                   t["top_logprobs"][0]["logprob"] >= t["logprob"] - 1e-6 for t in content)
    return _fails((ok, "six tokens, each with its logprob and the top 3"))


def _expect_n(resp, _):
    ch = resp["choices"]
    return _fails((len(ch) == 2 and all(len(c["token_ids"]) == 6 for c in ch), "two choices of six tokens"))


def _stop_of(results: dict) -> str:
    """A stop string the greedy answer of the ``reasoning off`` row contains after its second character."""
    text = message(results["reasoning off"])["content"]
    return text[2:5] if len(text) >= 5 else text[-1]


def _expect_stop(resp, results):
    full, stop = message(results["reasoning off"])["content"], _stop_of(results)
    got = message(resp).get("content") or ""
    return _fails((resp["choices"][0]["finish_reason"] == "stop", "finish_reason stop"),
                  (got == full[: full.index(stop)], "the answer cut before the stop string"))


def _expect_max_tokens(resp, _):
    return _fails((resp["usage"]["completion_tokens"] == 3 and resp["choices"][0]["finish_reason"] == "length",
                   "three tokens, finish_reason length"))


def _expect_error(fragment: str):
    def check(resp, _):
        return _fails((fragment in json.dumps(resp), f"the error names the problem ({fragment!r})"))
    return check


def _expect_alive(resp, results):
    return _fails((message(resp).get("content") == message(results["reasoning off"])["content"],
                   "after the refusals the server answers as before"))


ROWS: list[Row] = [
    Row("chat", "chat", lambda r: _body(8, messages=CODE), _expect_chat),
    Row("stream", "chat, streamed", lambda r: _body(8, messages=CODE, stream_options={"include_usage": True}),
        _expect_stream, stream=True),
    Row("reasoning off", "reasoning off (chat_template_kwargs)", lambda r: _body(8, NO_THINK, messages=CODE),
        _expect_no_think),
    Row("tools auto", "tools, tool_choice auto", lambda r: _body(8, NO_THINK, messages=ASK, tools=TOOLS),
        _expect_auto, plumbing="the model does not choose to call a tool: the tool list reaches the prompt and the "
                               "parser runs on the answer"),
    Row("tools required", "tools, tool_choice required",
        lambda r: _body(96, NO_THINK, messages=ASK, tools=TOOLS, tool_choice="required",
                        logit_bias=no_whitespace_bias()), _expect_required),
    Row("tools named", "tools, tool_choice named",
        lambda r: _body(96, NO_THINK, messages=ASK, tools=TOOLS, logit_bias=no_whitespace_bias(),
                        tool_choice={"type": "function", "function": {"name": "get_time"}}), _expect_named),
    Row("tools required stream", "tools, tool_choice required, streamed",
        lambda r: _body(96, NO_THINK, messages=ASK, tools=TOOLS, tool_choice="required",
                        logit_bias=no_whitespace_bias()), _expect_stream_required, stream=True),
    Row("tools auto forced call", "tools, tool_choice auto, a call in the answer",
        lambda r: _body(96, {**NO_THINK, "structured_outputs": {"regex": FORCED_CALL}}, messages=ASK, tools=TOOLS),
        _expect_forced_auto, plumbing="the call is forced by a regex over the answer, not chosen by the model"),
    Row("tool result", "a tool-result turn", lambda r: _body(8, NO_THINK, messages=_tool_turn(), tools=TOOLS),
        _expect_tool_result),
    Row("json_schema", "response_format json_schema",
        lambda r: _body(24, NO_THINK, messages=CODE, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
        _expect_json),
    Row("json_schema thinking on", "response_format json_schema, thinking on",
        lambda r: _body(8, messages=CODE, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
        _expect_json_thinking, plumbing="vLLM applies the grammar after </think>; this model never closes its thinking"),
    Row("regex", "structured_outputs regex", lambda r: _body(16, {**NO_THINK, "structured_outputs": {"regex": DATE}},
                                                              messages=CODE), _expect_regex),
    Row("choice", "structured_outputs choice",
        lambda r: _body(8, {**NO_THINK, "structured_outputs": {"choice": CHOICES}}, messages=CODE), _expect_choice),
    Row("logprobs", "logprobs, top_logprobs 3", lambda r: _body(6, NO_THINK, messages=CODE, logprobs=True,
                                                                top_logprobs=3), _expect_logprobs),
    Row("n", "n = 2, sampled with a seed", lambda r: {**_body(6, NO_THINK, messages=CODE, n=2, seed=7),
                                                       "temperature": 0.8}, _expect_n),
    Row("stop", "stop", lambda r: _body(8, NO_THINK, messages=CODE, stop=[_stop_of(r)]), _expect_stop),
    Row("max_tokens", "max_tokens", lambda r: _body(3, NO_THINK, messages=CODE), _expect_max_tokens),
    Row("unknown role", "bad input: an unknown role",
        lambda r: _body(4, messages=[{"role": "critic", "content": "x"}] + CODE), _expect_error("unsupported role"),
        status=400),
    Row("rejected schema", "bad input: a schema the grammar backend rejects",
        lambda r: _body(4, NO_THINK, messages=CODE, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "(["}}}),
        _expect_error("regex parse error"), status=400),
    Row("still serving", "after the refusals", lambda r: _body(8, NO_THINK, messages=CODE), _expect_alive),
]


# ---- what the recorded prompt must be ------------------------------------------------------------------------------
def template_input(request: dict) -> tuple[list[dict], list[dict] | None, dict]:
    """The request as vLLM 0.25.1 hands it to the chat template: tool call arguments parsed from their JSON text,
    each tool as its ``ChatCompletionToolsParam`` dump (``strict`` left out when unset), the request's
    ``chat_template_kwargs`` and the generation prompt."""
    messages = json.loads(json.dumps(request["messages"]))
    for m in messages:
        for c in m.get("tool_calls") or []:
            if isinstance(c["function"].get("arguments"), str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    tools = None
    if request.get("tools"):
        tools = [{"type": "function", "function": {k: t["function"].get(k) for k in ("name", "description",
                                                                                      "parameters")}}
                 for t in request["tools"]]
    kwargs = dict(request.get("extra_body", {}).get("chat_template_kwargs", {}), add_generation_prompt=True)
    return messages, tools, kwargs


def rendered_prompt(request: dict) -> str:
    messages, tools, kwargs = template_input(request)
    return render(messages, tools, **kwargs)


def prompt_failures(tok, request: dict, response: dict) -> list[str]:
    """The prompt the server rendered (``prompt_token_ids``) must be ``qwen36.chat.render`` of the request, tokenized
    as vLLM tokenizes a rendered chat (no special tokens added)."""
    want = tok.encode(rendered_prompt(request), add_special_tokens=False)
    got = response.get("prompt_token_ids")
    return [] if got == want else [f"the server's prompt ({len(got or [])} tokens) is not qwen36.chat.render's "
                                   f"({len(want)} tokens)"]


def log_softmax_at(row, token: int) -> float:
    """log p(token) of an fp32 logits row, in fp64."""
    r = row.double()
    return float(r[token] - (r - r.max()).exp().sum().log() - r.max())


