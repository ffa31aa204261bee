#!/usr/bin/env python3
"""Build the prompt set the draft-depth policy is fitted and evaluated on (qwen36/speculative/depth_prompts.json).

Prompts come only from the stdlib files the default checkpoint held out of training (scripts/train_tiny.py's
path-hash split), in five classes that accept drafts very differently:

    code-repetitive  the prompt ends inside a run of look-alike lines (tables, chains of assignments/calls)
    code-fresh       the prompt ends at the start of a function body
    prose            the prompt ends inside a docstring, after its first few words
    short            the first few tokens of a def/class line (6 tokens)
    long             a 256-token window ending at a line start

Within each class, prompts alternate between the "fit" and "eval" splits, so the policy is evaluated on prompts it
was not fitted on. The file is committed: the set must not change with the Python that runs the fit.

    python scripts/make_depth_prompts.py [--per-class 24] [--out models/qwen36/speculative/depth_prompts.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

from qwen36.commands.common import DEFAULT_CHECKPOINT
from qwen36.io_utils import atomic_write_json
from qwen36.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "models" / "qwen36" / "speculative" / "depth_prompts.json"
PROMPT_TOKENS = 64
LONG_TOKENS = 256
SHORT_TOKENS = 6


def _train_tiny():
    spec = importlib.util.spec_from_file_location("qwen36_script_train_tiny", HERE / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def heldout_texts() -> list[tuple[str, str]]:
    tt = _train_tiny()
    root = tt.stdlib_root()
    rels = [r for r in tt.list_corpus(root) if tt.is_val(r)]
    texts, _ = tt.read_corpus(root, rels)
    return list(zip(rels, texts))


def _repetitive_ends(lines: list[str]) -> list[int]:
    """Line indices inside runs of >= 6 consecutive lines sharing their first 8 non-blank characters' shape."""
    shape = [re.sub(r"[A-Za-z0-9_]", "a", ln.strip())[:8] if ln.strip() else "" for ln in lines]
    ends, run = [], 1
    for i in range(1, len(lines)):
        run = run + 1 if shape[i] and shape[i] == shape[i - 1] else 1
        if run == 4:  # three look-alike lines seen; the continuation keeps the pattern
            ends.append(i)
    return ends


def spaced(items: list[int], n: int) -> list[int]:
    """Up to n items spread evenly over the list (not the first n: prompts from all over a file)."""
    if len(items) <= n:
        return items
    return [items[round(j * (len(items) - 1) / (n - 1))] for j in range(n)] if n > 1 else items[:1]


def build(per_class: int) -> dict:
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    enc = lambda s: tok.encode(s)  # noqa: E731
    found: dict[str, list[dict]] = {c: [] for c in ("code-repetitive", "code-fresh", "prose", "short", "long")}

    def add(cls: str, rel: str, text_before: str, n_tokens: int) -> None:
        if len(found[cls]) >= per_class:
            return
        ids = enc(text_before)
        if len(ids) < n_tokens:
            return
        found[cls].append({"class": cls, "source": rel, "ids": ids[-n_tokens:]})

    for rel, text in heldout_texts():
        lines = text.splitlines(keepends=True)
        offs = [0]
        for ln in lines:
            offs.append(offs[-1] + len(ln))
        for i in spaced(_repetitive_ends(lines), 4):
            add("code-repetitive", rel, text[: offs[i + 1]], PROMPT_TOKENS)
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        for i in spaced(defs[1:], 3):
            add("code-fresh", rel, text[: offs[i + 1]], PROMPT_TOKENS)
            add("short", rel, lines[i].lstrip(), SHORT_TOKENS)
        docs = [i for i, ln in enumerate(lines) if re.match(r'\s*"""[A-Z][a-z]+ \w+', ln) and not ln.rstrip().endswith('"""')]
        for i in spaced(docs, 6):
            words = lines[i].split()
            head = " ".join(words[:3])
            add("prose", rel, text[: offs[i]] + lines[i][: lines[i].index(words[0])] + head, PROMPT_TOKENS)
        if len(lines) > 120:
            for frac in (2, 3):
                add("long", rel, text[: offs[len(lines) * (frac - 1) // frac]], LONG_TOKENS)
    prompts = []
    for cls, items in found.items():
        if len(items) < per_class:
            raise SystemExit(f"error: only {len(items)} held-out prompts of class {cls!r} (wanted {per_class})")
        for j, item in enumerate(items):
            prompts.append({**item, "split": "fit" if j % 2 == 0 else "eval"})
    return {"about": "draft-depth policy prompts from the default checkpoint's held-out stdlib files "
                     "(scripts/make_depth_prompts.py); token ids of the default checkpoint's tokenizer",
            "prompt_tokens": {"default": PROMPT_TOKENS, "long": LONG_TOKENS, "short": SHORT_TOKENS},
            "prompts": prompts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=24)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    data = build(args.per_class)
    atomic_write_json(args.out, data)
    print(f"wrote {len(data['prompts'])} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
