"""Qwen3.6's chat format (``qwen36.chat``) through the embedded default checkpoint's tokenizer and transformers'
``apply_chat_template``: the published turn layout, thinking on / off, reasoning kept only after the last user
message (or with preserve_thinking), the history prefix the next turn repeats, turn parsing."""
from __future__ import annotations

from pathlib import Path

import pytest

from qwen36.chat import (STOP_THINKING_PHRASE, THINK_END, THINK_START, ChatFormatError, check_chat_tokenizer,
                         history_ids, parse_turn, prompt_ids, validate_messages)

CKPT = Path(__file__).resolve().parents[1] / "models" / "qwen36" / "default_checkpoint"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(CKPT))


CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "    return x", "reasoning_content": "a function"},
        {"role": "user", "content": "import os"}]


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_published_layout(tok):
    check_chat_tokenizer(tok)
    text = render(tok, CONV, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef f(x):<|im_end|>\n"
                    "<|im_start|>assistant\n    return x<|im_end|>\n<|im_start|>user\nimport os<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")  # earlier reasoning dropped; thinking opened
    off = render(tok, CONV, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    kept = render(tok, CONV, add_generation_prompt=True, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\na function\n</think>\n\n    return x<|im_end|>\n" in kept
    # the last assistant turn (after the last user message) keeps its reasoning; from content with </think> too
    last = render(tok, CONV[:2] + [{"role": "assistant", "content": "<think>\nwhy\n</think>\n\nok"}])
    assert last.endswith("<|im_start|>assistant\n<think>\nwhy\n</think>\n\nok<|im_end|>\n")
    ids = prompt_ids(tok, CONV)
    assert ids[-2:] == [tok.convert_tokens_to_ids(THINK_START), tok.encode("\n")[0]]
    assert tok.decode(ids) == text


def test_markers_and_phrase_are_tokens(tok):
    start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
    assert (start, end) == (4094, 4095)
    phrase = tok.encode(STOP_THINKING_PHRASE)
    assert end in phrase and start not in phrase and tok.decode(phrase) == STOP_THINKING_PHRASE
    assert tok.decode(tok.encode("x.iterator(comparison)")) == "x.iterator(comparison)"  # the freed merges still encode


def test_history_prefix_is_the_next_prompts_prefix(tok):
    for preserve in (False, True):
        turn1 = CONV[:3]
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


def test_bad_conversations_and_tokenizers(tok, ci_ckpt):
    with pytest.raises(ChatFormatError, match="role"):
        validate_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatFormatError, match="first"):
        validate_messages([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    from transformers import AutoTokenizer

    with pytest.raises(ChatFormatError, match="no single token"):
        check_chat_tokenizer(AutoTokenizer.from_pretrained(str(ci_ckpt)))
