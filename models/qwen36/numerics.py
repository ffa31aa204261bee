"""Numerics comparison helpers shared by tests and probes on every backend (torch only: no ttnn import, so the
reference lane can use them on a machine without ttnn)."""
from __future__ import annotations

import torch


def pcc(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Pearson correlation of the flattened tensors in fp64 (1.0 when both are identical constants)."""
    a = expected.detach().double().flatten()
    b = actual.detach().double().flatten()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: expected {list(expected.shape)} vs actual {list(actual.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    if torch.equal(a, b):
        return 1.0
    a, b = a - a.mean(), b - b.mean()
    den = a.norm() * b.norm()
    return float((a @ b) / den) if den > 0 else 0.0
