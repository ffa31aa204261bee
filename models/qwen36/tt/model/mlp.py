"""SwiGLU MLP on a TP mesh: column-parallel gate_d and up_d, row-parallel down_proj + all_reduce.

    h   = silu(x @ gate_d) * (x @ up_d)     silu fused as the multiply's input activation
    out = all_reduce(h @ down_d)

Five programs per call (prefill): two matmuls, one multiply, one matmul, one collective. A single fused [gate_d | up_d]
matmul reads the same weight bytes but its output then has to be split (two slices) and activated (one silu) before
the multiply: seven programs. ``experimental.minimal_matmul(fuse_swiglu=True)`` would be one program for both, but in
ttnn 0.81.1 it requires the weight dtype to equal the activation dtype (its docstring: "DType: must match
input_tensor dtype"), so bf8/bf4 weights would need bf8/bf4 activations (or a typecast program per call).

Decode (T <= 32 rows; ``decode_matmuls.decode_matmul_plan``, one plan per layout): in the default ``mcast_1d``
layout the three matmuls are 1D multicast matmuls on DRAM-interleaved weights, as Tenstorrent's qwen36 decode runs
them: the decoder layer's post-attention RMSNorm writes x to L1 (``input_memory_config``), gate and up write L1, the
silu-multiply stays in L1, and down writes its output in L1 width shards, one whole block per computing core. In
the ``dram_sharded`` layout (tt_transformers' decode MLP) the weights are width-sharded over the DRAM banks, x is
width-sharded in L1 over the compute cores (the norm writes those shards), and gate/up/multiply/down stay in the
same cores' shards. Either way the down output is summed over the mesh where it lies, in its L1 width shards, by
the single-op form of ``ttnn.experimental.all_reduce_async`` (a persistent buffer tensor and one semaphore,
``TTCCL.all_reduce_sharded``: one program and one collective), and the sum goes back to DRAM for the residual add
(one reshard): gate, up, multiply, down, all-reduce, reshard: six programs and one collective per layer.

Why the single-op form: the composite form (reduce-scatter / all-gather semaphores) is a reduce-scatter then an
all-gather, two programs and two collective handshakes, and it converts a sharded input to interleaved itself and
its result back afterwards (``all_reduce_async.cpp``, read for facts). The single-op form's 0.81.1 device op requires
WIDTH_SHARDED input, buffer and output, and on Blackhole refuses a DRAM input ("does not support blackhole dram"): it
fits the down projection's L1 width shards exactly, and the mixers' DRAM outputs not at all (a reshard into L1 costs
more than the collective it saves). Tenstorrent's Llama-3 70B Galaxy decode (``models/demos/llama3_70b_galaxy/tt/
llama_ccl.py`` ``line_all_reduce``: one persistent buffer per cluster axis shared by every layer, semaphores cycled)
reduces its sharded outputs this way on Wormhole; we found no Tenstorrent model running it on a Blackhole pair, so
it stays a card check (docs/cost_figures.md).

x [1, 1, T, H] -> [1, 1, T, H] (replicated after the reduce).
"""
from __future__ import annotations

from .ccl import all_reduce, ccl_for
from .decode_matmuls import decode_matmul_plan
from .model_config import TensorGroup, TTModelArgs, activation_memory_config, compute_config_matmul
from .weights import MLPWeights


