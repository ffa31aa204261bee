"""Qwen3.6's chat format: the template (used through the tokenizer's own ``apply_chat_template``), the thinking
markers, the stop-thinking phrase, and the pieces a multi-turn loop needs (turn parsing, the history prefix the
next turn will repeat).

The format, as Qwen3.5 / Qwen3.6 publish it (written here from that description, not copied):
* every turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; roles system (first message only), user, assistant;
* the generation prompt opens the assistant turn *and* its thinking block: ``<|im_start|>assistant\\n<think>\\n``,
  so the model's output starts inside the thinking and only ``</think>`` appears in it; with thinking disabled the
  prompt carries an empty block, ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``, and the model answers at once;
* an earlier assistant turn is rendered as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}`` only when it comes after
  the last user message (or with ``preserve_thinking``); turns before the last user message keep the answer alone
  (their reasoning is dropped from the history, Qwen3.6's default);
* the reasoning of an assistant message is its ``reasoning_content`` field, else the part of its content before
  ``</think>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .errors import UserError

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_START, THINK_END = "<think>", "</think>"

# Qwen3 technical report, section 4.3 (thinking budget): inserted when the thinking reaches the budget.
STOP_THINKING_PHRASE = ("Considering the limited time by the user, I have to give the solution based on the thinking "
                        "directly now.\n</think>.\n\n")

CHAT_TEMPLATE = """\
{%- set think_on = enable_thinking if enable_thinking is defined else true -%}
{%- set keep_all = preserve_thinking if preserve_thinking is defined else false -%}
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- set text = m.content if m.content is string else '' -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first -%}{{- raise_exception('a system message must come first') -}}{%- endif -%}
    {{- '<|im_start|>system\\n' + text + '<|im_end|>\\n' -}}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set thought = '' -%}
    {%- set answer = text -%}
    {%- if m.reasoning_content is defined and m.reasoning_content is string -%}
      {%- set thought = m.reasoning_content -%}
    {%- elif '</think>' in text -%}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1] -%}
      {%- set answer = text.split('</think>')[-1] -%}
    {%- endif -%}
    {%- set thought = thought.strip('\\n') -%}
    {%- set answer = answer.lstrip('\\n') -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if thought and (keep_all or loop.index0 > state.last_user) -%}
      {{- '<think>\\n' + thought + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- answer + '<|im_end|>\\n' -}}
  {%- else -%}
    {{- raise_exception('unsupported role ' + m.role + ': this template knows system, user and assistant') -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n<think>\\n' -}}
  {%- if not think_on -%}{{- '\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


class ChatFormatError(UserError, ValueError):
    """A conversation the chat format cannot render (bad roles, a tokenizer without the chat tokens)."""


def check_chat_tokenizer(tok) -> None:
    """The tokenizer must know the markers as single tokens and carry the template."""
    for t in (IM_START, IM_END, THINK_START, THINK_END):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ChatFormatError(f"the tokenizer has no single token for {t!r}: it is not a chat tokenizer "
                                  "(the embedded default checkpoint's is; see docs/chat.md)")
    if not getattr(tok, "chat_template", None):
        raise ChatFormatError("the tokenizer carries no chat template (tokenizer_config.json 'chat_template')")



def validate_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content", ""), str):
            raise ChatFormatError(f"message {i}: needs a role of system / user / assistant and a string content, "
                                  f"got {m!r}")
        if m["role"] == "system" and i:
            raise ChatFormatError(f"message {i}: a system message must come first")
    return messages


def prompt_ids(tok, messages: Sequence[dict], enable_thinking: bool = True, preserve_thinking: bool = False) -> list[int]:
    """The token ids of the conversation plus the generation prompt, through the tokenizer's chat template."""
    out = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                  enable_thinking=enable_thinking, preserve_thinking=preserve_thinking)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def history_ids(tok, messages: Sequence[dict], preserve_thinking: bool = False) -> list[int]:
    """The tokens the next turn's prompt will start with, once the conversation ``messages`` (ending with an
    assistant turn) gets another user message: rendered with a placeholder user turn and cut before it. The
    template renders a turn depending only on where the last user message is, so this prefix is exactly the next
    prompt's (the test checks it). What a chat loop puts into the prefix cache between turns."""
    ids = tok.apply_chat_template(list(messages) + [{"role": "user", "content": ""}], tokenize=True,
                                  add_generation_prompt=False, preserve_thinking=preserve_thinking)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    start = tok.convert_tokens_to_ids(IM_START)
    return ids[: len(ids) - ids[::-1].index(start) - 1]


@dataclass
class Turn:
    reasoning: str
    answer: str

    def message(self) -> dict:
        return {"role": "assistant", "content": self.answer, "reasoning_content": self.reasoning}


def parse_turn(tok, generated: Sequence[int], thinking_open: bool) -> Turn:
    """Split one generated assistant turn into reasoning and answer. ``thinking_open``: the prompt ended inside a
    thinking block (the generation prompt with thinking enabled)."""
    text = tok.decode(list(generated), skip_special_tokens=False)
    for stop in (IM_END, EOS):
        text = text.split(stop)[0]
    if THINK_END in text:
        thought, answer = text.split(THINK_END, 1)
        return Turn(thought.split(THINK_START)[-1].strip("\n"), answer.lstrip("\n"))
    if thinking_open:  # never closed (cut by the token limit): all of it is reasoning
        return Turn(text.strip("\n"), "")
    return Turn("", text)
