"""L1 capacity per core on the emulated mesh: every L1 buffer is charged, per device, the bytes tt-metal's L1 allocator
takes from each bank (one bank per compute core; interleaved pages round-robin over the banks, a sharded buffer one
shard per core of its grid, the same address range reserved in every bank), freed by ttnn.deallocate or garbage
collection, and an allocation a core's bank cannot hold is refused with the card allocator's out-of-memory message
(tt-metal bank_manager.cpp). Sizes: tt_ops/emulator/l1.py."""
from __future__ import annotations

import gc

import pytest
import torch

from qwen36.tt_ops.device import open_mesh
from qwen36.tt_ops.emulator.errors import EmulatorError
from qwen36.tt_ops.emulator.l1 import l1_bank_bytes
from qwen36.tt_ops.emulator.mesh import P150A_L1_BANKS

BANK = 1_572_864 - 111_744  # worker_l1_size - Blackhole L1 unreserved base (l1.py)


def _put(ttnn, mesh, rows, cols, dtype=None, layout=None, memory_config=None):
    return ttnn.from_torch(torch.zeros(rows, cols), dtype=dtype or ttnn.bfloat16, layout=layout or ttnn.TILE_LAYOUT,
                           device=mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh), memory_config=memory_config)


def _width_sharded(ttnn, shard_cols, cores):
    return ttnn.create_sharded_memory_config(shape=(32, shard_cols), core_grid=ttnn.CoreGrid(y=1, x=cores),
                                             strategy=ttnn.ShardStrategy.WIDTH, use_height_and_width_as_shard_shape=True)


def test_bank_size_is_blackhole_l1_above_the_reserved_base():
    assert P150A_L1_BANKS == 110
    assert l1_bank_bytes(0) == BANK == 1_461_120
    assert l1_bank_bytes(24576) == BANK - 24576
    assert l1_bank_bytes(100) == BANK - 128, "l1_small_size is rounded up to the 64 B DRAM alignment"


def test_sharded_and_interleaved_l1_are_charged_per_core_and_freed():
    with open_mesh("emulated-p150x2", l1_small_size=0) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        assert mesh.l1_in_use() == [0, 0]
        dram = _put(ttnn, mesh, 32, 64)
        assert mesh.l1_in_use() == [0, 0], "a DRAM buffer takes no L1"
        # [32, 256] width-sharded over 4 cores: a [32, 64] shard, 2 bf16 tiles per core
        a = _put(ttnn, mesh, 32, 256, memory_config=_width_sharded(ttnn, 64, 4))
        assert mesh.l1_in_use() == [2 * 2048] * 2
        b = _put(ttnn, mesh, 32, 256, dtype=ttnn.bfloat8_b, memory_config=_width_sharded(ttnn, 64, 4))
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088] * 2
        # interleaved: 111 tiles round-robin over 110 banks put 2 tiles in the fullest bank; 110 tiles one in each
        c = _put(ttnn, mesh, 32, 32 * 111, memory_config=ttnn.L1_MEMORY_CONFIG)
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088 + 2 * 2048] * 2
        ttnn.deallocate(c)
        c = _put(ttnn, mesh, 32, 32 * 110, memory_config=ttnn.L1_MEMORY_CONFIG)
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088 + 2048] * 2
        # row-major interleaved: a page per row, rounded up to the 16 B L1 alignment (3 rows of 20 B: 32 B per bank)
        d = _put(ttnn, mesh, 3, 10, layout=ttnn.ROW_MAJOR_LAYOUT, memory_config=ttnn.L1_MEMORY_CONFIG)
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088 + 2048 + 32] * 2
        peak = mesh.l1_peak_per_core()
        assert peak == [2 * 2048 + 2 * 1088 + 2 * 2048] * 2, "the peak is the most held at once"
        e = ttnn.add(a, a)  # an op output in L1 is a buffer too (the input's sharded layout)
        assert e.memory_config().buffer_type == ttnn.BufferType.L1
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088 + 2048 + 32 + 2 * 2048] * 2
        del e
        gc.collect()
        assert mesh.l1_in_use() == [2 * 2048 + 2 * 1088 + 2048 + 32] * 2, "a collected tensor frees its L1"
        for t in (a, b, c, d):
            ttnn.deallocate(t)
        ttnn.deallocate(a)  # a second deallocate frees nothing more
        assert mesh.l1_in_use() == [0, 0]
        assert mesh.l1_peak_per_core() == [2 * 2048 + 2 * 1088 + 2048 + 32 + 2 * 2048] * 2
        del dram


