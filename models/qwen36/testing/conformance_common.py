"""What the emulator's conformance-case modules share: the case record, PCC, device upload/readback helpers and the
refusal check (``emulator_conformance`` and ``conformance_kda`` both build their cases from it)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class Case:
    op: str
    name: str
    source: str
    fn: Callable | None = None  # fn(ttnn, mesh) -> None; raises AssertionError on a mismatch
    skip: str | None = None  # why the emulator cannot express this case
    ci: bool = True  # in the CI subset (tests/emulator/test_conformance.py); the probe runs every case


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = a.norm() * b.norm()
    return 1.0 if den == 0 else float((a @ b) / den)


def _dev(ttnn, mesh, x, dtype=None, layout=None, mapper=None):
    return ttnn.from_torch(x, dtype=dtype or ttnn.bfloat16, layout=layout or ttnn.TILE_LAYOUT, device=mesh,
                           mesh_mapper=mapper)


def _one(ttnn, mesh, t):
    """Device 0's shard as torch."""
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()


def _expect_rejected(fn, needle):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the emulator's EmulatorError or a card's TT_FATAL
        assert needle in str(e), str(e)
    else:
        raise AssertionError(f"accepted a call the device op rejects ({needle})")
