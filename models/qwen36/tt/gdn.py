"""Gated DeltaNet layer on a TP mesh: each device owns Hk/N key heads and their Hv/N value heads.

One forward for any number of rows T (prefill chunk, 1-row decode, K+1-row verify):

    fused  = x @ [qkv_d | z_d | b_d | a_d]                     one column-parallel matmul
    conv   = silu(causal depthwise conv over [conv state | qkv])  shift register, state updated in place
    q, k   = l2norm(conv q/k) (one rms_norm with eps/Dk and weight Dk^-0.5), v = conv v
    g      = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)      (fp32)
    o, S   = chunk_gated_delta_rule (mode "prefill") | fused_recurrent_gated_delta_rule (mode "decode")
             fp32 state, HiFi4 + fp32 accumulation; S copied into the persistent state buffer, except for a
             1-row decode, which updates the state in place (the op's ring mode, as the verify does)
    y      = rmsnorm(o) * w * silu(z) ;  out = all_reduce(y @ out_proj_d)   partials reduced in fp32

Shapes per device: x [1, 1, T, H] -> out [1, 1, T, H] (replicated after the reduce).
"""
from __future__ import annotations

import torch

from ..reference.gdn import L2NORM_EPS
from .ccl import ccl_for
from .model_config import (TensorGroup, TTModelArgs, activation_memory_config, compute_config_fp32_state,
                           compute_config_matmul, compute_config_norm, state_memory_config)
from .state import GDNLayerState
from .weights import GDNWeights


def gdn_chunk_size() -> int:
    """32: the chunk the ttnn chunked-GDN kernels are tuned for ("32 is what the models use", op docstring)."""
    return 32


