"""`qwen36 report` on records made by CI-size probes (gate-0a, decode-cost, a short lossless run): the Markdown
report and every plot are written, the table rows carry the records' values, and records the report cannot use
are refused with a one-line error naming the file."""
from __future__ import annotations

import json

import pytest

from qwen36.probes.records import read_records

PLOTS = ("step_time_by_component.png", "step_time_by_cost_term.png", "tok_s_vs_k.png", "programs_per_layer.png",
         "acceptance.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from qwen36.cli import main

    d = tmp_path_factory.mktemp("runs")
    for probe, extra in (("gate-0a", ["--preset", "ci", "--ks", "1,3,7"]), ("decode-cost", ["--preset", "ci"]),
                         ("lossless", ["--ks", "1,2", "--mechanisms", "shadow_commit", "--max-new-tokens", "8"])):
        assert main(["probe", probe, "--device", "emulated-p150x2", *extra, "--records", str(d / f"{probe}.jsonl")]) == 0
    return d


def _table(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table after the heading starting with ``heading`` -> (header, rows)."""
    lines = md[md.index("## " + heading):].splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[i:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows[0], rows[2:]


@pytest.mark.slow
def test_report_tables_and_plots(runs, tmp_path):
    from qwen36.cli import main

    out = tmp_path / "report"
    assert main(["report", *sorted(map(str, runs.glob("*.jsonl"))), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        assert f"({name})" in md
    (g0a,) = read_records(runs / "gate-0a.jsonl")
    perf = g0a["performance"]
    assert "## Step time by component (modelled, ms)" in md

    header, rows = _table(md, "Step time by component")
    by_step = {r[0]: dict(zip(header, r)) for r in rows}
    assert set(by_step) == {"decode", "spec K=1", "spec K=3", "spec K=7"}
    names = {"GDN mixer": "gdn", "attention mixer": "attention", "MLP": "mlp", "LM head": "lm_head",
             "MTP draft": "mtp_draft", "host readback": "host_readback", "commit": "commit"}
    for title, step in (("decode", "decode"), ("spec K=3", "spec_k3"), ("spec K=7", "spec_k7")):
        s, row = perf["steps"][step], by_step[title]
        assert row["total"] == f"{s['ms']:.3f}" and row["programs"] == str(s["programs"])
        for col, comp in names.items():
            want = f"{s['components'][comp]['ms']:.3f}" if comp in s["components"] else "-"
            assert row[col] == want, (title, col)

    header, rows = _table(md, "Step time by cost term")
    dec = dict(zip(header, rows[0]))
    assert dec["dispatch (programs)"] == f"{perf['steps']['decode']['categories']['dispatch']:.3f}"
    assert dec["weights: lm_head"] == f"{perf['steps']['decode']['categories']['weights:lm_head']:.3f}"

    header, rows = _table(md, "Throughput")
    k3 = dict(zip(header, next(r for r in rows if r[0] == "3")))
    assert k3["tok/s @ 0.8"] == f"{perf['spec_tok_s']['3']['0.8']:.1f}"
    assert k3["tokens/step @ 0.8/0.6/0.5"] == "2.900"
    k7 = dict(zip(header, next(r for r in rows if r[0] == "7")))
    assert k7["tok/s @ 0.8/0.6/0.5"] == "-"  # the profile covers 3 positions
    assert k3["verify_cost_ratio"] == f"{perf['verify_cost_ratio']['3']:.3f}"

    header, rows = _table(md, "Programs per layer")
    lists = perf["steps"]["decode"]["programs_per_layer"]
    assert {r[0]: int(r[1]) for r in rows} == {k: sum(v.values()) for k, v in lists.items()}

    (ll,) = read_records(runs / "lossless.jsonl")
    header, rows = _table(md, "Acceptance")
    stats = {c["k"]: c["stats"] for c in ll["cells"] if "stats" in c}
    assert [int(r[0]) for r in rows] == [1, 2]
    for r in rows:
        st = stats[int(r[0])]
        assert r[3] == f"{st['mean_emitted']:.3f}" and r[2] == str(st["steps"])
        assert r[4] == ", ".join(f"{v:.3f}" for v in st["per_position"])

    header, rows = _table(md, "decode-cost")
    (dc,) = read_records(runs / "decode-cost.jsonl")
    assert rows[0][0] == str(dc["performance"]["programs"]["per_token"])
    header, rows = _table(md, "Sources")
    assert {r[1] for r in rows} == {"gate-0a", "decode-cost", "lossless"}

    # the calibrated figures beside the measured anchors: the three Llama pins (measured within the band), ours with
    # the record's band, the other-code 27B measurements as context
    header, rows = _table(md, "Calibrated figures")
    assert header == ["figure", "calibrated ms (band)", "roofline ms", "measured ms"]
    pins = [r for r in rows if r[0].startswith("pin: ")]
    assert len(pins) == 3 and all("measured" in r[3] for r in pins)
    c = dc["performance"]["calibrated"]
    ours = next(r for r in rows if r[0].startswith("ours: 27B plain decode"))
    assert ours[1] == f"{c['ms']:.2f} ({c['ms_low']:.2f}-{c['ms_high']:.2f})"
    assert sum(r[0].startswith("other code: ") for r in rows) == 3


def test_report_refuses_wrong_records(tmp_path):
    from qwen36.cli import main
    from qwen36.probes.records import ProbeReport, append_record, to_record

    other = tmp_path / "gdn-transaction.jsonl"
    append_record(to_record(ProbeReport(probe="gdn-transaction", backend="reference (torch CPU)", config={},
                                        cells=[{"cell": "x", "pass": True}])), other)
    notes = tmp_path / "notes.jsonl"
    notes.write_text(json.dumps({"hello": 1}) + "\n")
    text = tmp_path / "report.md"
    text.write_text("# not records\n")
    for bad, says in ((other, "records of probe 'gdn-transaction'; the report reads gate-0a, decode-cost, gate-0b, lossless, prefill-cost"), (notes, "not a probe run record"),
                      (text, "not a records file"), (tmp_path / "missing.jsonl", "no such records file")):
        with pytest.raises(SystemExit) as e:
            main(["report", str(bad), "--out", str(tmp_path / "out")])
        msg = str(e.value)
        assert msg.startswith("error: ") and "\n" not in msg and str(bad) in msg and says in msg, msg
    assert not (tmp_path / "out" / "report.md").exists()


@pytest.mark.slow
def test_report_keeps_a_measured_label(runs, tmp_path):
    """A gate-0a record shaped as the probe writes it on cards (wall-clock per component, no cost terms, label
    measured): the report labels its table measured and draws no cost-term plot."""
    from qwen36.cli import main
    from qwen36.probes.records import append_record

    (r,) = read_records(runs / "gate-0a.jsonl")
    perf = r["performance"]
    perf["label"], r["backend"] = "measured", "p150a x2 (hardware)"
    for s in perf["steps"].values():
        for key in ("categories", "programs", "programs_per_layer"):
            s.pop(key)
        s["components"] = {name: {"ms": c["ms"]} for name, c in s["components"].items()}
    for key in ("cost_model_constants", "host_readback_model"):
        perf.pop(key)
    path = tmp_path / "cards.jsonl"
    append_record(r, path)
    out = tmp_path / "report"
    assert main(["report", str(path), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Step time by component (measured, ms)" in md and "## Throughput (measured, batch 1)" in md
    assert "cost term" not in md and not (out / "step_time_by_cost_term.png").exists()
    assert (out / "step_time_by_component.png").exists() and (out / "tok_s_vs_k.png").exists()
    header, rows = _table(md, "Step time by component")
    assert dict(zip(header, rows[0]))["programs"] == "-"


@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory):
    """decode-cost at B = 1 and 4, gate-0b at B = 1 (K = 1, 3), B = 4 (K = 1, 3 costed, K = 2 refused: 12 rows) and
    B = 32 (every K refused: plain decode only), CI size."""
    from qwen36.cli import main

    d = tmp_path_factory.mktemp("batch-runs")
    for name, probe, extra in (("dc1", "decode-cost", []), ("dc4", "decode-cost", ["--batch", "4"]),
                               ("g0b1", "gate-0b", ["--ks", "1,3"]), ("g0b4", "gate-0b", ["--batch", "4", "--ks", "1,2,3"]),
                               ("g0b32", "gate-0b", ["--batch", "32", "--ks", "1"])):
        assert main(["probe", probe, "--device", "emulated-p150x2", "--preset", "ci", *extra,
                     "--records", str(d / f"{name}.jsonl")]) == 0
    return d


@pytest.mark.slow
def test_report_batch_tables(batch_runs, tmp_path):
    """Records at several B: the plain-decode table has one row per B with the record's per-user / aggregate tok/s and
    the aggregate against B = 1; the speculative table one row per (B, K) with verify rows, verify_cost_ratio and MTP
    tok/s per user and aggregate, a refused K keeps its row with the probe's reason; the
    batch-1 gate-0b table still shows the batch-1 record; the batch plot is written."""
    from qwen36.cli import main

    out = tmp_path / "report"
    assert main(["report", *sorted(map(str, batch_runs.glob("*.jsonl"))), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    data = (out / "batch_tok_s.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and "(batch_tok_s.png)" in md
    rec = {n: read_records(batch_runs / f"{n}.jsonl")[0]["performance"] for n in ("dc1", "dc4", "g0b1", "g0b4", "g0b32")}

    header, rows = _table(md, "Plain decode vs batch")
    by_b = {r[0]: dict(zip(header, r)) for r in rows}
    assert set(by_b) == {"1", "4"}
    agg1, agg4 = rec["dc1"]["modelled_aggregate_tok_s"], rec["dc4"]["modelled_aggregate_tok_s"]
    assert by_b["4"]["aggregate tok/s"] == f"{agg4:.1f}" and by_b["4"]["tok/s per user"] == f"{rec['dc4']['modelled_tok_s']:.1f}"
    assert by_b["4"]["aggregate vs B=1"] == f"{agg4 / agg1:.1f}x" and by_b["1"]["aggregate vs B=1"] == "1.0x"

    header, rows = _table(md, "Speculative step vs batch")
    by_bk = {(r[0], r[4]): dict(zip(header, r)) for r in rows}
    assert list(by_bk) == [("1", "1"), ("1", "3"), ("4", "1"), ("4", "2"), ("4", "3"), ("32", "1")]
    g1, g4 = rec["g0b1"], rec["g0b4"]
    row = by_bk[("1", "3")]
    assert row["verify_cost_ratio"] == f"{g1['verify_cost_ratio']['3']:.3f}" and row["verify rows"] == "4"
    assert row["MTP tok/s per user @ 0.8"] == f"{g1['mtp_tok_s_shadow_commit']['0.8']['3']:.1f}"
    row = by_bk[("4", "3")]
    assert row["verify_cost_ratio"] == f"{g4['verify_cost_ratio']['3']:.3f}" and row["verify rows"] == "16"
    per_user = g4["mtp_tok_s_shadow_commit"]["0.8"]["3"]
    assert row["MTP tok/s per user @ 0.8"] == f"{per_user:.1f}"
    assert row["MTP aggregate @ 0.8"] == f"{g4['mtp_aggregate_tok_s_shadow_commit']['0.8']['3']:.1f}"
    assert row["plain aggregate"] == f"{4e3 / g4['decode']['ms']:.1f}"
    assert by_bk[("4", "2")]["note"] == f"refused: {g4['ks_refused']['2']}" and by_bk[("4", "2")]["verify_cost_ratio"] == "-"
    assert by_bk[("32", "1")]["note"].startswith("refused: ") and "at most 32" in by_bk[("32", "1")]["note"]

    header, rows = _table(md, "gate-0b")  # the batch-1 record's phase table
    assert [r[0] for r in rows] == ["1", "3"] and rows[1][2] == f"{g1['verify_cost_ratio']['3']:.3f}"
    header, rows = _table(md, "Sources")
    assert sum(r[0].startswith("batch table") for r in rows) == 5
