"""Override table of the emulating namespace: ops and host functions the emulator implements itself.

``@device_op("ttnn.name")`` registers a device op (validated against the real signature, counted,
recorded during trace capture; implementation receives EmuTensors). ``@host_fn("ttnn.name")`` registers
a host/control function (tensor transfer, traces, mappers); it receives the mesh as first argument.
A registration for a name the installed ttnn lacks is never reachable: the namespace looks the name up
in the real module first.

This module imports nothing from the emulator at import time (it sits at the bottom of the import chain);
``load_all`` imports the op modules, which register themselves, on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass
class OverrideSpec:
    kind: str  # "op" | "host"
    fn: Callable
    collective_bytes: Callable | None = None
    validate: bool = True
    # optional accounting overrides: fn(args, kwargs, out) -> {dtype_name: bytes per device}
    read_bytes: Callable | None = None
    written_bytes: Callable | None = None


OVERRIDES: dict[str, OverrideSpec] = {}

_MODULES = ("ops_core", "ops_mappers", "ops_compute", "ops_ccl", "ops_attention", "ops_kv_cache", "ops_gdn",
            "ops_trace", "ops_sampling", "ops_gather", "ops_sparse", "ops_sdpa_prefill", "ops_kda", "ops_gdn_chunk",
            "ops_kda_scan")
_loaded = False


def device_op(*names: str, collective_bytes: Callable | None = None, read_bytes: Callable | None = None,
              written_bytes: Callable | None = None):
    def deco(fn):
        for n in names:
            OVERRIDES[n] = OverrideSpec("op", fn, collective_bytes, True, read_bytes, written_bytes)
        return fn

    return deco


def host_fn(*names: str, validate: bool = True):
    def deco(fn):
        for n in names:
            OVERRIDES[n] = OverrideSpec("host", fn, None, validate)
        return fn

    return deco


def validate_host(name: str) -> bool:
    spec = OVERRIDES.get(name)
    return bool(spec and spec.validate)


def host_impl(name: str) -> Callable:
    """The implementation registered for a host function (loads the op modules on first use)."""
    load_all()
    spec = OVERRIDES.get(name)
    if spec is None or spec.kind != "host":
        raise KeyError(f"no emulated host function registered as {name}")
    return spec.fn


def load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for m in _MODULES:
        importlib.import_module(f"{__package__}.{m}")
