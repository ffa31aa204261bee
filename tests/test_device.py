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
def test_hardware_open_on_cards():
    if dev.count_tenstorrent_cards() < 2:
        pytest.skip("needs 2 Tenstorrent P150a cards (none present on this machine)")
    with open_mesh("p150x2", trace_region_size=10_000_000) as ctx:
        assert not ctx.is_emulated and ctx.label == "p150a x2 (hardware)"
