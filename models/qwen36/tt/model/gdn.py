"""Gated DeltaNet layer on a TP mesh: each device owns Hk/N key heads and their Hv/N value heads.

One forward for any number of rows T (1-row decode, K+1-row verify, and the prefill chunks of configs whose GDN
heads are narrower than a tile; with tile-wide heads, the 27B's, a prefill chunk runs the fused ops of
gdn_prefill.py instead):

    mixed  = x @ in_proj_qkv ;  z = x @ in_proj_z ;  b = x @ in_proj_b ;  a' = x @ in_proj_a + dt_bias
             four matmuls (the same weight bytes as one fused matmul, and no output slices)
    conv   = silu(causal depthwise conv over [conv state | mixed])   conv state: ROW_MAJOR, updated in place
             decode/verify: the K-row window of every output row gathered by one embedding, one multiply by the
             taps, one row sum (the shift register costs no unaligned tile slices)
    q,k,v  = one reshape of conv to [T, 2 + Hv/Hk, Hk, D] (head groups on an outer dim: slices are aligned),
             q, k L2-normalised by one rms_norm (eps/Dk, weight Dk^-0.5)
    g      = softplus(a') * -exp(A_log) (softplus fused as the multiply's input activation), beta = sigmoid(b)
    o, S   = chunk_gated_delta_rule (mode "prefill") | fused_recurrent_gated_delta_rule (mode "decode")
             fp32 state [Hv, Dk, Dv], HiFi4 + fp32 accumulation; a 1-row decode updates it in place (ring mode
             with one slot), every other call copies S into the persistent state buffer
    y      = rmsnorm(o) * w * silu(z)  (silu fused as the multiply's input activation)
    out    = all_reduce(y @ out_proj_d)   partials reduced in fp32

Shapes per device: x [1, 1, T, H] -> out [1, 1, T, H] (replicated after the reduce). Needs Dk == Dv (the head
split reshapes q, k and v together).

Batched plain decode (B user slots, tt/runtime/batch.py): x [1, 1, B, H] holds one row per user, row b reading and writing
slot b of the state (conv [B, 1, K-1, Cd], recurrent [B*Hv, Dk, Dv]). The same ops run: the conv window becomes
[B, 1, K, Cd] (each user's own shift register), q/k/v/g/beta are viewed as [B, 1, heads, D] and the recurrence is
the ring mode with B slots (head h of user b reads and rewrites block b*Hv + h in place). B = 1 is the plain
decode.

Batched verify (B users x T = K+1 rows, tt/spec host rows): x [1, 1, B*T, H] holds user b's T rows at b*T..b*T+T-1.
The conv window is [B, 1, K-1+T, Cd] (each user's state then its T inputs), unfolded by one embedding whose index
reads user b's window rows only; q/k/v/g/beta are [B, T, heads, D] and the recurrence runs every user's T rows in
one call (ring mode: user b's head h starts from block idx[b*Hv + h] and leaves the state after row t in block
t*B*Hv + b*Hv + h; otherwise from and into the [B*Hv, Dk, Dv] buffer).
"""
from __future__ import annotations

import torch

from ...reference.gdn import L2NORM_EPS
from .ccl import all_reduce, ccl_for
from .gdn_plan import GDNKept, GDNStepPlan
from .gdn_prefill import GDNPrefill, unsupported
from .model_config import (TensorGroup, TTModelArgs, activation_memory_config, compute_config_fp32_state,
                           compute_config_matmul, compute_config_norm, state_memory_config)
from .state import GDNLayerState
from .weights import GDNWeights

