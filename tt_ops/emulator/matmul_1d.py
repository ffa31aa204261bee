"""The device op's validation of ``MatmulMultiCoreReuseMultiCast1DProgramConfig`` (1D multicast matmuls).

A 1D matmul with ``mcast_in0=True`` multicasts each in0 block (the activation rows) to every core of its grid; each
core computes ``per_core_M x per_core_N`` output tiles over the whole K, reading its own N columns of in1. The
arithmetic is the matmul's (``ops_compute``); what differs by program config is which configs the device op accepts.
The rules below are tt-metal's matmul device operation (``ttnn/cpp/ttnn/operations/matmul/device/
matmul_device_operation.cpp``, read for facts: the program-config checks shared by the reuse / 2D / 1D configs, the
work-distribution check and the 1D config's own checks), for the ``mcast_in0`` form this project runs; the refusal
messages are the ones the 0.81.1 library carries (its ``_ttnncpp.so`` holds each format string quoted here, prefixed
with the config's name as there):

* ``Kt % in0_block_w == 0``; non-zero subblocks; ``out_block_h % out_subblock_h``, ``out_block_w % out_subblock_w``,
  ``per_core_M % out_block_h`` and ``per_core_N % out_block_w`` all zero;
* the output subblock within the destination registers: ``out_subblock_h x out_subblock_w <= 8`` 32x32 tiles, 4 with
  ``fp32_dest_acc_en`` (``get_dest_reg_count``: half of the 16-tile Dst in the default half-sync mode, halved again by
  fp32);
* ``compute_with_storage_grid_size`` non-zero and within the device's worker grid;
* the output blocks, ``ceil(Mt / per_core_M) x ceil(Nt / per_core_N)``, at most the grid's cores, and for
  ``mcast_in0`` all of M in one block (``ceil(Mt / per_core_M) == 1``);
* a sharded output: its shard grid within the program grid; WIDTH_SHARDED (or BLOCK_SHARDED on one row of cores);
  ``M == per_core_M``; ``out_subblock_w == per_core_N or out_subblock_h == 1`` and the same for the out block;
* a sharded in0: ``fuse_batch``, WIDTH_SHARDED in ROW_MAJOR shards, the output (when sharded) in in0's buffer type and
  layout, ``M == per_core_M == shard height / 32``, ``K`` and the shard width in tiles divisible by ``in0_block_w``.

``gather_in0`` (a ring of sharded in0 with a global circular buffer) and ``mcast_in0=False`` (in1 multicast, the
tall-and-skinny form) are not emulated: the emulator refuses them rather than pass a config it has not checked.
"""
from __future__ import annotations

from .errors import EmulatorError, NotEmulatedError
from .numerics import kernel_config
from .ttnn_import import ttnn

NAME = "MatmulMultiCoreReuseMultiCast1DProgramConfig"
DEST_TILES = 8  # Dst registers in 32x32 tiles in half-sync mode; fp32 accumulation halves it


def _grid(pc) -> tuple[int, int]:
    g = pc.compute_with_storage_grid_size
    return int(g.x), int(g.y)


def _within(shard_grid, x: int, y: int) -> bool:
    return all(r.end.x < x and r.end.y < y for r in shard_grid.ranges())


