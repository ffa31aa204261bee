"""Checkpoint -> device weights with tensor-parallel sharding over the mesh width N.

Column-parallel (output features split, no communication): the GDN in-projections (qkv, z, b, a: four
matmuls, so no output needs a slice),
the attention projection [q | k | v] and its output gate, the fused MLP [gate | up], the LM head (vocab-parallel).
Row-parallel (input features split, partial sums all-reduced): GDN out_proj, attention o_proj, MLP down.

GDN split: device d owns key heads [d*Hk/N, (d+1)*Hk/N) and the value heads that read them
(value head j reads key head j // (Hv/Hk), so the owned value heads are the contiguous range
[d*Hv/N, (d+1)*Hv/N)). ``in_proj_qkv`` rows are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]; each device gets
[q_d | k_d | v_d], and the conv channels are permuted identically (z, b, a split by value head alike). Attention: Hq/N query heads (each
head's q and gate rows on the same device) and Hkv/N KV heads per device (q head i reads KV head i // (Hq/Hkv),
so contiguous ranges line up again).

Every tensor goes through ``ttnn.as_tensor(..., cache_file_name=...)`` when a cache directory is given,
so a second load skips the (slow) block-float conversion. Host-side rearrangement happens in the
checkpoint's own dtype (quantising from bf16 and from fp32 gives different bf8 codes).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ...checkpoint import CheckpointReader
from ...config import FULL
from ...reference.layers import rope_cos_sin
from .decode_matmuls import dram_bank_count, matrix_memory_config
from .model_config import TensorGroup, TTModelArgs, mtp_head_args, weight_memory_config


# ---- host-side layout helpers (pure torch; unit-tested without a device) ------------------------------
def per_device_blocks(t: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {n} devices")
    return list(torch.chunk(t, n, dim=dim))


def device_major(parts_per_device: list[list[torch.Tensor]], dim: int = 0) -> torch.Tensor:
    """[[a_0, b_0, ...], [a_1, b_1, ...]] -> cat(a_0, b_0, ..., a_1, b_1, ...) so that an even split of ``dim``
    over N devices hands device d exactly [a_d | b_d | ...]."""
    return torch.cat([torch.cat(p, dim=dim) for p in parts_per_device], dim=dim)


def gdn_qkv_rows(qkv: torch.Tensor, hk: int, dk: int, hv: int, dv: int, n: int) -> torch.Tensor:
    """GDN qkv in-projection rows [out, in], device-major: device d gets [q_d | k_d | v_d]."""
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=0)
    parts = zip(*(per_device_blocks(x, n) for x in (q, k, v)))
    return device_major([list(p) for p in parts])


def gdn_conv_channels(conv_w: torch.Tensor, hk: int, dk: int, hv: int, dv: int, n: int) -> torch.Tensor:
    """conv1d weight [C, 1, K] -> taps [K, C] with channels permuted like the qkv rows (device-major)."""
    w = conv_w[:, 0, :]
    q, k, v = torch.split(w, [hk * dk, hk * dk, hv * dv], dim=0)
    parts = zip(*(per_device_blocks(x, n) for x in (q, k, v)))
    return device_major([list(p) for p in parts]).t().contiguous()


def rope_head_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Order of a head's dims that turns partial NeoX RoPE into a full-width rotate_half: ``new[p] = old[perm[p]]``.

    Partial RoPE rotates dim i with dim i + r/2 for i < r/2 (r = rotary_dim) and passes dims >= r through. The
    device op (``rotary_embedding_hf``) rotates p with p + D/2 over the whole head. Placing old dims [0, r/2) at
    [0, r/2), old [r/2, r) at [D/2, D/2 + r/2) and the pass-through dims in the remaining slots (with cos = 1,
    sin = 0 there) makes the two the same map. Applied to the q and k rows of every head and to q_norm/k_norm
    (per-dim weights), it leaves every q.k product unchanged, so attention does not see it; only K in the cache
    is stored in this order."""
    h, half = rotary_dim // 2, head_dim // 2
    if rotary_dim % 2 or rotary_dim > head_dim or head_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} / head_dim {head_dim}: need even rotary_dim <= even head_dim")
    rest = list(range(rotary_dim, head_dim))
    return torch.tensor(list(range(h)) + rest[: half - h] + list(range(h, rotary_dim)) + rest[half - h:])


