"""Sparse mixture-of-experts block (Qwen3.6 MoE sibling, 35B-A3B) on a TP mesh.

x [1, 1, M, H] -> [1, 1, M, H] (replicated after one all_reduce), for any row count M: 1 (decode), K+1 (the
packed verify), a prefill chunk. Same maths as the reference (models/qwen36/reference/moe.py), all on device:

    logits = x @ W_router                       fp32, [M, E], replicated router on every device
    p = softmax(logits); (w, ids) = topk(p, k)  softmax over all E experts first, then top-k (the reference order)
    w = w / sum(w)                              renormalised over the k picked experts
    routed = sum_j w_j * down_{ids_j}(silu(gate_{ids_j} x) * up_{ids_j} x)
    out = all_reduce(routed + sigmoid(x . w_gate) * shared(x))

Parallel layout: every expert (and the shared expert) is tensor-parallel over its intermediate dim, like the dense
MLP (column-parallel gate/up, row-parallel down), so each device holds half of every expert and computes the same
routing. At two devices this reads exactly half of the k selected experts per device per row set, on both devices
alike; splitting whole experts over the devices (expert parallel) would make each device read the selected experts
that live on it: k/2 on average, but the step waits for the busier device (for top-8 of 256, E[max] ~5.1 experts,
docs/tt_moe.md), and the collective is the same one all_reduce either way. Programs per block are the same in both
layouts. Expert parallelism wins at wider meshes (all-to-all dispatch instead of reading every selected expert on
every device); at 1x2 tensor-parallel experts read fewer bytes on the critical device.

Expert matmuls: ``ttnn.sparse_matmul`` in its indexed mode: the M*k routed expert ids (on-device top-k output,
uint16, one ROW_MAJOR stick) list the groups of the stacked expert weights to compute; the reader fetches only
those groups. Slot i of the compact output is expert ids[i] applied to all M rows; the combine weight of slot i is
w[row(i), j(i)] on row row(i) and 0 on the other rows (a constant one-hot over rows), so

    routed[r] = sum_i c[i, r] * y[i, r],   c[i, r] = w_flat[i] * [row(i) == r]

Cost (honest, modelled): a decode step reads k experts (per device: k halves); a K+1-row verify reads (K+1)*k
expert slots, an expert picked by two rows is read twice. A card-optimal verify reads each distinct expert once
(deduplicated ids; expected distinct count E * (1 - (1 - k/E)^(K+1)) under uniform routing): 57.4 instead of 64 at
K=7 for top-8 of 256, so the duplicates cost ~11% of the verify's expert bytes there (docs/tt_moe.md).
The indexed mode lists at most E groups, so a chunk with M*k > E (prefill) runs every expert over all its rows
(scan mode, every group active) with dense combine weights: it reads all E experts once per chunk, which a long
prefill chunk touches nearly all of anyway; a card-optimal prefill would mask the sparsity to the union of routed
experts (or dispatch tokens all-to-all).
"""
from __future__ import annotations

import torch

from . import moe_dispatch
from .ccl import all_reduce, ccl_for
from .mlp import TTMLP
from .model_config import (TensorGroup, TTModelArgs, activation_memory_config, compute_config_matmul,
                           compute_config_norm)
from .weights import MoEWeights


