"""DRAM capacity per device on the emulated mesh: the trace region is reserved at open, every DRAM buffer (from_torch,
allocate_tensor_on_device, op outputs, DRAM-sharded weights) is charged to each device it lives on until
ttnn.deallocate or garbage collection frees it, L1 buffers are not charged, and an allocation that would not fit in a
P150a's DRAM is refused with the card allocator's out-of-memory message (tt-metal bank_manager.cpp)."""
from __future__ import annotations

import gc

import pytest
import torch

from qwen36.tt_ops.device import open_mesh
from qwen36.tt_ops.emulator.errors import EmulatorError
from qwen36.tt_ops.emulator.mesh import P150A_DRAM_BANK_BYTES, P150A_DRAM_BANKS, P150A_DRAM_BYTES

TILE_BF16 = 2048


def _put(ttnn, mesh, rows=32, cols=64, **kw):
    return ttnn.from_torch(torch.zeros(rows, cols), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(mesh), **kw)


def test_capacity_is_the_p150_allocator_banks():
    assert P150A_DRAM_BYTES == P150A_DRAM_BANKS * P150A_DRAM_BANK_BYTES == 8 * 4_273_390_016


def test_dram_accounting_and_refusal():
    region = P150A_DRAM_BYTES - 3 * TILE_BF16  # room for three bf16 tiles per device
    with open_mesh("emulated-p150x2", trace_region_size=region) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        assert mesh.dram_in_use() == [region] * 2
        a = _put(ttnn, mesh)  # two tiles on each device
        assert mesh.dram_in_use() == [region + 2 * TILE_BF16] * 2
        with pytest.raises(EmulatorError, match=r"^device 0: Out of Memory: Not enough space to allocate 4096 B DRAM "
                                                 r"buffer across 8 banks, .* \[32, 64\] BFLOAT16"):
            _put(ttnn, mesh)
        assert mesh.dram_in_use() == [region + 2 * TILE_BF16] * 2, "a refused allocation must not be charged"
        _put(ttnn, mesh, memory_config=ttnn.L1_MEMORY_CONFIG)  # L1: not DRAM
        assert mesh.dram_in_use() == [region + 2 * TILE_BF16] * 2
        ttnn.deallocate(a)
        assert mesh.dram_in_use() == [region] * 2
        b = _put(ttnn, mesh, rows=32, cols=32)
        c = ttnn.add(b, b)  # an op output is a DRAM buffer too
        assert mesh.dram_in_use() == [region + 2 * TILE_BF16] * 2
        del c
        gc.collect()
        assert mesh.dram_in_use() == [region + TILE_BF16] * 2, "a collected tensor frees its buffer"
        ttnn.deallocate(b)
        ttnn.deallocate(b)  # a second deallocate frees nothing more
        assert mesh.dram_in_use() == [region] * 2


def test_trace_region_larger_than_dram_is_refused():
    with pytest.raises(EmulatorError, match="trace_region_size .* exceeds a P150a's DRAM"):
        with open_mesh("emulated-p150", trace_region_size=P150A_DRAM_BYTES + 1):
            pass
