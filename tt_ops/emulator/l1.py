"""L1 (per-core SRAM) buffer accounting of the emulated Blackhole P150a, as tt-metal's L1 allocator sizes it.

Facts (tt-metal source, tenstorrent/tt-metal, and the installed ttnn 0.81.1 wheel):

* ``worker_l1_size`` 1,572,864 B per Tensix core: ``tt_metal/soc_descriptors/blackhole_140_arch.yaml`` (the same value
  as ``MEM_L1_SIZE (1536 * 1024)`` in ``tt_metal/hw/inc/internal/tt-1xx/blackhole/dev_mem_map.h``);
* L1 unreserved base 111,744 B: the Tensix HAL (``tt_metal/llrt/hal/tt-1xx/blackhole/bh_hal_tensix.cpp``) puts the
  kernel-config ring at ``MEM_MAP_END`` and the default unreserved base 69 KiB above it, rounded up to the larger of
  the DRAM (64 B) and L1 (16 B) alignments. ``MEM_MAP_END`` is 41,088 B in ttnn 0.81.1: its
  ``ttnn.get_max_worker_l1_unreserved_size()`` (L1 end minus the kernel-config base) returns 1,531,776 B;
  41,088 + 70,656 = 111,744 is a multiple of 64;
* one L1 bank per compute core, and every bank is ``worker_l1_size - l1_unreserved_base - l1_small_size`` bytes
  (``l1_small_size`` rounded up to 64 B sits above the regular L1 region):
  ``tt_metal/impl/allocator/l1_banking_allocator.cpp`` ``init_compute_and_storage_l1_bank_manager`` / ``generate_config``;
* a buffer takes ``ceil(pages / banks) * round_up(page_size, l1_alignment)`` bytes in each bank
  (``detail::calculate_bank_size_spread`` in ``tt_metal/impl/allocator/allocator.hpp``), where banks is the L1 bank count
  for an interleaved buffer and the shard grid's core count for a sharded one (``Buffer::aligned_size_per_bank``); the
  L1 alignment is 16 B (``ttnn.get_l1_alignment()`` on Blackhole);
* the L1 bank manager keeps ONE free list for all banks (``tt_metal/impl/allocator/bank_manager.cpp``
  ``BankManager::allocate_buffer``): a buffer gets the same address range in every bank, so a sharded buffer on k
  cores still takes its per-bank bytes out of every core's allocatable L1. The per-core charge is therefore one number
  per device, the sum of the live buffers' per-bank bytes, and that is what the refusal checks;
* refusal: ``BankManager::allocate_buffer``'s "Out of Memory: Not enough space to allocate {size} B L1 buffer across
  {banks} banks, where each bank needs to store {per bank} B, but bank size is {bank size} B (allocated: ..., free:
  ...)".

Circular buffers (the per-program scratch ops create at the bottom of L1 while they run) are not charged: the emulator
does not know each op's CB sizes. Fragmentation is not modelled either (a card may refuse earlier).
"""
from __future__ import annotations

import math

from .errors import EmulatorError, NotEmulatedError
from .tensor import BLOCK_FLOAT, ELEMENT_BYTES, TILE, TILE_BYTES, dtype_name, is_tile, padded_shape_of

BH_WORKER_L1_BYTES = 1_572_864  # blackhole_140_arch.yaml worker_l1_size
BH_L1_UNRESERVED_BASE = 111_744  # bh_hal_tensix.cpp DEFAULT_UNRESERVED: MEM_MAP_END (41,088 in 0.81.1) + 69 KiB, 64-aligned
BH_L1_ALIGNMENT = 16  # hal L1 alignment on Blackhole (ttnn.get_l1_alignment())
BH_DRAM_ALIGNMENT = 64  # l1_small_size and the unreserved base are rounded to it (l1_banking_allocator.cpp)


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def l1_bank_bytes(l1_small_size: int = 0) -> int:
    """Allocatable L1 bytes in each bank (one bank per compute core) for a device opened with ``l1_small_size``."""
    return BH_WORKER_L1_BYTES - BH_L1_UNRESERVED_BASE - _round_up(l1_small_size, BH_DRAM_ALIGNMENT)


def _pages(shape, dtype, layout) -> tuple[int, int]:
    """(pages, page bytes) of a tensor of this 2-D-folded or N-D shape: a tile per page in TILE layout, a row per page
    in ROW_MAJOR (tt-metal's buffer page rule for both)."""
    name = dtype_name(dtype)
    shape = [int(x) for x in shape]
    if is_tile(layout):
        padded = padded_shape_of(shape, layout)
        return math.prod(padded[:-2]) * (padded[-2] // TILE) * (padded[-1] // TILE), TILE_BYTES[name]
    if name in BLOCK_FLOAT:
        raise EmulatorError(f"{name} requires TILE layout")
    width = shape[-1] if shape else 1
    return math.prod(shape[:-1]) if len(shape) > 1 else 1, width * ELEMENT_BYTES[name]


def l1_footprint(t, num_banks: int) -> tuple[int, int, int]:
    """(buffer bytes, banks it is spread over, bytes per bank) of an L1 tensor on one device, as the allocator sizes
    it (module doc): an interleaved tensor's pages round-robin over ``num_banks``; a sharded tensor's pages over its
    shard grid, each core holding one (padded) shard."""
    mc = t.memory_config()
    if mc.is_sharded():
        spec = mc.shard_spec
        if spec is None:  # a spec-less config never gets here (shard_specs.require_shard_spec): an ND-only one
            raise NotEmulatedError("L1 accounting: a tensor sharded by an nd_shard_spec only (no 2-D shard_spec) "
                                   "is not emulated")
        cores = spec.grid.num_cores()
        pages_per_shard, page = _pages(list(spec.shape), t.dtype, t.layout)
        pages = pages_per_shard * cores
        banks = cores
    else:
        pages, page = _pages(t._shards[0].shape, t.dtype, t.layout)
        banks = num_banks
    aligned_page = _round_up(page, BH_L1_ALIGNMENT)
    per_bank = (0 if pages == 0 else -(-pages // banks)) * aligned_page
    return pages * aligned_page, banks, per_bank
