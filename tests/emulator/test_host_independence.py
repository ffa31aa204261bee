"""The emulator's answers do not depend on the host (rule N8, docs/emulator_ops.md).

A card computes every element of a tile the same way whatever drives it. torch on a CPU does not: its fp32
transcendentals run through Sleef in the vector loop and libm in the scalar tail (so an element's last bit depends
on its place in the call), its sums associate by SIMD width and thread split, and BLAS picks kernels by ISA and
row count. On an AVX-512 host this once made a batched verify and a batch-1 decode differ by 1 ulp in the GDN
gate g and flip a near-tie token, failing a lossless check that passed elsewhere.

``support.host_fingerprint`` runs the model's ops (1-row and 24-row calls), a plain and a traced greedy
speculative run with the device MTP head, a batched speculative run and the weights ``qwen36.tiny`` generates for
the test checkpoints, and writes SHA-256 fingerprints. Here it
runs in subprocesses under every ``ATEN_CPU_CAPABILITY`` this CPU has (scalar ``default``, ``avx2``, ``avx512``) and
with 1 and 2 torch threads; every fingerprint must be identical, and every op's row 0 must be the same with 1 row
as with 24. (Before rule N8 the scalar and SIMD settings gave softplus, sigmoid and silu different bits, and the
row check failed for them on every SIMD host.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds the test-support package `support`

pytest.importorskip("ttnn")


def _capabilities() -> list[str]:
    """The ATen capabilities this CPU can run: the scalar path always, AVX2 / AVX-512 when the CPU has them."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["default", best]


def _settings() -> list[tuple[str, int]]:
    """Every capability at one thread, and the widest one again at two threads."""
    caps = _capabilities()
    return [(c, 1) for c in caps] + [(caps[-1], 2)]


def _run(tmp_path, cap: str, threads: int, part: str) -> dict:
    out = tmp_path / f"{part}-{cap}-{threads}.json"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    code = f"import torch; torch.set_num_threads({threads}); from support.host_fingerprint import main; " \
           f"main([{str(out)!r}, '--part', {part!r}])"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{cap}/{threads} threads failed:\n{r.stderr[-3000:]}"
    rec = json.loads(out.read_text())
    assert rec.pop("cpu_capability").lower() == cap and rec.pop("torch_threads") == threads
    return rec


def _compare(runs: dict) -> list[str]:
    (base_key, base), *rest = runs.items()
    diffs = []
    for key, rec in rest:
        for name in sorted(set(base) | set(rec)):
            if base.get(name) != rec.get(name):
                diffs.append(f"{name}: {base_key} {base.get(name)} != {key} {rec.get(name)}")
    return diffs


@pytest.mark.slow
def test_ops_bit_identical_on_every_host_setting_and_row_count(tmp_path):
    runs = {f"{c}/{t}": _run(tmp_path, c, t, "ops") for c, t in _settings()}
    assert len(runs) >= 2
    rows = [f"{k} {name}" for k, rec in runs.items() for name, v in rec.items() if v[-1] is not True]
    assert not rows, "row 0 of a 24-row call differs from the 1-row call:\n" + "\n".join(rows)
    diffs = _compare(runs)
    assert not diffs, "emulated op results depend on the host setting:\n" + "\n".join(diffs)


@pytest.mark.slow
def test_model_runs_bit_identical_on_every_host_setting(tmp_path):
    """Prefill / decode logits, plain greedy tokens, a traced greedy speculative run (device MTP head) and a batched
    speculative run of two users: the same bits under every capability and thread count."""
    runs = {f"{c}/{t}": _run(tmp_path, c, t, "model") for c, t in _settings()}
    diffs = _compare(runs)
    assert not diffs, "emulated model results depend on the host setting:\n" + "\n".join(diffs)
    rec = next(iter(runs.values()))
    assert any(a > 0 for a in rec["model:spec_accepted"])  # the drafts were exercised, not all rejected
