"""Readers per DRAM bank of a DRAM-sharded decode matmul (``num_workers_per_dram_bank``, ttnn 0.81.1).

``MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig(..., num_workers_per_dram_bank=R)`` lets R worker cores
stream each DRAM bank's weight shard, each one contiguous part of the shard's N columns. Blackhole reaches about
55 % of DRAM peak with one reader per bank and about 90 % with two or three (tt-metal PR 54242, which added the
field), so the cost model charges the weight bytes of such a matmul by R: :func:`account_readers` moves them from
the ``@dram_sharded/B`` key to ``@dram_sharded/BxR``.

:func:`check_readers` applies the device op's rules as the 0.81.1 wheel states them (the messages and asserts in
its ``_ttnncpp.so``; the program factory is
``ttnn/cpp/ttnn/operations/matmul/device/factory/matmul_multicore_reuse_mcast_dram_sharded_program_factory.cpp``):

* ``num_workers_per_dram_bank must be in [1, 3]``;
* more than one worker per bank only on Blackhole (the emulated mesh is a Blackhole P150a);
* "weight shard width {} tiles per bank must be divisible by workers_per_bank";
* ``workers_per_bank == 1 || in1_shard_width_tiles == workers_per_bank * per_core_N_in1_sender``, where
  ``per_core_N_in1_sender`` is N tiles split over every reader (``ceil(N_t / (banks_used x R))``; banks holding only
  padding are dropped first, as the factory's worker list does).

One reader per bank is refused here where the device would not refuse it but would read the wrong tiles: its
reader streams ``ceil(N_t / banks_used)`` tiles per K row as one contiguous run (no bank row stride: the split-bank
path with its stride exists for R > 1 only), so a bank shard wider than that (e.g. one laid out for two readers and
then read by one) shifts every K row after the first. Sources: tt-metal's DRAM-sharded factory (a later version
than 0.81.1, read for facts) sizes its reader's row as ``per_core_N_compute = div_up(N, num_dram_banks)`` after
dropping padding-only banks; a public audit of another Blackhole port found its one-reader LM head with 20-tile
shards for 19 tiles per reader at PCC 0.79 on cards, and at >= 0.9999999 once the shard was 19 tiles wide.
"""
from __future__ import annotations

from .errors import EmulatorError
from .tensor import EmuTensor
from .ttnn_import import ttnn

MATMUL_OPS = ("ttnn.linear", "ttnn.matmul")
MAX_READERS = 3


def _program_config(args: tuple, kwargs: dict):
    pc = kwargs.get("program_config")
    cls = getattr(ttnn, "MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig", None)
    return pc if cls is not None and isinstance(pc, cls) else None


def readers_of(program_config) -> int:
    return int(getattr(program_config, "num_workers_per_dram_bank", 1) or 1)


def readers_rule_violation(shard_width_tiles: int, n_tiles: int, banks: int, readers: int) -> str | None:
    """Why ``readers`` workers per bank cannot stream a weight of ``n_tiles`` N tiles width-sharded over ``banks``
    banks in shards ``shard_width_tiles`` wide (module doc), or None when the device op accepts it."""
    r, sw = readers, shard_width_tiles
    if not 1 <= r <= MAX_READERS:
        return f"num_workers_per_dram_bank must be in [1, {MAX_READERS}], got {r}"
    if sw % r:
        return f"DRAM-sharded matmul weight shard width {sw} tiles per bank must be divisible by workers_per_bank {r}"
    used = banks - ((sw * banks - n_tiles) // sw if sw else 0)
    per_reader = -(-n_tiles // (used * r))
    if r == 1 and sw != per_reader:
        return (f"with one worker per DRAM bank the weight shard width ({sw} tiles) must equal the tiles it reads per "
                f"K row, ceil({n_tiles} / {used} banks) = {per_reader} (its reader has no bank row stride: a wider "
                "shard is read at the wrong offsets)")
    if sw != r * per_reader:
        return (f"with {r} workers per DRAM bank the weight shard width ({sw} tiles) must equal workers_per_bank x "
                f"per-reader N ({r} x ceil({n_tiles} / ({used} banks x {r})) = {r * per_reader} tiles)")
    return None


def check_readers(op_name: str, b: EmuTensor, program_config) -> int:
    """Validate ``num_workers_per_dram_bank`` against the weight ``b`` (module doc); returns R."""
    r = readers_of(program_config)
    name = "MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig"
    spec = b.memory_config().shard_spec
    if r != 1 and spec is None:  # check_dram_sharded_matmul refuses this first; kept for direct callers
        raise EmulatorError(f"{op_name}: {name}: input_tensor_b must be DRAM-sharded")
    why = (readers_rule_violation(int(spec.shape[1]) // 32, int(list(b.padded_shape)[-1]) // 32,
                                  spec.grid.num_cores(), r) if spec is not None else
           readers_rule_violation(1, 1, 1, r))
    if why:
        raise EmulatorError(f"{op_name}: {name}: {why}")
    return r


def account_readers(op_name: str, args: tuple, kwargs: dict, read: dict, read_key_of, bytes_of) -> dict:
    """``read`` with the weight bytes of a DRAM-sharded matmul of R > 1 readers per bank under ``...xR`` (module
    doc); validates R first. ``read_key_of`` / ``bytes_of``: the dispatcher's key and byte functions for a tensor."""
    if op_name not in MATMUL_OPS:
        return read
    pc = _program_config(args, kwargs)
    if pc is None:
        return read
    b = args[1] if len(args) > 1 else kwargs.get("input_tensor_b")
    if not isinstance(b, EmuTensor):
        return read
    r = check_readers(op_name, b, pc)
    if r == 1:
        return read
    key = read_key_of(b)
    if "@dram_sharded/" not in key:
        return read
    nbytes = bytes_of(b)
    out = dict(read)
    out[key] -= nbytes
    if out[key] == 0:
        del out[key]
    out[f"{key}x{r}"] = out.get(f"{key}x{r}", 0) + nbytes
    return out


__all__ = ["MAX_READERS", "account_readers", "check_readers", "readers_of", "readers_rule_violation"]
