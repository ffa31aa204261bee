"""The lossless probe's "TT plain greedy vs reference" cell, on synthetic logits: a different pick where the
reference's top-2 gap is below the clear-gap bound is a recorded near tie (the shipped checkpoint has one at its
third token, which bf16 arithmetic orders either way); a different pick where the reference decides clearly, logits
below the PCC gate, or a traced path that differs from the logits read-back path fail the cell."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen36.probes.lossless import CLEAR_GAP, plain_vs_reference

V, PROMPT = 16, [3, 1, 4]


class FakeReference:
    """Returns fixed logits rows for the positions after the prompt (a teacher-forced reference)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def new_state(self, batch, length):
        return None

    def __call__(self, ids, state):
        lead = torch.zeros(len(PROMPT) - 1, V)
        assert ids.shape[1] == len(PROMPT) - 1 + self.rows.shape[0]
        return SimpleNamespace(logits=torch.cat([lead, self.rows])[None])


def rows_with_gaps(gaps):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(len(gaps), V, generator=g)
    for i, gap in enumerate(gaps):
        rows[i, :2] = rows[i].max() + torch.tensor([1.0 + gap, 1.0])  # token 0 leads token 1 by ``gap``
    return rows


def cell_for(ref_rows, tt_rows, plain, kept_tokens=None):
    kept = SimpleNamespace(tokens=list(plain if kept_tokens is None else kept_tokens), logits=list(tt_rows))
    return plain_vs_reference(FakeReference(ref_rows), PROMPT, list(plain), kept, "accuracy")


def test_a_near_tie_flip_is_recorded_not_failed():
    ref = rows_with_gaps([2.0, CLEAR_GAP / 4, 2.0])
    tt = ref.clone()
    tt[1, 1] += CLEAR_GAP / 2  # TT orders the near tie the other way
    cell = cell_for(ref, tt, [0, 1, 0])
    assert cell["pass"] and cell["clear_rows"] == 2 and cell["clear_rows_disagreeing"] == []
    assert cell["near_tie_rows_disagreeing"] == [{"row": 1, "reference_gap": pytest.approx(CLEAR_GAP / 4, abs=1e-4),
                                                  "tt": 1, "reference": 0}]


def test_a_clear_disagreement_fails():
    ref = rows_with_gaps([2.0, 2.0])
    cell = cell_for(ref, ref.clone(), [0, 1])
    assert not cell["pass"] and cell["clear_rows_disagreeing"] == [1]


@pytest.mark.parametrize("what", ["pcc", "paths"])
def test_far_logits_or_two_different_tt_paths_fail(what):
    ref = rows_with_gaps([2.0, 2.0])
    tt = ref.clone()
    if what == "pcc":
        tt[1] = torch.randn(V, generator=torch.Generator().manual_seed(1))
        tt[1, 0] = tt[1].max() + 1  # the pick still agrees: only the logits are wrong
    cell = cell_for(ref, tt, [0, 0], kept_tokens=[0, 1] if what == "paths" else None)
    assert not cell["pass"]
    assert (cell["logits_pcc_min"] < cell["pcc_gate"]) if what == "pcc" else not cell["traced_equals_logits_readback"]
