"""SwiGLU MLP on a TP mesh: column-parallel gate_d and up_d, row-parallel down_proj + all_reduce.

    h   = silu(x @ gate_d) * (x @ up_d)     silu fused as the multiply's input activation
    out = all_reduce(h @ down_d)

Five programs per call: two matmuls, one multiply, one matmul, one collective. A single fused [gate_d | up_d]
matmul reads the same weight bytes but its output then has to be split (two slices) and activated (one silu) before
the multiply: seven programs. ``experimental.minimal_matmul(fuse_swiglu=True)`` would be one program for both, but in
ttnn 0.81.1 it requires the weight dtype to equal the activation dtype (its docstring: "DType: must match
input_tensor dtype"), so bf8/bf4 weights would need bf8/bf4 activations (or a typecast program per call).

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

    def partial(self, x):
        """This device's h @ down_d before the reduce: [1, 1, T, H] (the MoE block adds it to its routed part)."""
        ttnn, a = self.ttnn, self.args
        mc = activation_memory_config(ttnn)
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        cfg = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_GATE_UP))
        gate = ttnn.linear(x, self.w.gate, dtype=act, memory_config=mc, compute_kernel_config=cfg)
        up = ttnn.linear(x, self.w.up, dtype=act, memory_config=mc, compute_kernel_config=cfg)
        h = ttnn.multiply(gate, up, input_tensor_a_activations=[ttnn.UnaryOpType.SILU], memory_config=mc)
        out = ttnn.linear(h, self.w.down, dtype=act, memory_config=mc,
                          compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_DOWN)))
        return out

    def forward(self, x):
        return all_reduce(self.ttnn, self.partial(x), self.args.num_devices)
