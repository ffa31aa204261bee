"""Expected errors are one line: a user mistake prints `error: ...` on stderr and exits 2 without a traceback;
an unexpected failure keeps its traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen36.cli import main
from qwen36.errors import UserError
from qwen36.testing.cli import assert_one_line_error, run_cli, run_cli_streams as cli



def test_missing_checkpoint(capsys, tmp_path):
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(tmp_path / "nope"), "--ids", "1,2")
    assert_one_line_error(rc, err, "checkpoint directory", "does not exist")
    rc, err = run_cli(capsys, "demo", "--checkpoint", str(tmp_path))
    assert_one_line_error(rc, err, "config.json missing")


def test_malformed_checkpoint(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    rc, err = run_cli(capsys, "logits", "--checkpoint", str(tmp_path), "--ids", "1", "--out", str(tmp_path / "l.st"))
    assert_one_line_error(rc, err)


def test_bad_ids(capsys, ci_ckpt, tmp_path):
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,x")
    assert_one_line_error(rc, err, "--ids must be comma-separated integers")
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,99999999")
    assert_one_line_error(rc, err, "outside the vocabulary")
    rc, err = run_cli(capsys, "logits", "--checkpoint", str(ci_ckpt), "--ids", "99999999", "--out", str(tmp_path / "l"))
    assert_one_line_error(rc, err, "outside the vocabulary")


def test_prompt_without_tokenizer(capsys, ci_ckpt, tmp_path):
    for f in Path(ci_ckpt).iterdir():  # the checkpoint without its tokenizer files
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt", "def f(x):")
    assert_one_line_error(rc, err, "no tokenizer files", "--ids")


def test_unknown_preset_probe_and_device(capsys, tmp_path):
    rc, err = run_cli(capsys, "make-tiny", str(tmp_path / "t"), "--preset", "no-such-preset")
    assert_one_line_error(rc, err, "no-such-preset")
    rc, err = run_cli(capsys, "probe", "no-such-probe")
    assert_one_line_error(rc, err, "no-such-probe")
    rc, err = run_cli(capsys, "generate", "--ids", "1", "--device", "tpu-v9")
    assert_one_line_error(rc, err, "unknown --device 'tpu-v9'")
    rc, err = run_cli(capsys, "probe", "gdn-transaction", "--device", "emulated-p150x2")
    assert_one_line_error(rc, err, "gdn-transaction-tp")


def test_bad_sampling_and_k(capsys, ci_ckpt):
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--spec-k", "-1")
    assert_one_line_error(rc, err, "--spec-k must be >= 0")
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--spec-k", "2", "--top-p", "0")
    assert_one_line_error(rc, err, "top_p")
    rc, err = run_cli(capsys, "demo", "--spec-k", "0")
    assert_one_line_error(rc, err, "--spec-k must be >= 1")


@pytest.mark.parametrize("flag,value,fragment", [
    ("--temperature", "-0.5", "temperature must be >= 0"), ("--top-p", "1.5", "top_p must be in (0, 1]"),
    ("--min-p", "2", "min_p must be in [0, 1]"), ("--top-k", "-3", "top_k must be an integer >= 1"),
    ("--repetition-penalty", "0", "repetition_penalty must be > 0"),
    ("--presence-penalty", "3", "presence_penalty must be in [-2, 2]"),
    ("--frequency-penalty", "-2.5", "frequency_penalty must be in [-2, 2]"),
    ("--logprobs", "21", "logprobs must be an integer in [0, 20]"), ("--logprobs", "-1", "logprobs must be"),
])
def test_bad_sampling_values_plain_and_speculative(capsys, ci_ckpt, flag, value, fragment):
    """Refused before any model loads, with the same message on plain and speculative decoding."""
    for spec in ("0", "2"):
        rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--spec-k", spec,
                          flag, value)
        assert_one_line_error(rc, err, fragment)


def test_several_prompts_plain_sampling_equals_each_prompt_alone(capsys, ci_ckpt):
    """A sampled, penalised or logprobs plain batch on the reference runs the one plain driver (each user its own
    slot, generator and penalties): every prompt's output lines equal its own run (regression: this was refused
    while the reference's plain batch was a greedy-only loop of its own)."""
    for extra in (["--temperature", "0.7", "--seed", "3"], ["--repetition-penalty", "1.2"], ["--logprobs", "2"]):
        base = ["generate", "--checkpoint", str(ci_ckpt), "--max-new-tokens", "3", *extra]
        alone = []
        for ids in ("1,2", "3"):
            rc, out, err = cli(capsys, *base, "--ids", ids)
            assert rc == 0, err
            alone.append(out.splitlines())
        rc, out, err = cli(capsys, *base, "--ids", "1,2", "--ids", "3")
        assert rc == 0, err
        lines = out.splitlines()
        assert [l for l in lines if l.startswith("ids[")] == [f"ids[{i}]: " + a[0].removeprefix("ids: ")
                                                             for i, a in enumerate(alone)]
        assert "batch 2" in err


