"""Output a user can live with: ttnn's import-time config dump and tt-metal's device-layer info lines stay out
of the default output (``--verbose`` brings them back), our own DEBUG lines too, and progress bars have totals."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Opens an emulated mesh and converts one bfloat8_b tensor: the host-side conversion opens tt-metal's (mocked)
# UMD cluster, which is what logs the "Opening user mode device driver" / "Cluster destructor" lines.
OPEN_AND_CONVERT = """
import sys
if sys.argv[1] == "verbose":
    from qwen36.tt_ops.ttnn_env import set_verbose
    set_verbose(True)
import torch
from qwen36.tt_ops.device import open_mesh
with open_mesh("emulated-p150") as ctx:
    ttnn = ctx.ttnn
    ttnn.from_torch(torch.ones(32, 32), dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=ctx.mesh_device)
print("converted")
"""


def run_python(code: str, *args: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TT_LOGGER_LEVEL", "TT_METAL_MOCK_CLUSTER_DESC_PATH")}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # two fresh interpreters importing ttnn
def test_ttnn_logs_hidden_by_default_and_back_with_verbose():
    quiet = run_python(OPEN_AND_CONVERT, "quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "converted\n"  # no tt-metal info lines mixed into stdout, at open or at exit
    assert "Initial ttnn.CONFIG" not in quiet.stderr
    assert "opened emulated-p150" in quiet.stderr  # our own INFO line still says what ran

    loud = run_python(OPEN_AND_CONVERT, "verbose")
    assert loud.returncode == 0, loud.stderr
    assert "Initial ttnn.CONFIG" in loud.stderr
    assert "Opening user mode device driver" in loud.stdout and "Cluster destructor" in loud.stdout


def test_device_log_levels(monkeypatch):
    from qwen36.tt_ops import ttnn_env

    assert ttnn_env.device_log_level(emulated=True) == "error"  # its one warning: "the cluster is mocked"
    assert ttnn_env.device_log_level(emulated=False) == "warn"  # cards: keep tt-metal's warnings
    monkeypatch.setenv(ttnn_env.LOG_LEVEL_ENV, "trace")
    monkeypatch.setattr(ttnn_env, "_USER_LEVEL", "trace")  # as if set before the package was imported
    ttnn_env.configure_device_logs(emulated=True)
    assert os.environ[ttnn_env.LOG_LEVEL_ENV] == "trace"  # a level the user chose is never overridden


def test_cli_log_level(capsys, tmp_path):
    from loguru import logger

    from qwen36.cli import main

    assert main(["make-tiny", str(tmp_path / "a")]) == 0
    logger.debug("a debug line")
    logger.info("an info line")
    err = capsys.readouterr().err
    assert "an info line" in err and "a debug line" not in err and "wrote ci checkpoint" in err
    assert main(["--verbose", "make-tiny", str(tmp_path / "b")]) == 0
    logger.debug("a debug line")
    assert "a debug line" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path / "c")]) == 0  # back to the default: one handler, not two
    logger.info("once")
    assert capsys.readouterr().err.count("once") == 1


def test_weight_conversion_bar_has_a_total(ci_ckpt, monkeypatch):
    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.model import weights as weights_mod
    from qwen36.tt.model.model_config import TTModelArgs
    from qwen36.tt_ops.device import open_mesh

    bars = []

    class RecordingBar:
        def __init__(self, **kw):
            self.total, self.n, self.closed = kw.get("total"), 0, False
            bars.append(self)

        def set_postfix_str(self, *a, **kw):
            pass

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(weights_mod, "tqdm", RecordingBar)
    reader = load_checkpoint(ci_ckpt)
    with open_mesh("emulated-p150x2") as ctx:
        args = TTModelArgs.from_config(reader.config, 2, max_seq_len=64)
        weights_mod.WeightLoader(reader, args, ctx.ttnn, ctx.mesh_device, progress=True).load(layers=[0, 1])
    (bar,) = bars
    assert bar.total == 4 and bar.n == bar.total and bar.closed  # embedding, 2 layers, head + RoPE tables


def test_quiet_level_comes_back_after_verbose(monkeypatch):
    """Regression: an in-process `qwen36 --verbose` run left TT_LOGGER_LEVEL at info, so a later command in the
    same process (the test suite) printed tt-metal's cluster lines again when its first block-float conversion
    opened the cluster."""
    from qwen36.tt_ops import ttnn_env
    from qwen36.tt_ops.device import open_mesh

    monkeypatch.setattr(ttnn_env, "_USER_LEVEL", None)
    monkeypatch.delenv(ttnn_env.LOG_LEVEL_ENV, raising=False)
    try:
        ttnn_env.set_verbose(True)
        assert os.environ[ttnn_env.LOG_LEVEL_ENV] == "info"
    finally:
        ttnn_env.set_verbose(False)
    assert os.environ[ttnn_env.LOG_LEVEL_ENV] == "warn"
    with open_mesh("emulated-p150"):
        assert os.environ[ttnn_env.LOG_LEVEL_ENV] == "error"
