"""Whether the `cards`-marked tests can run: the device they run on, or the reason naming what is missing."""
from __future__ import annotations


def card_device_or_skip_reason(requested: str | None, need: int = 2) -> tuple[str | None, str | None]:
    """(device, None) when the card tests can run, else (None, reason naming what is missing)."""
    from qwen36.tt_ops.device import (EMULATED_DEVICES, HARDWARE_DEVICES, SIMULATOR, resolve_device_name,
                                 select_backend, count_tenstorrent_cards)

    name = resolve_device_name(requested or "p150x2")
    n = EMULATED_DEVICES.get(name) or HARDWARE_DEVICES[name]
    if n < need:
        return None, f"needs a {need}-device mesh; --tt-device {name} has {n}"
    if name in EMULATED_DEVICES or select_backend(name) == SIMULATOR:
        return name, None
    cards = count_tenstorrent_cards()
    if cards < n:
        return None, (f"needs {n} Tenstorrent P150a cards for --device {name} ({cards} present on this machine) "
                      "or the ttsim simulator (TT_METAL_SIMULATOR unset); pass --tt-device emulated-p150x2 to run "
                      "these tests on the emulated mesh")
    return name, None
