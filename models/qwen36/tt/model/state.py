"""Device-resident decode state, all explicit (never hidden inside modules), so a speculative step can
snapshot, ring-commit or recompute it.

Every tensor here is a *persistent* device buffer allocated once before any trace capture; forwards update
them in place (``ttnn.copy`` / paged cache ops), so a captured decode trace keeps pointing at them.

Shapes are per device (TP width N, B user slots: 1 for the single-user generator and the speculative
backend, the bucket size for the batched decoder, tt/runtime/batch.py):
  GDN layer:   recurrent [B*Hv/N, Dk, Dv] fp32 (TILE: the ring layout of fused_recurrent_gated_delta_rule, block
               b*Hv/N + h is head h of slot b, so a decode of one row per slot updates it in place);
               conv [B, 1, kernel-1, conv_dim/N] (ROW_MAJOR: the shift register's row concat/slice then needs no
               tile alignment)
  attention:   k, v [num_blocks, Hkv/N, block_size, head_dim] (TILE, paged; slot b owns the pages of page-table row b)
  inputs:      tokens [1, B*rows] uint32 RM; pos [B] int32 RM (cache position of the user's row, -1 = skip);
               rope_idx [1, B*rows] uint32 RM (row index into the cos/sin tables);
               page_table [B, blocks_per_seq] int32 RM
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...config import FULL
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
    users: int = 1  # B: one row per user when B > 1 (a batched plain decode)


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


def allocate_state(args: TTModelArgs, ttnn, mesh, layer_ids: list[int] | None = None,
                   slots: int | None = None) -> TTModelState:
    """Zeroed state of ``slots`` users (default ``args.batch``) for layers ``layer_ids`` (default all) plus an
    identity page table (user b owns blocks b*blocks_per_seq .. (b+1)*blocks_per_seq-1). Call before capturing any
    trace."""
    c = args.cfg
    slots = args.batch if slots is None else slots
    ids = range(c.num_hidden_layers) if layer_ids is None else layer_ids
    layers = []
    for i in ids:
        layers.append(new_layer_state(args, ttnn, mesh, c.layer_types[i], slots=slots))
    table = torch.arange(args.blocks_per_seq * slots, dtype=torch.int32).reshape(slots, args.blocks_per_seq)
    pt = ttnn.from_torch(table, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
                         memory_config=state_memory_config(ttnn))
    return TTModelState(layers, pt, table, 0)


def new_layer_state(args: TTModelArgs, ttnn, mesh, layer_type: str, slots: int | None = None):
    c, tile = args.cfg, ttnn.TILE_LAYOUT
    if layer_type == FULL:
        blocks = args.num_blocks if slots is None else args.blocks_per_seq * slots
        shape = (blocks, args.hkv_d, args.block_size, c.head_dim)
        dt = args.dtype(TensorGroup.KV_CACHE, ttnn)
        return KVLayerState(_zeros(ttnn, mesh, shape, dt, tile), _zeros(ttnn, mesh, shape, dt, tile))
    slots = args.batch if slots is None else slots
    rec = _zeros(ttnn, mesh, (slots * args.gdn_hv_d, c.linear_key_head_dim, c.linear_value_head_dim),
                 args.dtype(TensorGroup.GDN_STATE, ttnn), tile)
    conv = _zeros(ttnn, mesh, (slots, 1, c.linear_conv_kernel_dim - 1, args.gdn_conv_dim_d),
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
    """Persistent decode input buffers (replicated on every device): ``rows`` rows of one user (plain decode,
    K+1-row verify) or one row for each of ``batch`` users (batched plain decode). Token and RoPE rows sit on the
    last dimension ([1, B*rows]), so the embedding's [1, B*rows, H] output is the [1, 1, B*rows, H] activation
    by a view."""
    if batch > 1 and rows != 1:
        raise ValueError(f"batched decode inputs are one row per user (got rows={rows}, batch={batch})")
    mc = state_memory_config(ttnn)
    rm = ttnn.ROW_MAJOR_LAYOUT
    tokens = ttnn.from_torch(torch.zeros(1, batch * rows, dtype=torch.int32), dtype=ttnn.uint32, layout=rm,
                             device=mesh, memory_config=mc)
    pos = ttnn.from_torch(torch.zeros(batch, dtype=torch.int32), dtype=ttnn.int32, layout=rm, device=mesh,
                          memory_config=mc)
    rope_idx = ttnn.from_torch(torch.zeros(1, batch * rows, dtype=torch.int32), dtype=ttnn.uint32, layout=rm,
                               device=mesh, memory_config=mc)
    return DecodeInputs(tokens, pos, rope_idx, rows, batch)
