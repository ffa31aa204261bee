"""What the restated Tenstorrent op-test files share (``qwen36.testing.conformance_tt_tests`` lists the files): the
case record, the file's ``expect_error`` and PCC checks, and seeded random inputs (a generator per case, so running a
case never moves torch's global random state)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..numerics import pcc


@dataclasses.dataclass
class TTCase:
    op: str
    name: str
    fn: Callable | None  # fn(ttnn, mesh); raises on a mismatch
    mesh: str = "device"  # "device" (the file's single-device fixture) or "mesh2" (its two-device mesh_device)
    skip: str | None = None
    suite: bool = True  # carried by the conformance suite
    ci: bool = False  # in its CI subset
    trace_region: int = 0  # the file's device_params


def randn(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=dtype)


def raises(fn, needle: str) -> None:
    """The files' ``expect_error(RuntimeError, needle)``: a RuntimeError whose text contains ``needle``."""
    try:
        fn()
    except RuntimeError as e:
        assert needle in str(e), f"refused, but not with {needle!r}: {e}"
    else:
        raise AssertionError(f"accepted a call the device op refuses ({needle!r})")


def host0(ttnn, t) -> torch.Tensor:
    """The first device's tensor as torch."""
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0])


def pcc_at_least(want: torch.Tensor, got: torch.Tensor, gate: float) -> None:
    p = pcc(want.double(), got.double())
    assert p >= gate, f"PCC {p:.6f} < {gate}"


def two_devices(mesh) -> None:
    assert mesh.get_num_devices() >= 2, "this case needs a two-device mesh (Tenstorrent's mesh_device [2])"
