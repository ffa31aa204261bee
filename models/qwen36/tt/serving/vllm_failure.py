"""Failure policy of the vllm-tt adapter: a plugin call that fails inside the device work of a step stops the model
(:class:`DeviceStepFailed`, :func:`stops_on_device_failure`); the adapter's own refusals of a call leave it
serving."""
from __future__ import annotations

import functools
import inspect

import torch
from loguru import logger

ADAPTER = __name__.rsplit(".", 1)[0] + "."  # qwen36.tt.serving.: the adapter's modules, whose raises are refusals


class DeviceStepFailed(RuntimeError):
    """A plugin call failed inside the device work of a step; the model refuses every later call (stop and restart
    the server; on cards reset the devices first)."""


def _raised_here(err: BaseException) -> bool:
    """Whether the innermost frame of ``err`` is in one of the adapter's modules (a check, not a device failure)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__")).startswith(ADAPTER)


def _call_rows(fn, self, args, kwargs) -> str:
    """The rows of a plugin call, for the failure message: count, start positions and state slots."""
    try:
        named = inspect.signature(fn).bind_partial(self, *args, **kwargs).arguments
    except TypeError:
        named = dict(kwargs)
    tokens = named.get("tokens")
    parts = []
    if tokens is not None and hasattr(tokens, "shape"):
        parts.append(f"{tokens.shape[0]} rows")
    for key in ("start_pos", "empty_slots"):
        v = named.get(key)
        if v is not None:
            parts.append(f"{key} {[int(x) for x in torch.as_tensor(v).reshape(-1).tolist()]}")
    return ", ".join(parts) or "no rows"


def stops_on_device_failure(fn):
    """Wrap a plugin entry point that drives the device. An exception from below the adapter (the model, ttnn: on
    cards tt-metal raises RuntimeError for an op that fails on the host, TT_FATAL/TT_THROW, and for a dispatch
    timeout after a kernel hang) has left the step half done: earlier ops of the step already updated GDN/conv
    state and KV in place, and a fault inside a replayed trace cannot be located or undone. So the call fails
    with :class:`DeviceStepFailed` naming the call, its rows and the op's error, and every later call is refused
    with the same reason; vLLM 0.25.1 then stops the engine (an exception out of ``execute_model`` is fatal to its
    engine core). The adapter's own refusals of a call (ValueError / NotImplementedError, or any exception the
    adapter's modules in tt/serving raise from their checks, such as the TypeError for side tensors sent without
    ``spec_mode``) are raised before the device is touched and leave the model serving."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        failed = getattr(self, "_device_failure", None)
        if failed is not None:
            raise DeviceStepFailed(f"{fn.__name__} refused: an earlier step failed on the device ({failed}); the "
                                   f"device state cannot be trusted: restart the server (on cards reset the devices)")
        try:
            return fn(self, *args, **kwargs)
        except (ValueError, NotImplementedError):
            raise
        except Exception as err:
            if isinstance(err, DeviceStepFailed) or _raised_here(err):
                raise
            self._device_failure = f"{fn.__name__} ({_call_rows(fn, self, args, kwargs)}): {type(err).__name__}: {err}"
            logger.error(f"vllm-tt: device step failed in {self._device_failure}; this model serves nothing more")
            raise DeviceStepFailed(f"device step failed in {self._device_failure}; the requests of this call are "
                                   f"lost and the model refuses further calls: restart the server (on cards reset "
                                   f"the devices first)") from err
    return call
