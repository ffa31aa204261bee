"""Routed experts of a prefill chunk: every (row, choice) slot dispatched to its expert, on device.

A chunk of M rows routes S = M*k (row, expert) slots, more than the indexed ``sparse_matmul`` can list (at most E
groups). Instead of running every expert over every row, the rows are copied into an expert-major dispatch buffer
of NB = E + ceil(S / R) blocks of R = ``BLOCK`` rows: expert e owns ceil(c_e / R) consecutive blocks (c_e = slots
routed to it), its rows in slot order, the rest of its last block zero. One grouped ``sparse_matmul`` pair (gate/up,
down) then computes each block against its own expert only (the dense-A mode over NB batches, its sparsity marking
one expert per block, ``nnz`` = NB exactly, the compact output), and each slot reads its row of the result back.
NB is the bound sum_e ceil(c_e / R) <= E + S / R, so every shape is static (no host round trip); blocks past the
last used one hold zero rows and count as the last expert's. Slots are choice-major: slot s = j*M + r is row r's
j-th choice, so the weighted sum over the k choices is a sum over the outer dim of [1, k, M, H].

R trades the blocks' expert-weight reads (NB x one expert's weights: an expert is read again for every block of its
rows) against the dispatch buffers (R x NB rows): per chunk about (E + S/R) W + (E R + S) c bytes, least near
R = sqrt(S W / (c E)); for the 35B-A3B at TP=2 (W = 1.67 MB of bf8 weights per expert and device, c about 16 KB per
dispatch row, E = 256, S = 16,384 for a 2,048-row chunk) that is about 80, so R = 64 (a whole number of tile rows).

Index arithmetic is exact: counts, ranks, block and row numbers are integers below 2^24 held in fp32 (cumsum,
sums with fp32 Dst accumulation, SFPU element-wise ops), typecast to uint32/uint16 where an op takes indices:

    onehot[e, s] = [id_s == e]                      [E, S]
    rank_s       = sum_e onehot * cumsum_s(onehot)  rank (from 1) among the slots of its expert, in slot order
    c_e          = sum_s onehot;  b_e = ceil(c_e / R)
    bstart_e     = cumsum(b) - b;  sstart_e = cumsum(c) - c
    d_s          = R bstart_{e_s} + rank_s - 1      the slot's dispatch row
    dispatch row q of expert e (R bstart_e <= q < R bstart_e + c_e) holds the slot at position
    q - R bstart_e + sstart_e of the slots sorted by expert (``ttnn.sort``, stable: the rank order), else zeros.

The gathers of rows are ``ttnn.embedding`` lookups (the zero row is row M of the table), the slot lookups
``ttnn.gather`` on uint TILE tensors (an uint16 slot permutation from ``sort``, an uint32 row table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .model_config import TensorGroup, TTModelArgs, activation_memory_config, compute_config_norm

BLOCK = 64  # R: rows per dispatch block, the grouped matmul's M (module doc says why 64)


@dataclass
class DispatchConsts:
    """Host-built constants of one chunk size (made on the eager prefill, never inside a trace)."""

    slots: int
    blocks: int
    expert_rows: Any  # [1, 1, E, S] fp32: e on row e
    dispatch_rows: Any  # [1, 1, Q, E] fp32: q on row q (Q = R * blocks)
    block_rows: Any  # [1, 1, NB, E] fp32: b on row b
    row_of_slot: Any  # [1, 1, 1, S] uint32: s mod M
    keep_last: Any  # [1, 1, 1, E] fp32: 1, 0 for the last expert
    fill_last: Any  # [1, 1, 1, E] fp32: 0, NB for the last expert
    zero_rows: Any  # [1, 1, R, H] ROW_MAJOR activation zeros: the table row M that empty dispatch rows read


def dispatch_blocks(rows: int, k: int, experts: int) -> int:
    """NB = E + ceil(M k / R): the most R-row blocks the slots of a chunk can need (sum over experts of
    ceil(c_e / R) with sum c_e = M k)."""
    return experts + -(-rows * k // BLOCK)


def make_consts(ttnn, mesh, args: TTModelArgs, rows: int) -> DispatchConsts:
    c = args.cfg
    e, k, h = c.num_experts, c.num_experts_per_tok, c.hidden_size
    s, nb = rows * k, dispatch_blocks(rows, k, c.num_experts)
    mc, rep = activation_memory_config(ttnn), ttnn.ReplicateTensorToMesh(mesh)

    def put(x, dtype, layout=ttnn.TILE_LAYOUT):
        return ttnn.from_torch(x, dtype=dtype, layout=layout, device=mesh, memory_config=mc, mesh_mapper=rep)

    f32 = ttnn.float32
    last = torch.zeros(1, 1, 1, e)
    last[..., -1] = 1.0
    return DispatchConsts(
        slots=s, blocks=nb,
        expert_rows=put(torch.arange(e, dtype=torch.float32).view(1, 1, e, 1).expand(1, 1, e, s).contiguous(), f32),
        dispatch_rows=put(torch.arange(nb * BLOCK, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, nb * BLOCK, e)
                          .contiguous(), f32),
        block_rows=put(torch.arange(nb, dtype=torch.float32).view(1, 1, nb, 1).expand(1, 1, nb, e).contiguous(), f32),
        row_of_slot=put((torch.arange(s) % rows).view(1, 1, 1, s).to(torch.int32), ttnn.uint32),
        keep_last=put(1.0 - last, f32), fill_last=put(last * nb, f32),
        zero_rows=put(torch.zeros(1, 1, BLOCK, h), args.dtype(TensorGroup.ACTIVATION, ttnn), ttnn.ROW_MAJOR_LAYOUT))


@dataclass
class Dispatch:
    """One chunk's dispatch: the expert-major rows, the grouped matmuls' sparsity, each slot's dispatch row."""

    rows_x: Any  # [1, NB, R, H] the dispatched rows (zeros where no slot lands)
    sparsity: Any  # [1, 1, NB, E] bf16 ROW_MAJOR: exactly one expert per block
    slot_rows: Any  # [1, S] uint32 ROW_MAJOR: dispatch row of slot s
    blocks: int


