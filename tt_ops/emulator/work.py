"""Compute work of the ops whose time can be set by arithmetic rather than by bytes or launches (prefill).

For each call of a matmul-like op the emulator records one *work key* (``Counts.compute_work``): the op's
floating-point operations per device, its math fidelity (FPU phases: LoFi 1, HiFi2 2, HiFi3 3, HiFi4 4) and
whether Dst accumulates in fp32. The cost model (``cost_model.prefill_compute_excess_ms``) turns a key into time
at the fidelity's peak; it matters where an op's FLOPs outweigh its bytes (prefill chunks), not in decode.

FLOPs are counted on the shapes the device computes (tile-padded rows and columns, as the matrix engine works on
32 x 32 tiles; one multiply-add = 2 FLOPs):

* ``ttnn.linear`` / ``ttnn.matmul``: ``2 x batch x M x K x N`` over the padded shapes of the two operands;
* ``ttnn.sparse_matmul``: ``2 x groups x M x K x N``, groups = the expert groups its reader fetches (the listed
  indices, or ``nnz``: every expert in the MoE prefill's scan mode), each over all M rows;
* ``ttnn.transformer.chunked_scaled_dot_product_attention`` (q ``[B, Hq, T, D]`` at ``chunk_start``): Q K^T and
  P V over the causal pairs, ``4 x B x Hq x D x (T x chunk_start + T (T + 1) / 2)``;
* ``ttnn.transformer.chunk_gated_delta_rule``: the matrix products of the chunked delta rule (chunk C) per token
  and value head, ``6 K V`` (state read by q and k, state update) ``+ 4 C K`` (q k^T and k k^T within the chunk)
  ``+ 2 C V`` (the intra-chunk attention applied to v). An estimate of the algorithm's products, not a count of
  the device kernel's instructions (no public breakdown of the kernel's work was found).

Nothing here changes numerics; it reads shapes and the compute-kernel config only.
"""
from __future__ import annotations

from .numerics import kernel_config
from .tensor import EmuTensor

WORK_OPS = ("ttnn.linear", "ttnn.matmul", "ttnn.sparse_matmul", "ttnn.transformer.chunked_scaled_dot_product_attention",
            "ttnn.transformer.chunk_gated_delta_rule")


def _arg(args: tuple, kwargs: dict, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


def _padded(t: EmuTensor) -> list[int]:
    return [int(d) for d in t.padded_shape]


def compute_work(op_name: str, args: tuple, kwargs: dict) -> tuple | None:
    """``(flops per device, fpu phases, fp32_dest_acc_en)`` of one call, or None for ops without a work term."""
    if op_name not in WORK_OPS:
        return None
    ckc = kernel_config(kwargs.get("compute_kernel_config"))
    if op_name in ("ttnn.linear", "ttnn.matmul"):
        a, b = _arg(args, kwargs, 0, "input_tensor_a"), _arg(args, kwargs, 1, "input_tensor_b")
        if not isinstance(a, EmuTensor) or not isinstance(b, EmuTensor):
            return None
        pa, pb = _padded(a), _padded(b)
        if kwargs.get("transpose_a"):
            pa[-1], pa[-2] = pa[-2], pa[-1]
        if kwargs.get("transpose_b"):
            pb[-1], pb[-2] = pb[-2], pb[-1]
        batch = 1
        for d in pa[:-2]:
            batch *= d
        flops = 2 * batch * pa[-2] * pa[-1] * pb[-1]
    elif op_name == "ttnn.sparse_matmul":
        from .ops_sparse import bind_sparse_matmul, groups_read

        b = bind_sparse_matmul(args, kwargs)
        pa, pb = _padded(b["input_tensor_a"]), _padded(b["input_tensor_b"])
        flops = 2 * groups_read(b) * pa[-2] * pa[-1] * pb[-1]
    elif op_name == "ttnn.transformer.chunked_scaled_dot_product_attention":
        q = _arg(args, kwargs, 0, "input_tensor_q")
        start = int(_arg(args, kwargs, 4, "chunk_start_idx") or 0)
        if not isinstance(q, EmuTensor):
            return None
        b, hq, t, d = (int(x) for x in q.logical_shape_list)
        flops = 4 * b * hq * d * (t * start + t * (t + 1) // 2)
    else:  # chunk_gated_delta_rule
        k, v, beta = (_arg(args, kwargs, i, n) for i, n in ((1, "k"), (2, "v"), (4, "beta")))
        if not all(isinstance(x, EmuTensor) for x in (k, v, beta)):
            return None
        vs, ks = v.logical_shape_list, k.logical_shape_list
        chunk = int(kwargs.get("chunk_size", 64))
        if len(vs) == 4:  # [B, T, HV, V], k [B, T, H, K]
            b, t, hv, dv = vs
            dk = ks[-1]
        else:  # flat [B, T, HV * V], K == V
            hv = int(beta.logical_shape_list[-1])
            b, t, dv = vs[0], vs[1], vs[2] // hv
            dk = dv
        flops = b * t * hv * (6 * dk * dv + 4 * chunk * dk + 2 * chunk * dv)
    return int(flops), ckc.phases, ckc.fp32_dest_acc_en