class TTMLP:
    def __init__(self, args: TTModelArgs, weights: MLPWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        ccl = ccl_for(ttnn, mesh)  # the collectives' persistent semaphores exist before any trace capture
        self.i_d = args.intermediate_d
        plans = self.decode_plans(1)
        if plans is not None and args.num_devices > 1:  # the single-op all-reduce's buffer, before any capture
            ccl.prepare_reduce_buffer(plans[1].sharded_output_memory_config, args.dtype(TensorGroup.ACTIVATION, ttnn))

    def decode_plans(self, rows: int):
        """(gate/up plan, down plan) of the DRAM-sharded decode matmuls for ``rows`` rows, or None (module doc)."""
        ttnn, a = self.ttnn, self.args
        h, i_d = self.w.gate.shape[-2], self.w.gate.shape[-1]
        grid = self.mesh.compute_with_storage_grid_size()
        gu = decode_matmul_plan(ttnn, a, TensorGroup.MLP_GATE_UP, rows, h, i_d, grid)
        dn = decode_matmul_plan(ttnn, a, TensorGroup.MLP_DOWN, rows, i_d, h, grid)
        if gu is None or dn is None:
            if (gu is None) != (dn is None):
                raise ValueError(f"MLP decode layouts differ: gate/up {gu} vs down {dn}")
            return None
        if dn.sharded_output_memory_config is None:
            raise ValueError(f"MLP decode: the down projection's {dn.n} columns do not split over its {dn.cores} cores "
                             "(the single-op all-reduce takes whole L1 width shards)")
        if gu.layout == "dram_sharded" and (gu.cores, gu.grid) != (dn.cores, dn.grid):
            # the gate/up output shard must be down's input shard
            raise ValueError(f"MLP decode: gate/up on {gu.cores} cores {gu.grid}, down on {dn.cores} {dn.grid}")
        return gu, dn

    def input_memory_config(self, rows: int):
        """Where the decode matmuls read x (mcast_1d: L1 interleaved; dram_sharded: L1 width shards over the gate/up
        cores), or None (DRAM-interleaved x: prefill rows, the interleaved layout). The decoder layer's norm writes
        its output there directly."""
        plans = self.decode_plans(rows)
        if plans is None:
            return None
        return plans[0].input_memory_config or self.ttnn.L1_MEMORY_CONFIG

    def _decode_down(self, x, plans):
        """The decode MLP up to h @ down_d, left in down's L1 width shards (module doc)."""
        ttnn, a = self.ttnn, self.args
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        cfg = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_GATE_UP))
        cfg_down = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_DOWN))
        gu, dn = plans
        want = gu.input_memory_config
        xs = x if want is None or x.memory_config() == want else ttnn.to_memory_config(x, want)
        gate = ttnn.linear(xs, self.w.gate, dtype=act, memory_config=gu.output_memory_config,
                           program_config=gu.program_config, compute_kernel_config=cfg)
        up = ttnn.linear(xs, self.w.up, dtype=act, memory_config=gu.output_memory_config,
                         program_config=gu.program_config, compute_kernel_config=cfg)
        h = ttnn.multiply(gate, up, input_tensor_a_activations=[ttnn.UnaryOpType.SILU],
                          memory_config=gu.output_memory_config)
        return ttnn.linear(h, self.w.down, dtype=act, memory_config=dn.sharded_output_memory_config,
                           program_config=dn.program_config, compute_kernel_config=cfg_down)

    def partial(self, x):
        """This device's h @ down_d before the reduce: [1, 1, T, H] (the MoE block adds it to its routed part)."""
        ttnn, a = self.ttnn, self.args
        mc = activation_memory_config(ttnn)
        plans = self.decode_plans(x.shape[-2])
        if plans is not None:
            return ttnn.to_memory_config(self._decode_down(x, plans), mc)
        act = a.dtype(TensorGroup.ACTIVATION, ttnn)
        cfg = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_GATE_UP))
        cfg_down = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.MLP_DOWN))
        gate = ttnn.linear(x, self.w.gate, dtype=act, memory_config=mc, compute_kernel_config=cfg)
        up = ttnn.linear(x, self.w.up, dtype=act, memory_config=mc, compute_kernel_config=cfg)
        h = ttnn.multiply(gate, up, input_tensor_a_activations=[ttnn.UnaryOpType.SILU], memory_config=mc)
        return ttnn.linear(h, self.w.down, dtype=act, memory_config=mc, compute_kernel_config=cfg_down)

    def forward(self, x):
        """MLP(x), reduced over the mesh. Decode rows with a decode plan: the down output is reduced where it lies, in
        L1 width shards, by the single-op all-reduce (one program, one collective), then moved to DRAM (module doc);
        otherwise the partial goes to DRAM and through the composite all-reduce."""
        ttnn, a = self.ttnn, self.args
        plans = self.decode_plans(x.shape[-2])
        if plans is None or a.num_devices == 1:
            return all_reduce(ttnn, self.partial(x), a.num_devices)
        out = self._decode_down(x, plans)
        red = ccl_for(ttnn, self.mesh).all_reduce_sharded(out, plans[1].sharded_output_memory_config)
        return ttnn.to_memory_config(red, activation_memory_config(ttnn))
