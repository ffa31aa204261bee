"""Gated-DeltaNet recurrence: ttnn's golden for the math, plus the in-place "ring" mode it ignores.

``transformer.fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state,
initial_state_block_idx, output_final_state, output_per_token_state, use_qk_l2norm)``:

* q/k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g/beta ``[B, T, HV]``; returns ``(o [B, T, HV, V], state)``.
* Plain mode: the recurrence below, state ``[B, HV, K, V]`` (final) or ``[B, T, HV, K, V]`` (per token).
* Ring mode (``initial_state_block_idx`` given; op docstring): requires ``output_per_token_state=True``
  and an fp32 TILE ``initial_state`` of exact shape ``[T*BH, K, V]`` (BH = B*HV, h = b*HV + hv);
  ``idx`` is ``[BH]`` or ``[1, BH]`` uint32/int32 ROW_MAJOR with ``idx[h] % BH == h`` (caller contract).
  Head h starts from ring block ``idx[h]``; after token t its state is written *in place* to block
  ``t*BH + h``; all initial states are read before any write. The returned state is the ring tensor
  itself (same buffer).

Output dtypes: ``o`` takes v's dtype; states are fp32 (the GDN state must stay fp32). The math is the
golden's recurrence (ttnn's ``recurrent_gated_delta_rule``) computed in fp64, one token at a time, with the state
rounded to fp32 after every token as the kernel keeps it (rule N8: no host's kernels show, and a (K+1)-token verify
gives token t the same bits as t single-token decodes). Cards run it at the configured fidelity (not modelled).
"""

from __future__ import annotations

import torch

from . import numerics
from .errors import EmulatorError
from .registry import device_op
from .tensor import dtype_name, make_like, new_device_tensor, write_inplace
from .ttnn_import import ttnn

# the golden's token-by-token recurrence (FLA's naive form), which takes a compute dtype
_recurrence = ttnn.operations.transformer_golden.recurrent_gated_delta_rule


def _recurrent(q, k, v, g, beta, scale, h0, per_token: bool):
    """The fused op's math (its golden's argument order q, k, v, g, beta): fp64 per token, the state rounded to fp32
    after each token. Returns (o fp64 [B, T, HV, V], final fp32 state [B, HV, K, V], per-token fp32 states
    [B, T, HV, K, V] or None)."""
    q, k, v, g, beta = (numerics.wide(x) for x in (q, k, v, g, beta))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    state = None if h0 is None else h0.to(torch.float32)
    outs, states = [], []
    for t in range(v.shape[1]):
        sl = slice(t, t + 1)
        o, st = _recurrence(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], g[:, sl], scale=scale,
                            initial_state=None if state is None else numerics.wide(state), output_final_state=True,
                            dtype=numerics.WIDE)
        state = st.to(torch.float32)
        outs.append(o)
        if per_token:
            states.append(state)
    return torch.cat(outs, dim=1), state, (torch.stack(states, dim=1) if per_token else None)


def _gdn_bind(args, kwargs):
    from .signatures import bind_arguments

    return bind_arguments("ttnn.transformer.fused_recurrent_gated_delta_rule",
                          ttnn.transformer.fused_recurrent_gated_delta_rule, args, kwargs)


def _gdn_read(args, kwargs):
    """Inputs plus the BH initial states actually read (ring mode reads BH of the T*BH ring blocks)."""
    b = _gdn_bind(args, kwargs)
    d: dict = {}
    for k in ("q", "k", "v", "g", "beta", "initial_state_block_idx"):
        t = b.get(k)
        if t is not None:
            d[dtype_name(t.dtype)] = d.get(dtype_name(t.dtype), 0) + t.bytes_per_device()
    st = b.get("initial_state")
    if st is not None:
        n = st.bytes_per_device()
        if b.get("initial_state_block_idx") is not None:
            v = b["v"].logical_shape_list
            n = n // v[1]  # BH of T*BH blocks
        d[dtype_name(st.dtype)] = d.get(dtype_name(st.dtype), 0) + n
    return d