def test_l1_allocation_beyond_a_core_is_refused():
    with open_mesh("emulated-p150", l1_small_size=0) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        tiles = BANK // 2048  # 713 bf16 tiles fit a bank, 714 do not
        big = _put(ttnn, mesh, 32, 32 * tiles, memory_config=_width_sharded(ttnn, 32 * tiles, 1))
        assert mesh.l1_in_use() == [tiles * 2048]
        # the sharded buffer reserves its shard's bytes in every bank, so a 1-tile buffer on another core is refused
        with pytest.raises(EmulatorError, match=r"^device 0: Out of Memory: Not enough space to allocate 2048 B L1 "
                                                 r"buffer across 1 banks, where each bank needs to store 2048 B, but "
                                                 r"bank size is 1461120 B \(allocated: 1460224 B, free: 896 B\); "
                                                 r"tensor \[32, 32\] BFLOAT16 WIDTH_SHARDED"):
            _put(ttnn, mesh, 32, 32, memory_config=_width_sharded(ttnn, 32, 1))
        with pytest.raises(EmulatorError, match="Out of Memory: .* L1 buffer across 110 banks"):
            _put(ttnn, mesh, 32, 32, memory_config=ttnn.L1_MEMORY_CONFIG)
        assert mesh.l1_in_use() == [tiles * 2048], "a refused allocation must not be charged"
        ttnn.deallocate(big)
        with pytest.raises(EmulatorError, match=r"Out of Memory: Not enough space to allocate 1462272 B L1 buffer "
                                                 r"across 1 banks, where each bank needs to store 1462272 B"):
            _put(ttnn, mesh, 32, 32 * (tiles + 1), memory_config=_width_sharded(ttnn, 32 * (tiles + 1), 1))
    with open_mesh("emulated-p150", l1_small_size=64 * 1024) as ctx:  # L1_SMALL shrinks the regular banks
        with pytest.raises(EmulatorError, match=r"bank size is 1395584 B"):
            _put(ctx.ttnn, ctx.mesh_device, 32, 32 * 700, memory_config=_width_sharded(ctx.ttnn, 32 * 700, 1))


def test_capture_buffers_the_caller_dropped_do_not_hold_l1():
    """A trace keeps every tensor of its capture for replay, but on cards a captured op's output is freed once the
    caller drops it (its address reused): before refusing, the emulator frees those; release_trace frees the rest.
    (A speculative verify capture once ran out of L1 here on buffers a card had already freed.)"""
    tiles = 400  # 819,200 B on one core: one fits a bank, two do not
    with open_mesh("emulated-p150", trace_region_size=1 << 20) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = _put(ttnn, mesh, 32, 32 * tiles)  # DRAM input
        mc = _width_sharded(ttnn, 32 * tiles, 1)

        def step():
            ttnn.to_memory_config(x, mc)  # an L1 output nobody keeps

        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        for _ in range(3):
            step()
        kept = ttnn.to_memory_config(x, mc)  # the caller keeps this one
        ttnn.end_trace_capture(mesh, tid, cq_id=0)
        assert mesh.l1_in_use()[0] <= 2 * tiles * 2048
        ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)
        ttnn.release_trace(mesh, tid)
        gc.collect()
        assert mesh.l1_in_use() == [tiles * 2048], "after release only the buffer the caller holds is charged"
        ttnn.deallocate(kept)
        assert mesh.l1_in_use() == [0]
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)  # no pressure: the dropped output stays charged until release
        step()
        ttnn.end_trace_capture(mesh, tid, cq_id=0)
        assert mesh.l1_in_use() == [tiles * 2048]
        ttnn.release_trace(mesh, tid)
        gc.collect()
        assert mesh.l1_in_use() == [0]


def test_a_replayed_captures_dropped_intermediates_do_not_hold_l1():
    """A capture buffer that a later captured op reads (an intermediate) is held by the trace's records only, replays
    included (the replay lists each step's inputs once): when the caller has dropped it, it is freed before an
    allocation is refused, as after a card freed it."""
    tiles = 400  # 819,200 B on one core: one fits a bank, two do not
    with open_mesh("emulated-p150", trace_region_size=1 << 20) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        x = _put(ttnn, mesh, 32, 32 * tiles)  # DRAM input
        mc = _width_sharded(ttnn, 32 * tiles, 1)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        mid = ttnn.to_memory_config(x, mc)  # L1 intermediate
        out = ttnn.to_memory_config(mid, ttnn.DRAM_MEMORY_CONFIG)  # the captured op that reads it
        ttnn.end_trace_capture(mesh, tid, cq_id=0)
        del mid
        ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)
        assert mesh.l1_in_use() == [tiles * 2048]
        tid2 = ttnn.begin_trace_capture(mesh, cq_id=0)  # another trace's capture (the speculative step's pattern)
        again = ttnn.to_memory_config(x, mc)  # fits only once the dropped intermediate is freed
        ttnn.end_trace_capture(mesh, tid2, cq_id=0)
        assert mesh.l1_in_use() == [tiles * 2048]
        ttnn.execute_trace(mesh, tid, cq_id=0, blocking=True)  # the first trace still replays (its buffer kept)
        for t in (tid, tid2):
            ttnn.release_trace(mesh, t)
        del out, again
