"""GDN prefill on ttnn 0.81.1's fused GDN ops, with T (the chunk's rows) the tiled dimension from the in-projections
to the out-projection, per device:

    x      [1, 1, T, H], zero rows appended up to T32 (the next multiple of 32) when T is not one: the fused ops take
           whole 32-row tiles
    mixed  = x @ in_proj_qkv (bf16: the conv takes bf16 only), z = x @ in_proj_z (bf16: the norm's gate),
             b = x @ in_proj_b, a' = x @ in_proj_a + dt_bias (GDN_STATE dtype, fp32)
    q, k, v = experimental.kda.qkv_causal_conv1d_silu(mixed, history = the conv state)   one program: the 4-tap
             causal conv, SiLU and the [q | k | v] split, flat [1, T32, width] bf16
    conv state = the last Kc-1 real rows of [history | mixed]    to_layout + one ROW_MAJOR slice into the state
    beta   = sigmoid(b), g = softplus(a') * -exp(A_log), each times a 0/1 row mask when padded: a padded row is an
             identity step of the recurrence (g = 0: decay 1; beta = 0: no update)
    o, S   = transformer.chunk_gated_delta_rule(q, k, v, g, beta) on the flat form: the L2 norm of q and k, the
             Dk^-0.5 scale and the GQA head map in the kernel; o head-major [Hv, T32, Dv]; S copied into the state
    y      = experimental.kda.sigmoid_gated_rms_norm(o, z) * z = rmsnorm(o) * w * silu(z), time-first [1, T32, Vd]
    out    = all_reduce(y[:T] @ out_proj)

No op pads a head or a row to a tile on its own: q, k, v, g, beta and o keep T on the tile rows. The conv history
and its output are bf16 whatever the preset's GDN_ACTIVATION dtype says (the op's contract); a float32 conv state is
converted at the chunk's edges (one typecast in, one out). The chunk kernel casts q/k/v to bf16 itself.
Chunk boundaries: the conv reads the carried history, the recurrence the carried state, so a prompt prefilled in
one chunk or in several (chunks starting at multiples of 32, as the prefill chunks and prefix-cache hits do) runs
the same per-row conv; the recurrence's bits follow the kernel's 32-row chunks, which start at the same positions.
"""
from __future__ import annotations

import torch

from .ccl import all_reduce
from .model_config import (TensorGroup, activation_memory_config, compute_config_fp32_state, compute_config_matmul,
                           compute_config_norm, state_memory_config)
from .state import GDNLayerState

TILE_ROWS = 32
CHUNK = 32  # the rank-3 flat chunk_gated_delta_rule takes chunk_size 32 only
CONV_TAPS = 4  # experimental.kda.qkv_causal_conv1d_silu is compiled for four taps


