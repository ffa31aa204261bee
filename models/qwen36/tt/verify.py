"""Packed K+1-row verify on the TT target (issue 7): one target forward over the rows [pending, d_1..d_K] at
positions n..n+K, device only (traceable), with the GDN/conv state routed per commit mechanism.

Device-resident step state (:class:`SpecDeviceState`, allocated once before any capture):

    n        [1,1,1,1] fp32   position of row 0 (the pending token); the commit advances it: n' = n + a + 1
    pending  [1,1,1,1] fp32   the pending token id (exact in fp32 below 2**24); the commit sets it to token a
    drafts   [1,1,1,K] uint32 ROW_MAJOR: d_1..d_K (written by the MTP on device, or by a host drafter)
    per GDN layer: ``ring`` [T*Hv_d, Dk, Dv] fp32 (shadow_commit), ``snap_rec``/``snap_conv`` (snapshot),
    ``scratch_rec`` (recompute); T = K+1.

From n the verify derives on device: rope rows (uint32 [1, T]), the SDPA bounds n..n+K once per local KV head
(int32 [G*T], G = Hkv/N) and one [1] int32 KV write position per row; from the page table, the per-KV-head
table ``pt*G + h`` ([G, blocks] int32). Attention: one ``paged_update_cache`` per row (K+1 writes per cache),
then ONE paged SDPA decode in multi-position mode (``spec_multi_pos_tiles=T``) with one group per local KV head
over a per-head view of the cache: every candidate shares one scan of each KV head (``tt/attention.py``
``attend_verify``). GDN: ``fused_recurrent_gated_delta_rule`` over the T rows; shadow_commit in ring mode (per-token
states in place, head h starting from ring block ``initial_state_block_idx[h]`` = the slot the previous commit
selected), snapshot on the live state (after copying it), recompute on a scratch copy. The conv window of every
GDN layer is kept for the commit (``models/qwen36/tt/commit.py``), which selects the accepted row's window.

Limits (refused clearly by :func:`check_verify_shape`): the kernel's multi-position mode takes one KV head per
cache (the emulator enforces the same), which the per-head view satisfies for any Hkv/N; the query heads of one KV
head must fit one 32-row tile; the per-core L1 of the multi-position kernel bounds T (about 11 candidates at
head_dim 256 on Blackhole, DESIGN 4.1): T <= max_spec_tiles(head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import FULL
from .attention import AttentionContext
from .model import DecodeOutputs, TTQwen36Model
from .model_config import TensorGroup, state_memory_config
from .state import GDNLayerState, TTModelState

MECHANISMS = ("snapshot", "shadow_commit", "recompute")
SPEC_TILES_AT_HD256 = 11  # DESIGN 4.1: multi-position paged SDPA fits about 11 candidates at head_dim 256


def max_spec_tiles(head_dim: int) -> int:
    """Candidates the multi-position SDPA kernel fits per core: ~11 at head_dim 256, scaled by K/V row size
    (the per-candidate Q/out tiles and the K/V chunk grow with head_dim); never more than 32."""
    return max(1, min(32, SPEC_TILES_AT_HD256 * 256 // max(1, head_dim)))


class VerifyShapeError(ValueError):
    pass


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
            f"at head_dim {c.head_dim} (per-core L1; DESIGN 4.1); use K <= {max_spec_tiles(c.head_dim) - 1}")


@dataclass
class SpecLayerBuffers:
    ring: Any = None  # shadow_commit: [T*Hv_d, Dk, Dv] fp32
    snap_rec: Any = None  # snapshot
    snap_conv: Any = None
    scratch_rec: Any = None  # recompute


@dataclass
class GDNRecord:
    """What a verify leaves for the commit of one GDN layer (device tensors of this step)."""

    gdn: Any
    state: GDNLayerState
    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    window: Any  # [1, 1, Kc-1+T, Cd]: conv state before the verify, then the T rows' conv inputs


@dataclass
class VerifyPlan:
    """``AttentionContext.verify_plan`` of one verify: per-row positions and the mechanism's GDN routing."""

    step_state: "SpecDeviceState"
    row_pos: list  # T x [1] int32 RM: KV write position of row j
    bounds: Any  # [G*T] int32 RM: SDPA bound of candidate j (= n + j), once per local KV head
    head_page_table: Any  # [G, blocks] int32 RM: page table of the per-KV-head cache view (pt*G + h)
    records: list = field(default_factory=list)

    def conv_write(self, state: GDNLayerState):
        """snapshot: the verify advances the live conv state; shadow_commit/recompute leave it (window kept)."""
        return True if self.step_state.mechanism == "snapshot" else None

    def gdn_recurrence(self, gdn, state: GDNLayerState, q, k, v, g, beta, window):
        self.records.append(GDNRecord(gdn, state, q, k, v, g, beta, window))
        bufs = self.step_state.layer_bufs[id(state)]
        m = self.step_state.mechanism
        if m == "shadow_commit":
            return gdn.recurrence(q, k, v, g, beta, state, "decode", initial=bufs.ring, ring_idx=self.step_state.block_idx)
        if m == "snapshot":
            return gdn.recurrence(q, k, v, g, beta, state, "decode")  # live advances through all T rows
        return gdn.recurrence(q, k, v, g, beta, state, "decode", initial=bufs.scratch_rec, final=bufs.scratch_rec)


