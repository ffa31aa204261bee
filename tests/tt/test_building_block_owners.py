"""TT building blocks have one owner each; a second copy fails here (an AST scan, no device).

* trace capture/replay (``ttnn.begin_trace_capture`` / ``end_trace_capture`` / ``execute_trace`` /
  ``release_trace``): only ``tt/runtime/trace.py``. Everything else (generator, speculative step, MTP, probes, TT tests)
  goes through ``TracedStep`` / ``StepTraces``. The emulator's own trace tests (tests/emulator/) call the
  raw API on purpose: they test it.
* compute kernel configs (``WormholeComputeKernelConfig`` and its relatives): only ``tt/model/model_config.py``, where
  each is a named function that says why.
* RNG draws on device (``ttnn.uniform``): only ``tt/runtime/sampler_tables.py`` (the uniform table both the acceptor and
  the sampled draft pick use).
* the chunked-prefill attention context: only ``TTQwen36Model.prefill_chunk_context`` (tt/model/model.py), which the
  target prefill, the MTP prefill and the layer harness call.
Configs and RNG draws are checked in the sources (tests exercise those ops directly); traces everywhere.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACE_CALLS = {"begin_trace_capture", "end_trace_capture", "execute_trace", "release_trace"}
CONFIG_CALLS = {"WormholeComputeKernelConfig", "BlackholeComputeKernelConfig", "ComputeKernelConfig",
                "GrayskullComputeKernelConfig"}
RNG_CALLS = {"uniform", "rand", "bernoulli"}
OWNERS = {"trace": "models/qwen36/tt/runtime/trace.py", "config": "models/qwen36/tt/model/model_config.py",
          "rng": "models/qwen36/tt/runtime/sampler_tables.py", "prefill_ctx": "models/qwen36/tt/model/model.py"}


def _is_ttnn(node: ast.AST) -> bool:
    """``ttnn`` or ``<anything>.ttnn`` (self.ttnn, ctx.ttnn, mesh.ttnn): the receivers TT code calls ttnn through."""
    return (isinstance(node, ast.Name) and node.id == "ttnn") or (isinstance(node, ast.Attribute) and node.attr == "ttnn")


def violations(source: str, rel: str) -> list[str]:
    """Owner violations in one file's source: 'path:line: kind name'."""
    out = []
    calls = sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)), key=lambda n: n.lineno)
    for node in calls:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        via_ttnn = isinstance(f, ast.Attribute) and _is_ttnn(f.value)
        if name in TRACE_CALLS and via_ttnn and rel != OWNERS["trace"]:
            out.append(f"{rel}:{node.lineno}: trace {name}")
        if rel.startswith("tests/"):
            continue  # tests may build configs and draw uniforms to test those ops themselves
        if name in CONFIG_CALLS and rel != OWNERS["config"]:
            out.append(f"{rel}:{node.lineno}: compute config {name}")
        if name in RNG_CALLS and via_ttnn and rel != OWNERS["rng"]:
            out.append(f"{rel}:{node.lineno}: device rng {name}")
        prefill = node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "prefill"
        if name == "AttentionContext" and prefill and rel != OWNERS["prefill_ctx"]:
            out.append(f"{rel}:{node.lineno}: prefill attention context")
    return out


def _scanned_files():
    for top in ("models", "tt_ops", "probes", "scripts", "tests"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel.startswith("tt_ops/emulator/") or "/.venv/" in rel:
                continue  # the emulator implements these APIs
            if (rel.startswith(("tests/emulator/", "models/qwen36/testing/conformance_"))
                    or rel in ("tests/tt_ops/test_api_fidelity.py", "models/qwen36/testing/emulator_conformance.py")):
                continue  # tests of the emulator (incl. its conformance cases) / of ttnn signatures use the raw APIs
            yield rel, p


def test_one_owner_per_building_block():
    found = [v for rel, p in _scanned_files() for v in violations(p.read_text(), rel)]
    assert not found, "building blocks re-implemented outside their owner:\n" + "\n".join(found)


def test_scan_sees_a_second_copy():
    """The scan is not vacuous: a raw capture/replay, a hand-built config and an in-file RNG draw are reported."""
    bad = (
        "def step(self, ttnn):\n"
        "    tid = self.ttnn.begin_trace_capture(self.mesh, cq_id=0)\n"
        "    self.ttnn.end_trace_capture(self.mesh, tid, cq_id=0)\n"
        "    ttnn.execute_trace(self.mesh, tid, cq_id=0)\n"
        "    cfg = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4)\n"
        "    ttnn.uniform(self.table, 0.0, 1.0, 7)\n"
        "    self.gen.release_trace()\n"  # a method of ours, not the ttnn call: allowed
        "    ctx = AttentionContext('prefill', cos, sin, pt, chunk_start=0, chunk_page_table=cpt)\n"
    )
    got = violations(bad, "models/qwen36/tt/spec/accept.py")
    assert [v.split(": ", 1)[1] for v in got] == [
        "trace begin_trace_capture", "trace end_trace_capture", "trace execute_trace",
        "compute config WormholeComputeKernelConfig", "device rng uniform", "prefill attention context"], got
    assert violations(bad, OWNERS["trace"]) == [
        "models/qwen36/tt/runtime/trace.py:5: compute config WormholeComputeKernelConfig",
        "models/qwen36/tt/runtime/trace.py:6: device rng uniform", "models/qwen36/tt/runtime/trace.py:8: prefill attention context"]
    scanned = {rel for rel, _ in _scanned_files()}
    assert {"models/qwen36/tt/runtime/generator.py", "models/qwen36/tt/spec/spec_backend.py", "models/qwen36/tt/spec/mtp.py",
            "probes/decode_cost.py", "tests/tt/spec/test_tt_mtp.py"} <= scanned
