"""Device-resident decode state, all explicit (never hidden inside modules), so a speculative step can
snapshot, ring-commit or recompute it.

Every tensor here is a *persistent* device buffer allocated once before any trace capture; forwards update
them in place (``ttnn.copy`` / paged cache ops), so a captured decode trace keeps pointing at them.

Shapes are per device (TP width N, batch B = 1):
  GDN layer:   recurrent [B*Hv/N, Dk, Dv] fp32 (TILE: the ring layout of fused_recurrent_gated_delta_rule, so a
               1-row decode updates it in place);  conv [1, 1, kernel-1, conv_dim/N] (ROW_MAJOR: the
               shift register's row concat/slice then needs no tile alignment)
  attention:   k, v [num_blocks, Hkv/N, block_size, head_dim] (TILE, paged)
  inputs:      tokens [B, rows] uint32 RM; pos [B] int32 RM (cache position of the row, -1 = skip);
               rope_idx [B, rows] uint32 RM (row index into the cos/sin tables);
               page_table [B, blocks_per_seq] int32 RM
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import FULL
from .model_config import TensorGroup, TTModelArgs, state_memory_config


@dataclass
class GDNLayerState:
    recurrent: Any
    conv: Any


@dataclass
class KVLayerState:
    k: Any
    v: Any


@dataclass
class DecodeInputs:
    """Persistent input buffers of one decode step with ``rows`` rows per user (1 for plain decode)."""

    tokens: Any
    pos: Any
    rope_idx: Any
    rows: int


@dataclass
class TTModelState:
    layers: list  # GDNLayerState | KVLayerState, one per decoder layer
    page_table: Any  # device [B, blocks_per_seq] int32
    page_table_host: torch.Tensor
    pos: int = 0  # next position to write (host bookkeeping == tokens consumed)

    def gdn_states(self) -> list[GDNLayerState]:
        return [s for s in self.layers if isinstance(s, GDNLayerState)]


def _zeros(ttnn, mesh, shape, dtype, layout):
    torch_dt = torch.float32
    return ttnn.from_torch(torch.zeros(shape, dtype=torch_dt), dtype=dtype, layout=layout, device=mesh,
                           memory_config=state_memory_config(ttnn))


def allocate_state(args: TTModelArgs, ttnn, mesh, layer_ids: list[int] | None = None) -> TTModelState:
    """Zeroed state for layers ``layer_ids`` (default all) plus an identity page table (user 0 owns blocks
    0..blocks_per_seq-1). Call before capturing any trace."""
    c = args.cfg
    ids = range(c.num_hidden_layers) if layer_ids is None else layer_ids
    layers = []
    for i in ids:
        layers.append(new_layer_state(args, ttnn, mesh, c.layer_types[i]))
    table = torch.arange(args.num_blocks, dtype=torch.int32).reshape(args.batch, args.blocks_per_seq)
    pt = ttnn.from_torch(table, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
                         memory_config=state_memory_config(ttnn))
    return TTModelState(layers, pt, table, 0)


def new_layer_state(args: TTModelArgs, ttnn, mesh, layer_type: str):
    c, tile = args.cfg, ttnn.TILE_LAYOUT
    if layer_type == FULL:
        shape = (args.num_blocks, args.hkv_d, args.block_size, c.head_dim)
        dt = args.dtype(TensorGroup.KV_CACHE, ttnn)
        return KVLayerState(_zeros(ttnn, mesh, shape, dt, tile), _zeros(ttnn, mesh, shape, dt, tile))
    rec = _zeros(ttnn, mesh, (args.batch * args.gdn_hv_d, c.linear_key_head_dim, c.linear_value_head_dim),
                 args.dtype(TensorGroup.GDN_STATE, ttnn), tile)
    conv = _zeros(ttnn, mesh, (1, 1, c.linear_conv_kernel_dim - 1, args.gdn_conv_dim_d),
                  args.dtype(TensorGroup.GDN_ACTIVATION, ttnn), ttnn.ROW_MAJOR_LAYOUT)
    return GDNLayerState(rec, conv)


def reset_state(state: TTModelState, ttnn) -> None:
    """Zero every state buffer in place (host -> device writes; not allowed inside a trace capture). KV pages
    need no clearing: rows past ``pos`` are never attended and are overwritten before they are."""
    for s in state.layers:
        if isinstance(s, GDNLayerState):
            for buf in (s.recurrent, s.conv):
                host = ttnn.from_torch(torch.zeros(list(buf.shape)), dtype=buf.dtype, layout=buf.layout,
                                       mesh_mapper=ttnn.ReplicateTensorToMesh(buf.device()))
                ttnn.copy_host_to_device_tensor(host, buf)
    state.pos = 0


def allocate_decode_inputs(ttnn, mesh, rows: int = 1, batch: int = 1) -> DecodeInputs:
    """Persistent decode input buffers (replicated on every device)."""
    mc = state_memory_config(ttnn)
    rm = ttnn.ROW_MAJOR_LAYOUT
    tokens = ttnn.from_torch(torch.zeros(batch, rows, dtype=torch.int32), dtype=ttnn.uint32, layout=rm, device=mesh,
                             memory_config=mc)
    pos = ttnn.from_torch(torch.zeros(batch, dtype=torch.int32), dtype=ttnn.int32, layout=rm, device=mesh,
                          memory_config=mc)
    rope_idx = ttnn.from_torch(torch.zeros(batch, rows, dtype=torch.int32), dtype=ttnn.uint32, layout=rm, device=mesh,
                               memory_config=mc)
    return DecodeInputs(tokens, pos, rope_idx, rows)
