"""Tenstorrent's own Qwen3.6-27B decode step and prefill, restated as emulator counts, for pinning the calibrated
cost model to a hybrid Gated-DeltaNet model measured on the cards this project targets.

The code restated is tt-metal ``models/demos/blackhole/qwen36`` (``tt/layer.py``, ``tt/gdn/tp.py``,
``tt/attention/tp.py``, ``tt/mlp.py``, ``tt/model.py``, ``tt/tp_common.py`` and the recurrence it calls,
``models/experimental/gated_attention_gated_deltanet/tt/ttnn_delta_rule_ops.py``), on its Blackhole decode path
before the fused GDN decode: the measurements pinned here (2x P150a, tt-metal v0.77.0-rc1 with PRs 53314/53319/53320,
2026-08-24; tenstorrent/vllm issue 442, 2026-08-25) predate it. The fused decode (KDA conv + chunk rule + gated norm)
arrived later: tt-metal ``QWEN38_OPTIMIZATION_LOG.md`` row 1.2 (2026-10) replaces the "~69 small ops/layer" chain
restated below (34.04 -> 30.88 ms/token at TP=4). Every op call below is one call of that code with its shapes; each
becomes programs (reshape views and unaligned tiled slices follow the emulator's rules, ``emulator/programs.py``),
bytes read per device (tile-accurate, by dtype and placement: DRAM-interleaved is charged, L1 is free) and
collectives, in the same :class:`Counts` the emulator fills, charged by the same
:class:`~qwen36.tt_ops.cost_model.CalibratedP150aModel` as our own decode. Nothing here is a typed-in total.

What the index let us read is not the exact tree of the measurement (the files carry hundreds of versions; the commits
read are in ``SOURCES``): later versions than 2026-08 whose Blackhole decode branch their own comments keep
"byte-identical" (Wormhole-only changes are gated off on Blackhole). The per-layer counts agree with Tenstorrent's
own count of that tree's programs (``QWEN38_OPTIMIZATION_PLAN.md``: "~69 small ops/layer" in the GDN chain, "A ~45
device ops" per attention layer, "2 CCLs/layer instead of 4 (AG + RS x2)").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .emulator.counters import Counts

TILE = 32
P150_DRAM_BANKS = 8

# tt-metal files read, at the commit the index stored (read for facts; no code copied)
SOURCES = {
    "models/demos/blackhole/qwen36/tt/gdn/tp.py": "00c023afa53f9bf3793bb395f62a38be16adab91",
    "models/demos/blackhole/qwen36/tt/attention/tp.py": "01c6e8ed4a20a142e6eacf0b94cd217c4b7d9fec",
    "models/demos/blackhole/qwen36/tt/layer.py": "002e83d4d0f4da3622aca7307230b15045d48fbd",
    "models/demos/blackhole/qwen36/tt/mlp.py": "0740b8081708b3af60442c9463955e3ba5aa3f81",
    "models/demos/blackhole/qwen36/tt/model.py": "015056e66cf13d87a2b18471a4e06c68090b576f",
    "models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_PLAN.md": "755a0d6461d0cb15a1c746e6e935d22331bf1796",
    "models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_LOG.md": "755a0d6461d0cb15a1c746e6e935d22331bf1796",
    "models/demos/blackhole/qwen36/BENCHMARKS.md": "2cc3a626aab9c8045bc862a2f442c260f4f2e880",
}


@dataclass(frozen=True)
class Qwen36Dims:
    """Qwen3.6-27B (= Qwen3.8-27B) text model."""

    hidden: int = 5120
    intermediate: int = 17408
    layers: int = 64
    attention_every: int = 4  # layers 3, 7, ... are full attention
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    rope_dim: int = 64
    gdn_k_heads: int = 16
    gdn_v_heads: int = 48
    gdn_head_dim: int = 128
    conv_taps: int = 4
    vocab: int = 248320

    @property
    def attention_layers(self) -> int:
        return self.layers // self.attention_every

    @property
    def gdn_layers(self) -> int:
        return self.layers - self.attention_layers


QWEN36_27B = Qwen36Dims()


@dataclass(frozen=True)
class Per:
    """Per-device dims at tensor parallel ``tp`` (tt/model_config.py ``_init_tp_config``)."""

    d: Qwen36Dims
    tp: int

    def __post_init__(self):
        if self.tp not in (1, 2, 4, 8) or self.d.gdn_v_heads % self.tp or self.d.heads % self.tp:
            raise ValueError(f"tensor parallel {self.tp} does not divide the 27B's heads (1, 2, 4 or 8)")

    nk = property(lambda s: s.d.gdn_k_heads // s.tp)
    nv = property(lambda s: s.d.gdn_v_heads // s.tp)
    kd = property(lambda s: s.nk * s.d.gdn_head_dim)
    vd = property(lambda s: s.nv * s.d.gdn_head_dim)
    qkv = property(lambda s: 2 * s.kd + s.vd)
    qkvzab = property(lambda s: s.qkv + s.vd + 2 * s.nv)
    nh = property(lambda s: s.d.heads // s.tp)
    nkv = property(lambda s: max(1, s.d.kv_heads // s.tp))
    ff = property(lambda s: s.d.intermediate // s.tp)
    vocab = property(lambda s: s.d.vocab // s.tp)
    frac = property(lambda s: s.d.hidden // s.tp)


def _tile_bytes(shape, dtype: str) -> int:
    from .emulator.tensor import shard_bytes
    from .emulator.ttnn_import import ttnn

    return shard_bytes(list(shape), getattr(ttnn, dtype.lower()), ttnn.TILE_LAYOUT)


def _reshape_programs(old, new) -> int:
    from .emulator.programs import reshape_is_view
    from .emulator.ttnn_import import ttnn

    return 0 if reshape_is_view(list(old), list(new), ttnn.TILE_LAYOUT) else 1


def slice_programs(start: int, end: int, extent: int) -> int:
    """A tiled slice along the last dim: one program when its bounds are tile-aligned (or end at the extent), else
    untilize + slice + tilize (emulator/programs.py; tt-metal gdn/tp.py ``_project_qkvzab`` notes the same
    untilize for the mid-tile a/b slices)."""
    ok = start % TILE == 0 and (end % TILE == 0 or end == extent)
    return 1 if ok else 3


@dataclass(frozen=True)
class Read:
    """One input of an op call: a tile-layout tensor, where it lives (``dram`` interleaved, ``l1``, ``dram_sharded``
    over the 8 banks) and its dtype."""

    shape: tuple
    dtype: str = "BFLOAT16"
    place: str = "dram"

    @property
    def key(self) -> str:
        return {"dram": self.dtype, "l1": f"{self.dtype}@l1",
                "dram_sharded": f"{self.dtype}@dram_sharded/{P150_DRAM_BANKS}"}[self.place]

    @property
    def nbytes(self) -> int:
        if self.place == "dram_sharded":
            from .calibration_workloads import dram_sharded_weight_bytes

            return dram_sharded_weight_bytes(*self.shape, self.dtype)
        return _tile_bytes(self.shape, self.dtype)


def dram(*shape, dtype: str = "BFLOAT16") -> Read:
    return Read(tuple(shape), dtype, "dram")


def l1(*shape, dtype: str = "BFLOAT16") -> Read:
    return Read(tuple(shape), dtype, "l1")


def sharded(k: int, n: int, dtype: str = "BFLOAT8_B") -> Read:
    """A [k, n] weight width-sharded over the DRAM banks (tt/model_config.py ``create_dram_sharded_mem_config``)."""
    return Read((k, n), dtype, "dram_sharded")


@dataclass
class Region:
    """One region of a restated step (embed, a layer of each kind, head): its counts, built op by op."""

    name: str
    counts: Counts = field(default=None)

    def __post_init__(self):
        self.counts = Counts(self.name)

    def op(self, name: str, *reads: Read, programs: int = 1, work: tuple | None = None) -> None:
        read: dict = {}
        for r in reads:
            read[r.key] = read.get(r.key, 0) + r.nbytes
        self.counts.add_op(name, read, {}, programs=programs, work=work)

    def ccl(self, name: str, sent_bytes: int) -> None:
        self.counts.add_op(name, {}, {}, collective_bytes=int(sent_bytes))


# ---- decode (one traced step, B users at one row tile) --------------------------------------------------------
def _rows(batch: int) -> int:
    return TILE * -(-batch // TILE)


def norm_block(r: Region, p: Per, m: int) -> None:
    """tt_transformers DistributedNorm in decode (tt/layer.py ``_make_norm``): the fractured residual is
    all-gathered into the norm's sharded input, then the sharded RMSNorm (+1 offset folded into its weight)."""
    r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * m * p.frac * 2)
    r.op("ttnn.rms_norm", l1(1, 1, m, p.d.hidden))


