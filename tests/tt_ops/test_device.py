"""Device entry point: explicit backend choice, fail-fast without cards, labels from what ran."""

from __future__ import annotations

import pathlib

import pytest

from qwen36.tt_ops import device as dev
from qwen36.tt_ops.device import DeviceSelectionError, open_mesh, resolve_device_name


@pytest.fixture
def no_cards(monkeypatch, tmp_path):
    monkeypatch.setattr(dev, "TT_DEVICE_DIR", tmp_path / "tenstorrent-absent")
    ttnn = pytest.importorskip("ttnn")

    def boom(*a, **k):  # the check must happen before any ttnn device API is touched
        raise AssertionError("ttnn device API touched")

    monkeypatch.setattr(ttnn, "open_mesh_device", boom)
    monkeypatch.setattr(ttnn, "set_fabric_config", boom)


@pytest.mark.parametrize("name,alt", [("p150", "emulated-p150"), ("p150x2", "emulated-p150x2"),
                                      ("p150x4", "emulated-p150x4")])
def test_hardware_without_cards_fails_fast_naming_emulator(no_cards, name, alt):
    with pytest.raises(DeviceSelectionError) as e:
        open_mesh(name)
    msg = str(e.value)
    assert "no cards are present" in msg
    assert f"--device {alt}" in msg
    assert "no automatic fallback" in msg.lower()


def test_mesh_device_env_is_hardware_only(no_cards, monkeypatch):
    monkeypatch.setenv("MESH_DEVICE", "P300")
    assert resolve_device_name(None) == "p150x2"
    assert resolve_device_name("auto") == "p150x2"
    with pytest.raises(DeviceSelectionError, match="emulated-p150x2"):
        open_mesh(None)
    monkeypatch.setenv("MESH_DEVICE", "P150x4")
    assert resolve_device_name(None) == "p150x4"
    monkeypatch.setenv("MESH_DEVICE", "N300")
    with pytest.raises(DeviceSelectionError, match="P150, P300, P150x4"):
        resolve_device_name(None)
    monkeypatch.delenv("MESH_DEVICE")
    with pytest.raises(DeviceSelectionError, match="no device chosen"):
        resolve_device_name(None)


def test_unknown_device_name():
    with pytest.raises(DeviceSelectionError, match="unknown device"):
        resolve_device_name("emulated-n300")


def test_card_count_detection(tmp_path):
    d = tmp_path / "tt"
    assert dev.count_tenstorrent_cards(d) == 0
    d.mkdir()
    (d / "0").touch()
    (d / "1").touch()
    assert dev.count_tenstorrent_cards(d) == 2


def test_too_few_cards(monkeypatch, tmp_path):
    d = tmp_path / "tt"
    d.mkdir()
    (d / "0").touch()
    monkeypatch.setattr(dev, "TT_DEVICE_DIR", d)
    with pytest.raises(DeviceSelectionError, match="only 1 are present"):
        open_mesh("p150x2")


@pytest.mark.parametrize("name,n", [("emulated-p150", 1), ("emulated-p150x2", 2), ("emulated-p150x4", 4)])
def test_emulated_context(name, n):
    pytest.importorskip("ttnn")
    with open_mesh(name, trace_region_size=123, l1_small_size=456) as ctx:
        assert ctx.is_emulated and ctx.num_devices == n and ctx.mesh_shape == (1, n)
        assert ctx.label == f"{name} (ttnn goldens on CPU)"
        assert ctx.describe()["backend"] == ctx.label
        assert ctx.mesh_device.trace_region_size == 123 and ctx.mesh_device.l1_small_size == 456
        assert ctx.ttnn.is_emulated
        assert ctx.mesh_device.arch() == ctx.ttnn.Arch.BLACKHOLE
        assert pathlib.Path(ctx.mesh_device.mock_cluster_desc).is_file()
    assert ctx.mesh_device._closed


@pytest.mark.cards
def test_hardware_open_on_cards(card_device):
    with open_mesh(card_device, trace_region_size=10_000_000) as ctx:
        assert ctx.label == dev.backend_label(card_device, dev.select_backend(card_device))
        assert ctx.is_emulated == (ctx.backend == dev.EMULATED)


class _FakeMesh:
    """Stands in for ttnn's mesh device so the hardware code path runs without cards (nothing else is faked)."""


@pytest.fixture
def fake_ttnn_device_api(monkeypatch):
    ttnn = pytest.importorskip("ttnn")
    calls = []
    monkeypatch.setattr(ttnn, "open_mesh_device", lambda shape, **kw: calls.append(("open", kw)) or _FakeMesh())
    monkeypatch.setattr(ttnn, "close_mesh_device", lambda mesh: calls.append(("close", mesh)))
    monkeypatch.setattr(ttnn, "set_fabric_config", lambda cfg, *rest: calls.append(("fabric", cfg)))
    monkeypatch.delenv("TT_METAL_MOCK_CLUSTER_DESC_PATH", raising=False)  # the emulator sets it in-process
    return calls