def sparse_matmul_program_config(ttnn, rows: int, n: int):
    """The 1-D multicast config sparse_matmul requires (only this kind, ``mcast_in0=True``). Block sizes are the
    smallest valid ones (Tenstorrent's unit test uses the same); tune on cards."""
    return ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig(
        compute_with_storage_grid_size=ttnn.CoreCoord(8, 8), in0_block_w=1, out_subblock_h=1, out_subblock_w=1,
        out_block_h=1, out_block_w=1, per_core_M=max(1, -(-rows // 32)), per_core_N=max(1, -(-n // 32) // 64),
        fuse_batch=False, fused_activation=None, mcast_in0=True)


def row_onehot(rows: int, k: int) -> torch.Tensor:
    """[1, rows*k, rows, 1]: slot i = (row r, choice j) in row-major order -> 1 at row r, 0 elsewhere."""
    m = torch.zeros(1, rows * k, rows, 1)
    for r in range(rows):
        m[0, r * k:(r + 1) * k, r, 0] = 1.0
    return m


class TTMoE:
    def __init__(self, args: TTModelArgs, weights: MoEWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        ccl_for(ttnn, mesh)  # the collectives' persistent semaphores exist before any trace capture
        self.k = args.cfg.num_experts_per_tok
        self.i_d = args.moe_intermediate_d
        self.shared_mlp = TTMLP(args, weights.shared, ttnn, mesh)  # the dense SwiGLU, its reduce left to forward
        self._onehot: dict[int, object] = {}  # rows -> device one-hot (made on the eager run before any capture)
        self._dispatch: dict[int, moe_dispatch.DispatchConsts] = {}  # prefill chunk rows -> dispatch constants

    def onehot(self, rows: int):
        if rows not in self._onehot:
            ttnn = self.ttnn
            self._onehot[rows] = ttnn.from_torch(
                row_onehot(rows, self.k), dtype=self.args.dtype(TensorGroup.MOE_ROUTING, ttnn), layout=ttnn.TILE_LAYOUT,
                device=self.mesh, memory_config=activation_memory_config(ttnn),
                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        return self._onehot[rows]

    def route(self, x):
        """x [1, 1, M, H] -> (probs [1, 1, M, E], weights [1, 1, M, k] fp32 renormalised, expert ids [1, 1, M, k]
        uint32), on device."""
        ttnn, a = self.ttnn, self.args
        mc, rdt = activation_memory_config(ttnn), a.dtype(TensorGroup.MOE_ROUTING, ttnn)
        logits = ttnn.linear(x, self.w.router, dtype=rdt, memory_config=mc,
                             compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MOE_ROUTER)))
        probs = ttnn.softmax(logits, dim=-1, memory_config=mc, compute_kernel_config=compute_config_norm(ttnn))
        top_w, top_i = ttnn.topk(probs, self.k, dim=-1, largest=True, sorted=True, memory_config=mc)
        total = ttnn.sum(top_w, dim=-1, keepdim=True, memory_config=mc, compute_kernel_config=compute_config_norm(ttnn))
        return probs, ttnn.divide(top_w, total, memory_config=mc), top_w, top_i

    def dispatch_consts(self, rows: int) -> moe_dispatch.DispatchConsts:
        if rows not in self._dispatch:
            self._dispatch[rows] = moe_dispatch.make_consts(self.ttnn, self.mesh, self.args, rows)
        return self._dispatch[rows]

    def routed_dispatch(self, x, w, ids):
        """The k routed experts of every row for chunks with M*k > E (prefill): the slots dispatched to their experts
        in blocks of ``moe_dispatch.BLOCK`` rows, one grouped matmul pair over the blocks, the outputs gathered back and weighted
        (tt/model/moe_dispatch.py). Only the routed (row, expert) pairs are computed, each expert's weights read once
        per block of its rows."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        mc, act = activation_memory_config(ttnn), a.dtype(TensorGroup.ACTIVATION, ttnn)
        d = moe_dispatch.plan(ttnn, a, self.dispatch_consts(rows), x, ids)
        y = self._experts(d.rows_x, d.blocks, grouped=d.sparsity)  # [1, NB, R, H]
        y = moe_dispatch.gather_back(ttnn, y, d.slot_rows, rows, self.k)  # [1, k, M, H]
        wc = ttnn.reshape(ttnn.permute(w, (0, 1, 3, 2), memory_config=mc), [1, self.k, rows, 1])  # choice-major
        y = ttnn.multiply(y, wc, dtype=act, memory_config=mc)
        return ttnn.sum(y, dim=1, keepdim=True, memory_config=mc, compute_kernel_config=compute_config_norm(ttnn))

    def _experts(self, x, groups: int, grouped=None, **mode):
        """down(silu(gate x) * up x) of ``groups`` expert slots over the M rows of x: [1, groups, M, H]. ``mode`` picks
        the sparse_matmul mode the gate/up and down matmuls share: ``indices=`` (the listed experts, each over all M
        rows). ``grouped`` (a [1, 1, groups, E] sparsity with one expert per block): x is [1, groups, R, H], block b
        computed against its own expert only (the dense-A mode, ``nnz`` = groups, compact outputs)."""
        ttnn, a = self.ttnn, self.args
        rows, h = x.shape[2], a.cfg.hidden_size
        mc, act = activation_memory_config(ttnn), a.dtype(TensorGroup.ACTIVATION, ttnn)
        sparsity, down_a_sparse = self.w.sparsity, True
        outs = {}
        if grouped is not None:
            sparsity, down_a_sparse, mode = grouped, False, {"nnz": groups}
            outs = {n: ttnn.allocate_tensor_on_device(ttnn.Shape([1, groups, rows, n]), act, ttnn.TILE_LAYOUT,
                                                      self.mesh, mc) for n in (2 * self.i_d, h)}
        gu = ttnn.sparse_matmul(x, self.w.experts_gate_up, sparsity=sparsity, **mode,
                                optional_output_tensor=outs.get(2 * self.i_d),
                                is_input_a_sparse=False, is_input_b_sparse=True, dtype=act, memory_config=mc,
                                program_config=sparse_matmul_program_config(ttnn, rows, 2 * self.i_d),
                                compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_GATE_UP)))
        gu = ttnn.reshape(gu, [1, groups, rows, 2 * self.i_d])
        gate = ttnn.slice(gu, [0, 0, 0, 0], [1, groups, rows, self.i_d])
        up = ttnn.slice(gu, [0, 0, 0, self.i_d], [1, groups, rows, 2 * self.i_d])
        hid = ttnn.multiply(ttnn.silu(gate), up, memory_config=mc)
        return ttnn.sparse_matmul(hid, self.w.experts_down, sparsity=sparsity, **mode, optional_output_tensor=outs.get(h),
                                  is_input_a_sparse=down_a_sparse, is_input_b_sparse=True, dtype=act, memory_config=mc,
                                  program_config=sparse_matmul_program_config(ttnn, rows, h),
                                  compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_DOWN)))

    def routed(self, x, w, ids):
        """The k routed experts of every row, weighted and summed: a per-device partial [1, 1, M, H] (indexed mode,
        M*k <= E)."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        slots = rows * self.k
        mc, act = activation_memory_config(ttnn), a.dtype(TensorGroup.ACTIVATION, ttnn)
        # the ids as one ROW_MAJOR uint16 stick [1, 1, 1, M*k]: slot i = (row i // k, choice i % k)
        ids = ttnn.typecast(ids, ttnn.uint16)
        ids = ttnn.to_layout(ids, ttnn.ROW_MAJOR_LAYOUT)
        ids = ttnn.reshape(ids, [1, 1, 1, slots])
        y = self._experts(x, slots, indices=ids)
        # combine weight per (slot, row): the slot's routing weight on its own row, 0 on the others
        c = ttnn.reshape(w, [1, slots, 1, 1])
        if rows > 1:
            c = ttnn.multiply(c, self.onehot(rows), memory_config=mc)
        y = ttnn.multiply(y, c, dtype=act, memory_config=mc)
        return ttnn.sum(y, dim=1, keepdim=True, memory_config=mc, compute_kernel_config=compute_config_norm(ttnn))

    def shared(self, x):
        """sigmoid(x . w_gate) * SwiGLU_shared(x): a per-device partial [1, 1, M, H] (row-parallel down)."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        mc, act = activation_memory_config(ttnn), a.dtype(TensorGroup.ACTIVATION, ttnn)
        out = self.shared_mlp.partial(x)
        g = ttnn.linear(x, self.w.shared_gate, dtype=a.dtype(TensorGroup.MOE_ROUTING, ttnn), activation="sigmoid",
                        memory_config=mc,
                        compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MOE_ROUTER)))
        return ttnn.multiply(out, g, dtype=act, memory_config=mc)

    def forward(self, x):
        ttnn, a = self.ttnn, self.args
        probs, w, top_w, ids = self.route(x)
        if x.shape[2] * self.k <= a.cfg.num_experts:
            routed = self.routed(x, w, ids)
        else:
            routed = self.routed_dispatch(x, w, ids)
        out = ttnn.add(routed, self.shared(x), dtype=a.dtype(TensorGroup.ACTIVATION, ttnn))
        return all_reduce(ttnn, out, a.num_devices)
