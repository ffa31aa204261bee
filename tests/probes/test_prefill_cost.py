"""The prefill compute term and the calibrated TTFT (docs/cost_model.md "Prefill and time to first token"):
the emulator's FLOP counts against their formulas, the per-chunk extrapolation of prefill-cost against chunks
actually run (CI size), the GEMM pins of the compute term, and the probe's record keys."""
from __future__ import annotations

import pathlib

import pytest
import torch

from qwen36.tt_ops.cost_model import (
    CALIBRATED_LABEL,
    PREFILL_CALIBRATION,
    CalibratedP150aModel,
    calibrated_figures,
    calibrated_prefill_figures,
    matmul_peak_tflops,
    prefill_calibration_markdown_rows,
    prefill_compute_excess,
)
from qwen36.tt_ops.emulator.counters import Counts
from qwen36.tt_ops.emulator.tensor import TILE_BYTES

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cost_model.md"
SDPA = "ttnn.transformer.chunked_scaled_dot_product_attention"


def test_prefill_constants_name_their_source_and_band():
    doc = DOCS.read_text()
    for c in PREFILL_CALIBRATION.values():
        assert c.low <= c.value <= c.high and "tt-metal" in c.source, c.name
    for row in prefill_calibration_markdown_rows():
        assert row in doc, row
    assert matmul_peak_tflops(1) == pytest.approx(110 * 4096 * 1.35e9 / 1e12)  # 608 TFLOPS LoFi over 11 x 10 cores
    assert matmul_peak_tflops(2) == pytest.approx(matmul_peak_tflops(1) / 2)
    # the fast end of the band is the high utilization
    assert CalibratedP150aModel("low").k("matmul_util") == 0.87 and CalibratedP150aModel("high").k("matmul_util") == 0.8


