"""Qwen3.6's chat format: the template (used through the tokenizer's own ``apply_chat_template``, and by vLLM), the
same layout as a Python function (``render``: the template's specification, and the test's second implementation),
the chat markers, the stop-thinking phrase, and the pieces a multi-turn loop needs (turn parsing, the history prefix
the next turn will repeat).

The format, as Qwen3.5 / Qwen3.6 publish it (written here from that description, not copied):
* every turn is ``<|im_start|>{role}\\n{text}<|im_end|>\\n``, the text trimmed of surrounding whitespace; a message's
  content is a string or a list of text parts (concatenated); a system message may only come first;
* with ``tools`` the system turn opens with the tool list: ``# Tools``, then ``<tools>``, one JSON object per tool
  per line (``tojson``), ``</tools>``, then how to call one (instruction sentences in our own words: the tiny model
  was trained on neither), then the system message's text after a blank line when there is one;
* a tool call, in an assistant turn after its text (a blank line between them when the text is not empty; calls
  separated by a newline)::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE            (a string as is, anything else as JSON)
      </parameter>
      </function>
      </tool_call>

* consecutive ``tool`` messages are ONE user turn: ``<|im_start|>user``, then per message
  ``\\n<tool_response>\\n{text}\\n</tool_response>``, then ``<|im_end|>\\n``; a tool message must follow an assistant
  (or another tool) message;
* the generation prompt opens the assistant turn *and* its thinking block: ``<|im_start|>assistant\\n<think>\\n``,
  so the model's output starts inside the thinking and only ``</think>`` appears in it; with thinking disabled
  (``enable_thinking`` false) the prompt carries an empty block, ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``;
* an assistant turn after the last user query (a user message that is not only tool responses), or every assistant
  turn with ``preserve_thinking``, is rendered ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, with an empty block
  when it has no reasoning; earlier turns keep the answer alone (their reasoning is dropped from the history);
* the reasoning of an assistant message is its ``reasoning_content`` field, else the part of its content before
  ``</think>``;
* a conversation needs a user query.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import UserError

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# the markers a chat tokenizer holds as single tokens (added tokens, not special: decoding keeps them)
MARKERS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
ROLES = ("system", "user", "assistant", "tool")

# Qwen3 technical report, section 4.3 (thinking budget): inserted when the thinking reaches the budget.
STOP_THINKING_PHRASE = ("Considering the limited time by the user, I have to give the solution based on the thinking "
                        "directly now.\n</think>.\n\n")

# The system turn's tool section around the tool list (one JSON object per line between the two).
TOOLS_HEAD = "# Tools\n\nYou have access to these functions:\n\n<tools>"
TOOLS_TAIL = (
    "\n</tools>\n\n"
    "To call a function, reply with the call in exactly this layout and nothing after it:\n\n"
    "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n"
    "<parameter=ANOTHER_PARAMETER>\na value may span\nseveral lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "Rules:\n"
    "- the <function=...></function> block goes inside <tool_call></tool_call>\n"
    "- give every required parameter\n"
    "- reasoning about a call comes before it, never after it\n"
    "- when no function fits, answer normally and do not mention the functions")

_BAD_PART = "a {role} message has a content part without text: this model reads text only"
_BAD_CONTENT = "a {role} message's content must be a string or a list of text parts"
_BAD_ARGUMENTS = "tool call arguments must be a JSON object"
_NO_QUERY = "the conversation has no user message"
_SYSTEM_FIRST = "a system message must come first"
_TOOL_AFTER = "a tool message must follow an assistant message or another tool message"
_BAD_ROLE = "unsupported role {role}: this template knows system, user, assistant and tool"


def _jinja(s: str) -> str:
    """A Python string as a single-quoted Jinja string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