def _fake_cards(monkeypatch, tmp_path, n):
    d = tmp_path / "tenstorrent"
    d.mkdir()
    for i in range(n):
        (d / str(i)).touch()
    monkeypatch.setattr(dev, "TT_DEVICE_DIR", d)


def _fake_ttsim(monkeypatch, tmp_path, *, soc=True, slow_dispatch="1"):
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "libttsim_bh.so").touch()
    if soc:
        (sim / "soc_descriptor.yaml").touch()
    monkeypatch.setenv("TT_METAL_SIMULATOR", str(sim / "libttsim_bh.so"))
    if slow_dispatch is None:
        monkeypatch.delenv("TT_METAL_SLOW_DISPATCH_MODE", raising=False)
    else:
        monkeypatch.setenv("TT_METAL_SLOW_DISPATCH_MODE", slow_dispatch)


@pytest.mark.parametrize("case", ["emulated", "simulator", "hardware"])
def test_label_follows_the_backend_that_ran(case, monkeypatch, tmp_path, fake_ttnn_device_api):
    """The label comes from what selected the backend at run time: the device name plus the environment
    (cards in /dev/tenstorrent, TT_METAL_SIMULATOR). Only the detection inputs are faked; the label and the
    record are produced by the real code."""
    from qwen36.probes.records import ProbeReport, to_record

    monkeypatch.delenv("TT_METAL_SIMULATOR", raising=False)
    monkeypatch.setattr(dev, "TT_DEVICE_DIR", tmp_path / "no-cards")
    name = "emulated-p150x2" if case == "emulated" else "p150x2"
    if case == "simulator":
        _fake_ttsim(monkeypatch, tmp_path)
    if case == "hardware":
        _fake_cards(monkeypatch, tmp_path, 2)
    with open_mesh(name) as ctx:
        label = ctx.label
        assert ctx.backend == case
        assert ctx.is_emulated == (case == "emulated") and ctx.is_simulated == (case == "simulator")
        assert ctx.describe()["backend_kind"] == case
        assert ctx.ttnn_version == dev.installed_ttnn_version()
    record = to_record(ProbeReport(probe="label-check", backend=label, config={}, cells=[{"pass": True}]))
    expected = {"emulated": "emulated-p150x2 (ttnn goldens on CPU)", "simulator": "p150a x2 on ttsim (simulator)",
                "hardware": "p150a x2 (hardware)"}[case]
    assert label == expected and record["backend"] == expected
    assert ("hardware" in label) == (case == "hardware")  # a simulator run never reads as hardware
    assert ("ttsim (simulator)" in label) == (case == "simulator")
    if case != "emulated":
        kinds = [c[0] for c in fake_ttnn_device_api]
        assert kinds == ["fabric", "open", "close", "fabric"]  # the hardware code path ran (and closed)


def test_simulator_misconfiguration_fails_fast(monkeypatch, tmp_path, fake_ttnn_device_api):
    monkeypatch.setattr(dev, "TT_DEVICE_DIR", tmp_path / "no-cards")
    monkeypatch.setenv("TT_METAL_SIMULATOR", str(tmp_path / "missing" / "libttsim_bh.so"))
    with pytest.raises(DeviceSelectionError, match="is not a file"):
        open_mesh("p150x2")
    _fake_ttsim(monkeypatch, tmp_path, soc=False)
    with pytest.raises(DeviceSelectionError, match="soc_descriptor.yaml"):
        open_mesh("p150")
    (tmp_path / "sim" / "soc_descriptor.yaml").touch()
    monkeypatch.delenv("TT_METAL_SLOW_DISPATCH_MODE", raising=False)
    with pytest.raises(DeviceSelectionError, match="TT_METAL_SLOW_DISPATCH_MODE=1"):
        open_mesh("p150")
    assert fake_ttnn_device_api == []  # nothing reached ttnn's device API


def test_no_cards_error_names_the_simulator(no_cards, monkeypatch):
    monkeypatch.delenv("TT_METAL_SIMULATOR", raising=False)
    with pytest.raises(DeviceSelectionError, match="TT_METAL_SIMULATOR"):
        open_mesh("p150x2")


def test_ttnn_version_guard_warns_naming_both_versions():
    from loguru import logger

    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        assert dev.check_ttnn_version("0.82.0") == "0.82.0"
        assert dev.check_ttnn_version(dev.EXPECTED_TTNN_VERSION) == dev.EXPECTED_TTNN_VERSION
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "0.82.0" in lines[0] and dev.EXPECTED_TTNN_VERSION in lines[0]


def test_records_carry_the_installed_ttnn_version(monkeypatch):
    from qwen36.probes import records

    monkeypatch.setattr(records, "installed_ttnn_version", lambda: "9.9.9-src")
    r = records.to_record(records.ProbeReport(probe="x", backend="b", config={}, cells=[]))
    assert r["ttnn_version"] == "9.9.9-src"
