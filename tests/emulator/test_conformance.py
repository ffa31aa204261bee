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
