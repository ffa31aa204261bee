"""The programs of the TT speculative step, frozen: gate-0b on the ci preset (emulated P150a x2) at one user (the
single-user step: device-derived row inputs, no GDN row mask, n/pending advanced by the commit, the single-user MTP
ops) and at four users (the packed batched step), K = 1, 2, 3, compared exactly, phase by phase and op by op, with
``tests/data/tt_spec_program_golden.json`` (``qwen36.testing.program_golden``; its ``command`` field regenerates
it, only for a deliberate, reviewed change of the step's programs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen36.testing.program_golden import BATCHES, COMMAND, gate0b_programs

GOLDEN = Path(__file__).resolve().parent / "data" / "tt_spec_program_golden.json"


def diff(want: dict, got: dict) -> list[str]:
    out = [f"{p}: missing" for p in sorted(set(want) - set(got))]
    out += [f"{p}: new phase" for p in sorted(set(got) - set(want))]
    for p in sorted(set(want) & set(got)):
        w, g = want[p], got[p]
        if p == "ks_refused" or w == g:
            continue
        ops = sorted(set(w["programs"]) | set(g["programs"]))
        d = {op: g["programs"].get(op, 0) - w["programs"].get(op, 0) for op in ops}
        out.append(f"{p}: programs " + ", ".join(f"{op} {v:+d}" for op, v in d.items() if v)
                   + "".join(f"; {key} {w[key]} -> {g[key]}" for key in ("collectives", "collective_bytes", "bytes_read")
                             if w[key] != g[key]))
    return out


def test_golden_names_its_command():
    golden = json.loads(GOLDEN.read_text())
    assert golden["command"] == COMMAND
    assert sorted(golden["batches"]) == sorted(map(str, BATCHES))


@pytest.mark.parametrize("batch", BATCHES)
def test_gate0b_programs_equal_golden(batch):
    want = json.loads(GOLDEN.read_text())["batches"][str(batch)]
    got = json.loads(json.dumps(gate0b_programs(batch)))  # the golden's JSON types (str keys)
    assert got.get("ks_refused") == want.get("ks_refused")
    assert not diff(want, got), "\n".join(diff(want, got))
    assert got == want