def _matmul_counts(m, k, n, dtype, phases, name="mm"):
    """One DRAM-interleaved matmul program [m, k] x [k, n] (both operands ``dtype``), as the emulator records it."""
    tile = TILE_BYTES[dtype]
    read = {dtype: (m * k + k * n) // 1024 * tile}
    c = Counts(name)
    c.add_op("ttnn.linear", read, {dtype: m * n // 1024 * tile}, work=(2 * m * k * n, phases, False))
    return c


# tt-metal tech_reports/GEMM_FLOPS/GEMM_FLOPS.md, "P150 Out of Box Results (11x10 grid)", traced rows: measured
# "Inference Time Avg [ns]" per matmul (DRAM in and out, auto-selected program config). M >= 2560 rows set
# matmul_util (in sample); the smaller ones are held out.
GEMM_PINS = [
    # (m, k, n, dtype, phases, measured us, in sample)
    (2560, 4224, 4224, "BFLOAT16", 2, 392.00544, True),
    (2560, 4224, 4224, "BFLOAT8_B", 1, 206.96163, True),
    (1280, 2816, 2816, "BFLOAT16", 2, 108.10614, False),
    (640, 1408, 2816, "BFLOAT16", 2, 46.12923, False),
    (1280, 2816, 2816, "BFLOAT8_B", 1, 60.82773, False),
    (640, 1408, 2816, "BFLOAT8_B", 1, 32.78017, False),
]


@pytest.mark.parametrize("m,k,n,dtype,phases,measured_us,in_sample", GEMM_PINS)
def test_gemm_pins(m, k, n, dtype, phases, measured_us, in_sample):
    """One matmul program = launch + fixed kernel time + max(compute at the utilization, its DRAM bytes): within
    15 % of the P150 measurement; the in-sample measurements inside the band, the held-out ones at most 3 % above
    its slow end (one is: 1280 x 2816 x 2816 bf16 HiFi2, 108.1 us measured, band end 105.9; docs/cost_model.md)."""
    c = _matmul_counts(m, k, n, dtype, phases)
    f = calibrated_prefill_figures(c, m)
    us, lo, hi = f["ms"] * 1e3, f["ms_low"] * 1e3, f["ms_high"] * 1e3
    assert lo <= measured_us <= (hi if in_sample else 1.03 * hi), (lo, measured_us, hi)
    assert abs(us / measured_us - 1) < 0.15, (us, measured_us)
    assert us < measured_us  # the model is optimistic on every row (-3.5 % to -12.1 %)


def test_compute_excess_is_max_of_compute_and_bytes():
    """A compute-bound program adds compute - bytes (and the whole-grid matmul's fixed time); a bytes-bound one (a
    decode row) adds only the fixed time, and the decode figures (calibrated_figures) never include the compute
    term. A program accumulating in fp32 Dst runs at ``matmul_util_fp32_acc``."""
    m = CalibratedP150aModel()
    fixed = m.k("prefill_matmul_fixed_us") * 1e-3
    big = _matmul_counts(2048, 4096, 4096, "BFLOAT8_B", 2)
    e = prefill_compute_excess(big, m)
    t = 2 * 2048 * 4096 * 4096 / (matmul_peak_tflops(2) * 1e12 * 0.83) * 1e3
    read_ms = (2048 * 4096 + 4096 * 4096) // 1024 * 1088 / (376e9) * 1e3
    assert e["compute_ms"] == pytest.approx(t) and e["excess_ms"] == pytest.approx(t - read_ms + fixed)
    row = _matmul_counts(32, 4096, 4096, "BFLOAT8_B", 2)
    assert prefill_compute_excess(row, m)["excess_ms"] == pytest.approx(fixed)
    acc = Counts("fp32")
    acc.add_op("ttnn.linear", {}, {}, work=(2 * 2048 * 4096 * 4096, 2, True))
    t32 = 2 * 2048 * 4096 * 4096 / (matmul_peak_tflops(2) * 1e12 * m.k("matmul_util_fp32_acc")) * 1e3
    assert prefill_compute_excess(acc, m)["compute_ms"] == pytest.approx(t32) and t32 > t
    assert calibrated_figures(big)["ms"] == pytest.approx(m.breakdown(big)["total_ms"])
    f = calibrated_prefill_figures(big, 2048)
    assert f["label"] == CALIBRATED_LABEL and f["ms_low"] < f["ms"] < f["ms_high"]
    assert f["ms"] == pytest.approx(m.breakdown(big)["total_ms"] + e["excess_ms"])
    assert f["uncalibrated"]  # what the term does not cover travels with every figure


# ---- the emulator's FLOP counts ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx1():
    pytest.importorskip("ttnn")
    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150") as ctx:
        yield ctx


def test_linear_flops_and_fidelity_are_counted(ctx1):
    """2 x M x K x N over the tile-padded shapes, the fidelity's phases and fp32 Dst from the compute config; a
    decode-shaped row pads to 32 rows, as the matrix engine computes it."""
    ttnn, mesh = ctx1.ttnn, ctx1.mesh_device
    w = ttnn.from_torch(torch.randn(64, 96), dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=mesh)
    for rows, fid, phases in ((64, ttnn.MathFidelity.HiFi2, 2), (1, ttnn.MathFidelity.HiFi4, 4)):
        x = ttnn.from_torch(torch.randn(1, 1, rows, 64), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh)
        ckc = ttnn.WormholeComputeKernelConfig(math_fidelity=fid, fp32_dest_acc_en=True)
        with ctx1.counters.scope("mm") as c:
            ttnn.linear(x, w, compute_kernel_config=ckc)
        ((key, n),) = c.compute_work.items()
        assert n == 1 and key[:4] == ("ttnn.linear", 2 * max(rows, 32) * 64 * 96, phases, True)
        assert dict(key[4]) == dict(c.bytes_read)  # the program's own reads travel with its work
    with ctx1.counters.scope("add") as c:
        ttnn.add(x, x)
    assert not c.compute_work and c.flops_total == 0


# ---- prefill-cost's per-chunk extrapolation, proven against chunks run at CI size -------------------------------
PROMPT = 3 * 256 + 80  # three whole chunks and a partial one


@pytest.fixture(scope="module")
def ci_units():
    pytest.importorskip("ttnn")
    from qwen36.probes import prefill_cost as pc
    from qwen36.probes.decode_cost import build_bench, build_config

    cfg, base = build_config("ci", 4096)
    out = {}
    for numerics in ("exact", "strict"):
        bench = build_bench("emulated-p150x2", cfg, "performance", context=PROMPT, numerics=numerics,
                            prefill_chunk=256)
        try:
            ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0))
            out[numerics] = pc.count_chunks(bench, ids)
            out[numerics + "_embed"] = [bench.corrected_embed(ch["parts"]["embed"], ch["rows"])
                                        for ch in out[numerics]]
            # the same prompt through prefill_forward itself, from a fresh state
            from qwen36.tt.model.state import allocate_state

            bench.state = allocate_state(bench.args, bench.ttnn, bench.mesh, [0, 3])
            bench.model.region = lambda name: __import__("contextlib").nullcontext()
            with bench.ctx.counters.scope("prefill_forward") as whole:
                bench.model.prefill_forward(ids, bench.state)
            out[numerics + "_whole"] = whole
        finally:
            bench.close()
    out["unit"] = pc.measure_units("emulated-p150x2", cfg, "performance", 0, cfg.vocab_size, chunk=256, rows={80})
    return cfg, base, out


def _same(a: Counts, b: Counts, skip_sdpa: bool = False):
    assert a.programs_per_op == b.programs_per_op
    assert a.collectives == b.collectives and a.collective_bytes == b.collective_bytes
    sd = lambda c: {k: v for k, v in c.bytes_read.items()}  # noqa: E731
    if not skip_sdpa:
        assert sd(a) == sd(b)
    wa = {k: v for k, v in a.compute_work.items() if not (skip_sdpa and k[0] == SDPA)}
    wb = {k: v for k, v in b.compute_work.items() if not (skip_sdpa and k[0] == SDPA)}
    assert wa == wb


def test_chunk_counts_extrapolate_exactly(ci_units):
    """At CI size: the probe's chunk driver counts what prefill_forward counts; every whole chunk runs the same
    programs per layer kind; the embed and GDN-layer counts are identical across whole chunks; an attention chunk
    differs from chunk 0 only in its SDPA program, whose FLOPs the emulator records as 4 B Hq D x causal pairs and
    whose K/V reads are the pages up to the chunk's end; exact and strict numerics count the same; and
    prompt_counts (the units of measure_units moved to each chunk's position, a partial last chunk counted at its own
    size) equals the sum of the chunks actually run, for the prompt and for a prefix hit."""
    from qwen36.probes import prefill_cost as pc

    cfg, base, u = ci_units
    chunks = u["exact"]
    assert [(c["start"], c["rows"]) for c in chunks] == pc.chunk_plan(PROMPT, 0, 256, 64) == [
        (0, 256), (256, 256), (512, 256), (768, 80)]
    whole = Counts("driver")
    for ch in chunks:
        for part in ch["parts"].values():
            whole.add(part)
    _same(whole, u["exact_whole"])
    for a, b in zip(u["exact"], u["strict"]):
        for name in a["parts"]:
            _same(a["parts"][name], b["parts"][name])
    gdn, attn = "layer0", "layer1"  # the built layers: the first GDN (0) and attention (3) layer
    unit = u["unit"]
    pair = unit["sdpa_pair_flops"]
    assert pair == pc.sdpa_pair_flops(chunks[0]["parts"][attn], 0, 256)
    page = unit["kv_block_bytes"]
    for ch in chunks:
        s, rows = ch["start"], ch["rows"]
        ref = chunks[0] if rows == 256 else ch
        _same(ch["parts"]["embed"], ref["parts"]["embed"])
        _same(ch["parts"][gdn], ref["parts"][gdn])
        _same(ch["parts"][attn], ref["parts"][attn], skip_sdpa=True)
        ((key, n),) = [(k, n) for k, n in ch["parts"][attn].compute_work.items() if k[0] == SDPA]
        assert n == 1 and key[1] == pair * (rows * s + rows * (rows + 1) // 2)
        # its bf16 reads: q [1, Hq/2, rows, D] and K and V pages up to the chunk's end (not the whole cache)
        q_bytes = cfg.num_attention_heads // 2 * -(-rows // 32) * -(-cfg.head_dim // 32) * TILE_BYTES["BFLOAT16"]
        assert dict(key[4])[unit["kv_key"]] == q_bytes + 2 * -(-(s + rows) // 64) * page
    n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)

    def run_sum(run):
        want = Counts("want")
        for ch, emb in run:
            want.add(emb)
            want.add(ch["parts"][gdn], n_gdn)
            want.add(ch["parts"][attn], n_attn)
        want.add(run[-1][0]["parts"]["head"])
        return want

    run = list(zip(chunks, u["exact_embed"]))
    cap = PROMPT + 64  # the fixture's bench: build_bench sizes the page table for its context + 64 positions
    _same(pc.prompt_counts(unit, n_gdn, n_attn, PROMPT, capacity=cap), run_sum(run))
    # the SDPA program reads 2 x the K/V pages up to its chunk's end (the op's accounting, moved exactly)
    late = pc.sdpa_chunk_counts(unit["rows"][256]["attention"], 512, 256, unit["kv_key"], page, 64, pair)
    early = unit["rows"][256]["attention"]
    assert late.bytes_read_total - early.bytes_read_total == 2 * (512 // 64) * page
    # a prefix hit of 512 tokens prefills the last two chunks from position 512: the chunks actually run
    _same(pc.prompt_counts(unit, n_gdn, n_attn, PROMPT - 512, start=512, capacity=cap), run_sum(run[2:]))


def test_long_position_check_at_ci_size(ci_units):
    """The probe's long-position check: one whole chunk's attention layer run at position 8,192 (a bench whose KV
    holds 8,448 positions) counts exactly what the position-0 chunk moved there counts."""
    from qwen36.probes import prefill_cost as pc

    cfg, _, u = ci_units
    got = pc.long_position_check("emulated-p150x2", cfg, "performance", 0, u["unit"], 8192)
    assert got["agree"], got["fields"]
    assert got["kv_positions"] == 8192 + 256
    pair = u["unit"]["sdpa_pair_flops"]
    assert got["sdpa_flops"] == pair * (256 * 8192 + 256 * 257 // 2)


def test_prefill_cost_probe_record(tmp_path):
    from qwen36.cli import main
    from qwen36.probes.records import read_records

    rec = tmp_path / "pc.jsonl"
    assert main(["probe", "prefill-cost", "--device", "emulated-p150x2", "--preset", "ci", "--prompts", "128,256,512",
                 "--chunk", "256", "--prefix-hits", "512:256,512:320", "--long-check", "512", "--records", str(rec)]) == 0
    (r,) = read_records(rec)
    perf = r["performance"]
    assert r["verdict"] == "pass" and perf["label"] == CALIBRATED_LABEL and perf["tp"] == 2 and perf["batch"] == 1
    assert set(perf["ttft"]) == {"128", "256", "512"} and perf["ttft"]["128"]["chunks"] == 1
    assert perf["ttft"]["128"]["ms"] < perf["ttft"]["256"]["ms"]
    lc = perf["long_position_check"]
    assert lc["start"] == 512 and lc["agree"] and r["config"]["long_check"] == 512
    # the CI config's GDN heads (16 wide) are narrower than a tile: the composite prefill ran, and the record says so
    assert perf["gdn_prefill_path"].startswith("composite") and r["config"]["gdn_prefill"] == "fused"
    # a 128-token prompt is one partial chunk, counted as it runs: the same programs as a whole chunk (every op runs
    # once per layer whatever the rows), fewer bytes and FLOPs
    short, one_chunk = perf["ttft"]["128"], perf["ttft"]["256"]
    assert short["chunks"] == 1 and short["programs"] == one_chunk["programs"]
    assert short["bytes_read_per_device"] < one_chunk["bytes_read_per_device"]
    assert short["flops_per_device"] < one_chunk["flops_per_device"] and short["ms"] <= one_chunk["ms"]
    for t in perf["ttft"].values():
        assert t["ms_low"] < t["ms"] < t["ms_high"] and t["tok_s"] > 0
        assert {"launch_ms", "kernel_ms", "dram_interleaved_ms", "compute_excess_ms"} <= set(t["breakdown"])
    assert perf["ttft"]["512"]["ms"] > perf["ttft"]["256"]["ms"]
    hit, off_grid = perf["prefix_reuse"]
    assert hit["prompt_tokens"] == 512 and hit["hit_tokens"] == 256 and hit["prefilled_tokens"] == 256
    assert (hit["restored_from"], hit["rerun_tokens"], hit["saves"]) == (256, 0, 0)
    assert 0 < hit["ms"] < hit["full_prompt_ms"] and hit["saved_ms"] == pytest.approx(hit["full_prompt_ms"] - hit["ms"])
    assert 0 < hit["copies_ms"] < hit["ms"]  # the checkpoint restore's device copies are in it
    # the same programs as a captured trace: no host dispatch per op, so never slower than the untraced prefill
    assert 0 < hit["traced_ms_low"] < hit["traced_ms"] < hit["traced_ms_high"] and hit["traced_ms"] <= hit["ms"]
    # a hit of 320 tokens restores the same grid boundary (256) and reruns rows 256..319: the same pieces, same time
    assert (off_grid["restored_from"], off_grid["rerun_tokens"], off_grid["prefilled_tokens"]) == (256, 64, 256)
    assert off_grid["ms"] == pytest.approx(hit["ms"])
    assert perf["uncalibrated"]
    # the ranking of one chunk's programs adds up to one chunk of the 256-token prompt less its head
    rank = perf["chunk_ranking"]
    assert rank == sorted(rank, key=lambda x: -x["ms"]) and {x["region"] for x in rank} == {
        "embed", "GDN layers", "attention layers"}
    one = perf["ttft"]["256"]
    assert sum(x["programs"] for x in rank) == one["programs"] - perf["programs_per_chunk"]["head"]
    # qwen36 report shows it
    from qwen36.commands.report import write_report

    md = write_report([rec], tmp_path / "report")["markdown"].read_text()
    assert "## Time to first token (modelled (calibrated), batch 1, TP=2, prefill-cost)" in md
    assert "| 512 | 256 | 256 |" in md and "time to first token" in md


def test_prefill_cost_chunk_plan_and_refusals():
    from qwen36.errors import UserError
    from qwen36.probes import prefill_cost as pc

    assert pc.chunk_plan(128, 0, 2048, 64) == [(0, 128)]
    assert pc.chunk_plan(4096, 3840, 2048, 64) == [(3840, 2048), (5888, 2048)]
    assert pc.rows_needed(2048, 64, [128, 4096, 5000], [(4096, 3840)]) == {128, 2048, 904, 256}
    with pytest.raises(UserError, match="starts on a KV page"):
        pc.chunk_plan(256, 100, 256, 64)
    with pytest.raises(UserError, match="no counted chunk of 44 rows"):
        pc.prompt_counts({"chunk": 256, "block": 64, "rows": {256: {}}}, 1, 1, 300)
    with pytest.raises(UserError, match="PROMPT:HIT"):
        pc.parse_hits("4096")
    with pytest.raises(UserError, match="multiple of the KV page"):
        pc.hit_plan(512, 300, 256, 64)


def test_force_gdn_prefill():
    """--gdn-prefill composite drops every GDN layer's fused prefill (the attention layers untouched); fused keeps
    the model's choice; an unknown name and layers that disagree are refused."""
    from types import SimpleNamespace

    from qwen36.errors import UserError
    from qwen36.probes import prefill_cost as pc

    def model():
        gdn = [SimpleNamespace(fused_prefill=object(), prefill_path="fused") for _ in range(2)]
        return SimpleNamespace(layers=[SimpleNamespace(mixer=m) for m in gdn] + [SimpleNamespace(mixer=object())])

    m = model()
    assert pc.force_gdn_prefill(m, "fused") == "fused"
    assert all(layer.mixer.fused_prefill is not None for layer in m.layers[:2])
    assert pc.force_gdn_prefill(m, "composite").startswith("composite")
    assert all(layer.mixer.fused_prefill is None for layer in m.layers[:2])
    with pytest.raises(UserError, match="--gdn-prefill"):
        pc.force_gdn_prefill(model(), "chunked")
    m = model()
    m.layers[1].mixer.prefill_path = "composite (heads of 16)"
    with pytest.raises(ValueError, match="prefill differently"):
        pc.force_gdn_prefill(m, "fused")


def test_moe_units_extrapolate_in_experts():
    """The MoE sibling's prefill at CI size: per-chunk counts built at 32, 64 and 96 experts, extrapolated to 128 as
    a quadratic in the expert count, equal the counts of a build at 128 experts (programs, bytes, collectives, FLOPs
    of every compute program); the grouped expert matmuls compute E + M k / R blocks of R rows each (only the
    routed pairs: tt/model/moe_dispatch.py)."""
    pytest.importorskip("ttnn")
    import dataclasses

    from qwen36.probes import prefill_cost as pc
    from qwen36.probes.decode_cost import build_config

    cfg, _ = build_config("moe-ci", 4096)
    real = dataclasses.replace(cfg, num_experts=128)
    got = pc.measure_units_moe("emulated-p150x2", cfg, real, "performance", 0, experts=(32, 64, 96), chunk=256)
    want = pc.measure_units("emulated-p150x2", real, "performance", 0, real.vocab_size, chunk=256)
    for part in pc.PARTS:
        g, w = got["rows"][256][part], want["rows"][256][part]
        _same(g, w)
        assert dict(g.bytes_read_per_op) == {k: dict(v) for k, v in w.bytes_read_per_op.items()}
    sparse = [(k, n) for k, n in want["rows"][256]["gdn"].compute_work.items() if k[0] == "ttnn.sparse_matmul"]
    assert len(sparse) == 2 and all(n == 1 for _, n in sparse)
    pad = lambda n: -(-n // 32) * 32  # noqa: E731  (the engine computes whole tiles)
    h, i_d = real.hidden_size, real.moe_intermediate_size // 2  # each expert tensor-parallel over 2 devices
    from qwen36.tt.model.moe_dispatch import BLOCK

    blocks = 128 + 256 * real.num_experts_per_tok // BLOCK
    assert sorted(k[1] for k, _ in sparse) == sorted([2 * blocks * BLOCK * h * pad(2 * i_d),
                                                      2 * blocks * BLOCK * pad(i_d) * h])
    assert got["experts"] == {"built": [32, 64, 96], "extrapolated_to": 128}
