"""Decode matmuls of the dense MLP and the LM head (T <= 32 activation rows, one tile row): where their weights live
and which program config each matmul runs, per ``TTModelArgs.decode_matmuls``.

* ``"mcast_1d"`` (the default): DRAM-interleaved weights, 1D multicast matmuls
  (``MatmulMultiCoreReuseMultiCast1DProgramConfig`` with ``mcast_in0``: the activation row tile multicast to every
  core, each core streaming its own N columns of the weight over the full K) on an explicit small grid. This is how
  Tenstorrent's qwen36 runs its Blackhole decode matmuls (tt-metal ``models/demos/blackhole/qwen36/tt/model_config.py``:
  "small grids beat the ~80-core DRAM-sharded grid on the bandwidth-bound skinny decode matmuls"; its measured sweep
  puts its bfloat4_b gate/up at 42.8 us on 44 cores and its bfloat8_b down at ~63 us on 33 cores at TP=4: 293 and
  376 GB/s).
* ``"dram_sharded"``: the weights width-sharded over the DRAM banks, the activation width-sharded in L1 over the
  compute cores (tt_transformers' decode matmuls), with ``args.dram_readers`` readers per bank where the device op
  allows them.
* ``"interleaved"``: DRAM-interleaved weights and ttnn's default program configs (A/B figures only).

Why ``mcast_1d`` is the default (docs/cost_figures.md has the figures; all modelled): the calibrated cost model
charges a DRAM-sharded weight at the in-model utilisation fitted to Tenstorrent's Llama-3.1-8B decode (0.54 of
512 GB/s at two readers per bank, 276 GB/s) and an interleaved bfloat8_b weight at 376 GB/s (tt-metal issue 55898;
the bfloat8_b down projection of Tenstorrent's 1D-matmul sweep above streams at that rate), so the 27B's MLP and
LM-head weights cost about 9 ms less per step interleaved. That ranking rests on the Llama fit: at the band's fast end (0.9, the isolated matmul of
tt-metal PR 54242) two DRAM-sharded readers would beat the interleaved stream. Which layout wins in the model is
a card check; both stay selectable.

Every layout computes the same contraction: the emulator's matmul arithmetic does not depend on the program config
(one fp32-Dst accumulation rounded once), and the tests check that decode logits are bit-identical across layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model_config import TILE, TensorGroup, TTModelArgs, weight_memory_config

# Weight groups with a decode plan: the dense MLP (two thirds of the 27B weight stream; not a MoE model's shared
# expert, uses_decode_plan says why) and the LM head (0.68 GB per device and token at 27B). The mixer projections
# keep DRAM-interleaved weights and ttnn's default program configs (the same bytes at the same rate in the model).
DECODE_PLAN_GROUPS = frozenset({TensorGroup.MLP_GATE_UP, TensorGroup.MLP_DOWN, TensorGroup.LM_HEAD})
# Compute cores of one DRAM-sharded matmul: at most an 8x8 block of the worker grid (11 x 10 usable workers on a
# P150a), the bound tt_transformers uses too.
MAX_DECODE_MATMUL_GRID = (8, 8)
# Cores a 1D decode matmul aims at, per group: Tenstorrent's fastest measured grids for its qwen36 gate/up (44) and
# down (33) at TP=4 (tt/model_config.py, "wide1d" sweep), the whole worker grid for the LM head (3,880 tiles of N per
# device at TP=2: per_core_N 36 keeps a core's double-buffered weight block at 8 x 36 bfloat8_b tiles, 627 KB of L1).
MCAST_1D_TARGET_CORES = {TensorGroup.MLP_GATE_UP: 44, TensorGroup.MLP_DOWN: 33, TensorGroup.LM_HEAD: 110}
# A 1D matmul's in0 block: the largest divisor of K in tiles up to this (every core streams the whole K)
MCAST_1D_MAX_IN0_BLOCK = 8


def dram_bank_count(mesh) -> int:
    """DRAM banks of one device (``mesh.dram_grid_size()``: 8 x 1 on Blackhole P150a, 12 x 1 on Wormhole)."""
    g = mesh.dram_grid_size()
    if g.y != 1:
        raise ValueError(f"DRAM grid {g.x}x{g.y}: DRAM-sharded weights assume one row of banks")
    return int(g.x)


def uses_decode_plan(args: TTModelArgs, group: TensorGroup, k: int, n: int) -> bool:
    """Whether the decode matmuls of the per-device [k, n] weight of ``group`` run a plan of this module: the layout is
    ``mcast_1d`` or ``dram_sharded``, the group is one of DECODE_PLAN_GROUPS, the model is dense, and k and n are whole
    tiles (tiny test configs whose per-device widths are not tile multiples keep ttnn's defaults). A MoE model's only
    dense MLP is its shared expert (3 x 2048 x 256 bf8 per device at 35B-A3B, 1.7 MB), whose reshards would cost
    more than the layout saves, and its LM head stays as the MoE figures (docs/tt_moe.md) were recorded."""
    return (args.decode_matmuls in ("mcast_1d", "dram_sharded") and group in DECODE_PLAN_GROUPS
            and not args.cfg.is_moe and k % TILE == 0 and n % TILE == 0)


def uses_dram_sharded_weights(args: TTModelArgs, group: TensorGroup, k: int, n: int) -> bool:
    """Whether the per-device [k, n] weight of ``group`` is DRAM-sharded (and its decode matmuls with it)."""
    return args.decode_matmuls == "dram_sharded" and uses_decode_plan(args, group, k, n)


def dram_bank_shard_tiles(n_tiles: int, banks: int, readers: int = 1) -> int:
    """Width in tiles of each bank's shard of a weight N tiles wide, DRAM-sharded over ``banks`` banks for a matmul
    of ``readers`` readers per bank: R x ceil(N / (banks x R)). The 0.81.1 device op reads ceil(N / (banks x R))
    tiles per reader (banks holding only padding dropped first) and asserts ``in1_shard_width_tiles ==
    workers_per_bank * per_core_N_in1_sender`` for R > 1 (the wheel's message); with one reader it asserts nothing
    but reads ceil(N / banks) tiles per K row with no bank row stride, so a wider physical shard would be misread
    (emulator/dram_sharded_readers.py says where that is from, and refuses both). At R = 1 this is ceil(N / banks)
    as before; for R = 2 it rounds the shard up to an even width (the 27B LM head: 485 -> 486 tiles, the last
    bank's shard padded)."""
    return readers * -(-n_tiles // (banks * readers))


def dram_sharded_weight_memory_config(ttnn, k: int, n: int, banks: int, readers: int = 1):
    """A [k, n] weight width-sharded over the ``banks`` DRAM banks: bank b holds columns [b*w, (b+1)*w) of every
    row, w = :func:`dram_bank_shard_tiles` for the matmul's ``readers`` per bank (the last bank's shard is padded).
    Each reading core of a DRAM-sharded matmul then streams one bank only, so all banks are read in parallel without
    NoC contention between readers."""
    w = dram_bank_shard_tiles(-(-n // TILE), banks, readers) * TILE
    grid = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(banks - 1, 0))})
    return ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.DRAM,
                             ttnn.ShardSpec(grid, (k, w), ttnn.ShardOrientation.ROW_MAJOR))


def matrix_memory_config(ttnn, args: TTModelArgs, group: TensorGroup, k: int, n: int, banks: int):
    """Where a per-device [k, n] weight matrix of ``group`` lives: DRAM-sharded for the groups whose decode matmuls
    are DRAM-sharded (prefill reads the same tensor with ttnn's default program config), else DRAM-interleaved."""
    if uses_dram_sharded_weights(args, group, k, n):
        # the bank shard width follows the readers its decode matmul will ask for (decode_matmul_plan): both come
        # from decode_readers_per_bank, so the weight's layout and the program config cannot disagree
        return dram_sharded_weight_memory_config(ttnn, k, n, banks, decode_readers_per_bank(args, n, banks, group))
    return weight_memory_config(ttnn)


@dataclass(frozen=True)
class DecodeMatmulPlan:
    """One decode matmul [rows <= 32, k] x [k, n] of ``layout``: ``cores`` cores computing output blocks on a
    ``grid`` (x, y), its program config, the layout ``input_memory_config`` its activation must be in (``None``: any
    interleaved tensor, DRAM or L1), the ``output_memory_config`` it writes by default, and
    ``sharded_output_memory_config``: L1 width shards, one [32, n / cores] block per computing core (what the
    single-op all-reduce takes), or ``None`` where n does not split evenly over the cores."""

    layout: str
    k: int
    n: int
    cores: int
    grid: tuple
    program_config: Any
    input_memory_config: Any
    output_memory_config: Any
    sharded_output_memory_config: Any


def _l1_width_shards(ttnn, width: int, cores: int, x: int, y: int):
    """[32, width] in L1, width-sharded in whole [32, width / cores] blocks over the first ``cores`` cores of an
    x-wide grid in row-major order (a rectangle: cores = x * y)."""
    return ttnn.create_sharded_memory_config(
        shape=(TILE, width // cores), core_grid=ttnn.CoreGrid(y=y, x=x), strategy=ttnn.ShardStrategy.WIDTH,
        orientation=ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True)


def _decode_grid(k_tiles: int, n_tiles: int) -> tuple[int, int, int]:
    """The most cores c that split both K and N into whole tiles and fit an x <= 8, y <= 8 block: (c, x, y)."""
    gx, gy = MAX_DECODE_MATMUL_GRID
    g = math.gcd(k_tiles, n_tiles)
    for c in range(min(g, gx * gy), 0, -1):
        if g % c:
            continue
        for x in range(min(c, gx), 0, -1):
            if c % x == 0 and c // x <= gy:
                return c, x, c // x
    raise AssertionError("unreachable: c = 1 always fits")


# groups whose DRAM-sharded decode matmuls ask for ``args.dram_readers`` readers per bank. The LM head is one of them
# since its bank shards are laid out for the readers (dram_bank_shard_tiles: 485 -> 486 tiles at 27B TP=2, the last
# bank's shard padded); the real head and a probe's cut vocabulary then get the same reader count.
MULTI_READER_GROUPS = frozenset({TensorGroup.MLP_GATE_UP, TensorGroup.MLP_DOWN, TensorGroup.LM_HEAD})


def decode_readers_per_bank(args: TTModelArgs, n: int, banks: int = 8,
                            group: TensorGroup = TensorGroup.MLP_GATE_UP) -> int:
    """Readers per DRAM bank of a DRAM-sharded decode matmul whose [k, n] weight is width-sharded over ``banks``
    in bank shards :func:`dram_bank_shard_tiles` wide for that reader count: ``args.dram_readers`` where the 0.81.1
    device op's rule accepts those shards (tt_ops/emulator/dram_sharded_readers.py, which the emulated op enforces),
    else one. The weight's memory config (:func:`matrix_memory_config`) asks the same question, so weight layout and
    program config agree.

    Why two: Blackhole's DRAM-sharded matmul reaches about 55 % of DRAM peak with one reader per bank and about 90 %
    with two or three in isolation (tt-metal PR 54242); Tenstorrent's Llama-3.1-8B on P150 takes two for its QKV,
    output, gate/up and down weights wherever the bank shard splits evenly (PR 54242 / 55080, 30.53 -> 23.76 ms per
    step). The 27B MLP shards (34 and 20 tiles per bank at TP=2) split evenly; the LM head's 3880 tiles per device
    take 486-tile shards (the last bank holds 478 tiles and 8 of padding, +0.2 % bytes)."""
    from qwen36.tt_ops.emulator.dram_sharded_readers import readers_rule_violation

    if group not in MULTI_READER_GROUPS:
        return 1
    n_tiles = -(-n // TILE)
    r = args.dram_readers
    ok = readers_rule_violation(dram_bank_shard_tiles(n_tiles, banks, r), n_tiles, banks, r) is None
    return r if ok else 1


def _dram_sharded_plan(ttnn, args: TTModelArgs, group: TensorGroup, k: int, n: int) -> DecodeMatmulPlan:
    """DRAM-sharded (tt_transformers' decode matmuls; the device op's rules): one tile row of activations
    (per_core_M = 1: the op supports M == 1 tile only), in0 width-sharded in L1 over the compute cores with
    in0_block_w the whole shard (one pass over K per core), per_core_N = N tiles / cores, output width-sharded in
    L1 on the same cores."""
    cores, x, y = _decode_grid(k // TILE, n // TILE)
    pc = ttnn.MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig(
        in0_block_w=k // TILE // cores, per_core_M=1, per_core_N=n // TILE // cores, fused_activation=None,
        num_workers_per_dram_bank=decode_readers_per_bank(args, n, group=group))
    out = _l1_width_shards(ttnn, n, cores, x, y)
    return DecodeMatmulPlan("dram_sharded", k, n, cores, (x, y), pc, _l1_width_shards(ttnn, k, cores, x, y), out, out)


def _mcast_1d_cores(n_tiles: int, target: int, grid_x: int, grid_y: int, even: bool) -> tuple[int, int, int]:
    """(blocks, x, y) of a 1D decode matmul over N = ``n_tiles``: ``even`` (the output is width-sharded, so every
    core holds a whole block): the rectangle x * y <= grid of a core count dividing N closest to ``target`` (the larger
    on a tie); else the ``target``-core grid shaped wide first (x up to the grid width, which Tenstorrent's sweep found
    ~2 % faster than a tall one) and blocks = ceil(N / ceil(N / cores))."""
    if even:
        fits = [(c, x, c // x) for c in range(1, grid_x * grid_y + 1) if n_tiles % c == 0
                for x in range(min(c, grid_x), 0, -1) if c % x == 0 and c // x <= grid_y]
        best = min(fits, key=lambda f: (abs(f[0] - target), -f[0], -f[1]))
        return best
    x = min(grid_x, target, n_tiles)
    y = min(grid_y, -(-min(target, n_tiles) // x))
    per_core_n = -(-n_tiles // (x * y))
    return -(-n_tiles // per_core_n), x, y


def _mcast_1d_plan(ttnn, args: TTModelArgs, group: TensorGroup, k: int, n: int, grid) -> DecodeMatmulPlan:
    """A 1D multicast decode matmul (module doc) on ``MCAST_1D_TARGET_CORES[group]`` cores of the device grid: the
    whole K per core in blocks of the largest divisor of K tiles up to 8, per_core_N = ceil(N tiles / cores), output
    subblock 1 x (the largest divisor of per_core_N up to 4: fp32 Dst accumulation holds 4 tiles). The MLP down
    projection splits N evenly, so its output can be width-sharded for the single-op all-reduce."""
    k_t, n_t = k // TILE, n // TILE
    even = group == TensorGroup.MLP_DOWN
    blocks, x, y = _mcast_1d_cores(n_t, MCAST_1D_TARGET_CORES[group], grid.x, grid.y, even)
    per_core_n = -(-n_t // blocks)
    in0_block_w = max(d for d in range(1, MCAST_1D_MAX_IN0_BLOCK + 1) if k_t % d == 0)
    sub_w = max(d for d in range(1, 5) if per_core_n % d == 0)
    pc = ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(x, y), in0_block_w=in0_block_w, out_subblock_h=1,
        out_subblock_w=sub_w, per_core_M=1, per_core_N=per_core_n, fuse_batch=True, fused_activation=None,
        mcast_in0=True)
    sharded = _l1_width_shards(ttnn, n, blocks, x, y) if blocks == x * y and n_t % blocks == 0 else None
    return DecodeMatmulPlan("mcast_1d", k, n, blocks, (x, y), pc, None, ttnn.L1_MEMORY_CONFIG, sharded)


def decode_matmul_plan(ttnn, args: TTModelArgs, group: TensorGroup, rows: int, k: int, n: int, grid=None):
    """The plan of a decode-mode matmul of ``group`` over ``rows`` activation rows (:class:`DecodeMatmulPlan`), or
    ``None``: ttnn's default program config on DRAM-interleaved activations (more than 32 rows: prefill; the
    ``interleaved`` layout; groups and configs outside :func:`uses_decode_plan`). ``grid``: the device's worker grid
    (``mesh.compute_with_storage_grid_size()``; the P150a's 11 x 10 when not given)."""
    if not uses_decode_plan(args, group, k, n) or rows > TILE:
        return None
    if args.decode_matmuls == "dram_sharded":
        return _dram_sharded_plan(ttnn, args, group, k, n)
    return _mcast_1d_plan(ttnn, args, group, k, n, grid or ttnn.CoreCoord(11, 10))