def test_precision_is_a_tt_option(capsys, ci_ckpt):
    """--precision picks the TT preset of plain and speculative decoding alike; on the reference it is refused in
    one line (the reference's numerics are --dtype), plain and speculative alike."""
    for extra in ([], ["--spec-k", "2"]):
        rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--max-new-tokens", "2",
                          "--precision", "accuracy", *extra)
        assert_one_line_error(rc, err, "--precision applies to the TT devices", "--dtype")


def test_plain_and_speculative_generate_load_the_same_tt_precision(monkeypatch):
    """Regression: plain `generate` on TT loaded the performance preset and `--spec-k` the accuracy preset, so at a
    near tie the two CLI paths decoded different models (prompt 5,6,1734 of the shipped checkpoint: the reference's
    top-2 logits differ by 0.003, and the two presets pick different first tokens). Both now take --precision
    (default performance)."""
    import argparse

    from qwen36.commands import generate

    seen = {}

    def fake_target(ckpt, device, dtype=None, precision="performance", **kw):
        seen.setdefault("plain" if not kw.get("require_mtp") else "spec", []).append(precision)
        raise SystemExit(0)

    monkeypatch.setattr("qwen36.tt.runtime.generator.build_generator", fake_target)
    for extra in ([], ["--spec-k", "2"], ["--precision", "accuracy"], ["--precision", "accuracy", "--spec-k", "2"],
                  ["--ids", "3,4", "--spec-k", "2"]):
        ns = argparse.ArgumentParser()
        sub = ns.add_subparsers()
        generate.add_parser(sub, "generate")
        args = ns.parse_args(["generate", "--ids", "1,2", "--device", "emulated-p150x2", *extra])
        with pytest.raises(SystemExit):
            args.run(args)
    assert seen == {"plain": ["performance", "accuracy"], "spec": ["performance", "accuracy", "performance"]}, seen


def test_no_cards(capsys, monkeypatch, ci_ckpt, tmp_path):
    from qwen36.tt_ops import device

    monkeypatch.setattr(device, "TT_DEVICE_DIR", tmp_path / "no-tenstorrent")  # whatever this machine has
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--device", "p150x2")
    assert_one_line_error(rc, err, "no cards are present", "--device emulated-p150x2")


def test_k_too_large_for_the_verify_kernel(capsys, ci_ckpt):
    """On-device acceptance draws K+1 uniforms from one 32-wide RNG row, so K <= 31 on the TT backend."""
    rc, err = run_cli(capsys, "generate", "--checkpoint", str(ci_ckpt), "--ids", "1,2", "--max-new-tokens", "2",
                      "--device", "emulated-p150x2", "--spec-k", "40")
    assert_one_line_error(rc, err, "k=40", "at most 31 drafts")


def test_unexpected_failure_keeps_its_traceback(monkeypatch, tmp_path):
    from qwen36.commands import make_tiny

    def boom(args):
        raise RuntimeError("a bug, not a user mistake")

    monkeypatch.setattr(make_tiny, "run", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["make-tiny", str(tmp_path / "t")])


def test_library_errors_are_user_errors_and_keep_their_builtin_types():
    from qwen36.checkpoint import CheckpointError
    from qwen36.config import ConfigError
    from qwen36.tokenizer import TokenizerMissingError
    from qwen36.tt.spec.accept import DraftDepthError
    from qwen36.tt.model.model_config import TPSplitError
    from qwen36.tt.spec.verify import VerifyShapeError
    from qwen36.tt_ops.device import DeviceSelectionError

    for cls, builtin in [(CheckpointError, ValueError), (ConfigError, ValueError), (TPSplitError, ValueError),
                         (VerifyShapeError, ValueError), (DraftDepthError, ValueError), (DeviceSelectionError, RuntimeError),
                         (TokenizerMissingError, FileNotFoundError)]:
        assert issubclass(cls, UserError) and issubclass(cls, builtin), cls


@pytest.mark.slow  # a fresh interpreter importing torch
def test_installed_command_prints_one_line(tmp_path):
    """Through a real process: only `error: ...` on stderr, exit status 2."""
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-m", "qwen36.cli", "generate", "--checkpoint", str(tmp_path / "nope"),
                           "--ids", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: checkpoint directory {tmp_path / 'nope'} (--checkpoint) does not exist\n"
    assert proc.stdout == ""