_TEMPLATE_BODY = """\
{%- set think_on = not (enable_thinking is defined and enable_thinking is false) -%}
{%- set keep_all = preserve_thinking is defined and preserve_thinking is true -%}
{%- macro text_of(content, role) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is none or content is undefined -%}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is mapping and 'text' in part -%}
        {{- part.text -}}
      {%- else -%}
        {{- raise_exception(BAD_PART.replace('{role}', role)) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- else -%}
    {{- raise_exception(BAD_CONTENT.replace('{role}', role)) -}}
  {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception(NO_QUERY) -}}{%- endif -%}
{%- set first_system = messages[0].role == 'system' -%}
{%- if tools and tools is iterable and tools is not mapping -%}
  {{- '<|im_start|>system\\n' + TOOLS_HEAD -}}
  {%- for tool in tools -%}{{- '\\n' + tool|tojson -}}{%- endfor -%}
  {{- TOOLS_TAIL -}}
  {%- if first_system -%}
    {%- set sys_text = text_of(messages[0].content, 'system')|trim -%}
    {%- if sys_text -%}{{- '\\n\\n' + sys_text -}}{%- endif -%}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- elif first_system -%}
  {{- '<|im_start|>system\\n' + text_of(messages[0].content, 'system')|trim + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {%- set t = text_of(m.content, 'user')|trim -%}
    {%- if not (t.startswith('<tool_response>') and t.endswith('</tool_response>')) -%}
      {%- set ns.last_query = loop.index0 -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.last_query < 0 -%}{{- raise_exception(NO_QUERY) -}}{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first -%}{{- raise_exception(SYSTEM_FIRST) -}}{%- endif -%}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user\\n' + text_of(m.content, 'user')|trim + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set answer = text_of(m.content, 'assistant')|trim -%}
    {%- set thought = '' -%}
    {%- if m.reasoning_content is string -%}
      {%- set thought = m.reasoning_content -%}
    {%- elif '</think>' in answer -%}
      {%- set thought = answer.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
      {%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if keep_all or loop.index0 > ns.last_query -%}
      {{- '<think>\\n' + thought|trim + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- answer -}}
    {%- if m.tool_calls and m.tool_calls is iterable and m.tool_calls is not mapping -%}
      {%- for call in m.tool_calls -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {%- if not loop.first -%}{{- '\\n' -}}{%- elif answer|trim -%}{{- '\\n\\n' -}}{%- endif -%}
        {{- '<tool_call>\\n<function=' + fn.name + '>\\n' -}}
        {%- if fn.arguments is defined and fn.arguments is not none -%}
          {%- if fn.arguments is not mapping -%}{{- raise_exception(BAD_ARGUMENTS) -}}{%- endif -%}
          {%- for name, value in fn.arguments|items -%}
            {{- '<parameter=' + name + '>\\n' -}}
            {{- value if value is string else value|tojson -}}
            {{- '\\n</parameter>\\n' -}}
          {%- endfor -%}
        {%- endif -%}
        {{- '</function>\\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role not in ('assistant', 'tool') -%}{{- raise_exception(TOOL_AFTER) -}}{%- endif -%}
    {%- if loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + text_of(m.content, 'tool')|trim + '\\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- else -%}
    {{- raise_exception(BAD_ROLE.replace('{role}', m.role|string)) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n<think>\\n' -}}
  {%- if not think_on -%}{{- '\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""
# tokenizer_config.json carries the template as one string: the shared texts become Jinja variables at its top
CHAT_TEMPLATE = "".join("{%- set " + name + " = " + _jinja(text) + " -%}\n" for name, text in (
    ("TOOLS_HEAD", TOOLS_HEAD), ("TOOLS_TAIL", TOOLS_TAIL), ("BAD_PART", _BAD_PART), ("BAD_CONTENT", _BAD_CONTENT),
    ("BAD_ARGUMENTS", _BAD_ARGUMENTS), ("NO_QUERY", _NO_QUERY), ("SYSTEM_FIRST", _SYSTEM_FIRST),
    ("TOOL_AFTER", _TOOL_AFTER), ("BAD_ROLE", _BAD_ROLE))) + _TEMPLATE_BODY


class ChatFormatError(UserError, ValueError):
    """A conversation the chat format cannot render (bad roles, a tokenizer without the chat tokens)."""


# ---- the format as a Python function (must equal the template: tests/test_chat_template.py) ---------------------
def _text_of(content: Any, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if not isinstance(part, dict) or "text" not in part:
                raise ChatFormatError(_BAD_PART.format(role=role))
            out.append(str(part["text"]))
        return "".join(out)
    raise ChatFormatError(_BAD_CONTENT.format(role=role))


def _trim(s: str) -> str:
    return s.strip()  # Jinja's trim: Python's str.strip()


def _to_json(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)  # transformers' tojson filter


def _render_call(call: dict, first: bool, answer: str) -> str:
    fn = call["function"] if "function" in call else call
    sep = "" if first and not _trim(answer) else ("\n\n" if first else "\n")
    out = [sep, f"<tool_call>\n<function={fn['name']}>\n"]
    args = fn.get("arguments")
    if args is not None:
        if not isinstance(args, dict):
            raise ChatFormatError(_BAD_ARGUMENTS)
        for name, value in args.items():
            out.append(f"<parameter={name}>\n{value if isinstance(value, str) else _to_json(value)}\n</parameter>\n")
    out.append("</function>\n</tool_call>")
    return "".join(out)


def render(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False,
           enable_thinking: bool = True, preserve_thinking: bool = False) -> str:
    """The conversation as text, exactly as ``CHAT_TEMPLATE`` renders it (the docstring above states the format)."""
    if not messages:
        raise ChatFormatError(_NO_QUERY)
    out = []
    first_system = messages[0].get("role") == "system"
    if tools:
        out.append(IM_START + "system\n" + TOOLS_HEAD + "".join("\n" + _to_json(t) for t in tools) + TOOLS_TAIL)
        sys_text = _trim(_text_of(messages[0].get("content"), "system")) if first_system else ""
        out.append(("\n\n" + sys_text if sys_text else "") + IM_END + "\n")
    elif first_system:
        out.append(IM_START + "system\n" + _trim(_text_of(messages[0].get("content"), "system")) + IM_END + "\n")
    last_query = -1
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            t = _trim(_text_of(m.get("content"), "user"))
            if not (t.startswith(TOOL_RESPONSE_START) and t.endswith(TOOL_RESPONSE_END)):
                last_query = i
    if last_query < 0:
        raise ChatFormatError(_NO_QUERY)
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system":
            if i:
                raise ChatFormatError(_SYSTEM_FIRST)
        elif role == "user":
            out.append(IM_START + "user\n" + _trim(_text_of(m.get("content"), "user")) + IM_END + "\n")
        elif role == "assistant":
            answer, thought = _trim(_text_of(m.get("content"), "assistant")), ""
            if isinstance(m.get("reasoning_content"), str):
                thought = m["reasoning_content"]
            elif THINK_END in answer:
                thought = answer.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
                answer = answer.split(THINK_END)[-1].lstrip("\n")
            out.append(IM_START + "assistant\n")
            if preserve_thinking or i > last_query:
                out.append(f"{THINK_START}\n{_trim(thought)}\n{THINK_END}\n\n")
            out.append(answer)
            calls = m.get("tool_calls")
            if calls and isinstance(calls, (list, tuple)):
                out.extend(_render_call(c, j == 0, answer) for j, c in enumerate(calls))
            out.append(IM_END + "\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") not in ("assistant", "tool"):
                raise ChatFormatError(_TOOL_AFTER)
            if messages[i - 1].get("role") != "tool":
                out.append(IM_START + "user")
            out.append(f"\n{TOOL_RESPONSE_START}\n{_trim(_text_of(m.get('content'), 'tool'))}\n{TOOL_RESPONSE_END}")
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                out.append(IM_END + "\n")
        else:
            raise ChatFormatError(_BAD_ROLE.format(role=role))
    if add_generation_prompt:
        out.append(IM_START + "assistant\n" + THINK_START + "\n" + ("" if enable_thinking is not False
                                                                   else "\n" + THINK_END + "\n\n"))
    return "".join(out)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split an assistant answer (after any reasoning) into its text and its tool calls, the inverse of the layout
    above: ``(content, [{"name", "arguments": {param: value text}}])``. Parameter values stay text (the layout does
    not say a value's type; a server converts them with the tool's schema)."""
    calls, content = [], text
    if TOOL_CALL_START in text:
        content = text.split(TOOL_CALL_START)[0].rstrip("\n")
        for block in text.split(TOOL_CALL_START)[1:]:
            body = block.split(TOOL_CALL_END)[0].strip("\n")
            if not body.startswith("<function=") or ">" not in body:
                raise ChatFormatError(f"a tool call without <function=NAME>: {block[:60]!r}")
            name, rest = body[len("<function="):].split(">", 1)
            args = {}
            for piece in rest.split("<parameter=")[1:]:
                key, value = piece.split(">", 1)
                args[key] = value.split("</parameter>")[0].strip("\n")
            calls.append({"name": name, "arguments": args})
    return content, calls


