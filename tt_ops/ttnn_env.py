"""The one way this package imports the real ``ttnn`` module, so that its logging is set before it loads.

ttnn talks in two places a user would otherwise see on every run:
- its Python ``__init__`` logs the whole ``ttnn.CONFIG`` at loguru DEBUG while it is imported; loguru's default
  handler prints DEBUG, so the dump reached the terminal even when nothing asked for it;
- tt-metal's C++ logger (UMD / Device) prints info lines to *stdout* when the host-side cluster opens and closes
  (on the emulator that happens on the first block-float conversion and at interpreter exit), mixing into the
  command's output. Its level is read from ``TT_LOGGER_LEVEL`` when that logger is created, so setting the
  variable any time before the cluster opens is enough.

By default the import-time dump is dropped and the C++ logger shows warnings on cards and only errors on the
emulated mesh (where its one warning is that the cluster is mocked, which the emulator already says). A
``TT_LOGGER_LEVEL`` set by the user is never overridden. ``qwen36 --verbose`` (``set_verbose(True)``) lets
everything through again.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType

LOG_LEVEL_ENV = "TT_LOGGER_LEVEL"
_USER_LEVEL = os.environ.get(LOG_LEVEL_ENV)  # what the environment asked for before this package touched it
_verbose = False


def set_verbose(flag: bool) -> None:
    """Let ttnn's and tt-metal's info/debug output through (``qwen36 --verbose``), or stop doing so. Takes effect
    for ttnn's import if called before it, and for the C++ logger if called before the first mesh or host-side
    cluster is opened (the level is read once per process, when that logger is created)."""
    global _verbose
    _verbose = bool(flag)
    if _USER_LEVEL is None:
        os.environ[LOG_LEVEL_ENV] = device_log_level(emulated=False)


def device_log_level(emulated: bool) -> str:
    """The tt-metal C++ log level this package asks for (unless the user set ``TT_LOGGER_LEVEL``)."""
    if _verbose:
        return "info"  # tt-metal's own default
    return "error" if emulated else "warn"  # the spellings tt-metal 0.81 accepts


def configure_device_logs(emulated: bool) -> None:
    """Set ``TT_LOGGER_LEVEL`` for the backend about to be opened (called by ``import_ttnn`` and ``open_mesh``)."""
    if _USER_LEVEL is None:
        os.environ[LOG_LEVEL_ENV] = device_log_level(emulated)


def import_ttnn(*, emulated: bool) -> ModuleType:
    """Import (or return) the real ttnn module with its logging configured as described above."""
    configure_device_logs(emulated)
    module = sys.modules.get("ttnn")
    if module is not None:
        return module
    from loguru import logger

    quiet = not _verbose
    if quiet:
        logger.disable("ttnn")  # drops only records logged by ttnn's modules, only while it is imported
    try:
        import ttnn
    finally:
        if quiet:
            logger.enable("ttnn")
    return ttnn


__all__ = ["import_ttnn", "set_verbose", "configure_device_logs", "device_log_level", "LOG_LEVEL_ENV"]