@device_op("ttnn.transformer.fused_recurrent_gated_delta_rule", read_bytes=_gdn_read)
def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    initial_state_block_idx=None,
    output_final_state=False,
    output_per_token_state=False,
    use_qk_l2norm=False,
    memory_config=None,
    compute_kernel_config=None,
):
    op = "ttnn.transformer.fused_recurrent_gated_delta_rule"
    if use_qk_l2norm:
        raise EmulatorError(f"{op}: use_qk_l2norm must be False (L2-normalise q/k before the op)")
    ring = initial_state_block_idx is not None
    if ring:
        if not output_per_token_state:
            raise EmulatorError(f"{op}: ring mode (initial_state_block_idx) requires output_per_token_state=True")
        if initial_state is None:
            raise EmulatorError(f"{op}: ring mode needs the [T*BH, K, V] ring as initial_state")
        if dtype_name(initial_state.dtype) != "FLOAT32" or initial_state.layout != ttnn.TILE_LAYOUT:
            raise EmulatorError(f"{op}: the ring must be FLOAT32 in TILE layout (got "
                                f"{dtype_name(initial_state.dtype)}/{initial_state.layout.name})")
        if dtype_name(initial_state_block_idx.dtype) not in ("UINT32", "INT32") or \
                initial_state_block_idx.layout != ttnn.ROW_MAJOR_LAYOUT:
            raise EmulatorError(f"{op}: initial_state_block_idx must be uint32/int32 in ROW_MAJOR layout")
    outs, states, new_ring = [], [], []
    for i in range(q.num_shards):
        qi, ki, vi, gi, bi = (t.shards[i] for t in (q, k, v, g, beta))
        b_sz, t_len, hv = vi.shape[0], vi.shape[1], vi.shape[2]
        kd, vd = ki.shape[-1], vi.shape[-1]
        bh = b_sz * hv
        if ring:
            rt = initial_state.shards[i]
            if list(rt.shape) != [t_len * bh, kd, vd]:
                raise EmulatorError(f"{op}: ring shape {list(rt.shape)} must be exactly [T*BH, K, V] = "
                                    f"{[t_len * bh, kd, vd]}")
            idx = initial_state_block_idx.shards[i].to(torch.int64).reshape(-1)
            if idx.numel() != bh:
                raise EmulatorError(f"{op}: initial_state_block_idx has {idx.numel()} entries, BH = {bh}")
            heads = torch.arange(bh)
            if bool(((idx % bh) != heads).any()) or bool(((idx < 0) | (idx >= t_len * bh)).any()):
                raise EmulatorError(
                    f"{op}: caller contract idx[h] % BH == h (and idx < T*BH) violated: idx={idx.tolist()}, BH={bh}"
                )
            h0 = rt[idx].reshape(b_sz, hv, kd, vd).to(torch.float32).clone()  # read all before writing
            o, _, per_tok = _recurrent(qi, ki, vi, gi, bi, scale, h0, per_token=True)
            ring_new = rt.clone()
            # per_tok [B, T, HV, K, V] -> block t*BH + (b*HV + hv)
            ring_new[:] = per_tok.permute(1, 0, 2, 3, 4).reshape(t_len * bh, kd, vd).to(rt.dtype)
            new_ring.append(ring_new)
            outs.append(o)
        else:
            h0 = None if initial_state is None else initial_state.shards[i].to(torch.float32)
            o, final, per_tok = _recurrent(qi, ki, vi, gi, bi, scale, h0, per_token=output_per_token_state)
            outs.append(o)
            states.append(per_tok if output_per_token_state else (final if output_final_state else None))
    o_t = make_like(v, outs, memory_config=memory_config)
    if ring:
        write_inplace(initial_state, new_ring)
        return o_t, initial_state
    if states and states[0] is not None:
        st_t = new_device_tensor(q.mesh, [s.to(torch.float32).contiguous() for s in states], ttnn.float32,
                                 ttnn.TILE_LAYOUT, memory_config=memory_config)
        return o_t, st_t
    return o_t, None
