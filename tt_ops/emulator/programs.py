"""How many device programs an op call launches on a card (the emulator's program accounting).

Default: one program per op call. Exceptions, each with its reason:

* ``reshape``: a pure view costs nothing. ttnn 0.81.1's ``ttnn.reshape`` docstring: "for a 0 cost view ... the
  last dimension must not change; in Tiled the second last two dimensions must not change OR there is no
  padding on the second last dimension". Any other reshape is one program (0.81.1 reshapes tiled tensors in
  place with a cached tile-mapping tensor, ``reshape_tile_mode``), and moves the tensor's bytes.
* ``slice`` / ``concat`` of TILE tensors whose bounds along the last two dims are not multiples of 32: counted as
  untilize (per input) + the row-major op + tilize. This is the conservative reading: whether a given 0.81.1
  factory handles an unaligned tiled slice in one kernel was not verified, and cards never do better than one
  program per input plus the op.
* ``all_reduce`` (synchronous): two programs, reduce_scatter then all_gather (the composite the ring
  all-reduce is built from); every other collective is one program.
* ``experimental.all_reduce_async`` (the composite form, reduce-scatter / all-gather semaphores): a sharded input
  is converted to interleaved (same buffer type) inside the op first, and the result is then converted to the
  requested memory config (``all_reduce_async.cpp``, read for facts): one program more for a sharded input, one
  more again unless the requested output is interleaved in the input's buffer type. Handing it an L1-sharded
  tensor therefore never saves a reshard program.
"""

from __future__ import annotations

from typing import Sequence

from .tensor import EmuTensor, is_tile

TILE = 32


def reshape_is_view(old: Sequence[int], new: Sequence[int], layout) -> bool:
    """True when ``ttnn.reshape`` from ``old`` to ``new`` is a 0-cost view (docstring rule, see module doc)."""
    old, new = list(old), list(new)
    if -1 in new:
        known = 1
        for d in new:
            known *= d if d != -1 else 1
        total = 1
        for d in old:
            total *= d
        new = [total // known if d == -1 else d for d in new]
    if not old or not new or old[-1] != new[-1]:
        return False
    if not is_tile(layout):
        return True
    o2 = old[-2] if len(old) >= 2 else 1
    n2 = new[-2] if len(new) >= 2 else 1
    return o2 == n2 or (o2 % TILE == 0 and n2 % TILE == 0)


def _aligned(*extents: int) -> bool:
    return all(int(e) % TILE == 0 for e in extents)


def _slice_unaligned(t: EmuTensor, starts, ends) -> bool:
    shape = t.logical_shape_list
    r = len(shape)
    for d in (r - 2, r - 1):
        if d < 0:
            continue
        s = int(starts[d]) if starts is not None and d < len(starts) else 0
        e = int(ends[d]) if ends is not None and d < len(ends) else shape[d]
        e = shape[d] if e > shape[d] else e
        if e < 0:
            e += shape[d]
        if not (_aligned(s) and (_aligned(e) or e == shape[d])):
            return True
    return False


def programs_for(op_name: str, args: tuple, kwargs: dict, out) -> int:
    """Programs a card launches for this call (see the module doc)."""
    if op_name == "ttnn.reshape":
        t = args[0] if args else kwargs.get("input_tensor")
        if isinstance(t, EmuTensor) and isinstance(out, EmuTensor) and reshape_is_view(
                t.logical_shape_list, out.logical_shape_list, t.layout):
            return 0
        return 1
    if op_name == "ttnn.slice":
        t = args[0] if args else kwargs.get("input_tensor")
        starts = args[1] if len(args) > 1 else kwargs.get("slice_start", kwargs.get("starts"))
        ends = args[2] if len(args) > 2 else kwargs.get("slice_end", kwargs.get("ends"))
        if isinstance(t, EmuTensor) and is_tile(t.layout) and _slice_unaligned(t, starts, ends):
            return 3
        return 1
    if op_name == "ttnn.concat":
        parts = args[0] if args else kwargs.get("input_tensors", kwargs.get("tensors"))
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        parts = [p for p in (parts or []) if isinstance(p, EmuTensor)]
        if parts and is_tile(parts[0].layout):
            rank = len(parts[0].logical_shape_list)
            d = int(dim) % rank
            if d >= rank - 2 and not all(_aligned(p.logical_shape_list[d]) for p in parts[:-1]):
                return len(parts) + 2
        return 1
    if op_name == "ttnn.all_reduce":
        return 2
    if op_name == "ttnn.experimental.all_reduce_async":
        t = args[0] if args else kwargs.get("input_tensor")
        if isinstance(t, EmuTensor) and t.is_sharded():
            out_mc = kwargs.get("memory_config") or t.memory_config()
            back = out_mc.is_sharded() or out_mc.buffer_type != t.memory_config().buffer_type
            return 1 + 1 + int(back)
        return 1
    return 1