def conv_channel_chunk(channels: int, cap: int = 768) -> int:
    """The conv's ``channel_chunk_size``: the largest tile multiple <= ``cap`` dividing the conv channels (the op
    requires a tile-aligned divisor; Tenstorrent's qwen36 port runs 768 of 6,144 channels, a width its L1 holds)."""
    for c in range(min(cap, channels) // TILE_ROWS * TILE_ROWS, 0, -TILE_ROWS):
        if channels % c == 0:
            return c
    raise ValueError(f"GDN prefill: conv channels {channels} have no tile-aligned divisor (need a multiple of 32)")


def unsupported(args) -> str | None:
    """Why the fused ops cannot run this config's GDN prefill (None: they can). The composite prefill of
    ``TTGatedDeltaNet`` runs it then (e.g. the CI configs, head dims of 16)."""
    c = args.cfg
    if c.linear_conv_kernel_dim != CONV_TAPS:
        return (f"qkv_causal_conv1d_silu takes {CONV_TAPS} conv taps "
                f"(linear_conv_kernel_dim = {c.linear_conv_kernel_dim})")
    if c.linear_key_head_dim != c.linear_value_head_dim or c.linear_value_head_dim % TILE_ROWS:
        return (f"the flat chunk_gated_delta_rule and sigmoid_gated_rms_norm take K == V, a multiple of 32 "
                f"(head dims {c.linear_key_head_dim} / {c.linear_value_head_dim})")
    return None


class GDNPrefill:
    """The fused prefill of one GDN layer (``TTGatedDeltaNet.forward`` in mode "prefill", one user slot). Owns the
    chunk kernel's constant tiles (passed on every call: otherwise the op uploads them from the host each time) and
    the row masks of padded chunks."""

    def __init__(self, gdn):
        self.gdn, self.ttnn, self.mesh = gdn, gdn.ttnn, gdn.mesh
        why = unsupported(gdn.args)
        if why is not None:
            raise ValueError(f"GDN fused prefill: {why}")
        ttnn = self.ttnn
        self.program_config = ttnn.QkvCausalConv1dSiluProgramConfig(channel_chunk_size=conv_channel_chunk(gdn.cd))
        self.consts = self._const_tiles()
        self.zero = self._dev(torch.zeros(1, dtype=torch.int32), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)  # actual_start
        self.row_masks: dict[tuple[int, int], object] = {}

    def _dev(self, x: torch.Tensor, dtype, layout):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=dtype, layout=layout, device=self.mesh, memory_config=state_memory_config(ttnn),
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def _const_tiles(self):
        """eye, tril, ones [1, 1, C, C] and the [1, 1, 32, 96] quadrant masks (top-left, bottom-right, bottom-left
        16x16 blocks side by side), fp32 TILE: the constants the chunk kernel builds itself unless given."""
        ttnn, c = self.ttnn, CHUNK
        i, j = torch.arange(TILE_ROWS)[:, None], torch.arange(TILE_ROWS)[None, :]
        top, left = i < TILE_ROWS // 2, j < TILE_ROWS // 2
        masks = torch.cat([(top & left), (~top & ~left), (~top & left)], dim=1).float()
        tiles = (torch.eye(c), torch.tril(torch.ones(c, c)), torch.ones(c, c), masks)
        return tuple(self._dev(t.reshape(1, 1, *t.shape), ttnn.float32, ttnn.TILE_LAYOUT) for t in tiles)

    def _row_mask(self, padded: int, rows: int):
        """[1, 1, T32, 1] fp32: 1 for the chunk's T real rows, 0 for the padding (made once per shape)."""
        key = (padded, rows)
        if key not in self.row_masks:
            m = (torch.arange(padded) < rows).float().reshape(1, 1, padded, 1)
            self.row_masks[key] = self._dev(m, self.ttnn.float32, self.ttnn.TILE_LAYOUT)
        return self.row_masks[key]

    def forward(self, x, state: GDNLayerState):
        g_ = self.gdn
        ttnn, a, w = self.ttnn, g_.args, g_.w
        rows = x.shape[2]
        padded = -(-rows // TILE_ROWS) * TILE_ROWS
        if padded != rows:
            x = ttnn.pad(x, [(0, 0), (0, 0), (0, padded - rows), (0, 0)], 0.0)
        mc = activation_memory_config(ttnn)
        bf16, f32 = ttnn.bfloat16, a.dtype(TensorGroup.GDN_STATE, ttnn)
        mm = dict(memory_config=mc, compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_IN)))
        mixed = ttnn.linear(x, w.in_proj, dtype=bf16, **mm)
        z = ttnn.linear(x, w.in_proj_z, dtype=bf16, **mm)
        b = ttnn.linear(x, w.in_proj_b, dtype=f32, **mm)
        a_in = ttnn.linear(x, w.in_proj_a, bias=w.dt_bias, dtype=f32, **mm)

        q, k, v = self._conv(mixed, state, rows, padded)

        beta = ttnn.sigmoid_accurate(b)
        g = ttnn.multiply(a_in, w.neg_exp_a, input_tensor_a_activations=[ttnn.UnaryOpType.SOFTPLUS])
        if padded != rows:  # padded rows: identity steps of the recurrence
            mask = self._row_mask(padded, rows)
            g, beta = ttnn.multiply(g, mask), ttnn.multiply(beta, mask)
        g, beta = (ttnn.reshape(t, [1, padded, g_.hv]) for t in (g, beta))
        eye, tril, ones, masks = self.consts
        initial = ttnn.reshape(state.recurrent, [1, g_.hv, g_.dk, g_.dv])  # a view
        o, s = ttnn.transformer.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial, output_final_state=True, chunk_size=CHUNK,
            output_head_major=True, eye=eye, tril=tril, ones=ones, masks=masks,
            compute_kernel_config=compute_config_fp32_state(ttnn))  # o [Hv, T32, Dv]
        ttnn.copy(ttnn.reshape(s, list(state.recurrent.shape)), state.recurrent)
        ttnn.deallocate(s)

        act = a.dtype(TensorGroup.GDN_ACTIVATION, ttnn)
        z3 = ttnn.reshape(z, [1, padded, g_.vd])  # a view
        y = ttnn.experimental.kda.sigmoid_gated_rms_norm(o, z3, w.norm_flat, g_.hv, epsilon=g_.eps,
                                                         output_dtype=act)  # rmsnorm(o) * w * sigmoid(z)
        y = ttnn.multiply(y, z3, dtype=act)  # * z: silu(z) = z * sigmoid(z)
        y = ttnn.reshape(y, [1, 1, padded, g_.vd])
        if padded != rows:
            y = ttnn.slice(y, [0, 0, 0, 0], [1, 1, rows, g_.vd])
        part = ttnn.linear(y, w.out_proj, dtype=a.dtype(TensorGroup.GDN_PARTIAL, ttnn), memory_config=mc,
                           compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_OUT)))
        return all_reduce(ttnn, part, a.num_devices)

    def _conv(self, mixed, state: GDNLayerState, rows: int, padded: int):
        """q, k, v [1, T32, Kd | Kd | Vd] bf16 from the fused conv over [conv state | mixed]; the conv state becomes
        the last Kc-1 real rows of that window (written in place, in the state's own dtype)."""
        g_ = self.gdn
        ttnn, kc1, cd = self.ttnn, g_.kernel - 1, g_.cd
        conv = state.conv  # [1, 1, Kc-1, Cd] ROW_MAJOR
        hist = conv if conv.dtype == ttnn.bfloat16 else ttnn.typecast(conv, ttnn.bfloat16)
        q, k, v = ttnn.experimental.kda.qkv_causal_conv1d_silu(
            ttnn.reshape(mixed, [1, padded, cd]), ttnn.reshape(hist, [1, kc1, cd]), *g_.w.conv_tap_rows,
            g_.kd, g_.kd, g_.vd, program_config=self.program_config, actual_start=self.zero,
            predecessor_carry=ttnn.reshape(hist, [1, kc1, cd]), memory_config=activation_memory_config(ttnn),
            compute_kernel_config=compute_config_norm(ttnn))
        # the next chunk's history: window rows T .. T+Kc-2 of [history | mixed] (the last Kc-1 real inputs)
        mixed_rm = ttnn.to_layout(mixed, ttnn.ROW_MAJOR_LAYOUT)  # [1, 1, T32, Cd]
        if rows >= kc1:
            src, start = mixed_rm, rows - kc1
        else:  # a chunk shorter than the history keeps some history rows
            src, start = ttnn.concat([hist, mixed_rm], dim=2), rows
        end = [1, 1, start + kc1, cd]
        if conv.dtype == ttnn.bfloat16:
            ttnn.slice(src, [0, 0, start, 0], end, output_tensor=conv)
        else:
            ttnn.typecast(ttnn.slice(src, [0, 0, start, 0], end), conv.dtype, output_tensor=conv)
        return q, k, v
