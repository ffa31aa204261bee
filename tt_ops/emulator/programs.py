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
* ``experimental.all_reduce_async`` (the composite form, reduce-scatter / all-gather semaphores): what
  ``all_reduce_async.cpp`` (tt-metal, read for facts) launches. It picks the scatter dim (the last dim whose tile
  count splits evenly over the devices). On the common path it is a ``reduce_scatter_minimal_async`` then an
  ``all_gather_async``: 2 programs and 2 collectives (each with its own handshake). When the scatter would pad a
  tile (row-major input, or a scattered extent that is not a tile multiple), or no dim splits, it is an all-gather
  then a local sum over the gathered copies (fp32: a transpose and a ``sum``; bfloat8_b: typecast, ``moreh_sum``,
  typecast; otherwise ``moreh_sum``; row-major input adds a to_layout each way): 1 collective. A sharded input is
  converted to interleaved (same buffer type) inside the op first, and the result is then converted to the
  requested memory config: one program more for a sharded input, one more again unless the requested output is
  interleaved in the input's buffer type. Handing it an L1-sharded tensor therefore never saves a reshard
  program. The form with ``multi_device_global_semaphore`` (a persistent buffer tensor, sharded in and out) is one
  device op: 1 program, 1 collective.
"""

from __future__ import annotations

from typing import Sequence

from .tensor import EmuTensor, dtype_name, is_tile

TILE = 32

# ops whose program count depends on their arguments, registered by their op module: fn(args, kwargs, out) -> int
_OP_PROGRAMS: dict = {}


def register_programs(op_name: str, fn) -> None:
    """Register how many programs one call of ``op_name`` launches (an op module's own rule, stated there)."""
    _OP_PROGRAMS[op_name] = fn


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
    fn = _OP_PROGRAMS.get(op_name)
    if fn is not None:
        return int(fn(args, kwargs, out))
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
        return _all_reduce_async_plan(args, kwargs)[0]
    return 1


def collectives_for(op_name: str, args: tuple, kwargs: dict) -> int:
    """Collective launches of a CCL call (each pays its own fixed cost on cards; see the module doc)."""
    if op_name == "ttnn.all_reduce":
        return 2
    if op_name == "ttnn.experimental.all_reduce_async":
        return _all_reduce_async_plan(args, kwargs)[1]
    return 1


def _input_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("input_tensor")


def _scatter_dim(shape: Sequence[int], tiled: bool, n: int) -> int | None:
    """The dim ``all_reduce_async`` scatters over: the last whose extent (in tiles for the last two dims of a TILE
    tensor) splits evenly over ``n`` devices; None when none does."""
    dims = [int(d) for d in shape]
    if tiled:
        for i in (-1, -2):
            if len(dims) >= -i:
                dims[i] = -(-dims[i] // TILE)
    for d in range(len(dims) - 1, -1, -1):
        if dims[d] % n == 0:
            return d
    return None


def _all_reduce_async_plan(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(programs, collectives) of one ``experimental.all_reduce_async`` call (module doc)."""
    t = _input_of(args, kwargs)
    if not isinstance(t, EmuTensor):
        return 2, 2
    if kwargs.get("multi_device_global_semaphore") is not None:
        return 1, 1  # the single-op form over a persistent buffer tensor
    shape = t.logical_shape_list
    tiled = is_tile(t.layout)
    n = 1 if kwargs.get("cluster_axis") == 0 else max(int(t.num_shards), 1)
    dim = _scatter_dim(shape, tiled, n)
    rank = len(shape)
    composite = dim is None or not tiled
    if not composite and dim >= rank - 2 and (shape[dim] // n) % TILE != 0:
        composite = True  # scattering a padded tile
    convert = 0
    if t.is_sharded():
        out_mc = kwargs.get("memory_config") or t.memory_config()
        back = out_mc.is_sharded() or out_mc.buffer_type != t.memory_config().buffer_type
        convert = 1 + int(back)
    if not composite:
        return 2 + convert, 2
    dtype = dtype_name(t.dtype)
    if dtype == "FLOAT32":
        local_sum = 2  # transpose + sum
    elif dtype == "BFLOAT8_B":
        local_sum = 3  # typecast + moreh_sum + typecast
    else:
        local_sum = 1
    layout = 0 if tiled else 2
    return 1 + local_sum + layout + convert, 1
