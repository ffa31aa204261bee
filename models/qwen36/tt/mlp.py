"""SwiGLU MLP on a TP mesh: fused column-parallel [gate_d | up_d], row-parallel down_proj + all_reduce.

x [1, 1, T, H] -> [1, 1, T, H] (replicated after the reduce).
"""
from __future__ import annotations

from .ccl import ccl_for
from .gdn import all_reduce
from .model_config import TensorGroup, TTModelArgs, activation_memory_config, compute_config_matmul
from .weights import MLPWeights


class TTMLP:
    def __init__(self, args: TTModelArgs, weights: MLPWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        ccl_for(ttnn, mesh)  # the collectives' persistent semaphores exist before any trace capture
        self.i_d = args.intermediate_d

    def forward(self, x):
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        mc = activation_memory_config(ttnn)
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        gu = ttnn.linear(x, self.w.gate_up, dtype=act, memory_config=mc,
                         compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_GATE_UP)))
        gate = ttnn.slice(gu, [0, 0, 0, 0], [1, 1, rows, self.i_d])
        up = ttnn.slice(gu, [0, 0, 0, self.i_d], [1, 1, rows, 2 * self.i_d])
        h = ttnn.multiply(ttnn.silu(gate), up, memory_config=mc)
        out = ttnn.linear(h, self.w.down, dtype=act, memory_config=mc,
                          compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_DOWN)))
        return all_reduce(ttnn, out, a.num_devices)