def plan(ttnn, args: TTModelArgs, consts: DispatchConsts, x, ids) -> Dispatch:
    """x [1, 1, M, H], ids [1, 1, M, k] (top-k expert ids) -> the chunk's :class:`Dispatch` (module doc)."""
    f32, mc, ncfg = ttnn.float32, activation_memory_config(ttnn), compute_config_norm(ttnn)
    rows, h = x.shape[2], x.shape[3]
    s, nb = consts.slots, consts.blocks
    kw = dict(memory_config=mc)
    red = dict(memory_config=mc, compute_kernel_config=ncfg)

    def col_to_row(t):  # [1, 1, n, 1] -> [1, 1, 1, n]
        return ttnn.permute(t, (0, 1, 3, 2), **kw)

    ids_row = ttnn.reshape(ttnn.permute(ttnn.typecast(ids, f32), (0, 1, 3, 2), **kw), [1, 1, 1, s])  # choice-major
    onehot = ttnn.eq(consts.expert_rows, ids_row, **kw)  # [1, 1, E, S]
    rank = ttnn.sum(ttnn.multiply(onehot, ttnn.cumsum(onehot, dim=3, dtype=f32), **kw), dim=2, keepdim=True, **red)
    counts = ttnn.sum(onehot, dim=3, keepdim=True, **red)  # [1, 1, E, 1]
    blocks = ttnn.ceil(ttnn.multiply(counts, 1.0 / BLOCK, **kw), **kw)
    bend = ttnn.cumsum(blocks, dim=2, dtype=f32)
    first = ttnn.multiply(ttnn.subtract(bend, blocks, **kw), float(BLOCK), **kw)  # R bstart_e
    sstart = ttnn.subtract(ttnn.cumsum(counts, dim=2, dtype=f32), counts, **kw)
    # each slot's dispatch row: R bstart of its expert + its rank - 1
    d = ttnn.add(ttnn.sum(ttnn.multiply(onehot, ttnn.subtract(first, 1.0, **kw), **kw), dim=2, keepdim=True, **red),
                 rank, **kw)
    slot_rows = ttnn.reshape(ttnn.to_layout(ttnn.typecast(d, ttnn.uint32), ttnn.ROW_MAJOR_LAYOUT), [1, s])
    # each dispatch row's source: the sorted slot at q - R bstart_e + sstart_e for the expert e whose rows hold q
    lo, cnt = col_to_row(first), col_to_row(counts)
    own = ttnn.multiply(ttnn.ge(consts.dispatch_rows, lo, **kw),
                        ttnn.lt(consts.dispatch_rows, ttnn.add(lo, cnt, **kw), **kw), **kw)  # [1, 1, Q, E]
    pos = ttnn.sum(ttnn.multiply(own, ttnn.subtract(consts.dispatch_rows, ttnn.subtract(lo, col_to_row(sstart), **kw),
                                                    **kw), **kw), dim=3, keepdim=True, **red)  # [1, 1, Q, 1]
    valid = col_to_row(ttnn.sum(own, dim=3, keepdim=True, **red))  # [1, 1, 1, Q]: 1 where a slot lands
    _, perm = ttnn.sort(ids_row, dim=-1, stable=True, **kw)  # slots in expert order (ranks ascending)
    slot = ttnn.gather(perm, -1, ttnn.typecast(col_to_row(pos), ttnn.uint32), **kw)
    row = ttnn.typecast(ttnn.gather(consts.row_of_slot, -1, slot, **kw), f32)
    src = ttnn.add(ttnn.multiply(ttnn.subtract(row, float(rows), **kw), valid, **kw), float(rows), **kw)  # M: zeros
    src = ttnn.reshape(ttnn.to_layout(ttnn.typecast(src, ttnn.uint32), ttnn.ROW_MAJOR_LAYOUT), [1, nb * BLOCK])
    table = ttnn.concat([ttnn.to_layout(x, ttnn.ROW_MAJOR_LAYOUT), consts.zero_rows], dim=2, **kw)
    rows_x = ttnn.embedding(src, ttnn.reshape(table, [rows + BLOCK, h]), layout=ttnn.TILE_LAYOUT, **kw)
    # the grouped matmuls' sparsity: block b belongs to the expert whose blocks hold it (tail blocks: the last one)
    bstart = col_to_row(ttnn.subtract(bend, blocks, **kw))
    bend_row = ttnn.add(ttnn.multiply(col_to_row(bend), consts.keep_last, **kw), consts.fill_last, **kw)
    mine = ttnn.multiply(ttnn.ge(consts.block_rows, bstart, **kw), ttnn.lt(consts.block_rows, bend_row, **kw), **kw)
    sparsity = ttnn.to_layout(ttnn.typecast(mine, ttnn.bfloat16), ttnn.ROW_MAJOR_LAYOUT)
    return Dispatch(ttnn.reshape(rows_x, [1, nb, BLOCK, h]), sparsity, slot_rows, nb)


def gather_back(ttnn, y, slot_rows, rows: int, k: int):
    """y [1, NB, R, H] (the dispatch rows' expert outputs) -> [1, k, M, H]: slot s = j*M + r's output at [0, j, r]."""
    nb, h = y.shape[1], y.shape[3]
    table = ttnn.reshape(ttnn.to_layout(ttnn.reshape(y, [1, 1, nb * BLOCK, h]), ttnn.ROW_MAJOR_LAYOUT),
                         [nb * BLOCK, h])
    out = ttnn.embedding(slot_rows, table, layout=ttnn.TILE_LAYOUT, memory_config=activation_memory_config(ttnn))
    return ttnn.reshape(out, [1, k, rows, h])
