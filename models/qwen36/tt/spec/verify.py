"""Packed K+1-row verify on the TT target: one target forward over the rows [pending, d_1..d_K] at
positions n..n+K, device only (traceable), with the GDN/conv state routed per commit mechanism.

Device-resident step state (:class:`SpecDeviceState`, allocated once before any capture):

    n        [1,1,1,1] fp32   position of row 0 (the pending token); the commit advances it: n' = n + a + 1
    pending  [1,1,1,1] fp32   the pending token id (exact in fp32 below 2**24); the commit sets it to token a
    drafts   [1,1,1,K] uint32 ROW_MAJOR: d_1..d_K (written by the MTP on device, or by a host drafter)
    per GDN layer: the commit mechanism's buffers (``mechanisms.SpecLayerBuffers``: the shadow_commit ring
    [T*Hv_d, Dk, Dv] fp32, the snapshot copies, the recompute scratch); T = K+1.

From n the verify derives on device: rope rows (uint32 [1, T]), the SDPA bounds n..n+K once per local KV head
(int32 [G*T], G = Hkv/N); from the page table, the physical KV cache row of every row (int32 [1, T]) and the
per-KV-head table ``pt*G + h`` ([G, blocks] int32). Attention: ONE ``indexed_fused_update_cache`` writes the K+1
rows of K and V, then ONE paged SDPA decode in multi-position mode (``spec_multi_pos_tiles=T``) with one group per local KV head
over a per-head view of the cache: every candidate shares one scan of each KV head (``tt/model/attention.py``
``attend_verify``). GDN: ``fused_recurrent_gated_delta_rule`` over the T rows, routed by the commit mechanism
(``tt/spec/mechanisms.py``): shadow_commit in ring mode (per-token states in place, head h starting from ring block
``initial_state_block_idx[h]`` = the slot the previous commit selected), snapshot on the live state (after copying
it), recompute on a scratch copy. The conv window of every
GDN layer is kept for the commit (``models/qwen36/tt/spec/commit.py``), which selects the accepted row's window.

Users (``users=B``, ``TTSpecBackend`` with B slots, ``tt/spec/spec_backend.py``): the verify packs B users x T rows (user b's at
b*T..) over a decoder's B slots. Its row inputs (token rows, RoPE rows, physical KV rows, SDPA bounds, the
per-KV-head page table) are then persistent buffers the host writes before each verify (``HostRowsState``,
tt/spec/host_rows.py) instead of being derived from a resident n and pending token (``SpecDeviceState``, one user
only), the GDN recurrence
multiplies g and beta by a per-row mask (``row_mask`` [B, T, 1]: 0 for inert rows, so a user's rows past its depth
and a slot outside the step leave its state bit for bit), the mechanism buffers are B-slot shaped (``hv`` counts
the ring heads of all users, B*Hv_d) and the commit selects per user (``commit.py``). ``HostRowsState`` at one user
is the batched step at B = 1 (the same numbers as the one-user step, other programs).

Limits (refused clearly by :func:`check_verify_shape`): the kernel's multi-position mode takes one KV head per
cache (the emulator enforces the same), which the per-head view satisfies for any Hkv/N; the query heads of one KV
head must fit one 32-row tile; the per-core L1 of the multi-position kernel bounds T (about 11 candidates at
head_dim 256 on Blackhole: the kernel keeps every candidate row of a head in one core's L1): T <= max_spec_tiles(head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...config import FULL
from ...errors import UserError
from ..model.attention import AttentionContext
from .mechanisms import GDNStateBytes, SpecLayerBuffers, TTMechanism, tt_mechanism
from ..model.model import DecodeOutputs, TTQwen36Model
from ..model.gdn_plan import GDNStepPlan
from ..model.model_config import compute_config_exact_count, state_memory_config
from ..model.state import TTModelState

SPEC_TILES_AT_HD256 = 11  # multi-position paged SDPA fits about 11 candidate rows per core at head_dim 256 (L1 budget)


def max_spec_tiles(head_dim: int) -> int:
    """Candidates the multi-position SDPA kernel fits per core: ~11 at head_dim 256, scaled by K/V row size
    (the per-candidate Q/out tiles and the K/V chunk grow with head_dim); never more than 32."""
    return max(1, min(32, SPEC_TILES_AT_HD256 * 256 // max(1, head_dim)))


class VerifyShapeError(UserError, ValueError):
    """A draft depth K (or head layout) the K+1-row verify kernels cannot hold."""


def check_verify_shape(args, k: int) -> None:
    c = args.cfg
    if not isinstance(k, int) or k < 1:
        raise VerifyShapeError(f"draft depth K must be an int >= 1, got {k!r}")
    t = k + 1
    if FULL in c.layer_types and args.hq_d // args.hkv_d > 32:
        raise VerifyShapeError(
            f"K+1-row verify: {args.hq_d // args.hkv_d} query heads per KV head (num_attention_heads="
            f"{c.num_attention_heads}, num_key_value_heads={c.num_key_value_heads}) exceed one 32-row tile")
    if t > max_spec_tiles(c.head_dim):
        raise VerifyShapeError(
            f"K={k}: K+1={t} candidates exceed the multi-position SDPA kernel's limit of {max_spec_tiles(c.head_dim)} "
            f"at head_dim {c.head_dim} (per-core L1); use K <= {max_spec_tiles(c.head_dim) - 1}")


@dataclass
class VerifyPlan:
    """``AttentionContext.verify_plan`` of one verify: per-row KV cache rows and SDPA bounds; ``gdn`` is the GDN
    layers' plain-data plan (``AttentionContext.gdn_plan``: each layer's route from the commit mechanism, and what
    each layer keeps for the commit)."""

    users: int  # user slots of the packed verify (the attention and GDN layers lay the rows out per user)
    phys_rows: Any  # [1, T] int32 RM: physical KV cache row (page * block_size + row in page) of row j
    bounds: Any  # [G*T] int32 RM: SDPA bound of candidate j (= n + j), once per local KV head
    head_page_table: Any  # [G, blocks] int32 RM: page table of the per-KV-head cache view (pt*G + h)
    gdn: GDNStepPlan


@dataclass
class VerifyOutputs:
    out: DecodeOutputs  # logits [1,1,T,V] fp32, tokens [1,1,T] argmax, hidden [1,1,T,H]
    plan: VerifyPlan
    tokens: Any  # [1, T] uint32 RM: the verified rows

    def without_gdn_kept(self) -> "VerifyOutputs":
        """These outputs with no GDN layer's kept tensors: a commit of them does only the work that does not repeat
        per GDN layer (the cost probes count one layer's part as the difference)."""
        return replace(self, plan=replace(self.plan, gdn=replace(self.plan.gdn, kept=[])))


class SpecDeviceState:
    """Persistent device buffers of the speculative step for one model state, one K and ``users`` user slots (see
    module doc), the verify's row inputs derived on device from the resident position and pending token (one user).
    The B-slot layout's step state, whose row inputs the host writes, is :class:`~.host_rows.HostRowsState`."""

    def __init__(self, model: TTQwen36Model, state: TTModelState, k: int, mechanism: str | TTMechanism,
                 shared: "SpecDeviceState | None" = None, users: int = 1):
        """``shared``: the step state of another depth of the same generation. This one then uses its position,
        pending token and (mechanisms without a ring) GDN buffers instead of allocating its own: the per-depth
        step states of ``--spec-k auto`` are views of ONE device state, and only what has a K+1 shape is per depth
        (drafts, row constants, the shadow_commit ring).

        ``users``: the user slots of ``state`` one verify packs (B; one here, B in ``HostRowsState``)."""
        mechanism = tt_mechanism(mechanism)
        self._check_users(users)
        if shared is not None and (shared.state is not state or shared.mechanism.name != mechanism.name
                                   or type(shared) is not type(self)):
            raise ValueError("a shared step state must be of the same model state and commit mechanism, with "
                             "device-derived rows")
        self.shared, self.users = shared, users
        check_verify_shape(model.args, k)
        self.model, self.state, self.k, self.t, self.mechanism = model, state, k, k + 1, mechanism
        self.ttnn, self.mesh = model.ttnn, model.mesh
        a = model.args
        c = a.cfg
        self.hv, self.dk, self.dv = users * a.gdn_hv_d, c.linear_key_head_dim, c.linear_value_head_dim
        self.kc = c.linear_conv_kernel_dim
        self.rep = self.ttnn.ReplicateTensorToMesh(self.mesh)
        self.block_idx = None  # the acceptor's persistent ring index (set by attach_acceptor)
        self.row_mask = None  # host rows: [B, T, 1], 1 for the rows of the step's users up to their depth
        self.layer_bufs: dict[int, SpecLayerBuffers] = {}
        per_user = GDNStateBytes.of(a, len(state.gdn_states()))  # counters
        self.state_bytes = per_user if users == 1 else GDNStateBytes(per_user.recurrent * users, per_user.conv * users)
        self.allocate()

    # ---- allocation (before any capture) ----------------------------------------------------------------
    def _dev(self, x: torch.Tensor, dtype=None, layout=None):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=dtype or ttnn.float32, layout=layout or ttnn.TILE_LAYOUT, device=self.mesh,
                               mesh_mapper=self.rep, memory_config=state_memory_config(ttnn))

    def host(self, x: torch.Tensor, like):
        """Host tensor laid out like the persistent buffer ``like`` (for copy_host_to_device_tensor)."""
        return self.ttnn.from_torch(x, dtype=like.dtype, layout=like.layout, mesh_mapper=self.rep)

    @staticmethod
    def _check_users(users: int) -> None:
        if users != 1:
            raise ValueError(f"device-derived row inputs hold one user's position; {users} users need the host-rows "
                             f"step state (HostRowsState)")

    def allocate(self) -> None:
        ttnn, t, kc, sh = self.ttnn, self.t, self.kc, self.shared
        if sh is None:
            self.n = self._dev(torch.zeros(1, 1, 1, 1))
            self.pending = self._dev(torch.zeros(1, 1, 1, 1))
            self.c_one = self._dev(torch.ones(1, 1, 1, 1))
            self.c_zero = self._dev(torch.zeros(1, 1, 1, 1))
            # conv commit: new state row i = window row a + 1 + i (commit.py gathers rows c_conv_rows + a)
            self.c_conv_rows = self._dev(torch.arange(1, kc, dtype=torch.float32).reshape(1, 1, 1, kc - 1))
            self.c_heads = self._dev(torch.arange(self.model.args.hkv_d, dtype=torch.float32).reshape(-1, 1))
            bs, pages = self.model.args.block_size, int(self.state.page_table.shape[-1])
            starts = torch.arange(pages, dtype=torch.float32).reshape(1, 1, 1, pages) * bs
            self.c_page_start, self.c_page_end = self._dev(starts), self._dev(starts + bs)  # page b: [b bs, (b+1) bs)
        else:
            self.n, self.pending, self.c_one, self.c_zero = sh.n, sh.pending, sh.c_one, sh.c_zero
            self.c_conv_rows, self.c_heads = sh.c_conv_rows, sh.c_heads
            self.c_page_start, self.c_page_end = sh.c_page_start, sh.c_page_end
        self.drafts = self._dev(torch.zeros(1, 1, 1, self.k, dtype=torch.int32), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)
        self.c_ar = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, 1, 1, t))
        self.c_rows = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, t, 1))  # re-advance row mask base
        self.c_tok_cols = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, 1, 1, t))
        for s in self.state.gdn_states():
            if sh is not None and not self.mechanism.ring:  # state-shaped buffers: one set for every depth
                self.layer_bufs[id(s)] = sh.layer_bufs[id(s)]
            else:
                self.layer_bufs[id(s)] = self.mechanism.buffers(self, s)

    def attach_acceptor(self, acceptor) -> None:
        """The acceptor owns the accepted count and the ring index (``ring_block_idx``)."""
        self.acceptor = acceptor
        self.block_idx = self.mechanism.ring_index(acceptor)

    # ---- host-side (outside capture) -------------------------------------------------------------------
    def start(self, n: int = 0, pending: int = 0) -> None:
        """After a prefill of n tokens: n, pending, then the mechanism's start (shadow_commit: the live recurrent
        state into ring slot 0, every head pointed at it). Eager, outside any capture (allocates temporaries)."""
        ttnn = self.ttnn
        ttnn.copy_host_to_device_tensor(self.host(torch.tensor([[[[float(n)]]]]), self.n), self.n)
        ttnn.copy_host_to_device_tensor(self.host(torch.tensor([[[[float(pending)]]]]), self.pending), self.pending)
        self.mechanism.start(self)

    def write_drafts(self, drafts: list[int]) -> None:
        """Host drafter: write d_1..d_K into the persistent drafts buffer (between replays)."""
        x = torch.tensor(drafts, dtype=torch.int32).reshape(1, 1, 1, self.k)
        self.ttnn.copy_host_to_device_tensor(self.host(x, self.drafts), self.drafts)

    # ---- device work (traceable) -------------------------------------------------------------------------
    def pre_verify(self) -> None:
        """Mechanism copies before the verify: snapshot saves live (recurrent + conv), recompute fills scratch."""
        for s in self.state.gdn_states():
            self.mechanism.pre_verify(self, s, self.layer_bufs[id(s)])

    def verify_rows(self):
        """-> (tokens [1,T] uint32 RM, rope_idx [1,T] uint32 RM, bounds [G*T] int32 RM, phys_rows [1,T] int32 RM,
        head_page_table [G, blocks] int32 RM); G = local KV heads (see ``attend_verify``). Name suffixes give the
        shape: T rows, G local KV heads, P pages per sequence."""
        ttnn, t, heads, bs = self.ttnn, self.t, self.model.args.hkv_d, self.model.args.block_size
        rm = ttnn.ROW_MAJOR_LAYOUT
        pos_111T = ttnn.add(self.n, self.c_ar)  # fp32: n..n+K
        rope_idx_1T = ttnn.to_layout(ttnn.reshape(ttnn.typecast(pos_111T, ttnn.uint32), [1, t]), rm)
        bounds_GT = ttnn.to_layout(ttnn.reshape(ttnn.typecast(ttnn.concat([pos_111T] * heads, dim=3), ttnn.int32),
                                                [heads * t]), rm)
        # block indices < 2**24: exact in fp32
        pt_1P = ttnn.typecast(ttnn.to_layout(self.state.page_table, ttnn.TILE_LAYOUT), ttnn.float32)
        # physical cache row of position p (the indexed KV write takes no page table): pt[p // bs] * bs + p % bs
        # = p + sum_b [b bs <= p < (b + 1) bs] (pt[b] bs - b bs): a 0/1 page select, integer sums exact in fp32
        pos_11T1 = ttnn.reshape(pos_111T, [1, 1, t, 1])
        sel_11TP = ttnn.logical_and(ttnn.ge(pos_11T1, self.c_page_start), ttnn.lt(pos_11T1, self.c_page_end))
        shift_1P = ttnn.subtract(ttnn.multiply(pt_1P, float(bs)), self.c_page_start)
        phys_11T1 = ttnn.add(pos_11T1, ttnn.sum(ttnn.multiply(sel_11TP, shift_1P), dim=-1, keepdim=True,
                                                compute_kernel_config=compute_config_exact_count(ttnn)))
        phys_1T = ttnn.to_layout(ttnn.reshape(ttnn.typecast(phys_11T1, ttnn.int32), [1, t]), rm)
        head_pt_GP = ttnn.add(ttnn.multiply(pt_1P, float(heads)), self.c_heads)  # pt*G + h
        head_pt_GP = ttnn.to_layout(ttnn.typecast(head_pt_GP, ttnn.int32), rm)
        drafts_111K = ttnn.typecast(ttnn.to_layout(self.drafts, ttnn.TILE_LAYOUT), ttnn.float32)
        toks_111T = ttnn.concat([self.pending, drafts_111K], dim=3)
        tokens_1T = ttnn.to_layout(ttnn.reshape(ttnn.typecast(toks_111T, ttnn.uint32), [1, t]), rm)
        return tokens_1T, rope_idx_1T, bounds_GT, phys_1T, head_pt_GP

    def gdn_plan(self) -> GDNStepPlan:
        """The GDN layers' routes for one verify (the commit mechanism's, over this step state's buffers)."""
        return GDNStepPlan(self.users, {id(s): self.mechanism.route(self, self.layer_bufs[id(s)])
                                        for s in self.state.gdn_states()})

    def commit_selection(self):
        """The commit's row selection (device, traceable; tt/spec/commit.py): (conv window rows of the new conv state,
        uint32 RM [1, Kc-1]; the re-advance mask [1, T, 1], 1 for rows <= a, or None without a re-advance)."""
        ttnn, a = self.ttnn, self.acceptor.count  # [1,1,1,1] fp32
        # window row index of every new conv-state row: a+1+i, as the uint32 ROW_MAJOR [1, Kc-1] embedding wants
        idx = ttnn.typecast(ttnn.add(self.c_conv_rows, a), ttnn.uint32)  # [1,1,1,Kc-1]
        idx = ttnn.reshape(ttnn.to_layout(idx, ttnn.ROW_MAJOR_LAYOUT), [1, self.kc - 1])
        mask = ttnn.le(self.c_rows, a) if self.mechanism.readvance else None  # [1,T,1]: 1 for rows <= a
        return idx, mask

    def advance(self, result) -> None:
        """After the commit (device, traceable): n' = n + a + 1, pending' = the emitted token a of the acceptor's
        ``result`` row."""
        ttnn, a = self.ttnn, self.acceptor.count
        ttnn.copy(ttnn.add(self.n, ttnn.add(a, self.c_one)), self.n)
        toks = ttnn.typecast(ttnn.slice(result, [0, 0, 0, 0], [1, 1, 1, self.t]), ttnn.float32)
        # fp32 token ids: the accurate (SFPU, full fp32) sum needs fp32_dest_acc_en; without it the FPU reads TF32
        # and ids above 2048 come out wrong (ttnn.sum docstring, fast_and_approximate_mode)
        pend = ttnn.sum(ttnn.multiply(toks, ttnn.eq(self.c_tok_cols, a)), dim=3, keepdim=True,
                        compute_kernel_config=compute_config_exact_count(ttnn))
        ttnn.copy(pend, self.pending)

    def verify(self) -> VerifyOutputs:
        """Pre-verify copies + ONE target forward over the T rows (device only)."""
        m = self.model
        self.pre_verify()
        tokens_1T, rope_idx_1T, bounds_GT, phys_1T, head_pt_GP = self.verify_rows()
        verify_plan = VerifyPlan(self.users, phys_1T, bounds_GT, head_pt_GP, self.gdn_plan())
        with m.region("embed"):
            x_11TH = m.embed(tokens_1T)
            cos_1T1D, sin_1T1D = m.rope_rows(rope_idx_1T)
        ctx = AttentionContext("decode", cos_1T1D, sin_1T1D, self.state.page_table, verify_plan=verify_plan,
                               gdn_plan=verify_plan.gdn)
        x_11TH = m.layers_forward(x_11TH, self.state, ctx)
        with m.region("head"):
            logits_11TV, hidden_11TH = m.head(x_11TH, last_row_only=False)
            argmax_11T = self.ttnn.argmax(logits_11TV, dim=-1)
        return VerifyOutputs(DecodeOutputs(logits_11TV, argmax_11T, hidden_11TH), verify_plan, tokens_1T)