def check_mcast_1d_matmul(op: str, a, b, program_config, memory_config, compute_kernel_config,
                          transpose_a: bool = False, transpose_b: bool = False) -> None:
    """Refuse a 1D multicast program config the device op would refuse (module doc); any other config passes."""
    cls = getattr(ttnn, NAME, None)
    if cls is None or not isinstance(program_config, cls):
        return
    pc = program_config
    if pc.gather_in0:
        raise NotEmulatedError(f"{op}: {NAME}(gather_in0=True) is not emulated")
    if not pc.mcast_in0:
        raise NotEmulatedError(f"{op}: {NAME}(mcast_in0=False) is not emulated")
    if transpose_a or transpose_b:
        raise NotEmulatedError(f"{op}: {NAME} with transpose_a/transpose_b is not emulated")
    pa, pb = list(a.padded_shape), list(b.padded_shape)
    kt, nt = pa[-1] // 32, pb[-1] // 32
    mt = (pa[-2] // 32) * (_volume(pa[:-2]) if pc.fuse_batch else 1)
    bw, sh, sw = pc.in0_block_w, pc.out_subblock_h, pc.out_subblock_w
    bh, bwo, pm, pn = pc.out_block_h, pc.out_block_w, pc.per_core_M, pc.per_core_N
    if bw == 0 or kt % bw:
        raise EmulatorError(f"{op}: {NAME}: Kt ({kt}) must be divisible by in0_block_w ({bw})")
    if sh == 0 or sw == 0 or bh == 0 or bwo == 0 or pm == 0 or pn == 0:
        raise EmulatorError(f"{op}: {NAME}: subblock, block and per-core dims must be non-zero")
    for num, den, what, by in ((bh, sh, "out_block_h", "out_subblock_h"), (bwo, sw, "out_block_w", "out_subblock_w"),
                               (pm, bh, "per_core_M", "out_block_h"), (pn, bwo, "per_core_N", "out_block_w")):
        if num % den:
            raise EmulatorError(f"{op}: {NAME}: {what} ({num}) must be divisible by {by} ({den})")
    dest = DEST_TILES // (2 if kernel_config(compute_kernel_config).fp32_dest_acc_en else 1)
    if sh * sw > dest:
        raise EmulatorError(f"{op}: {NAME}: out_subblock_w {sw} times out_subblock_h {sh} needs to be at most "
                            f"{dest} to fit in hardware")
    gx, gy = _grid(pc)
    dev = a.mesh.compute_with_storage_grid_size() if a.mesh is not None else None
    if gx <= 0 or gy <= 0:
        raise EmulatorError(f"{op}: {NAME}: compute_with_storage_grid_size must be non-zero, got ({gx}, {gy})")
    if dev is not None and (gx > dev.x or gy > dev.y):
        raise EmulatorError(f"{op}: {NAME}: compute_with_storage_grid_size ({gx}, {gy}) must fit within device grid "
                            f"({dev.x}, {dev.y})")
    blocks_y, blocks_x = -(-mt // pm), -(-nt // pn)
    if blocks_y * blocks_x > gx * gy:
        raise EmulatorError(f"{op}: {NAME}: Number of blocks exceeds number of cores: {blocks_y * blocks_x} blocks > "
                            f"{gx * gy} cores")
    if blocks_y != 1:
        raise EmulatorError(f"{op}: {NAME}: mcast_in0 requires M ({mt}) to fit within a single per_core_M block "
                            f"({pm}), got num_blocks_y={blocks_y}")
    amc = a.memory_config()
    if amc.is_sharded():
        aspec = amc.shard_spec
        if not pc.fuse_batch:
            raise EmulatorError(f"{op}: {NAME}: fuse_batch must be enabled when input A is sharded")
        if amc.memory_layout != ttnn.TensorMemoryLayout.WIDTH_SHARDED:
            raise EmulatorError(f"{op}: {NAME}: input A must be WIDTH_SHARDED when mcast_in0 is set, got "
                                f"{amc.memory_layout}")
        if memory_config is not None and memory_config.is_sharded() and (
                memory_config.memory_layout != amc.memory_layout or memory_config.buffer_type != amc.buffer_type):
            raise EmulatorError(f"{op}: {NAME}: input A and output buffer types and memory layouts must match")
        if aspec.orientation != ttnn.ShardOrientation.ROW_MAJOR:
            raise EmulatorError(f"{op}: {NAME}: input A shard orientation must be ROW_MAJOR")
        if mt != pm or pm != aspec.shape[0] // 32:
            raise EmulatorError(f"{op}: {NAME}: M ({mt}) must equal per_core_M ({pm}) and shard height / 32 "
                                f"({aspec.shape[0] // 32})")
        if (aspec.shape[1] // 32) % bw:
            raise EmulatorError(f"{op}: {NAME}: shard width ({aspec.shape[1] // 32} tiles) must be divisible by "
                                f"in0_block_w ({bw})")
    if memory_config is not None and memory_config.is_sharded() and memory_config.buffer_type == ttnn.BufferType.L1:
        spec = memory_config.shard_spec
        if spec is not None and not _within(spec.grid, gx, gy):
            raise EmulatorError(f"{op}: {NAME}: output shard grid {spec.grid} must lie within extent ({gx}, {gy})")
        layout = memory_config.memory_layout
        one_row = (layout == ttnn.TensorMemoryLayout.BLOCK_SHARDED and spec is not None
                   and len({r.start.y for r in spec.grid.ranges()} | {r.end.y for r in spec.grid.ranges()}) == 1)
        if layout != ttnn.TensorMemoryLayout.WIDTH_SHARDED and not one_row:
            raise EmulatorError(f"{op}: {NAME}: output memory layout must be WIDTH_SHARDED or BLOCK_SHARDED on a "
                                f"1-row grid, got {layout}")
        if mt != pm:
            raise EmulatorError(f"{op}: {NAME}: M ({mt}) must equal per_core_M ({pm})")
        if not (sw == pn or sh == 1) or not (bwo == pn or bh == 1):
            raise EmulatorError(f"{op}: {NAME}: out_subblock_w ({sw}) must equal per_core_N ({pn}) or out_subblock_h "
                                f"({sh}) must be 1 (and the same for the out block)")


def _volume(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n