TILE_ROWS = 32


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
        if self.dk != self.dv:
            raise ValueError(f"TT GDN layer: the head split reshapes q, k and v together and needs linear_key_head_dim "
                             f"== linear_value_head_dim (got {self.dk} and {self.dv})")
        self.kernel = c.linear_conv_kernel_dim
        self.cd, self.vd = args.gdn_conv_dim_d, args.gdn_value_dim_d
        self.kd = args.gdn_key_dim_d
        self.eps = c.rms_norm_eps
        self.unfold_idx = {t: self._unfold_index(t) for t in range(1, self.max_unfold_rows() + 1)}
        # ring index of a 1-row decode in place: head h starts from (and rewrites) block h of the state buffer
        self.head_idx = self._ring_index(1)
        # batched decode (B users, one row each): ring and (B > 1) tap-major window indices per B, made by
        # prepare_batch before capture
        self.batch_head_idx: dict[int, object] = {1: self.head_idx}
        self.batch_unfold_idx: dict[int, object] = {}
        self.verify_unfold_idx: dict[tuple[int, int], object] = {}  # (B, T) -> index of a batched verify's conv
        self.taps_by_tap = None  # conv taps as [1, K, 1, Cd] (batched decode), made by prepare_batch
        # prefill on ttnn's fused GDN ops where the config's head widths fit them (gdn_prefill.py), else the
        # composite prefill below; ``prefill_path`` says which (the cost probes record it)
        self.fused_prefill = GDNPrefill(self) if unsupported(args) is None else None
        self.prefill_path = "fused" if self.fused_prefill is not None else f"composite ({unsupported(args)})"

    def _ring_index(self, users: int):
        """uint32 ROW_MAJOR [1, B*Hv]: entry b*Hv + h = b*Hv + h (each user's head reads and rewrites its own block)."""
        ttnn, n = self.ttnn, users * self.hv
        return ttnn.from_torch(torch.arange(n, dtype=torch.int32).reshape(1, n), dtype=ttnn.uint32,
                               layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh, memory_config=state_memory_config(ttnn),
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def prepare_batch(self, users: int) -> None:
        """Allocate the index tensors of a B-user decode (call before capturing its trace)."""
        if users not in self.batch_head_idx:
            self.batch_head_idx[users] = self._ring_index(users)
        if users > 1 and users not in self.batch_unfold_idx:
            self.batch_unfold_idx[users] = self._batch_unfold_index(users)
        if users > 1 and self.taps_by_tap is None:
            self.taps_by_tap = self.ttnn.reshape(self.w.conv_taps, [1, self.kernel, 1, self.cd])

    def prepare_batch_verify(self, users: int, rows: int) -> None:
        """Allocate the conv unfold index of a B-user x T-row verify (call before capturing its trace): entry
        (b*T + t)*K + j = window row b*(K-1+T) + t + j (tap j of user b's row t, inside user b's own window)."""
        if (users, rows) in self.verify_unfold_idx:
            return
        ttnn, k = self.ttnn, self.kernel
        per_user = torch.arange(rows)[:, None] + torch.arange(k)[None, :]  # [T, K]
        idx = (per_user[None] + torch.arange(users)[:, None, None] * (k - 1 + rows)).reshape(1, -1).to(torch.int32)
        self.verify_unfold_idx[(users, rows)] = ttnn.from_torch(
            idx, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
            mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh), memory_config=state_memory_config(ttnn))

    def _batch_unfold_index(self, users: int):
        """uint32 ROW_MAJOR [1, K*B], tap-major: entry j*B + b = window row b*K + j (tap j of user b's [K, Cd]
        window). Tap-major because the tile rows then hold 32 users of one tap: with user-major [B, K] rows every
        user's K = 4 taps would be padded to a 32-row tile (8x the bytes of every op after the gather at B = 32)."""
        ttnn, k = self.ttnn, self.kernel
        idx = (torch.arange(k)[:, None] + torch.arange(users)[None, :] * k).reshape(1, -1).to(torch.int32)
        return ttnn.from_torch(idx, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh), memory_config=state_memory_config(ttnn))

    # ---- pieces ------------------------------------------------------------------------------------
    def max_unfold_rows(self) -> int:
        """Largest T whose T*K unfolded window rows fit one 32-row tile (8 at K = 4): up to there the conv is one
        gather + multiply + row sum; longer chunks (prefill) take the per-tap path."""
        return max(1, TILE_ROWS // self.kernel)

    def _unfold_index(self, rows: int):
        """uint32 ROW_MAJOR [1, T*K]: window row t + j for output row t, tap j (allocated once, before capture)."""
        ttnn, k = self.ttnn, self.kernel
        idx = (torch.arange(rows)[:, None] + torch.arange(k)[None, :]).reshape(1, rows * k).to(torch.int32)
        return ttnn.from_torch(idx, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh), memory_config=state_memory_config(ttnn))

    def causal_conv(self, mixed, conv_state, rows: int, write_state=True, return_window: bool = False):
        """Depthwise causal conv (kernel K) as a shift register: window = [state (K-1 rows) | mixed (T rows)]
        (ROW_MAJOR: row concats and slices have no tile alignment to respect); out_t = sum_j tap_j * window[t + j];
        the last K-1 window rows become the new state, written by the slice itself into ``conv_state``
        (``write_state=True``), into another buffer (``write_state=<buffer>``) or nowhere (``None``: a
        speculative verify keeps the window and its commit selects the rows of the accepted row).
        mixed: [1, 1, T, Cd] -> silu(out) [1, T, 1, Cd] for T <= max_unfold_rows() and [1, 1, T, Cd] for longer
        chunks (prefill) (and the ROW_MAJOR window [1, 1, K-1+T, Cd] if asked).
        Batched decode: conv_state [B, 1, K-1, Cd] and mixed [1, 1, B, Cd] (one row per user): window
        [B, 1, K, Cd], output [1, 1, B, Cd] (:meth:`qkv_heads` reshapes either form the same way)."""
        ttnn, k = self.ttnn, self.kernel
        mc = activation_memory_config(ttnn)
        users = conv_state.shape[0]
        per_user = rows // users
        if users > 1 and rows != users and (users, per_user) not in self.verify_unfold_idx:
            raise NotImplementedError(f"GDN conv: {rows} rows over {users} user slots needs prepare_batch_verify("
                                      f"{users}, {per_user}) before the step (a batched verify of T rows per user)")
        mixed_rm = ttnn.to_layout(mixed, ttnn.ROW_MAJOR_LAYOUT)
        if users > 1:
            mixed_rm = ttnn.reshape(mixed_rm, [users, 1, per_user, self.cd])  # ROW_MAJOR, last dim kept: a view
        window = ttnn.concat([conv_state, mixed_rm], dim=2, memory_config=mc)  # [B, 1, K-1+T, Cd] RM
        if write_state is not None:
            ttnn.slice(window, [0, 0, per_user, 0], [users, 1, per_user + k - 1, self.cd],
                       output_tensor=conv_state if write_state is True else write_state)
        if users > 1 and per_user > 1:  # batched verify: every user's T rows from its own window
            table = ttnn.reshape(window, [users * (k - 1 + per_user), self.cd])  # ROW_MAJOR, last dim kept: a view
            unf = ttnn.embedding(self.verify_unfold_idx[(users, per_user)], table, layout=ttnn.TILE_LAYOUT,
                                 dtype=mixed.dtype, memory_config=mc)  # [1, B*T*K, Cd]: row (b, t, j)
            unf = ttnn.reshape(unf, [1, rows, k, self.cd])
            acc = ttnn.sum(ttnn.multiply(unf, self.w.conv_taps, memory_config=mc), dim=2, keepdim=True,
                           memory_config=mc, compute_kernel_config=compute_config_fp32_state(ttnn))  # [1, B*T, 1, Cd]
        elif users > 1:  # one row per user: tap-major unfold, taps summed over an outer dim
            table = ttnn.reshape(window, [users * k, self.cd])  # ROW_MAJOR, last dim kept: a view
            unf = ttnn.embedding(self.batch_unfold_idx[users], table, layout=ttnn.TILE_LAYOUT, dtype=mixed.dtype,
                                 memory_config=mc)  # [1, K*B, Cd]: row (j, b) = window[b][j]
            unf = ttnn.reshape(unf, [1, k, users, self.cd])  # a view when B is a multiple of 32
            acc = ttnn.sum(ttnn.multiply(unf, self.taps_by_tap, memory_config=mc), dim=1, keepdim=True,
                           memory_config=mc, compute_kernel_config=compute_config_fp32_state(ttnn))  # [1, 1, B, Cd]
        elif rows <= self.max_unfold_rows():
            table = ttnn.reshape(window, [k - 1 + rows, self.cd])  # ROW_MAJOR, last dim kept: a view
            unf = ttnn.embedding(self.unfold_idx[rows], table, layout=ttnn.TILE_LAYOUT, dtype=mixed.dtype,
                                 memory_config=mc)  # [1, T*K, Cd]: row (t, j) = window[t + j]
            unf = ttnn.reshape(unf, [1, rows, k, self.cd])  # a view at T = 1
            acc = ttnn.sum(ttnn.multiply(unf, self.w.conv_taps, memory_config=mc), dim=2, keepdim=True,
                           memory_config=mc, compute_kernel_config=compute_config_fp32_state(ttnn))  # [1, T, 1, Cd]
        else:  # long chunks (prefill): one shifted window slice per tap
            win = ttnn.to_layout(window, ttnn.TILE_LAYOUT)
            acc = None
            for j in range(k):
                tap_in = ttnn.slice(win, [0, 0, j, 0], [1, 1, j + rows, self.cd])
                tap = ttnn.slice(self.w.conv_taps, [0, 0, j, 0], [1, 1, j + 1, self.cd])
                acc = (ttnn.multiply(tap_in, tap, memory_config=mc) if acc is None
                       else ttnn.addcmul(acc, tap_in, tap, memory_config=mc))
            # acc stays [1, 1, T, Cd], T on the tile rows: as [1, T, 1, Cd] (the decode form) every row would be a
            # 32-row tile of its own (32x the bytes of silu and of the head-split reshape that reads it)
        out = ttnn.silu(acc, memory_config=mc)
        return (out, window) if return_window else out

    def project(self, x):
        """x [1, 1, T, H] -> (mixed [1,1,T,Cd], z [1,1,T,Vd], b [1,1,T,Hv], a + dt_bias [1,1,T,Hv])."""
        ttnn, a = self.ttnn, self.args
        dt = a.dtype(TensorGroup.GDN_ACTIVATION, ttnn)
        mc = activation_memory_config(ttnn)
        cfg = compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_IN))
        mixed, z, b = (ttnn.linear(x, w, dtype=dt, memory_config=mc, compute_kernel_config=cfg)
                       for w in (self.w.in_proj, self.w.in_proj_z, self.w.in_proj_b))
        a_in = ttnn.linear(x, self.w.in_proj_a, bias=self.w.dt_bias, dtype=dt, memory_config=mc,
                           compute_kernel_config=cfg)
        return mixed, z, b, a_in

    def gates(self, b, a_in, rows: int, users: int = 1):
        """beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (``a_in`` carries the bias), both fp32 [1, T, Hv]
        ([B, 1, Hv] for a batched decode: the recurrence's batch dimension)."""
        ttnn = self.ttnn
        f32 = self.args.dtype(TensorGroup.GDN_STATE, ttnn)
        if b.dtype != f32:  # static: the GDN_ACTIVATION group is fp32 in every shipped preset
            b, a_in = ttnn.typecast(b, f32), ttnn.typecast(a_in, f32)
        beta = ttnn.sigmoid_accurate(b)  # ttnn.sigmoid is bf16-only; beta stays fp32
        g = ttnn.multiply(a_in, self.w.neg_exp_a, input_tensor_a_activations=[ttnn.UnaryOpType.SOFTPLUS])
        shape = [users, rows // users, self.hv]
        return ttnn.reshape(g, shape), ttnn.reshape(beta, shape)

    def qkv_heads(self, conv_out, rows: int, users: int = 1):
        """conv_out [1, T, 1, Cd] or [1, 1, T, Cd] -> q, k [1, T, Hk, Dk] (L2-normalised), v [1, T, Hv, Dv] ([B, 1, ...] for a batched
        decode of B users: the same views with the users on the recurrence's batch dimension).
        One reshape puts the head groups [q | k | v_0 .. v_{r-1}] (r = Hv/Hk, Hk heads each) on dim 1, where slices
        are tile-aligned (1 program each) and the [T, 1, Hk, D] -> [1, T, Hk, D] reshapes are views."""
        ttnn, hk, d = self.ttnn, self.hk, self.dk
        if users == 1 and rows > self.max_unfold_rows():
            return self._qkv_heads_prefill(conv_out, rows)
        groups = 2 + self.hv // hk
        heads = ttnn.reshape(conv_out, [rows, groups, hk, d])
        qk = ttnn.slice(heads, [0, 0, 0, 0], [rows, 2, hk, d])
        # x / sqrt(sum x^2 + eps) == rms_norm(x, eps / Dk) * Dk^-0.5 (weight filled with Dk^-0.5)
        qk = ttnn.rms_norm(qk, epsilon=L2NORM_EPS / d, weight=self.w.qk_l2_weight,
                           compute_kernel_config=compute_config_norm(ttnn))
        b, t = users, rows // users
        q = ttnn.reshape(ttnn.slice(qk, [0, 0, 0, 0], [rows, 1, hk, d]), [b, t, hk, d])
        k = ttnn.reshape(ttnn.slice(qk, [0, 1, 0, 0], [rows, 2, hk, d]), [b, t, hk, d])
        v = ttnn.reshape(ttnn.slice(heads, [0, 2, 0, 0], [rows, groups, hk, d]), [b, t, self.hv, self.dv])
        return q, k, v

    def _qkv_heads_prefill(self, conv_out, rows: int):
        """The prefill form of :meth:`qkv_heads` (conv_out [1, 1, T, Cd]): the column slices [q | k] and [v] come
        first (tile-aligned: Kd and Cd are whole tiles at the 27B), q and k are L2-normalised as [1, 1, T*2*Hk, D]
        (one head per row, no padding), and only the kernel inputs take the [1, T, H, D] form. The decode form's
        [T, 2 + Hv/Hk, Hk, D] pads Hk = 8 heads per device to a 32-row tile: 4x the bytes of the reshape, the norm
        and three slices (about 60 of 85 MB per 256-row chunk and layer at the 27B), for one program less."""
        ttnn, hk, d, kd = self.ttnn, self.hk, self.dk, self.kd
        qk = ttnn.slice(conv_out, [0, 0, 0, 0], [1, 1, rows, 2 * kd])
        qk = ttnn.reshape(qk, [1, 1, rows * 2 * hk, d])  # row (t, q|k, h)
        qk = ttnn.rms_norm(qk, epsilon=L2NORM_EPS / d, weight=self.w.qk_l2_weight,
                           compute_kernel_config=compute_config_norm(ttnn))
        qk = ttnn.reshape(qk, [rows, 2, hk, d])
        q = ttnn.reshape(ttnn.slice(qk, [0, 0, 0, 0], [rows, 1, hk, d]), [1, rows, hk, d])
        k = ttnn.reshape(ttnn.slice(qk, [0, 1, 0, 0], [rows, 2, hk, d]), [1, rows, hk, d])
        v = ttnn.reshape(ttnn.slice(conv_out, [0, 0, 0, 2 * kd], [1, 1, rows, self.cd]), [1, rows, self.hv, self.dv])
        return q, k, v

    def recurrence(self, q, k, v, g, beta, state: GDNLayerState, mode: str, *, initial=None, final=None,
                   ring_idx=None):
        """o [1, T, Hv, Dv] fp32; the state after the last row lands in ``final`` (default ``state.recurrent``),
        starting from ``initial`` (default ``state.recurrent``); state buffers are [Hv, Dk, Dv] fp32.
        Ring mode (``ring_idx`` given, decode only): ``initial`` is the [T*Hv, Dk, Dv] fp32 ring, head h starts
        from block ring_idx[h] and the state after row t is written in place to block t*Hv + h (no copy).
        A 1-row decode that starts and ends in the same buffer runs the same ring mode with T = 1: the buffer is
        a one-slot ring, head h reads and rewrites block h in place (no state copy). Otherwise the final state
        is copied into ``final``."""
        ttnn = self.ttnn
        cfg = compute_config_fp32_state(ttnn)
        initial = state.recurrent if initial is None else initial
        final = state.recurrent if final is None else final
        if ring_idx is None and mode == "decode" and v.shape[1] == 1 and initial is final:
            ring_idx = self.batch_head_idx[v.shape[0]]  # B users x 1 row: a B-slot ring (B = 1: the plain decode)
        if ring_idx is not None:
            o, _ = ttnn.transformer.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=initial, initial_state_block_idx=ring_idx,
                output_per_token_state=True, compute_kernel_config=cfg)
            return o
        initial = ttnn.reshape(initial, [v.shape[0], self.hv, self.dk, self.dv])  # [B, HV, K, V] for the kernels: a view
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
        ttnn.copy(ttnn.reshape(s, list(final.shape)), final)
        ttnn.deallocate(s)
        return o

    def output(self, o, z, rows: int):
        """Gated RMSNorm (plain weight) * silu(z), then the row-parallel out_proj reduced in fp32."""
        ttnn, a = self.ttnn, self.args
        y = ttnn.rms_norm(o, epsilon=self.eps, weight=self.w.norm, compute_kernel_config=compute_config_norm(ttnn))
        y = ttnn.reshape(y, [1, 1, rows, self.vd])  # heads back into columns; z stays [1, 1, T, Vd]
        y = ttnn.multiply(y, z, input_tensor_b_activations=[ttnn.UnaryOpType.SILU],
                          dtype=a.dtype(TensorGroup.GDN_ACTIVATION, ttnn))
        part = ttnn.linear(y, self.w.out_proj, dtype=a.dtype(TensorGroup.GDN_PARTIAL, ttnn),
                           memory_config=activation_memory_config(ttnn),
                           compute_kernel_config=compute_config_matmul(ttnn, a.dtype_name(TensorGroup.GDN_OUT)))
        return all_reduce(ttnn, part, a.num_devices)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, x, state: GDNLayerState, mode: str, plan: GDNStepPlan | None = None):
        """x [1, 1, T, H] (T rows at consecutive positions) -> [1, 1, T, H]; advances ``state`` in place.
        ``plan`` (a multi-row step such as a K+1-row speculative verify; plain data, gdn_plan.py) says where the conv
        window and the recurrent state go (its route for ``state``), and receives what the commit needs (a GDNKept)."""
        rows = x.shape[2]
        users = state.conv.shape[0]  # user slots of the state: a batched decode feeds one row per slot
        plan_users = 1 if plan is None else plan.users  # a multi-row plan covers every slot of the state
        if users > 1 and (mode != "decode" or (plan is not None and plan_users != users)):
            raise NotImplementedError(f"GDN {mode}{' verify' if plan is not None else ''} over a {users}-slot "
                                      "state: prefill runs on a batch-1 view of one slot, and a verify over B slots "
                                      "needs a step plan of B users")
        if mode == "prefill" and self.fused_prefill is not None:
            if plan is not None:
                raise ValueError("GDN prefill takes no multi-row step plan (a verify runs in mode 'decode')")
            return self.fused_prefill.forward(x, state)
        route = None if plan is None else plan.route(state)
        mixed, z, b, a_in = self.project(x)
        conv_write = True if route is None or route.conv_write else None
        conv_out, window = self.causal_conv(mixed, state.conv, rows, write_state=conv_write, return_window=True)
        q, k, v = self.qkv_heads(conv_out, rows, users)
        g, beta = self.gates(b, a_in, rows, users)
        if route is None:
            o = self.recurrence(q, k, v, g, beta, state, mode)
        else:
            if route.row_mask is not None:  # inert rows masked out of the recurrence (g = beta = 0)
                g, beta = self.ttnn.multiply(g, route.row_mask), self.ttnn.multiply(beta, route.row_mask)
            plan.kept.append(GDNKept(self, state, q, k, v, g, beta, window))
            o = self.recurrence(q, k, v, g, beta, state, "decode", initial=route.initial, final=route.final,
                                ring_idx=route.ring_idx)
        return self.output(o, z, rows)
