"""Mesh graph descriptors shipped with the project (``TT_MESH_GRAPH_DESC_PATH`` for opening cards).

``read_textproto`` parses the small protobuf text-format subset these files use (nested messages,
scalars, ``[ ... ]`` lists, ``#`` comments) so tests can check a descriptor without the protobuf package;
tt-metal parses the real thing with its own schema when the mesh opens.
"""

from __future__ import annotations

import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent
P150X2_ONE_CABLE = HERE / "p150x2_one_cable.textproto"

_TOKEN = re.compile(r'\s*(?:(#[^\n]*)|("(?:[^"\\]|\\.)*")|([{}\[\]:,])|([^\s{}\[\]:,#"]+))')


def _tokens(text: str):
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip():
                raise ValueError(f"cannot parse textproto at offset {pos}: {text[pos:pos + 20]!r}")
            return
        pos = m.end()
        if m.group(1):
            continue
        tok = m.group(2) or m.group(3) or m.group(4)
        if tok:
            yield tok


def _scalar(tok: str):
    if tok.startswith('"'):
        return tok[1:-1]
    try:
        return int(tok)
    except ValueError:
        return tok  # enum names (BLACKHOLE, RELAXED)


def read_textproto(path) -> dict:
    """-> {field: [values]} (every field a list: text format allows repeats); messages are dicts."""
    toks = list(_tokens(pathlib.Path(path).read_text()))
    i = 0

    def message(end):
        nonlocal i
        out: dict = {}
        while i < len(toks) and toks[i] != end:
            name = toks[i]
            i += 1
            if toks[i] == ":":
                i += 1
            if toks[i] == "{":
                i += 1
                val = message("}")
                i += 1
            elif toks[i] == "[":
                i += 1
                val = []
                while toks[i] != "]":
                    if toks[i] != ",":
                        val.append(_scalar(toks[i]))
                    i += 1
                i += 1
            else:
                val = _scalar(toks[i])
                i += 1
            out.setdefault(name, []).append(val)
        return out

    return message(None)
