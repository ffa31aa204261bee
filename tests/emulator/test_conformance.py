"""The CI subset of the conformance cases (qwen36.testing.emulator_conformance, written from Tenstorrent's op tests) on the
emulated 1x2 mesh, and the probe that runs them all."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ttnn")

from qwen36.testing import emulator_conformance as C  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402


@pytest.fixture(scope="module")
def ctx2():
    with open_mesh("emulated-p150x2", trace_region_size=10_000_000) as c:
        yield c


@pytest.mark.parametrize("case", [c for c in C.CASES if c.ci and not c.skip], ids=lambda c: f"{c.op}:{c.name}")
def test_conformance_case(ctx2, case):
    case.fn(ctx2.ttnn, ctx2.mesh_device)


def test_every_hand_emulated_op_has_cases_and_skips_say_why():
    ops = {c.op for c in C.CASES if not c.skip}
    for op in ("experimental.paged_update_cache", "experimental.paged_fill_cache",
               "transformer.paged_scaled_dot_product_attention_decode", "transformer.fused_recurrent_gated_delta_rule",
               "transformer.chunk_gated_delta_rule", "experimental.rotary_embedding_llama",
               "experimental.rotary_embedding_hf", "experimental.paged_fused_update_cache",
               "experimental.nlp_create_qkv_heads_decode", "rms_norm", "experimental.indexed_fused_update_cache",
               "experimental.all_gather_async",
               "experimental.reduce_scatter_minimal_async", "sparse_matmul",
               "experimental.kda.qkv_causal_conv1d_silu", "experimental.kda.qkv_causal_conv1d_silu_with_carry",
               "experimental.kda.sigmoid_gated_rms_norm", "transformer.gated_delta_attn_seq",
               "experimental.kda.prepare_chunk_recurrence", "experimental.kda.recurrent_chunk_scan",
               "experimental.kda.summarize_chunk_recurrence", "experimental.kda.affine_exclusive_scan",
               "experimental.kda.chain_affine_transforms", "experimental.kda.reduce_affine_transforms",
               "experimental.kda.select_final_carry"):
        assert op in ops, f"no runnable conformance case for {op}"
    assert all(len(c.skip) > 20 for c in C.CASES if c.skip)
    assert all(c.source for c in C.CASES)


def test_a_failing_case_is_recorded_not_raised(ctx2, monkeypatch):
    def bad(ttnn, mesh):
        raise AssertionError("deliberate mismatch")

    monkeypatch.setattr(C, "CASES", [C.Case("x.op", "bad", "test", bad), C.Case("x.op", "skip", "test", skip="why " * 8)])
    res = C.run_cases(ctx2)
    assert [r["status"] for r in res] == ["failed", "skipped"] and "deliberate mismatch" in res[0]["reason"]
    assert C.summarize(res) == {"x.op": {"passed": 0, "failed": 1, "skipped": 1}}


def test_probe_writes_a_record(tmp_path):
    from qwen36.cli import main

    rec = tmp_path / "runs.jsonl"
    rc = main(["probe", "emu-conformance", "--device", "emulated-p150x2", "--ci-only", "--records", str(rec)])
    assert rc == 0
    r = json.loads(rec.read_text().splitlines()[-1])
    assert r["probe"] == "emu-conformance" and r["verdict"] == "pass"
    assert r["backend"].startswith("emulated-p150x2")
    per = r["counters"]["per_op"]
    assert per["transformer.fused_recurrent_gated_delta_rule"]["passed"] >= 3
    assert any(c["status"] == "skipped" and c["reason"] for c in r["cells"])


def test_a_restated_tt_file_counts_passed_failed_and_skipped(monkeypatch):
    """conformance_tt_tests.run_file (the whole-file check run by hand) opens the mesh a case names and counts a
    failure instead of raising; the suite carries the marked cases of every restated file (as tt_file:<name>)."""
    from qwen36.testing import conformance_tt_tests as T
    from qwen36.testing.conformance_tt_base import TTCase

    carried = sum(c.suite for cs in T.TT_FILES.values() for c in cs)
    assert len({c.name for c in C.CASES if c.name.startswith("tt_file:")}) == carried
    seen = []

    def ok(ttnn, mesh):
        seen.append(mesh.get_num_devices())

    def bad(ttnn, mesh):
        raise AssertionError("deliberate mismatch")

    monkeypatch.setitem(T.TT_FILES, "x", [TTCase("x.op", "ok", ok), TTCase("x.op", "two", ok, mesh="mesh2"),
                                          TTCase("x.op", "bad", bad), TTCase("x.op", "skip", None, skip="why " * 8)])
    r = T.run_file("x")
    assert r["counts"] == {"passed": 2, "failed": 1, "skipped": 1} and seen == [1, 2]
    assert r["failures"] == [("bad", "AssertionError: deliberate mismatch")]


@pytest.mark.parametrize("name", ["program_cache_reuses_runtime_positions", "tensor_parallel_mesh_heads"])
def test_a_program_cache_case_leaves_the_shared_mesh_caching(name):
    """The restated indexed-cache cases that switch the program cache on used to switch it off when they finished,
    so every later case of the suite on the same mesh ran without a program cache (and program-cache cases of other
    ops failed). The mesh must be left as it was opened: caching, and empty."""
    from qwen36.testing.conformance_tt_cache import indexed_cases

    case = next(c for c in indexed_cases() if c.name == name)
    device = "emulated-p150" if case.mesh == "device" else "emulated-p150x2"
    with open_mesh(device, trace_region_size=case.trace_region or 10_000_000) as c:
        case.fn(c.ttnn, c.mesh_device)
        assert c.mesh_device.num_program_cache_entries() == 0
        x = c.ttnn.from_torch(__import__("torch").ones(32, 32), dtype=c.ttnn.bfloat16, layout=c.ttnn.TILE_LAYOUT,
                              device=c.mesh_device, mesh_mapper=c.ttnn.ReplicateTensorToMesh(c.mesh_device))
        c.ttnn.add(x, x)
        assert c.mesh_device.num_program_cache_entries() > 0
