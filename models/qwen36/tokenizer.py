"""Byte-level BPE tokenizers for project-made checkpoints (trained with the `tokenizers` library) and glue
to load any checkpoint's tokenizer through ``transformers.AutoTokenizer``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from .chat import CHAT_TEMPLATE, MARKERS, check_chat_tokenizer
from .errors import UserError
from .io_utils import atomic_write_json, atomic_write_text

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]

# A fixed corpus for random-weight test checkpoints: the tokenizer must not change when code changes.
_FIXED_CORPUS = """\
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with a small head
and verifies them with one forward pass of the target model; accepted tokens are committed, the rest are
discarded. Gated DeltaNet layers keep a recurrent state per head, attention layers keep a key/value cache.
import os, sys, json
for key, value in sorted(config.items()):
    print(f"{key} = {value!r}")
if __name__ == "__main__":
    main()
"""


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer (deterministic for the same texts and settings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out_dir: str | Path, model_max_length: int = 32768) -> int:
    """Write tokenizer.json + tokenizer_config.json loadable by AutoTokenizer. Returns the EOS id."""
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "tokenizer.json", tok.to_str())
    eos_id = tok.token_to_id(EOS_TOKEN)
    atomic_write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    })
    return eos_id


def make_fixed_tokenizer(out_dir: str | Path, vocab_size: int) -> int:
    """The tokenizer of random-weight tiny checkpoints. Returns the EOS id."""
    tok = train_bpe([_FIXED_CORPUS] * 4, vocab_size=vocab_size, min_frequency=1)
    return save_hf_tokenizer(tok, out_dir)


def add_chat_format(checkpoint_dir: str | Path) -> list[int]:
    """Give a project-made tokenizer Qwen3.6's chat format: the markers (``qwen36.chat.MARKERS``: the thinking block's
    and the tool call / tool response delimiters) as single added tokens, not special (decoding keeps them, as in
    Qwen's tokenizers), and the chat template (``qwen36.chat.CHAT_TEMPLATE``) in tokenizer_config.json. The model's
    vocabulary is full (its embedding has one row per id), so each missing marker takes the id of one of the last BPE
    merges (the rarest pairs of the training text), which is removed (its text then encodes as its two halves; the
    trained model loses that rare token and nothing else). Returns the markers' ids. Idempotent."""
    checkpoint_dir = Path(checkpoint_dir)
    path, cfg_path = checkpoint_dir / "tokenizer.json", checkpoint_dir / "tokenizer_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    missing = [t for t in MARKERS if t not in added]
    if missing:
        model = data["model"]
        last = model["merges"][-len(missing):]
        del model["merges"][-len(missing):]
        for token, merge in zip(missing, last):
            left, right = merge if isinstance(merge, list) else merge.split(" ")
            data["added_tokens"].append({"id": model["vocab"].pop(left + right), "content": token, "single_word": False,
                                         "lstrip": False, "rstrip": False, "normalized": False, "special": False})
        # the tokenizers library numbers added tokens absent from the vocabulary in list order after it: keep the
        # list in id order so that every marker gets the id written next to it
        data["added_tokens"].sort(key=lambda t: t["id"])
        atomic_write_text(path, json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    atomic_write_json(cfg_path, cfg)
    data = json.loads(path.read_text(encoding="utf-8"))
    return [next(t["id"] for t in data["added_tokens"] if t["content"] == tok) for tok in MARKERS]


class TokenizerMissingError(UserError, FileNotFoundError):
    """The checkpoint directory has no tokenizer files."""


def load_tokenizer(checkpoint_dir: str | Path):
    """The checkpoint's own tokenizer via transformers.AutoTokenizer (fails loudly when absent, before the slow
    transformers import)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "tokenizer.json").exists() and not (checkpoint_dir / "tokenizer_config.json").exists():
        raise TokenizerMissingError(f"{checkpoint_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json); pass --ids instead of --prompt")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


def load_chat_tokenizer(checkpoint_dir: str | Path):
    """The checkpoint's tokenizer (transformers AutoTokenizer), checked to carry the chat format (qwen36.chat)."""
    tok = load_tokenizer(checkpoint_dir)
    check_chat_tokenizer(tok)
    return tok


def tokenizer_vocab_size(checkpoint_dir: str | Path) -> int:
    data = json.loads((Path(checkpoint_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    return len(data["model"]["vocab"]) + len(data.get("added_tokens", []))
