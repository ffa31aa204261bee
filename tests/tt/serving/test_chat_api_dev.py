"""Dev-only: the chat format against vLLM 0.25.1's own parsers and grammar, and the chat API table live through
``qwen36 serve`` (skipped unless vLLM, the vllm-tt plugin and the openai client are installed; CI replays the
recorded table in tests/tt/serving/test_chat_api_replay.py).

- vLLM's ``qwen3_coder`` tool parser (the default of ``qwen36 serve``) reads the calls ``qwen36.chat.render`` writes,
  names, arguments (typed by the tool's schema) and the text before them; ``hermes`` (a JSON object inside
  ``<tool_call>``) leaves them in ``content`` as raw markup, which is why it is not the default;
- vLLM's ``qwen3`` reasoning parser splits an answer the template's layout at ``</think>``;
- the grammar vLLM builds for ``tool_choice`` required / named with ``qwen3_coder`` (xgrammar's builtin ``qwen_3_coder``
  structural tag) accepts the call ``render`` writes, and refuses a call to another tool or with a value outside
  the schema;
- ``qwen36 serve --spec-k`` with a plugin that has no speculative runner is refused before vLLM starts;
- the whole table (``scripts/chat_api_table.py``, about 10 minutes on the shared host): every row answers as
  ``qwen36.testing.chat_api.ROWS`` says, the prompts are the template's, and SIGINT stops the server cleanly.
"""
from __future__ import annotations

import importlib.util
import json
import random

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (dev-only check; see docs/serving.md)")
pytest.importorskip("vllm_tt_plugin", reason="the vllm-tt plugin is not installed (dev-only check)")

from qwen36 import DEFAULT_CHECKPOINT  # noqa: E402
from qwen36.chat import render  # noqa: E402
from qwen36.testing.chat_api import ASK, CLOCK, TOOLS, WEATHER  # noqa: E402
from qwen36.testing.cli import assert_one_line_error, run_cli  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


def request(**kw):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="qwen36", messages=ASK, tools=TOOLS, **kw)


def answer_of(calls: list[dict], text: str = "") -> str:
    """The assistant answer ``render`` writes for ``calls`` after ``text`` (thinking block and turn end removed)."""
    msgs = ASK + [{"role": "assistant", "content": text, "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    return render(msgs, TOOLS).split("</think>\n\n")[-1].rsplit("<|im_end|>", 1)[0]


def random_calls(rng: random.Random) -> list[tuple[str, dict]]:
    out = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            out.append(("get_weather", {"city": rng.choice(["Paris", "Rome", "Oslo"]),
                                        **({"unit": rng.choice(["C", "F"])} if rng.random() < 0.5 else {})}))
        else:
            out.append(("get_time", {"zone": rng.choice(["UTC", "CET"])}))
    return out


def test_qwen3_coder_reads_the_templates_calls_and_hermes_does_not(tok):
    from vllm.tool_parsers import ToolParserManager

    rng = random.Random(0)
    for _ in range(20):
        calls, text = random_calls(rng), rng.choice(["", "Let me check."])
        answer = answer_of(calls, text)
        req = request(tool_choice="auto")
        got = ToolParserManager.get_tool_parser("qwen3_coder")(tok, req.tools).extract_tool_calls(answer, req)
        assert got.tools_called and [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] \
            == calls, answer
        assert (got.content or "") == text
        hermes = ToolParserManager.get_tool_parser("hermes")(tok, req.tools).extract_tool_calls(answer, req)
        assert not hermes.tools_called and "<tool_call>" in hermes.content  # the markup left in the answer


def test_qwen3_reasoning_parser_splits_at_think_end(tok):
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)
    reasoning, content = parser.extract_reasoning("first\nsecond\n</think>\n\nthe answer", request())
    assert reasoning.strip() == "first\nsecond" and content.strip() == "the answer"


def test_the_tool_call_grammar_accepts_the_templates_calls():
    import xgrammar

    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

    def accepts(tool_choice, text: str) -> bool:
        req = request(tool_choice=tool_choice)
        tag = get_model_structural_tag("qwen_3_coder", req.tools, req.tool_choice, reasoning=False)
        grammar = xgrammar.Grammar.from_structural_tag(json.dumps(tag.model_dump()))
        return xgrammar.testing._is_grammar_accept_string(grammar, text)

    named = {"type": "function", "function": {"name": "get_time"}}
    assert accepts(named, answer_of([("get_time", {"zone": "UTC"})]))
    assert not accepts(named, answer_of([("get_weather", {"city": "Rome"})]))  # another tool
    assert not accepts(named, answer_of([("get_time", {"zone": "PST"})]))  # a value outside the enum
    rng = random.Random(1)
    for _ in range(10):
        assert accepts("required", answer_of(random_calls(rng)))
    assert not accepts("required", "no call at all")
    assert WEATHER in TOOLS and CLOCK in TOOLS


def test_a_speculative_launch_is_refused_without_a_speculative_runner(capsys):
    if importlib.util.find_spec("vllm_tt_plugin.spec_decode") is not None:
        pytest.skip("this plugin has a speculative runner")
    rc, err = run_cli(capsys, "serve", "--device", "emulated-p150x2", "--spec-k", "3")
    assert_one_line_error(rc, err, "no speculative runner")


@pytest.mark.slow
def test_the_table_live(tmp_path):
    pytest.importorskip("openai", reason="the openai client is not installed")
    from qwen36.testing.scripts import load_script

    assert load_script("chat_api_table").main(["--port", "8793", "--out", str(tmp_path / "t.json.gz")]) == 0
