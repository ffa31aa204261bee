"""Program-cache bookkeeping for the emulated mesh (``device.num_program_cache_entries()``).

ttnn keys its program cache on a hash of the device operation's attributes and its input tensors'
specs (``compute_program_hash`` in ``ttnn/api/ttnn/device_operation.hpp``: op type, attributes, and each
tensor's shape, dtype, layout and memory config; not tensor contents or buffer addresses). The first
call with a new key compiles a program (a cache miss, one new entry); later calls with the same key
reuse it. Tenstorrent's op tests assert reuse with ``num_program_cache_entries()``.

The emulator records one entry per distinct ``(op, tensor specs, non-tensor arguments)`` key of the
device ops it dispatches. Ops that launch several programs on cards still count one entry here, and
attribute choices ttnn leaves out of its hash (e.g. some runtime-only scalars) count as distinct keys.
"""

from __future__ import annotations

from typing import Any


def _spec(obj: Any):
    from .tensor import EmuTensor, dtype_name

    if isinstance(obj, EmuTensor):
        mc, memo = obj.memory_config(), obj._spec_memo
        if memo is None or memo[0] is not mc or memo[1] is not obj.dtype or memo[2] is not obj.layout:
            # the memory config's repr is the costly part of a key, and a tensor's config object rarely changes
            memo = obj._spec_memo = (mc, obj.dtype, obj.layout, dtype_name(obj.dtype), obj.layout.name, repr(mc))
        return ("tensor", tuple(obj.logical_shape_list), memo[3], memo[4], memo[5])
    if isinstance(obj, (list, tuple)):
        return tuple(_spec(o) for o in obj)
    if isinstance(obj, dict):
        return tuple(sorted((k, _spec(v)) for k, v in obj.items()))
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    r = repr(obj)
    # objects whose repr carries an address (semaphores, configs without a value repr) hash by type only
    return type(obj).__name__ if " at 0x" in r or r.startswith("Emu") else r


# ops whose attributes ttnn hashes after resolving them (a default compute config equals the explicit one), registered
# by their op module: fn(args, kwargs) -> (args, kwargs) with the resolved attributes
_KEY_ARGS: dict = {}


def register_key_args(op_name: str, fn) -> None:
    _KEY_ARGS[op_name] = fn


def program_key(op_name: str, args: tuple, kwargs: dict) -> tuple:
    fn = _KEY_ARGS.get(op_name)
    if fn is not None:
        args, kwargs = fn(args, kwargs)
    return (op_name, _spec(args), _spec(kwargs))
