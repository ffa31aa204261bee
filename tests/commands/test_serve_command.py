"""`qwen36 serve`: the `vllm serve` command line it builds (Qwen3.6's parsers on, one prompt per prefill, the cards'
trace and fabric settings only on cards), and the launches it refuses before vLLM starts, each with one line. The
server itself runs in tests/tt/serving/test_chat_api_dev.py (dev-only) and scripts/chat_api_table.py."""
from __future__ import annotations

import importlib.util
import json

import pytest

from qwen36.cli import build_parser
from qwen36.commands import serve
from qwen36.testing.cli import assert_one_line_error, run_cli


def argv_of(*cli: str) -> list[str]:
    args = build_parser().parse_args(["serve", *cli])
    return serve.vllm_argv(args, serve.resolve_checkpoint(args.checkpoint))


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_vllm_command_line():
    from qwen36 import DEFAULT_CHECKPOINT

    argv = argv_of("--device", "emulated-p150x2", "--port", "8123", "--max-num-seqs", "4", "--max-model-len", "2048",
                   "--", "--generation-config", "vllm")
    assert argv[0] == str(DEFAULT_CHECKPOINT)
    assert option(argv, "--reasoning-parser") == "qwen3" and option(argv, "--tool-call-parser") == "qwen3_coder"
    assert "--enable-auto-tool-choice" in argv
    assert option(argv, "--max-num-seqs") == "4" and option(argv, "--max-model-len") == "2048"
    assert option(argv, "--max-num-batched-tokens") == "2048" and option(argv, "--block-size") == "64"
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--no-async-scheduling"):
        assert flag in argv
    assert json.loads(option(argv, "--additional-config")) == {"tt": {"trace_mode": "all",
                                                                       "optimizations": "performance"}}
    assert option(argv, "--host") == "127.0.0.1" and option(argv, "--port") == "8123"
    assert argv[-2:] == ["--generation-config", "vllm"] and "--speculative-config" not in argv
    cards = argv_of("--device", "p150x2", "--spec-k", "auto", "--tool-call-parser", "none", "--reasoning-parser",
                    "none", "--precision", "accuracy")
    tt = json.loads(option(cards, "--additional-config"))["tt"]
    assert tt == {"trace_mode": "all", "optimizations": "accuracy", "trace_region_size": 67108864,
                  "fabric_config": "FABRIC_1D", "spec_depth": "auto"}
    assert json.loads(option(cards, "--speculative-config")) == {
        "method": "custom_class", "model": "vllm_tt_plugin.model_owned_drafter", "num_speculative_tokens": 7}
    assert not {"--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"} & set(cards)


def test_usage_errors(capsys):
    for bad, what in ((["--device", "reference"], "invalid choice"), (["--device", "p150x2", "--spec-k", "0"], "spec-k"),
                      (["--device", "p150x2", "--max-num-seqs", "33"], "1..32")):
        rc, err = run_cli(capsys, "serve", *bad)
        assert rc == 2 and what in err, err


@pytest.fixture
def installed(monkeypatch):
    """vLLM and the plugin "installed" as e3fc849 is: no speculative runner (CI installs neither)."""
    real = importlib.util.find_spec
    present = {"vllm", "vllm_tt_plugin"}
    monkeypatch.setattr(serve.importlib.util, "find_spec",
                        lambda name, *a: object() if name in present else (None if name.startswith("vllm") else
                                                                           real(name, *a)))


def test_refusals_before_vllm_starts(capsys, tmp_path, ci_ckpt, installed):
    rc, err = run_cli(capsys, "serve", "--device", "emulated-p150x2", "--checkpoint", str(tmp_path))
    assert_one_line_error(rc, err, "no config.json")
    from qwen36.tt_ops.device import count_tenstorrent_cards, simulator_path

    if count_tenstorrent_cards() < 2 and simulator_path() is None:  # no cards: named, with the emulated alternative
        rc, err = run_cli(capsys, "serve", "--device", "p150x2")
        assert_one_line_error(rc, err, "needs two P150a cards", "--device emulated-p150x2")
    rc, err = run_cli(capsys, "serve", "--device", "emulated-p150x2", "--spec-k", "3")
    assert_one_line_error(rc, err, "--spec-k", "no speculative runner", "vllm_tt_plugin.spec_decode")
    # the parsers read <think> / <tool_call>: a checkpoint whose tokenizer lacks the chat format is refused with them
    rc, err = run_cli(capsys, "serve", "--device", "emulated-p150x2", "--checkpoint", str(ci_ckpt))
    assert_one_line_error(rc, err, "no single token for '<think>'")


def test_refused_without_vllm(capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    rc, err = run_cli(capsys, "serve", "--device", "emulated-p150x2")
    assert_one_line_error(rc, err, "needs vLLM 0.25.1", "scripts/install_vllm_tt.sh")
