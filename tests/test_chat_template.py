"""Qwen3.6's chat format (``qwen36.chat``) through the embedded default checkpoint's tokenizer and transformers'
``apply_chat_template``: the published turn layout, thinking on / off, reasoning kept only after the last user
query (or with preserve_thinking), tools in the system turn, tool calls on assistant turns, tool responses grouped
into one user turn; the Python ``render`` equals the template on fixed and random conversations; the markers are
single tokens at their declared ids; the history prefix the next turn repeats; turn and tool-call parsing."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from qwen36.chat import (CHAT_TEMPLATE, MARKERS, STOP_THINKING_PHRASE, THINK_END, THINK_START, TOOLS_HEAD,
                         TOOLS_TAIL, ChatFormatError, check_chat_tokenizer, history_ids, parse_tool_calls, parse_turn,
                         prompt_ids, render, validate_messages)

CKPT = Path(__file__).resolve().parents[1] / "models" / "qwen36" / "default_checkpoint"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(CKPT))


CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "    return x", "reasoning_content": "a function"},
        {"role": "user", "content": "import os"}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TOOL_CONV = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Weather in Paris and Rome?"},
             {"role": "assistant", "content": "I'll check.", "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
                 {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "22C"},
             {"role": "tool", "tool_call_id": "c2", "content": "18C"}]


def jinja(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_shipped_template_is_the_modules(tok):
    assert tok.chat_template == CHAT_TEMPLATE  # tokenizer_config.json carries qwen36.chat.CHAT_TEMPLATE
    check_chat_tokenizer(tok)


def test_published_layout(tok):
    text = jinja(tok, CONV, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef f(x):<|im_end|>\n"
                    "<|im_start|>assistant\nreturn x<|im_end|>\n<|im_start|>user\nimport os<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")  # text trimmed; earlier reasoning dropped; thinking opened
    off = jinja(tok, CONV, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    kept = jinja(tok, CONV, add_generation_prompt=True, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\na function\n</think>\n\nreturn x<|im_end|>\n" in kept
    # an assistant turn after the last user query keeps its reasoning (from content with </think> too), and gets an
    # empty block when it has none, as Qwen3.6's template renders it
    last = jinja(tok, CONV[:2] + [{"role": "assistant", "content": "<think>\nwhy\n</think>\n\nok"}])
    assert last.endswith("<|im_start|>assistant\n<think>\nwhy\n</think>\n\nok<|im_end|>\n")
    bare = jinja(tok, CONV[:2] + [{"role": "assistant", "content": "ok"}])
    assert bare.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>\n")
    ids = prompt_ids(tok, CONV)
    assert ids[-2:] == [tok.convert_tokens_to_ids(THINK_START), tok.encode("\n")[0]]
    assert tok.decode(ids) == text


def test_tools_layout(tok):
    """Tools in the system turn (one JSON object per line, then the system text), the assistant's text then its
    calls (string arguments as is, others as JSON), both tool results in ONE user turn; the tool turns do not move
    the last user query, so the assistant turn between them keeps its (empty) thinking block."""
    text = jinja(tok, TOOL_CONV, tools=[WEATHER], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\n" + TOOLS_HEAD + "\n" + json.dumps(WEATHER) + TOOLS_TAIL + "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nI'll check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert TOOLS_HEAD.startswith("# Tools\n") and TOOLS_HEAD.endswith("<tools>") and "\n</tools>" in TOOLS_TAIL
    # no system message: the tool section alone; a call without text starts right after the thinking block
    alone = jinja(tok, [TOOL_CONV[1], {"role": "assistant", "content": "", "tool_calls": TOOL_CONV[2]["tool_calls"][1:]}],
                  tools=[WEATHER])
    assert alone.startswith("<|im_start|>system\n# Tools") and TOOLS_TAIL + "<|im_end|>\n<|im_start|>user" in alone
    assert "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>" in alone
    ids = prompt_ids(tok, TOOL_CONV, tools=[WEATHER])
    ids = ids[ids.index(tok.convert_tokens_to_ids("<|im_end|>")):]  # after the system turn (its example has markers)
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert ids.count(tok.convert_tokens_to_ids(marker)) == 2, marker  # each marker is one token in the prompt


def test_markers_are_tokens_at_their_ids(tok):
    """Every marker is one added token at the id tokenizer.json declares for it (the tokenizers library numbers added
    tokens by their order in the file: a marker listed out of id order would silently move), the thinking markers
    where the model has always had them, the phrase encodes and decodes, the freed merges still encode."""
    declared = {t["content"]: t["id"] for t in json.loads((CKPT / "tokenizer.json").read_text())["added_tokens"]}
    for m in MARKERS:
        assert tok.encode(m, add_special_tokens=False) == [declared[m]], m
    assert [declared[m] for m in MARKERS] == [4094, 4095, 4090, 4091, 4092, 4093]
    start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
    phrase = tok.encode(STOP_THINKING_PHRASE)
    assert end in phrase and start not in phrase and tok.decode(phrase) == STOP_THINKING_PHRASE
    for freed in ("x.iterator(comparison)", " your List NaN Le"):
        assert tok.decode(tok.encode(freed)) == freed


def _random_conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    words = ["x", " pad ", "<think>a</think>b", "\n\nline\n", "", "{\"k\": 1}", "é ✓", "  two  words  "]

    def text():
        t = "".join(rng.choice(words) for _ in range(rng.randint(0, 3)))
        return [{"type": "text", "text": t[:2]}, {"type": "text", "text": t[2:]}] if rng.random() < 0.2 else t

    def call():
        args = {f"a{i}": rng.choice(["s", " v ", 3, 2.5, True, None, [1, "x"], {"n": {"m": [False]}}])
                for i in range(rng.randint(0, 3))}
        fn = {"name": rng.choice(["f", "get_weather"]), "arguments": args}
        return {"id": "c", "type": "function", "function": fn} if rng.random() < 0.8 else fn

    msgs: list[dict] = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 6)):
        msgs.append({"role": "user", "content": text()})
        if rng.random() < 0.8:
            a = {"role": "assistant", "content": text()}
            if rng.random() < 0.4:
                a["reasoning_content"] = rng.choice(["", "\nwhy\n", " because "])
            if rng.random() < 0.4:
                a["tool_calls"] = [call() for _ in range(rng.randint(1, 3))]
                msgs.append(a)
                msgs += [{"role": "tool", "content": text()} for _ in range(rng.randint(1, 3))]
            else:
                msgs.append(a)
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": None}}] if rng.random() < 0.5 else None
    return msgs, tools


def test_python_render_equals_the_template(tok):
    """``render`` (the format as Python) and the Jinja template through transformers agree byte for byte."""
    cases = [(CONV, None), (TOOL_CONV, [WEATHER]), (TOOL_CONV + [{"role": "user", "content": "ok"}], [WEATHER])]
    rng = random.Random(0)
    cases += [_random_conversation(rng) for _ in range(150)]
    for messages, tools in cases:
        for kw in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False},
                   {"preserve_thinking": True}):
            assert render(messages, tools, **kw) == jinja(tok, messages, tools=tools, **kw), (messages, tools, kw)


@pytest.mark.parametrize("messages,match", [
    ([{"role": "developer", "content": "x"}, {"role": "user", "content": "q"}], "unsupported role developer"),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "x"}], "must come first"),
    ([{"role": "system", "content": "x"}], "no user message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}], "must follow an assistant"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                         "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], "JSON object"),
])
def test_refusals_name_the_problem(tok, messages, match):
    """Both implementations refuse the same conversations with the same message (vLLM answers it as a 400)."""
    from jinja2.exceptions import TemplateError

    with pytest.raises(ChatFormatError, match=match):
        render(messages)
    with pytest.raises(TemplateError, match=match):
        jinja(tok, messages)


def test_history_prefix_is_the_next_prompts_prefix(tok):
    for preserve in (False, True):
        for turn1 in (CONV[:3], TOOL_CONV + [{"role": "assistant", "content": "Warm in both."}]):
            hist = history_ids(tok, turn1, preserve_thinking=preserve)
            nxt = prompt_ids(tok, turn1 + [{"role": "user", "content": "next question"}], preserve_thinking=preserve)
            assert nxt[: len(hist)] == hist and len(nxt) > len(hist)
            assert tok.decode(hist).endswith("<|im_end|>\n")


def test_parse_turn(tok):
    gen = tok.encode("step one\nstep two\n</think>\n\nthe answer<|im_end|>")
    t = parse_turn(tok, gen, thinking_open=True)
    assert (t.reasoning, t.answer) == ("step one\nstep two", "the answer")
    assert parse_turn(tok, tok.encode("still thinking"), True).answer == ""
    assert parse_turn(tok, tok.encode("plain<|im_end|>junk"), False).answer == "plain"


def test_parse_tool_calls_inverts_the_layout():
    text = render(TOOL_CONV[:3], [WEATHER]).split("</think>\n\n")[-1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(text)
    assert content == "I'll check."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}},
                     {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert parse_tool_calls("no calls") == ("no calls", [])
    with pytest.raises(ChatFormatError, match="without <function=NAME>"):
        parse_tool_calls("<tool_call>\n{\"name\": \"f\"}\n</tool_call>")


def test_bad_conversations_and_tokenizers(tok, ci_ckpt):
    with pytest.raises(ChatFormatError, match="role"):
        validate_messages([{"role": "function", "content": "x"}])
    with pytest.raises(ChatFormatError, match="first"):
        validate_messages([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    assert validate_messages(TOOL_CONV) == TOOL_CONV  # tool turns are a conversation the format renders
    from transformers import AutoTokenizer

    with pytest.raises(ChatFormatError, match="no single token"):
        check_chat_tokenizer(AutoTokenizer.from_pretrained(str(ci_ckpt)))