class TTGatedDeltaNet:
    def __init__(self, args: TTModelArgs, weights: GDNWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        ccl_for(ttnn, mesh)  # the collectives' persistent semaphores exist before any trace capture
        c = args.cfg
        self.hk, self.hv = args.gdn_hk_d, args.gdn_hv_d
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.kernel = c.linear_conv_kernel_dim
        self.cd, self.vd = args.gdn_conv_dim_d, args.gdn_value_dim_d
        self.kd = args.gdn_key_dim_d
        self.eps = c.rms_norm_eps
        # ring block of every (user, head) for the in-place 1-row decode: block h starts and ends head h
        self.bh = args.batch * self.hv
        self.identity_block_idx = ttnn.from_torch(
            torch.arange(self.bh, dtype=torch.int32), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh,
            mesh_mapper=ttnn.ReplicateTensorToMesh(mesh), memory_config=state_memory_config(ttnn))

    # ---- pieces ------------------------------------------------------------------------------------
    def causal_conv(self, mixed, conv_state, rows: int, write_state=True, return_window: bool = False):
        """Depthwise causal conv (kernel K) as a shift register: window = [state (K-1 rows) | mixed (T rows)];
        out_t = sum_j tap_j * window[t + j]; the last K-1 window rows become the new state, copied in place into
        ``conv_state`` (``write_state=True``), into another buffer (``write_state=<buffer>``) or nowhere (``None``:
        a speculative verify keeps the window and its commit selects the rows of the accepted row).
        mixed: [1, 1, T, Cd] -> silu(out) [1, 1, T, Cd] (and the window [1, 1, K-1+T, Cd] if asked)."""
        ttnn, k = self.ttnn, self.kernel
        mc = activation_memory_config(ttnn)
        window = ttnn.concat([conv_state, mixed], dim=2, memory_config=mc)  # [1, 1, K-1+T, Cd]
        acc = None
        for j in range(k):
            tap_in = ttnn.slice(window, [0, 0, j, 0], [1, 1, j + rows, self.cd])
            acc = (ttnn.multiply(tap_in, self.w.conv_taps[j], memory_config=mc) if acc is None
                   else ttnn.addcmul(acc, tap_in, self.w.conv_taps[j], memory_config=mc))
        if write_state is not None:  # the shifted rows sliced straight into the state buffer (no copy program)
            dest = conv_state if write_state is True else write_state
            if dest.dtype != window.dtype:
                raise ValueError(f"conv state {dest.dtype} and conv window {window.dtype} differ: the slice writes "
                                 "the window's rows into the state buffer unconverted")
            ttnn.slice(window, [0, 0, rows, 0], [1, 1, rows + k - 1, self.cd], output_tensor=dest)
        out = ttnn.silu(acc, memory_config=mc)
        return (out, window) if return_window else out

    def project(self, x):
        """x [1, 1, T, H] -> (mixed [1,1,T,Cd], z [1,1,T,Vd], b [1,1,T,Hv], a [1,1,T,Hv])."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        fused = ttnn.linear(x, self.w.in_proj, dtype=a.dtype(TensorGroup.GDN_ACTIVATION, ttnn),
                            memory_config=activation_memory_config(ttnn),
                            compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_IN)))
        bounds = [0, self.cd, self.cd + self.vd, self.cd + self.vd + self.hv, self.cd + self.vd + 2 * self.hv]
        return tuple(ttnn.slice(fused, [0, 0, 0, lo], [1, 1, rows, hi]) for lo, hi in zip(bounds[:-1], bounds[1:]))

    def gates(self, b, a_in, rows: int):
        """beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), both fp32 [1, T, Hv]."""
        ttnn = self.ttnn
        f32 = self.args.dtype(TensorGroup.GDN_STATE, ttnn)
        if b.dtype != f32:  # static: the GDN_ACTIVATION group is fp32 in every shipped preset
            b, a_in = ttnn.typecast(b, f32), ttnn.typecast(a_in, f32)
        beta = ttnn.sigmoid_accurate(b)  # ttnn.sigmoid is bf16-only; beta stays fp32
        g = ttnn.multiply(ttnn.softplus(ttnn.add(a_in, self.w.dt_bias)), self.w.neg_exp_a)
        return ttnn.reshape(g, [1, rows, self.hv]), ttnn.reshape(beta, [1, rows, self.hv])

    def qkv_heads(self, conv_out, rows: int):
        """conv_out [1,1,T,Cd] -> q, k [1, T, Hk, Dk] (L2-normalised), v [1, T, Hv, Dv]."""
        ttnn = self.ttnn
        qk = ttnn.reshape(ttnn.slice(conv_out, [0, 0, 0, 0], [1, 1, rows, 2 * self.kd]), [1, rows, 2 * self.hk, self.dk])
        # x / sqrt(sum x^2 + eps) == rms_norm(x, eps / Dk) * Dk^-0.5 (weight filled with Dk^-0.5)
        qk = ttnn.rms_norm(qk, epsilon=L2NORM_EPS / self.dk, weight=self.w.qk_l2_weight,
                           compute_kernel_config=compute_config_norm(ttnn))
        q = ttnn.slice(qk, [0, 0, 0, 0], [1, rows, self.hk, self.dk])
        k = ttnn.slice(qk, [0, 0, self.hk, 0], [1, rows, 2 * self.hk, self.dk])
        v = ttnn.reshape(ttnn.slice(conv_out, [0, 0, 0, 2 * self.kd], [1, 1, rows, self.cd]), [1, rows, self.hv, self.dv])
        return q, k, v

    def recurrence(self, q, k, v, g, beta, state: GDNLayerState, mode: str, *, initial=None, final=None,
                   ring_idx=None):
        """o [1, T, Hv, Dv] fp32; the state after the last row is copied into ``final`` (default
        ``state.recurrent``) in place, starting from ``initial`` (default ``state.recurrent``).
        Ring mode (``ring_idx`` given, decode only): ``initial`` is the [T*Hv, Dk, Dv] fp32 ring, head h starts
        from block ring_idx[h] and the state after row t is written in place to block t*Hv + h (no copy)."""
        ttnn = self.ttnn
        cfg = compute_config_fp32_state(ttnn)
        initial = state.recurrent if initial is None else initial
        final = state.recurrent if final is None else final
        if ring_idx is not None:
            o, _ = ttnn.transformer.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial, initial_state_block_idx=ring_idx,
                output_per_token_state=True, compute_kernel_config=cfg)
            return o
        if mode == "decode" and initial is final and q.shape[1] == 1:
            # One row advancing a state in place: the op's ring mode over the state viewed as its [B*Hv, K, V]
            # ring (T = 1, head h reads and writes block h; the op reads a head's whole state before writing
            # it). The state is written where it lives: no final-state output and no copy of it (the verify's
            # ring does the same).
            ring = ttnn.reshape(final, [self.bh, self.dk, self.dv])
            o, _ = ttnn.transformer.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=ring, initial_state_block_idx=self.identity_block_idx,
                output_per_token_state=True, compute_kernel_config=cfg)
            return o
        if mode == "decode":
            o, s = ttnn.transformer.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial, output_final_state=True, compute_kernel_config=cfg)
        elif mode == "prefill":
            o, s = ttnn.transformer.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial, output_final_state=True,
                chunk_size=gdn_chunk_size(), compute_kernel_config=cfg)
            o = ttnn.to_layout(o, ttnn.TILE_LAYOUT)  # token-major output is ROW_MAJOR on cards
        else:
            raise ValueError(f"GDN mode must be 'prefill' or 'decode', got {mode!r}")
        ttnn.copy(s, final)
        ttnn.deallocate(s)
        return o

    def output(self, o, z, rows: int):
        """Gated RMSNorm (plain weight) * silu(z), then the row-parallel out_proj reduced in fp32."""
        ttnn, a = self.ttnn, self.args
        y = ttnn.rms_norm(o, epsilon=self.eps, weight=self.w.norm, compute_kernel_config=compute_config_norm(ttnn))
        zs = ttnn.silu(ttnn.reshape(z, [1, rows, self.hv, self.dv]))
        y = ttnn.multiply(y, zs, dtype=a.dtype(TensorGroup.GDN_ACTIVATION, ttnn))
        y = ttnn.reshape(y, [1, 1, rows, self.vd])
        part = ttnn.linear(y, self.w.out_proj, dtype=a.dtype(TensorGroup.GDN_PARTIAL, ttnn),
                           memory_config=activation_memory_config(ttnn),
                           compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_OUT)))
        return all_reduce(ttnn, part, a.num_devices)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, x, state: GDNLayerState, mode: str, verify_plan=None):
        """x [1, 1, T, H] (T rows at consecutive positions) -> [1, 1, T, H]; advances ``state`` in place.
        ``verify_plan`` (a K+1-row speculative verify, models/qwen36/tt/verify.py VerifyPlan) decides where the conv window and the
        recurrent state go for a K+1-row verify (ring / snapshot / scratch) and records what the commit needs."""
        rows = x.shape[2]
        mixed, z, b, a_in = self.project(x)
        conv_write = True if verify_plan is None else verify_plan.conv_write(state)
        conv_out, window = self.causal_conv(mixed, state.conv, rows, write_state=conv_write, return_window=True)
        q, k, v = self.qkv_heads(conv_out, rows)
        g, beta = self.gates(b, a_in, rows)
        if verify_plan is None:
            o = self.recurrence(q, k, v, g, beta, state, mode)
        else:
            o = verify_plan.gdn_recurrence(self, state, q, k, v, g, beta, window)
        return self.output(o, z, rows)


def all_reduce(ttnn, t, num_devices: int):
    """Sum row-parallel partials over the mesh (no collective at width 1)."""
    if num_devices == 1:
        return t
    return ccl_for(ttnn, t.device()).all_reduce(t, memory_config=activation_memory_config(ttnn))
