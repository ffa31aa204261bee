"""`qwen36 generate` with several prompts, `--spec-k` and `--thinking-budget` on the emulated TT mesh: the B-slot
TTSpecBackend forces each user's stop-thinking phrase through its own step (``TTSpecBackend.inject``, host rows)
while the others step on; every user's ids equal the TT plain batched decoder's with the same budget."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from qwen36 import DEFAULT_CHECKPOINT
from qwen36.chat import STOP_THINKING_PHRASE
from qwen36.cli import main

# two prompts of different lengths end inside an open <think> block (4094): budget 1 is reached at each one's first
# token (the join's pick), so its phrase is forced before its first step; the third prompt has no open block and
# steps normally in the rounds where the others are forced
PROMPTS = ["5,11,12,4094", "4094,201,16,5,201", "13,14,15,16,17,18"]


def batch_ids(out: str) -> list[list[int]]:
    return [[int(x) for x in line.split(":", 1)[1].split(",")] for line in out.splitlines() if line.startswith("ids[")]


@pytest.mark.slow  # two emulated TT runs of three users (the model loads twice)
def test_tt_batched_speculative_thinking_budget_equals_tt_plain_batch(capsys):
    ids = [a for p in PROMPTS for a in ("--ids", p)]
    base = ["generate", *ids, "--device", "emulated-p150x2", "--max-new-tokens", "40", "--thinking-budget", "1"]
    assert main(base + ["--spec-k", "2"]) == 0
    spec = batch_ids(capsys.readouterr().out)
    assert main(base) == 0  # plain: TTBatchDecoder, each user's budget counted on its own (ForcedFeed)
    plain = batch_ids(capsys.readouterr().out)
    assert len(spec) == 3 and spec == plain
    phrase = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT)).encode(STOP_THINKING_PHRASE)
    for u in (0, 1):  # forced right after the first token
        assert spec[u][1:1 + len(phrase)] == phrase
    assert 4095 not in spec[2]  # the user without an open block is never forced