def residual_add(r: Region, p: Per, m: int) -> None:
    """``h = ttnn.add(x, attn_output)``: the fractured residual and the reduce-scattered block output (DRAM)."""
    r.op("ttnn.add", dram(1, 1, m, p.frac), dram(1, 1, m, p.frac))


def reduce_scatter(r: Region, p: Per, m: int, width: int) -> None:
    """tt_transformers ``tt_all_reduce`` on a 1xN mesh: ``reduce_scatter_minimal_async`` to the fractured hidden."""
    r.ccl("ttnn.experimental.reduce_scatter_minimal_async", (p.tp - 1) * m * width * 2 // p.tp)


def matmul_1d(r: Region, x: Read, k: int, n: int, dtype: str, *, sharded_input: bool = True) -> None:
    """tp_common ``matmul_1d_decode``: ``to_memory_config`` of the K-sharded activation to L1 interleaved (a no-op
    when it already is), then a 1D-mcast linear on the interleaved weight (model_config ``proj_1d_decode`` /
    ``mlp_1d_decode``, the default decode matmuls)."""
    if sharded_input:
        r.op("ttnn.to_memory_config", x)
    r.op("ttnn.linear", Read(x.shape, x.dtype, "l1"), dram(k, n, dtype=dtype))


def gdn_decode_mixer(r: Region, p: Per, batch: int) -> None:
    """``TPGatedDeltaNet.forward_decode`` (Blackhole branch, high-precision recurrence) and the recurrence it calls
    (``recurrent_gated_delta_rule_decode_ttnn``), up to and including the out-projection's reduce-scatter."""
    m, b, d = _rows(batch), batch, p.d
    nk, nv, dk, c = p.nk, p.nv, d.gdn_head_dim, p.qkv
    x = l1(1, 1, m, d.hidden)
    # _project_qkvzab: one [qkv|z|a|b] matmul, then slices (a/b end mid-tile: from a tile-aligned block)
    matmul_1d(r, x, d.hidden, p.qkvzab, "BFLOAT8_B")
    out = (1, m, p.qkvzab)
    for lo, hi in ((0, c), (c, c + p.vd), (c + p.vd, c + p.vd + TILE * -(-2 * nv // TILE))):
        r.op("ttnn.slice", l1(*out), programs=slice_programs(lo, hi, p.qkvzab))
    ab_w = TILE * -(-2 * nv // TILE)
    for lo, hi in ((0, nv), (nv, 2 * nv)):
        r.op("ttnn.slice", l1(1, m, ab_w), programs=slice_programs(lo, hi, ab_w))
    # conv: shift register (4 in-place copies of the DRAM conv states), then multiply + 3 x mac (each a multiply and
    # an add on the device: "7 BinaryNg ops for these 4 calls") + SiLU
    st = dram(1, m, c)
    for _ in range(d.conv_taps - 1):
        r.op("ttnn.copy", st)
    r.op("ttnn.copy", l1(1, m, c))
    taps = dram(1, 1, c)
    r.op("ttnn.multiply", st, taps)
    for _ in range(d.conv_taps - 1):
        r.op("ttnn.multiply", st, taps)
        r.op("ttnn.add", l1(1, m, c), l1(1, m, c))
    r.op("ttnn.silu", l1(1, m, c))
    # q/k/v slices, head reshapes, GQA expand, recurrence-input reshapes
    for lo, hi, heads, hd in ((0, p.kd, nk, dk), (p.kd, 2 * p.kd, nk, dk), (2 * p.kd, c, nv, dk)):
        r.op("ttnn.slice", l1(1, m, c), programs=slice_programs(lo, hi, c))
        r.op("ttnn.reshape", l1(1, m, hi - lo), programs=_reshape_programs((1, b, hi - lo), (b, heads, hd)))
    for _ in range(2):
        r.op("ttnn.repeat_interleave", l1(b, nk, dk))
    for hd in (dk, dk, dk):
        r.op("ttnn.reshape", l1(b, nv, hd), programs=_reshape_programs((b, nv, hd), (b, 1, nv, hd)))
    r.op("ttnn.sigmoid", l1(1, m, nv))
    r.op("ttnn.reshape", l1(1, m, nv), programs=_reshape_programs((1, b, nv), (b, 1, nv)))
    r.op("ttnn.add", l1(1, m, nv), dram(1, 1, nv))  # a + dt_bias with the softplus activation fused
    r.op("ttnn.multiply", dram(1, 1, nv), l1(1, m, nv))  # -exp(A) * softplus(...)
    r.op("ttnn.reshape", l1(1, m, nv), programs=_reshape_programs((1, b, nv), (b, 1, nv)))
    _recurrence(r, p, batch)
    # the recurrence's new state copied into the trace's fixed state buffer
    r.op("ttnn.copy", dram(b, nv, dk, dk, dtype="FLOAT32"))
    # gated RMSNorm + SiLU(z) gate, out-projection, reduce-scatter
    r.op("ttnn.reshape", l1(b, 1, nv, dk), programs=_reshape_programs((b, 1, nv, dk), (b, nv, dk)))
    r.op("ttnn.rms_norm", dram(b, nv, dk, dtype="FLOAT32"))
    r.op("ttnn.reshape", l1(b, nv, dk), programs=_reshape_programs((b, nv, dk), (1, b, p.vd)))
    r.op("ttnn.silu", l1(1, m, p.vd))
    r.op("ttnn.multiply", l1(1, m, p.vd), l1(1, m, p.vd))
    matmul_1d(r, l1(1, m, p.vd), p.vd, d.hidden, "BFLOAT8_B", sharded_input=False)
    reduce_scatter(r, p, m, d.hidden)


def _recurrence(r: Region, p: Per, b: int) -> None:
    """``recurrent_gated_delta_rule_decode_ttnn(high_precision=True)``: fp32 inputs, L2 norms, decay, read, delta,
    outer-product write (``fused_decay_and_write_ttnn``), query; the fp32 state [B, Nv, 128, 128] lives in DRAM."""
    nv, k = p.nv, p.d.gdn_head_dim
    qk = l1(b, 1, nv, k)
    for _ in range(3):
        r.op("ttnn.typecast", qk)  # q, k, v
    for _ in range(2):
        r.op("ttnn.typecast", l1(b, 1, nv))  # beta, g
    f = "FLOAT32"
    for _ in range(2):  # l2_norm_ttnn(q), (k): multiply, sum, add eps, rsqrt, multiply
        r.op("ttnn.multiply", l1(b, 1, nv, k, dtype=f), l1(b, 1, nv, k, dtype=f))
        r.op("ttnn.sum", l1(b, 1, nv, k, dtype=f))
        r.op("ttnn.add", l1(b, 1, nv, 1, dtype=f))
        r.op("ttnn.rsqrt", l1(b, 1, nv, 1, dtype=f))
        r.op("ttnn.multiply", l1(b, 1, nv, k, dtype=f), l1(b, 1, nv, 1, dtype=f))
    r.op("ttnn.multiply", l1(b, 1, nv, k, dtype=f))  # q * scale
    for _ in range(2):  # q_row, k_row [B, H, 1, K] in DRAM
        r.op("ttnn.reshape", l1(b, 1, nv, k, dtype=f), programs=_reshape_programs((b, 1, nv, k), (b, nv, 1, k)))
    r.op("ttnn.reshape", l1(b, 1, nv, k, dtype=f), programs=_reshape_programs((b, 1, nv, k), (b, nv, k)))  # v_t
    for _ in range(2):  # beta_t, g_t [B, H]
        r.op("ttnn.reshape", l1(b, 1, nv, dtype=f), programs=_reshape_programs((b, 1, nv), (b, nv)))
    r.op("ttnn.exp", l1(b, nv, dtype=f))
    h = dram(b, nv, k, k, dtype=f)
    r.op("ttnn.reshape", l1(b, nv, dtype=f), programs=_reshape_programs((b, nv), (b, nv, 1, 1)))
    r.op("ttnn.multiply", h, l1(b, nv, 1, 1, dtype=f))  # decay
    r.op("ttnn.matmul", dram(b, nv, 1, k, dtype=f), h)  # v_read = k @ h
    r.op("ttnn.reshape", dram(b, nv, 1, k, dtype=f), programs=_reshape_programs((b, nv, 1, k), (b, nv, k)))
    r.op("ttnn.subtract", l1(b, nv, k, dtype=f), dram(b, nv, k, dtype=f))
    r.op("ttnn.reshape", dram(b, nv, 1, k, dtype=f), programs=_reshape_programs((b, nv, 1, k), (b, nv, k)))
    # fused_decay_and_write_ttnn(apply_decay=False): decay/beta/k/delta reshapes, delta to DRAM, outer, beta, add
    r.op("ttnn.reshape", l1(b, nv, dtype=f), programs=_reshape_programs((b, nv), (b, nv, 1, 1)))
    r.op("ttnn.reshape", l1(b, nv, dtype=f), programs=_reshape_programs((b, nv), (b, nv, 1, 1)))
    r.op("ttnn.reshape", dram(b, nv, k, dtype=f), programs=_reshape_programs((b, nv, k), (b, nv, k, 1)))
    r.op("ttnn.reshape", l1(b, nv, k, dtype=f), programs=_reshape_programs((b, nv, k), (b, nv, 1, k)))
    r.op("ttnn.to_memory_config", l1(b, nv, 1, k, dtype=f))
    r.op("ttnn.matmul", dram(b, nv, k, 1, dtype=f), dram(b, nv, 1, k, dtype=f))  # outer = k (x) delta
    r.op("ttnn.multiply", dram(b, nv, k, k, dtype=f), l1(b, nv, 1, 1, dtype=f))  # * beta
    r.op("ttnn.add", h, dram(b, nv, k, k, dtype=f))  # h + outer
    r.op("ttnn.matmul", dram(b, nv, 1, k, dtype=f), h)  # o = q @ h
    r.op("ttnn.reshape", dram(b, nv, 1, k, dtype=f), programs=_reshape_programs((b, nv, 1, k), (b, 1, nv, k)))


def attention_decode_mixer(r: Region, p: Per, batch: int, context: int) -> None:
    """``TPAttention.forward_decode`` on the paged path (Blackhole: q-gate applied before concat-heads, the partial
    RoPE chain, pad-then-reshard KV write), bf16 paged KV (``QWEN_SDPA_BF8`` off, the default), every user at
    position ``context - 1``."""
    m, b, d = _rows(batch), batch, p.d
    nh, nkv, hd = p.nh, p.nkv, d.head_dim
    qkv3, gate = (nh + 2 * nkv) * hd, nh * hd
    matmul_1d(r, l1(1, 1, m, d.hidden), d.hidden, qkv3 + gate, "BFLOAT8_B")  # output DRAM
    r.op("ttnn.slice", dram(1, 1, m, qkv3 + gate))  # [q|k|v]
    r.op("ttnn.slice", dram(1, 1, m, qkv3 + gate))  # gate
    # _make_heads_decode: qkv to L1 (tt-metal #16667), head split, q/k/v back to L1 interleaved
    r.op("ttnn.to_memory_config", dram(1, 1, m, qkv3))
    r.op("ttnn.experimental.nlp_create_qkv_heads_decode", l1(1, 1, m, qkv3))
    for _ in range(3):  # q, k, v
        r.op("ttnn.sharded_to_interleaved", l1(1, b, TILE, hd))
    r.op("ttnn.reshape", dram(1, 1, m, gate), programs=_reshape_programs((1, 1, b, gate), (1, b, nh, hd)))
    for heads in (nh, nkv):  # _qk_norm on Blackhole: rms_norm then the (1+w) multiply
        r.op("ttnn.rms_norm", l1(1, b, heads, hd))
        r.op("ttnn.multiply", l1(1, b, heads, hd), l1(1, 1, 1, hd))
    # apply_partial_rope_decode for q and k: "fourteen" device ops (attention/tp.py ``_rope_decode``): per tensor
    # the cos/sin shards, the rotary and pass-through slices, the reshard onto the rotary grid, the rotary, back to
    # interleaved and the concat
    for heads in (nh, nkv):
        for op in ("ttnn.to_memory_config", "ttnn.to_memory_config"):  # cos, sin shards
            r.op(op, dram(1, b, TILE, d.rope_dim))
        r.op("ttnn.slice", l1(1, b, heads, hd))
        r.op("ttnn.slice", l1(1, b, heads, hd))
        r.op("ttnn.to_memory_config", l1(1, b, heads, d.rope_dim))
        r.op("ttnn.experimental.rotary_embedding_llama", l1(1, b, heads, d.rope_dim))
        r.op("ttnn.concat", l1(1, b, heads, d.rope_dim), l1(1, b, heads, hd - d.rope_dim))
    # KV write: pad to [1, B, 32, HD], reshard onto the update grid, paged_update_cache (reads the row tile it
    # touches per KV head and user)
    for _ in range(2):
        r.op("ttnn.pad", l1(1, b, nkv, hd))
        r.op("ttnn.to_memory_config", l1(1, b, TILE, hd))
        r.op("ttnn.experimental.paged_update_cache", dram(b * nkv, 1, TILE, hd))
    # paged SDPA decode: each user's K and V blocks up to its position (bf16 cache)
    kv_rows = TILE * -(-context // TILE)
    r.op("ttnn.transformer.paged_scaled_dot_product_attention_decode", l1(1, b, nh, hd),
         dram(b * nkv, 1, kv_rows, hd), dram(b * nkv, 1, kv_rows, hd))
    # sigmoid gate (Blackhole: before concat-heads), concat-heads to one row tile, back to B rows
    r.op("ttnn.sigmoid", l1(1, b, nh, hd))
    r.op("ttnn.multiply", l1(1, b, nh, hd), l1(1, b, nh, hd))
    r.op("ttnn.to_memory_config", l1(1, b, nh, hd))
    r.op("ttnn.experimental.nlp_concat_heads_decode", l1(1, b, TILE, hd))
    r.op("ttnn.sharded_to_interleaved", l1(1, 1, TILE, gate))
    if b != m:
        r.op("ttnn.slice", l1(1, 1, TILE, gate), programs=3)  # rows 0..B of the padded 32 (mid-tile end)
    matmul_1d(r, l1(1, 1, m, gate), gate, d.hidden, "BFLOAT8_B", sharded_input=False)
    reduce_scatter(r, p, m, d.hidden)


def mlp_decode(r: Region, p: Per, batch: int, gate_up_dtype: str = "BFLOAT4_B") -> None:
    """``Qwen36MLP._forward_tp`` on the 1D-decode path (model_config ``mlp_1d_decode``, interleaved weights): the
    norm output interleaved once, gate (SiLU fused) and up at bfloat4_b, their product, down at bfloat8_b, the
    reduce-scatter."""
    m, d = _rows(batch), p.d
    x = l1(1, 1, m, d.hidden)
    r.op("ttnn.to_memory_config", x)
    r.op("ttnn.linear", x, dram(d.hidden, p.ff, dtype=gate_up_dtype))
    r.op("ttnn.linear", x, dram(d.hidden, p.ff, dtype=gate_up_dtype))
    r.op("ttnn.mul", l1(1, 1, m, p.ff), l1(1, 1, m, p.ff))
    r.op("ttnn.linear", l1(1, 1, m, p.ff), dram(p.ff, d.hidden, dtype="BFLOAT8_B"))
    reduce_scatter(r, p, m, d.hidden)


def decode_layer(kind: str, p: Per, batch: int, context: int) -> Region:
    """One decoder layer (tt/layer.py ``forward``, decode): norm, mixer, residual add, norm, MLP, residual add."""
    r = Region(f"{kind} layer")
    m = _rows(batch)
    norm_block(r, p, m)
    if kind == "gdn":
        gdn_decode_mixer(r, p, batch)
    else:
        attention_decode_mixer(r, p, batch, context)
    residual_add(r, p, m)
    norm_block(r, p, m)
    mlp_decode(r, p, batch)
    residual_add(r, p, m)
    return r


def decode_embed(p: Per, batch: int) -> Region:
    """tt_transformers ``Embedding`` on the mesh: one row of the hidden-sharded table per token, fractured out."""
    r = Region("embed")
    r.op("ttnn.embedding", dram(1, p.frac))
    return r


def on_device_sampling(p: Per) -> bool:
    """tt/model.py: on-device sampling only on 1x4 / 1x8 meshes, where vocab / TP fits Top-K's 64K shard limit."""
    return p.tp in (4, 8) and p.vocab <= 64 * 1024


def decode_head(p: Per, batch: int) -> Region:
    """Final DistributedNorm, the vocab-sharded LM head (one bfloat8_b interleaved weight per device, tt/model.py);
    then either the logits all-gathered for host sampling (TP=2: on-device sampling is refused below TP=4) or the
    greedy pick on device (``force_argmax``: a local argmax, one all-gather of the candidates, the final argmax)."""
    r = Region("head")
    m = _rows(batch)
    norm_block(r, p, m)
    matmul_1d(r, l1(1, 1, m, p.d.hidden), p.d.hidden, p.vocab, "BFLOAT8_B")
    if on_device_sampling(p):
        r.op("ttnn.argmax", l1(1, 1, m, p.vocab))
        r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * m * TILE * 4)
        r.op("ttnn.argmax", l1(1, 1, m, TILE * p.tp))
    elif p.tp > 1:
        r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * m * p.vocab * 2)
    return r


@dataclass
class TTQwen36Decode:
    """A restated decode step: its regions (per-token = embed + gdn x G + attention x A + head) and the host part of a
    step of Tenstorrent's demo loop (logits read back for host sampling)."""

    tp: int
    batch: int
    context: int
    regions: dict
    layers: dict  # region name -> times per step
    readback_bytes: int

    @property
    def counts(self) -> Counts:
        total = Counts(f"tt-qwen36 decode, TP={self.tp}, B={self.batch}, context {self.context}")
        for name, reg in self.regions.items():
            total.add(reg.counts, self.layers[name])
        return total


def tt_qwen36_decode(tp: int, batch: int, context: int, dims: Qwen36Dims = QWEN36_27B) -> TTQwen36Decode:
    """One decode step of Tenstorrent's qwen36 at ``tp`` devices, ``batch`` users each at position ``context - 1``."""
    if not 1 <= batch <= TILE:
        raise ValueError(f"batch {batch}: the restated decode runs B users in one row tile (1..32)")
    if context < 1:
        raise ValueError(f"context {context} must be at least 1")
    p = Per(dims, tp)
    regions = {"embed": decode_embed(p, batch), "gdn layer": decode_layer("gdn", p, batch, context),
               "attention layer": decode_layer("attention", p, batch, context), "head": decode_head(p, batch)}
    layers = {"embed": 1, "gdn layer": dims.gdn_layers, "attention layer": dims.attention_layers, "head": 1}
    # the gathered bf16 logits, one device's copy (host sampling), or one token per user
    readback = 4 * TILE if on_device_sampling(p) else _rows(batch) * dims.vocab * 2
    return TTQwen36Decode(tp, batch, context, regions, layers, readback)


def gdn_mixer_counts(tp: int, batch: int = 1, dims: Qwen36Dims = QWEN36_27B) -> Counts:
    """The GDN mixer alone (the in-projection's reshard through the out-projection's reduce-scatter): what
    tenstorrent/vllm issue 442's per-layer Tracy figure covers."""
    r = Region("gdn mixer")
    gdn_decode_mixer(r, Per(dims, tp), batch)
    return r.counts


__all__ = ["QWEN36_27B", "Per", "Qwen36Dims", "Read", "Region", "SOURCES", "TTQwen36Decode", "gdn_mixer_counts",
           "tt_qwen36_decode"]