@dataclass
class VerifyOutputs:
    out: DecodeOutputs  # logits [1,1,T,V] fp32, tokens [1,1,T] argmax, hidden [1,1,T,H]
    plan: VerifyPlan
    tokens: Any  # [1, T] uint32 RM: the verified rows


class SpecDeviceState:
    """Persistent device buffers of the speculative step for one model state and one K (see module doc)."""

    def __init__(self, model: TTQwen36Model, state: TTModelState, k: int, mechanism: str):
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown commit mechanism {mechanism!r}; choose from {MECHANISMS}")
        check_verify_shape(model.args, k)
        self.model, self.state, self.k, self.t, self.mechanism = model, state, k, k + 1, mechanism
        self.ttnn, self.mesh = model.ttnn, model.mesh
        a = model.args
        c = a.cfg
        self.hv, self.dk, self.dv = a.gdn_hv_d, c.linear_key_head_dim, c.linear_value_head_dim
        self.kc = c.linear_conv_kernel_dim
        self.rep = self.ttnn.ReplicateTensorToMesh(self.mesh)
        self.block_idx = None  # the acceptor's persistent ring index (set by attach_acceptor)
        self.layer_bufs: dict[int, SpecLayerBuffers] = {}
        self.allocate()

    # ---- allocation (before any capture) ----------------------------------------------------------------
    def _dev(self, x: torch.Tensor, dtype=None, layout=None):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=dtype or ttnn.float32, layout=layout or ttnn.TILE_LAYOUT, device=self.mesh,
                               mesh_mapper=self.rep, memory_config=state_memory_config(ttnn))

    def host(self, x: torch.Tensor, like):
        """Host tensor laid out like the persistent buffer ``like`` (for copy_host_to_device_tensor)."""
        return self.ttnn.from_torch(x, dtype=like.dtype, layout=like.layout, mesh_mapper=self.rep)

    def allocate(self) -> None:
        ttnn, t, kc = self.ttnn, self.t, self.kc
        f32 = ttnn.float32
        self.n = self._dev(torch.zeros(1, 1, 1, 1))
        self.pending = self._dev(torch.zeros(1, 1, 1, 1))
        self.drafts = self._dev(torch.zeros(1, 1, 1, self.k, dtype=torch.int32), ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT)
        self.c_ar = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, 1, 1, t))
        self.c_one = self._dev(torch.ones(1, 1, 1, 1))
        self.c_zero = self._dev(torch.zeros(1, 1, 1, 1))
        # conv commit: new state row i = window row a + 1 + i (commit.py gathers rows c_conv_rows + a)
        self.c_conv_rows = self._dev(torch.arange(1, kc, dtype=torch.float32).reshape(1, 1, 1, kc - 1))
        self.c_rows = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, t, 1))  # re-advance row mask base
        self.c_tok_cols = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, 1, 1, t))
        self.c_heads = self._dev(torch.arange(self.model.args.hkv_d, dtype=torch.float32).reshape(-1, 1))
        for s in self.state.gdn_states():
            b = SpecLayerBuffers()
            if self.mechanism == "shadow_commit":
                b.ring = self._dev(torch.zeros(t * self.hv, self.dk, self.dv), f32)
            elif self.mechanism == "snapshot":
                b.snap_rec = self._dev(torch.zeros(list(s.recurrent.shape)), s.recurrent.dtype)
                b.snap_conv = self._dev(torch.zeros(list(s.conv.shape)), s.conv.dtype)
            else:
                b.scratch_rec = self._dev(torch.zeros(list(s.recurrent.shape)), s.recurrent.dtype)
            self.layer_bufs[id(s)] = b

    def attach_acceptor(self, acceptor) -> None:
        """The acceptor owns the accepted count and the ring index (``ring_block_idx``)."""
        self.acceptor = acceptor
        self.block_idx = acceptor.block_idx if self.mechanism == "shadow_commit" else None

    # ---- byte sizes (counters) ------------------------------------------------------------------------
    def gdn_state_bytes(self) -> int:
        """Bytes of all GDN recurrent + conv state on one device (fp32)."""
        c = self.model.args.cfg
        per = self.hv * self.dk * self.dv * 4 + (self.kc - 1) * self.model.args.gdn_conv_dim_d * 4
        return per * len(self.state.gdn_states())

    # ---- host-side (outside capture) -------------------------------------------------------------------
    def start(self, n: int, pending: int) -> None:
        """After a prefill of n tokens: n, pending; shadow_commit puts the live recurrent state in ring slot 0
        and points every head at it (count 0). Eager, outside any capture (allocates temporaries)."""
        ttnn = self.ttnn
        ttnn.copy_host_to_device_tensor(self.host(torch.tensor([[[[float(n)]]]]), self.n), self.n)
        ttnn.copy_host_to_device_tensor(self.host(torch.tensor([[[[float(pending)]]]]), self.pending), self.pending)
        if self.mechanism == "shadow_commit":
            for s in self.state.gdn_states():
                ring = self.layer_bufs[id(s)].ring
                slot0 = ttnn.reshape(s.recurrent, [self.hv, self.dk, self.dv])
                rest = ttnn.slice(ring, [self.hv, 0, 0], [self.t * self.hv, self.dk, self.dv])
                ttnn.copy(ttnn.concat([slot0, rest], dim=0), ring)
            ttnn.copy(self.c_zero, self.acceptor.count)
            self.acceptor.ring_block_idx()

    def write_drafts(self, drafts: list[int]) -> None:
        """Host drafter: write d_1..d_K into the persistent drafts buffer (between replays)."""
        x = torch.tensor(drafts, dtype=torch.int32).reshape(1, 1, 1, self.k)
        self.ttnn.copy_host_to_device_tensor(self.host(x, self.drafts), self.drafts)

    def publish_live(self, a: int) -> None:
        """Probe helper (eager): copy ring slot ``a`` into each layer's plain recurrent buffer so single-row decode
        (which does not read the ring) continues from the committed state. Not part of the step."""
        if self.mechanism != "shadow_commit":
            return
        ttnn = self.ttnn
        for s in self.state.gdn_states():
            ring = self.layer_bufs[id(s)].ring
            sl = ttnn.slice(ring, [a * self.hv, 0, 0], [(a + 1) * self.hv, self.dk, self.dv])
            ttnn.copy(ttnn.reshape(sl, list(s.recurrent.shape)), s.recurrent)

    def read_scalar(self, buf) -> float:
        return float(self.ttnn.to_torch(self.ttnn.get_device_tensors(buf)[0]).reshape(-1)[0])

    # ---- device work (traceable) -------------------------------------------------------------------------
    def pre_verify(self) -> None:
        """Mechanism copies before the verify: snapshot saves live (recurrent + conv), recompute fills scratch."""
        ttnn = self.ttnn
        for s in self.state.gdn_states():
            b = self.layer_bufs[id(s)]
            if self.mechanism == "snapshot":
                ttnn.copy(s.recurrent, b.snap_rec)
                ttnn.copy(s.conv, b.snap_conv)
            elif self.mechanism == "recompute":
                ttnn.copy(s.recurrent, b.scratch_rec)

    def verify_rows(self):
        """-> (tokens [1,T] uint32 RM, rope_idx [1,T] uint32 RM, bounds [G*T] int32 RM, row_pos T x [1] int32 RM,
        head_page_table [G, blocks] int32 RM); G = local KV heads (see ``attend_verify``). Name suffixes give the
        shape: T rows, G local KV heads, P pages per sequence."""
        ttnn, t, heads = self.ttnn, self.t, self.model.args.hkv_d
        rm = ttnn.ROW_MAJOR_LAYOUT
        pos_111T = ttnn.add(self.n, self.c_ar)  # fp32: n..n+K
        rope_idx_1T = ttnn.to_layout(ttnn.reshape(ttnn.typecast(pos_111T, ttnn.uint32), [1, t]), rm)
        bounds_GT = ttnn.to_layout(ttnn.reshape(ttnn.typecast(ttnn.concat([pos_111T] * heads, dim=3), ttnn.int32),
                                                [heads * t]), rm)
        row_pos = [ttnn.slice(bounds_GT, [j], [j + 1]) for j in range(t)]
        # block indices < 2**24: exact in fp32
        pt_1P = ttnn.typecast(ttnn.to_layout(self.state.page_table, ttnn.TILE_LAYOUT), ttnn.float32)
        head_pt_GP = ttnn.add(ttnn.multiply(pt_1P, float(heads)), self.c_heads)  # pt*G + h
        head_pt_GP = ttnn.to_layout(ttnn.typecast(head_pt_GP, ttnn.int32), rm)
        drafts_111K = ttnn.typecast(ttnn.to_layout(self.drafts, ttnn.TILE_LAYOUT), ttnn.float32)
        toks_111T = ttnn.concat([self.pending, drafts_111K], dim=3)
        tokens_1T = ttnn.to_layout(ttnn.reshape(ttnn.typecast(toks_111T, ttnn.uint32), [1, t]), rm)
        return tokens_1T, rope_idx_1T, bounds_GT, row_pos, head_pt_GP

    def verify(self) -> VerifyOutputs:
        """Pre-verify copies + ONE target forward over the T rows (device only)."""
        m = self.model
        self.pre_verify()
        tokens_1T, rope_idx_1T, bounds_GT, row_pos, head_pt_GP = self.verify_rows()
        verify_plan = VerifyPlan(self, row_pos, bounds_GT, head_pt_GP)
        with m.region("embed"):
            x_11TH = m.embed(tokens_1T)
            cos_1T1D, sin_1T1D = m.rope_rows(rope_idx_1T)
        ctx = AttentionContext("decode", cos_1T1D, sin_1T1D, self.state.page_table, verify_plan=verify_plan)
        x_11TH = m.layers_forward(x_11TH, self.state, ctx)
        with m.region("head"):
            logits_11TV, hidden_11TH = m.head(x_11TH, last_row_only=False)
            argmax_11T = self.ttnn.argmax(logits_11TV, dim=-1)
        return VerifyOutputs(DecodeOutputs(logits_11TV, argmax_11T, hidden_11TH), verify_plan, tokens_1T)
