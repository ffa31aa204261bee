"""`qwen36 demo` on the embedded default: speculative vs plain decoding in one run, labelled with the backend."""
from __future__ import annotations

import pytest

from qwen36.cli import main


@pytest.mark.slow
def test_demo_greedy_prints_text_acceptance_and_speed(capsys):
    assert main(["demo", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "backend    : reference (torch CPU)" in out
    assert "generated (speculative):" in out and "class Counter:" in out
    assert "mean emitted/step" in out and "per-position acceptance (d1..d3)" in out
    assert "tok/s" in out and "speed-up" in out
    assert "greedy check: speculative output == plain greedy output" in out


@pytest.mark.slow
def test_demo_stochastic_with_snapshot_commit(capsys):
    assert main(["demo", "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "3", "--commit", "snapshot",
                 "--spec-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "stochastic (T=0.8" in out and "commit=snapshot" in out and "d1..d2" in out


def test_demo_refuses_unknown_device(capsys):
    assert main(["demo", "--device", "no-such-device"]) == 2
    assert "error: unknown --device 'no-such-device'" in capsys.readouterr().err


@pytest.mark.slow  # the demo on the emulated mesh
def test_demo_on_the_emulated_mesh_uses_one_mesh_and_says_so(capsys):
    """Regression: the demo read backend.model.config (absent on the TT backend) and opened a second mesh with a
    different precision preset for the plain baseline. Now plain decoding runs on the spec backend's own model."""
    assert main(["demo", "--device", "emulated-p150x2", "--max-new-tokens", "12", "--spec-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "emulated-p150x2 (ttnn goldens on CPU)" in out
    assert "greedy check: speculative output == plain greedy output" in out
    assert "not a card figure" in out


def test_demo_refuses_zero_draft_depth(capsys):
    assert main(["demo", "--spec-k", "0"]) == 2
    assert "--spec-k must be >= 1" in capsys.readouterr().err


def test_demo_stochastic_with_argmax_drafts_flag(capsys):
    """--draft greedy reaches SamplingParams (stochastic acceptance against one-hot draft distributions)."""
    assert main(["demo", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "1", "--draft", "greedy",
                 "--spec-k", "2"]) == 0
    assert "drafts=greedy" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["demo", "--draft", "sometimes"])


def _logprob_rows(out: str, title: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"{title} logprobs (raw;"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        rows.append(line.split())
    return rows


def test_demo_logprobs_prints_both_runs_and_they_agree(capsys):
    """--logprobs N: one line per emitted token for the speculative and the plain run (id, logprob, rank, N top
    id:logprob pairs), and the two runs' logprobs of their shared tokens agree to rounding (greedy: all shared)."""
    n_new, n_top = 10, 3
    assert main(["demo", "--max-new-tokens", str(n_new), "--logprobs", str(n_top)]) == 0
    out = capsys.readouterr().out
    spec, plain = _logprob_rows(out, "speculative"), _logprob_rows(out, "plain")
    assert len(spec) == len(plain) == n_new
    for s, p in zip(spec, plain):
        assert s[1] == p[1]  # same token id (greedy speculative == plain greedy)
        bar = s.index("|")
        tops = s[bar + 1: bar + 1 + n_top]
        assert len(tops) == n_top and all(":" in t for t in tops)
        # rank 1 <=> the emitted token is the first top entry; its logprob is that entry's value
        if s[3] == "1":
            assert tops[0].split(":")[0] == s[1] and float(tops[0].split(":")[1]) == pytest.approx(float(s[2]), abs=1e-4)
        assert float(s[2]) == pytest.approx(float(p[2]), abs=1e-3)
    check = next(l for l in out.splitlines() if l.startswith("logprobs check:"))
    assert f"{n_new} shared leading tokens" in check
    assert float(check.split("=")[1].split()[0]) < 1e-3


def test_demo_without_logprobs_prints_none(capsys):
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "logprobs (raw;" not in out and "logprobs check" not in out


def test_demo_refuses_logprobs_beyond_the_maximum(capsys):
    assert main(["demo", "--logprobs", "21"]) == 2
    assert "logprobs must be an integer in [0, 20]" in capsys.readouterr().err