def attention_qkv_rows(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, hq: int, d: int,
                       n: int, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention projection rows, device-major: (qkv, gate) where device d gets [q_d | k_d | v_d] of qkv (the
    layout ``experimental.nlp_create_qkv_heads_decode`` splits) and gate_d of gate (q_proj rows are per head
    [q | gate]; the head's q and gate rows land on the same device). ``perm`` reorders each q and k head's rows
    (:func:`rope_head_permutation`)."""
    qg = q_proj.reshape(hq, 2, d, -1)
    q, gate = qg[:, 0], qg[:, 1].reshape(hq * d, -1)
    if perm is not None:
        q = q[:, perm]
        k_proj = k_proj.reshape(-1, d, k_proj.shape[-1])[:, perm].reshape(k_proj.shape)
    q = q.reshape(hq * d, -1)
    parts = zip(*(per_device_blocks(x, n) for x in (q, k_proj, v_proj)))
    return device_major([list(p) for p in parts]), gate


def expert_gate_up_blocks(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """Stacked experts.gate_up_proj [E, 2I, H] (per expert gate rows then up rows) -> [1, E, H, 2I] whose last dim
    is device-major per expert: an even split over N devices hands device d [gate_d | up_d] of every expert."""
    gate, up = gate_up.chunk(2, dim=1)  # [E, I, H] each
    parts = zip(per_device_blocks(gate, n, dim=1), per_device_blocks(up, n, dim=1))
    rows = device_major([list(p) for p in parts], dim=1)  # [E, 2I, H]
    return rows.transpose(1, 2).unsqueeze(0).contiguous()


def rope_tables(max_len: int, head_dim: int, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_len, head_dim] cos/sin over the *whole* head in the permuted head order
    (:func:`rope_head_permutation`): cos = 1 and sin = 0 on the pass-through dims, so the full-width
    ``x * cos + rotate_half(x) * sin`` is partial RoPE (no slicing of the head)."""
    cos, sin = rope_cos_sin(torch.arange(max_len), rotary_dim, theta, torch.float32)
    pad = head_dim - rotary_dim
    perm = rope_head_permutation(head_dim, rotary_dim)
    return (torch.cat([cos, torch.ones(max_len, pad)], -1)[:, perm],
            torch.cat([sin, torch.zeros(max_len, pad)], -1)[:, perm])


# ---- device weight containers -------------------------------------------------------------------------
@dataclass
class GDNWeights:
    in_proj: Any  # qkv [H, Cd]: [q_d | k_d | v_d] (the conv input)
    in_proj_z: Any  # [H, Vd]
    in_proj_b: Any  # [H, Hv_d] (beta = sigmoid of it)
    in_proj_a: Any  # [H, Hv_d] (its linear takes dt_bias as the bias)
    conv_taps: Any  # [1, 1, K, Cd]; row j multiplies input t - (K-1) + j
    qk_l2_weight: Any  # [Dk] filled with Dk^-0.5: rms_norm(x, eps/Dk) * Dk^-0.5 == x / sqrt(sum x^2 + eps)
    neg_exp_a: Any  # [1, 1, 1, Hv_d] -exp(A_log) (fp32)
    dt_bias: Any  # [1, 1, 1, Hv_d] (fp32)
    norm: Any  # gated RMSNorm weight [Dv] (plain, not zero-centred)
    out_proj: Any  # [Vd, H] row-parallel
    # the prefill's fused ops (tt/model/gdn_prefill.py): the conv taps as four [1, Cd] TILE tensors (tap j multiplies
    # input t - (K-1) + j: experimental.kda.qkv_causal_conv1d_silu's tap0..tap3) and the gated-norm weight as a
    # rank-1 [Dv] TILE tensor (experimental.kda.sigmoid_gated_rms_norm's weight)
    conv_tap_rows: tuple = ()
    norm_flat: Any = None


# GDNWeights fields only the prefill reads (a decode step's weight bytes leave them out)
GDN_PREFILL_ONLY = ("conv_tap_rows", "norm_flat")


@dataclass
class AttentionWeights:
    qkv: Any  # [H, (Hq_d + 2 Hkv_d) D]: [q_d | k_d | v_d] (the decode head split's input layout)
    gate: Any  # [H, Hq_d D]: the output gate, its own matmul (no split of a fused output)
    q_norm: Any  # [D] as (1 + w)
    k_norm: Any
    o_proj: Any  # [Hq_d D, H] row-parallel


@dataclass
class MLPWeights:
    gate: Any  # [H, I_d] column-parallel (its own tensor: silu is fused into the multiply, no split of a fused output)
    up: Any  # [H, I_d] column-parallel
    down: Any  # [I_d, H]


@dataclass
class MoEWeights:
    """A sparse MoE block: every routed expert and the shared expert tensor-parallel over their intermediate dim."""

    router: Any  # [H, E] replicated (fp32 logits, then softmax/top-k on every device)
    experts_gate_up: Any  # [1, E, H, 2 I_d]: per expert [gate_d | up_d] (sparse_matmul groups)
    experts_down: Any  # [1, E, I_d, H] row-parallel
    shared: MLPWeights  # shared expert: [H, 2 S_d] and [S_d, H]
    shared_gate: Any  # [H, 1] replicated (sigmoid gate of the shared expert)
    sparsity: Any  # [1, 1, 1, E] bf16 ROW_MAJOR ones: sparse_matmul's required operand, unread in indexed mode


@dataclass
class LayerWeights:
    layer_type: str
    input_norm: Any
    post_norm: Any
    mixer: GDNWeights | AttentionWeights
    mlp: MLPWeights | MoEWeights


@dataclass
class ModelWeights:
    embedding: Any  # [V, H] replicated, ROW_MAJOR (row gather)
    layers: list[LayerWeights]
    final_norm: Any
    lm_head: Any  # [H, V_d] vocab-parallel
    rope_cos: Any  # [max_len, D] (row gather by position), head dims in the RoPE order (rope_head_permutation)
    rope_sin: Any
    mtp: dict = field(default_factory=dict)  # MTP head weights (filled by the MTP loader below)


class WeightLoader:
    """Converts one checkpoint onto one mesh. ``cache_dir`` (optional) holds ttnn weight caches."""

    def __init__(self, reader: CheckpointReader, args: TTModelArgs, ttnn, mesh, cache_dir: str | Path | None = None,
                 progress: bool = True):
        self.reader, self.args, self.ttnn, self.mesh = reader, args, ttnn, mesh
        self.cache_dir = None if cache_dir is None else Path(cache_dir) / args.cache_key()
        self.progress = progress
        n = args.num_devices
        self.shard_cols = ttnn.ShardTensorToMesh(mesh, dim=-1)
        self.shard_rows = ttnn.ShardTensorToMesh(mesh, dim=-2)
        self.replicate = ttnn.ReplicateTensorToMesh(mesh)
        self.n = n
        self.bar = None

    # ---- one tensor -----------------------------------------------------------------------------------
    def _put(self, name: str, host: torch.Tensor, dtype, *, layout=None, mapper=None, memory_config=None):
        ttnn = self.ttnn
        layout = ttnn.TILE_LAYOUT if layout is None else layout
        cache = None if self.cache_dir is None else str(self.cache_dir / name)
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
        mc = weight_memory_config(ttnn) if memory_config is None else memory_config
        return ttnn.as_tensor(host, dtype=dtype, layout=layout, device=self.mesh,
                              memory_config=mc, mesh_mapper=mapper or self.replicate, cache_file_name=cache)

    def _get(self, name: str) -> torch.Tensor:
        return self.reader.get(name)

    def norm_weight(self, name: str, host: torch.Tensor, zero_centred: bool):
        """RMSNorm weight, replicated. Zero-centred norms store (1 + w). Layout: ROW_MAJOR [1, 1, dim/32, 32]
        (the tt_transformers convention) when dim is a tile multiple, else TILE [1, 1, 1, dim]."""
        ttnn = self.ttnn
        w = host.float() + 1.0 if zero_centred else host.float()
        dim = w.numel()
        dt = self.args.dtype(TensorGroup.NORM, ttnn)
        if dim % 32 == 0:
            return self._put(name, w.reshape(1, 1, dim // 32, 32), dt, layout=ttnn.ROW_MAJOR_LAYOUT)
        return self._put(name, w.reshape(1, 1, 1, dim), dt)

    def matrix(self, name: str, rows_out_in: torch.Tensor, group: TensorGroup, parallel: str):
        """[out, in] rows -> ttnn [in, out]; column-parallel shards out, row-parallel shards in."""
        w = rows_out_in.t().contiguous()
        mapper = self.shard_cols if parallel == "column" else self.shard_rows
        k, n = w.shape  # per device: column-parallel splits n, row-parallel splits k
        k, n = (k, n // self.n) if parallel == "column" else (k // self.n, n)
        mc = matrix_memory_config(self.ttnn, self.args, group, k, n, dram_bank_count(self.mesh))
        # ttnn.as_tensor's cache file stores the tensor with its memory config and a cache hit loads it as stored
        # (ttnn/operations/core.py, 0.81.1): a DRAM-sharded weight's bank shard width (which follows its readers
        # per bank, decode_matmuls.dram_bank_shard_tiles) is part of its file name, so a layout change never loads an
        # old file
        spec = mc.shard_spec if mc.is_sharded() else None
        cache_name = name if spec is None else f"{name}_bankw{int(spec.shape[1])}"
        return self._put(cache_name, w, self.args.dtype(group, self.ttnn), mapper=mapper, memory_config=mc)

    # ---- blocks ---------------------------------------------------------------------------------------
    def gdn(self, p: str) -> GDNWeights:
        ttnn, a, c = self.ttnn, self.args, self.args.cfg
        hk, dk, hv, dv, n = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim, self.n
        # four column-parallel matmuls instead of one fused matmul + four output slices: the same weight bytes,
        # no slice programs (the b/a slices of a fused output are not tile-aligned: 3 programs each on cards)
        rows = gdn_qkv_rows(self._get(f"{p}in_proj_qkv.weight"), hk, dk, hv, dv, n)
        in_proj = self.matrix(f"{p}in_proj_qkv", rows, TensorGroup.GDN_IN, "column")
        in_z, in_b, in_a = (self.matrix(f"{p}in_proj_{x}", self._get(f"{p}in_proj_{x}.weight"), TensorGroup.GDN_IN,
                                        "column") for x in ("z", "b", "a"))
        taps = gdn_conv_channels(self._get(f"{p}conv1d.weight"), hk, dk, hv, dv, n)  # [K, C] device-major
        small = a.dtype(TensorGroup.NORM, ttnn)
        conv_taps = self._put(f"{p}conv_taps", taps[None, None], small, mapper=self.shard_cols)
        l2w = self._put(f"{p}qk_l2_weight", torch.full((1, 1, 1, dk), dk ** -0.5), small)
        state_dt = a.dtype(TensorGroup.GDN_STATE, ttnn)
        neg_exp_a = self._put(f"{p}neg_exp_A", -self._get(f"{p}A_log").float().exp().reshape(1, 1, 1, hv), state_dt,
                              mapper=self.shard_cols)
        dt_bias = self._put(f"{p}dt_bias", self._get(f"{p}dt_bias").float().reshape(1, 1, 1, hv), state_dt,
                            mapper=self.shard_cols)
        norm = self.norm_weight(f"{p}norm", self._get(f"{p}norm.weight"), zero_centred=False)
        out = self.matrix(f"{p}out_proj", self._get(f"{p}out_proj.weight"), TensorGroup.GDN_OUT, "row")
        tap_rows = tuple(self._put(f"{p}conv_tap{j}", taps[j:j + 1], small, mapper=self.shard_cols)
                         for j in range(taps.shape[0]))
        norm_flat = self._put(f"{p}norm_flat", self._get(f"{p}norm.weight").float().reshape(dv), small)
        return GDNWeights(in_proj, in_z, in_b, in_a, conv_taps, l2w, neg_exp_a, dt_bias, norm, out, tap_rows, norm_flat)

    def attention(self, p: str) -> AttentionWeights:
        c = self.args.cfg
        perm = rope_head_permutation(c.head_dim, c.rotary_dim)
        rows, gate_rows = attention_qkv_rows(self._get(f"{p}q_proj.weight"), self._get(f"{p}k_proj.weight"),
                                             self._get(f"{p}v_proj.weight"), c.num_attention_heads, c.head_dim,
                                             self.n, perm)
        # "_ropeperm": q/k rows in the RoPE head order (cache files of the unpermuted layout must not be reused);
        # "qkv_nogate": [q | k | v] without the gate (cache files of the fused [q | gate | k | v] layout differ)
        qkv = self.matrix(f"{p}qkv_nogate_ropeperm", rows, TensorGroup.ATTN_QKV, "column")
        gate = self.matrix(f"{p}q_gate", gate_rows, TensorGroup.ATTN_QKV, "column")
        qn = self.norm_weight(f"{p}q_norm_ropeperm", self._get(f"{p}q_norm.weight")[perm], zero_centred=True)
        kn = self.norm_weight(f"{p}k_norm_ropeperm", self._get(f"{p}k_norm.weight")[perm], zero_centred=True)
        o = self.matrix(f"{p}o_proj", self._get(f"{p}o_proj.weight"), TensorGroup.ATTN_O, "row")
        return AttentionWeights(qkv, gate, qn, kn, o)

    def mlp(self, p: str) -> MLPWeights:
        gate = self.matrix(f"{p}gate_proj", self._get(f"{p}gate_proj.weight"), TensorGroup.MLP_GATE_UP, "column")
        up = self.matrix(f"{p}up_proj", self._get(f"{p}up_proj.weight"), TensorGroup.MLP_GATE_UP, "column")
        down = self.matrix(f"{p}down_proj", self._get(f"{p}down_proj.weight"), TensorGroup.MLP_DOWN, "row")
        return MLPWeights(gate, up, down)

    def moe(self, p: str) -> MoEWeights:
        ttnn, a = self.ttnn, self.args
        e = a.cfg.num_experts
        router = self._put(f"{p}gate", self._get(f"{p}gate.weight").t().contiguous(), a.dtype(TensorGroup.MOE_ROUTER, ttnn))
        gu = self._put(f"{p}experts.gate_up_blocks", expert_gate_up_blocks(self._get(f"{p}experts.gate_up_proj"), self.n),
                       a.dtype(TensorGroup.MLP_GATE_UP, ttnn), mapper=self.shard_cols)
        down = self._put(f"{p}experts.down_blocks", self._get(f"{p}experts.down_proj").transpose(1, 2).unsqueeze(0),
                         a.dtype(TensorGroup.MLP_DOWN, ttnn), mapper=self.shard_rows)
        shared = self.mlp(f"{p}shared_expert.")
        sg = self._put(f"{p}shared_expert_gate", self._get(f"{p}shared_expert_gate.weight").t().contiguous(),
                       a.dtype(TensorGroup.MOE_ROUTER, ttnn))
        sparsity = self._put(f"moe_sparsity_ones_{e}", torch.ones(1, 1, 1, e), ttnn.bfloat16,
                             layout=ttnn.ROW_MAJOR_LAYOUT)
        return MoEWeights(router, gu, down, shared, sg, sparsity)

    def feed_forward(self, p: str) -> MLPWeights | MoEWeights:
        """The block after the mixer: the routed-expert block for a MoE config, else the dense SwiGLU MLP."""
        return self.moe(p) if self.args.cfg.is_moe else self.mlp(p)

    def layer(self, i: int) -> LayerWeights:
        t = self.args.cfg.layer_types[i]
        p = f"layers.{i}."
        mixer = self.attention(f"{p}self_attn.") if t == FULL else self.gdn(f"{p}linear_attn.")
        return LayerWeights(t, self.norm_weight(f"{p}input_layernorm", self._get(f"{p}input_layernorm.weight"), True),
                            self.norm_weight(f"{p}post_attention_layernorm",
                                             self._get(f"{p}post_attention_layernorm.weight"), True),
                            mixer, self.feed_forward(f"{p}mlp."))

    def load(self, layers: list[int] | None = None) -> ModelWeights:
        """All weights (or only ``layers``, e.g. for a per-layer test or the cost probe)."""
        ttnn, a, c = self.ttnn, self.args, self.args.cfg
        layer_ids = list(range(c.num_hidden_layers)) if layers is None else list(layers)
        # one bar step per part with a known count (embedding, each decoder layer, the head and RoPE tables), so
        # the bar has a total; the postfix names the tensor being converted
        self.bar = tqdm(desc=f"weights -> tp{self.n} {a.precision.name}", unit="part", total=len(layer_ids) + 2,
                        disable=not self.progress, leave=False)
        emb_host = self._get("embed_tokens.weight")
        # ttnn.embedding gathers rows of a ROW_MAJOR table (so bf16/fp32 only: block floats need TILE)
        embedding = self._put("embed_tokens", emb_host, a.dtype(TensorGroup.EMBEDDING, ttnn), layout=ttnn.ROW_MAJOR_LAYOUT)
        self.bar.update()
        out = []
        for i in layer_ids:
            out.append(self.layer(i))
            self.bar.update()
        final_norm = self.norm_weight("norm", self._get("norm.weight"), zero_centred=True)
        head_rows = emb_host if c.tie_word_embeddings else self._get("lm_head.weight")
        lm_head = self.matrix("lm_head", head_rows, TensorGroup.LM_HEAD, "column")
        cos, sin = rope_tables(a.max_seq_len, c.head_dim, c.rotary_dim, c.rope_theta)
        rope_dt = a.dtype(TensorGroup.ROPE, ttnn)
        rope_cos = self._put(f"rope_cos_ropeperm_{a.max_seq_len}", cos, rope_dt, layout=ttnn.ROW_MAJOR_LAYOUT)
        rope_sin = self._put(f"rope_sin_ropeperm_{a.max_seq_len}", sin, rope_dt, layout=ttnn.ROW_MAJOR_LAYOUT)
        self.bar.update()
        self.bar.close()
        self.bar = None
        return ModelWeights(embedding, out, final_norm, lm_head, rope_cos, rope_sin)


# ---- MTP head --------------------------------------------------------------------------------------------
@dataclass
class MTPWeights:
    """``mtp.*`` on the mesh. The decoder layer ``mtp.layers.0`` is converted exactly like a target attention
    layer (same fused column-parallel qkv, row-parallel o_proj, fused MLP); embedding and LM head are the
    target's (shared)."""

    fc: Any  # [2H, H/N] column-parallel over the input [norm_e(embed(x_{t+1})) | norm_h(h_t)]
    norm_embedding: Any  # pre_fc_norm_embedding (1 + w)
    norm_hidden: Any  # pre_fc_norm_hidden (1 + w)
    final_norm: Any  # mtp.norm (1 + w)
    layer: LayerWeights  # full-attention decoder layer


def load_mtp_weights(loader: WeightLoader) -> MTPWeights:
    """Convert the ``mtp.*`` tensors (15 for a dense config; the layer's MLP is the MoE block for a MoE one) with ``loader`` (same cache directory / precision as the target).
    ``mtp.fc`` is column-parallel (see models/qwen36/tt/spec/mtp.py for why) and uses the ATTN_QKV precision, of
    the MTP head's precision (model_config.mtp_head_args) when the preset gives the head its own."""
    if not loader.reader.has_mtp:
        raise ValueError(f"{loader.reader.path}: checkpoint has no 'mtp.*' tensors (MTP head needed for drafting)")
    # the head's own precision (PrecisionSetting.mtp; the same args its TTMTPHead layer computes with)
    head_args = mtp_head_args(loader.args)
    if head_args is not loader.args:
        loader = copy.copy(loader)
        loader.args = head_args
    p = "mtp."
    lp = f"{p}layers.0."
    layer = LayerWeights(FULL, loader.norm_weight(f"{lp}input_layernorm", loader._get(f"{lp}input_layernorm.weight"), True),
                         loader.norm_weight(f"{lp}post_attention_layernorm",
                                            loader._get(f"{lp}post_attention_layernorm.weight"), True),
                         loader.attention(f"{lp}self_attn."), loader.feed_forward(f"{lp}mlp."))
    fc = loader.matrix(f"{p}fc", loader._get(f"{p}fc.weight"), TensorGroup.ATTN_QKV, "column")
    return MTPWeights(fc, loader.norm_weight(f"{p}pre_fc_norm_embedding", loader._get(f"{p}pre_fc_norm_embedding.weight"), True),
                      loader.norm_weight(f"{p}pre_fc_norm_hidden", loader._get(f"{p}pre_fc_norm_hidden.weight"), True),
                      loader.norm_weight(f"{p}norm", loader._get(f"{p}norm.weight"), True), layer)