def check_chat_tokenizer(tok) -> None:
    """The tokenizer must know the markers as single tokens and carry the template."""
    for t in (IM_START, IM_END, *MARKERS):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ChatFormatError(f"the tokenizer has no single token for {t!r}: it is not a chat tokenizer "
                                  "(the embedded default checkpoint's is; see docs/chat.md)")
    if not getattr(tok, "chat_template", None):
        raise ChatFormatError("the tokenizer carries no chat template (tokenizer_config.json 'chat_template')")


def validate_messages(messages: Any) -> list[dict]:
    """A conversation from a file, checked before rendering: a one-line error naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), (str, list)):
            raise ChatFormatError(f"message {i}: needs a role of {' / '.join(ROLES)} and a string content, got {m!r}")
    try:
        render(messages)
    except ChatFormatError as e:
        raise ChatFormatError(f"messages: {e}") from None
    return messages


def prompt_ids(tok, messages: Sequence[dict], enable_thinking: bool = True, preserve_thinking: bool = False,
               tools: Sequence[dict] | None = None) -> list[int]:
    """The token ids of the conversation plus the generation prompt, through the tokenizer's chat template."""
    out = tok.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=True,
                                  add_generation_prompt=True, enable_thinking=enable_thinking,
                                  preserve_thinking=preserve_thinking)
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
