"""The programs of the TT speculative step, frozen: gate-0b on the ci preset (emulated P150a x2) at one user (the
one-user step: device-derived row inputs, no GDN row mask, n/pending advanced by the commit, the one-user MTP ops)
and at four users (the packed B-slot step), K = 1, 2, 3, compared exactly, phase by phase and op by op; and (slow)
the replayed step as ``TTSpecBackend`` runs it in both layouts (programs per op, trace replays, host transfers,
captures, tokens). Against ``tests/data/tt_spec_program_golden.json`` (``support.program_golden``; its
``command`` field regenerates it, only for a deliberate, reviewed change of the step's programs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.program_golden import BACKEND_CASES, BATCHES, COMMAND, backend_steps, gate0b_programs

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "tt_spec_program_golden.json"


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
    assert sorted(golden["backend_steps"]) == sorted(c[0] for c in BACKEND_CASES)


@pytest.mark.parametrize("batch", BATCHES)
def test_gate0b_programs_equal_golden(batch):
    want = json.loads(GOLDEN.read_text())["batches"][str(batch)]
    got = json.loads(json.dumps(gate0b_programs(batch)))  # the golden's JSON types (str keys)
    assert got.get("ks_refused") == want.get("ks_refused")
    assert not diff(want, got), "\n".join(diff(want, got))
    assert got == want


@pytest.mark.slow
def test_backend_steps_equal_golden():
    want = json.loads(GOLDEN.read_text())["backend_steps"]
    got = json.loads(json.dumps(backend_steps()))
    for name in want:
        w, g = want[name], got[name]
        ops = sorted(set(w["programs"]) | set(g["programs"]))
        d = {op: g["programs"].get(op, 0) - w["programs"].get(op, 0) for op in ops}
        assert w == g, f"{name}: programs " + ", ".join(f"{op} {v:+d}" for op, v in d.items() if v) + "".join(
            f"; {key} {w[key]} -> {g[key]}" for key in w if key != "programs" and w[key] != g[key])
    # the layouts as recorded: one user 2 replays, no host writes; B slots 3 replays, 12 host writes
    assert {n: (r["trace_replays"], r["host_calls"].get("ttnn.copy_host_to_device_tensor", 0)) for n, r in got.items()} \
        == {n: (2, 0) if rows == "device" else (3, 12) for n, _, rows, *_ in BACKEND_CASES}
