"""Shared fixtures: project-made checkpoints (built once per session in a temp dir)."""
from __future__ import annotations

import pytest
import torch

from support.cards import card_device_or_skip_reason

# One intra-op thread for the whole suite: the shapes are tiny (batch-1 decode, emulator goldens that are many small
# torch ops), where one thread is as fast as two on an idle 2-core machine and 10-30x faster on a busy one
# (measured). Tests and commands that change it (the demo's --threads, training) are undone after each test.
TEST_TORCH_THREADS = 1
torch.set_num_threads(TEST_TORCH_THREADS)


# The slowest test files (about 50-130 s each with two workers on the 2-core CI machine), started first so that the
# two pytest-xdist workers finish together (longest first; the Makefile turns off xdist's reordering by test count).
# Every other file keeps its collection order; a listed path that no longer exists stops the run at collection.
SLOWEST_FILES_FIRST = (
    "tests/tt/serving/test_vllm_soak_replay.py", "tests/tt/serving/test_vllm_prefix_replay.py",
    "tests/probes/test_gdn_transaction_tp.py", "tests/tt/speculative/test_spec_depth.py",
    "tests/tt/speculative/test_spec_backend.py",
    "tests/speculative/test_engine.py", "tests/emulator/test_host_independence.py",
    "tests/tt/speculative/test_spec_stochastic.py", "tests/tt/speculative/test_thinking_inject.py", "tests/probes/test_lossless.py",
    "tests/tt/model/test_tt_moe.py",
)


def pytest_collection_modifyitems(config, items):
    missing = [f for f in SLOWEST_FILES_FIRST if not (config.rootpath / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FILES_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: in-file order kept


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    yield
    torch.set_num_threads(TEST_TORCH_THREADS)


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """make(preset, seed=0, wrapped=False, with_mtp=True, expert_layout="stacked") -> checkpoint dir (cached)."""
    from qwen36.tiny import PRESETS, random_weights, write_checkpoint
    from dataclasses import replace

    cache: dict = {}

    def make(preset: str = "ci", seed: int = 0, wrapped: bool = False, with_mtp: bool = True,
             expert_layout: str = "stacked"):
        key = (preset, seed, wrapped, with_mtp, expert_layout)
        if key not in cache:
            cfg = PRESETS[preset] if with_mtp else replace(PRESETS[preset], mtp_num_hidden_layers=0)
            d = tmp_path_factory.mktemp(f"ckpt-{preset}-{seed}-{'w' if wrapped else 'f'}-{'m' if with_mtp else 'nom'}"
                                        f"-{expert_layout}")
            write_checkpoint(d, cfg, random_weights(cfg, seed, with_mtp=with_mtp), wrapped=wrapped,
                             expert_layout=expert_layout)
            cache[key] = d
        return cache[key]

    return make


@pytest.fixture(scope="session")
def ci_ckpt(ckpt_factory):
    return ckpt_factory("ci")


def pytest_addoption(parser):
    parser.addoption("--tt-device", default=None,
                     help="device for the `cards`-marked tests: p150x2 (cards, or ttsim when TT_METAL_SIMULATOR is "
                          "set), p150, or emulated-p150x2 to run the same tests on the emulated mesh. Default: p150x2 "
                          "when two cards or ttsim are present, else those tests skip")


@pytest.fixture(scope="session")
def card_device(request):
    """Device name for the `cards`-marked tests, or skip naming the missing cards/simulator."""
    name, reason = card_device_or_skip_reason(request.config.getoption("--tt-device"))
    if name is None:
        pytest.skip(reason)
    return name
