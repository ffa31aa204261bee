"""Helpers the op modules (``ops_*``) share: an op call's arguments bound to its real ttnn signature, the
per-device byte accounting of what an op really reads or writes (``read_bytes`` / ``written_bytes`` of
``registry.device_op``), and one device's shard of an index tensor as int64."""

from __future__ import annotations

import torch

from .tensor import EmuTensor, dtype_name
from .ttnn_import import ttnn



def shard_ints(t: EmuTensor | None, i: int) -> torch.Tensor | None:
    if t is None:
        return None
    return t.shards[i].to(torch.int64).reshape(-1) if t.shards[i].ndim <= 1 else t.shards[i].to(torch.int64)


def add_bytes(d: dict, t: EmuTensor | None, nbytes: int | None = None) -> None:
    if t is None:
        return
    k = dtype_name(t.dtype)
    d[k] = d.get(k, 0) + (t.bytes_per_device() if nbytes is None else nbytes)


def bind_op(name, args, kwargs):
    from .signatures import bind_arguments

    real = ttnn
    for part in name.split(".")[1:]:
        real = getattr(real, part)
    return bind_arguments(name, real, args, kwargs)
