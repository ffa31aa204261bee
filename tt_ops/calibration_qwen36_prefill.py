"""Tenstorrent's qwen36 prefill (time to first token), restated like its decode step (calibration_qwen36.py).

A prompt of N tokens runs as passes of T rows through every layer (tt/model.py): a prompt of at most
``PREFILL_CHUNK`` tokens in one eager pass padded to the GDN chunk kernel's 128-row granularity (``layer.forward``
``chunk_size=128``: "the only size the chunk-seq prefill kernel supports"); a longer prompt as chunk-outer passes of
``PREFILL_CHUNK`` rows replayed from one captured trace ("Chunk-outer trace: one all-layer chunk captured, replayed per
chunk via DMA inputs", tt/model.py; the GDN conv of PR 53320 runs at "T=2048 per device"), the last chunk padded.
Then the final norm and the LM head on the last row tile (tt_transformers ``prefill_forward_text`` slices the last
token's tile), the logits all-gathered and read back for host sampling at TP=2.

Per pass and layer, the Blackhole prefill path of the same files: the attention/GDN norm is distributed (statistics
all-gathered) and its activation gather is fused into the in-projection (``all_gather_matmul_prefill``: one program,
one collective); the GDN conv is the native depthwise ``ttnn.conv1d`` (TILE prologue, the carry concat, the conv's
i2s/halo/move/conv chain, split in two channel halves where the per-device width exceeds 4096 (PR 53314's
channel-chunking, PR 53320: "C=5120 ... chunked 2x C=2560")); the chunked delta rule is
``ttnn.transformer.chunk_gated_delta_rule`` (the fused chunk op); the GDN out-projection is fused with its
fp32 reduce-scatter (``matmul_reduce_scatter_prefill``); the MLP norm gathers (its AG is not fused: "w1+w3 are two
consumers"), gate (SiLU fused) / up / down are 2D prefill matmuls (LoFi, fp32 Dst), then a reduce-scatter. Matmuls
record their FLOPs with their fidelity and fp32 Dst flag (``HiFi2`` for the projections, tp_common ``COMPUTE_HIFI2``;
``LoFi`` for the MLP), so the cost model's compute term applies.
"""
from __future__ import annotations

from dataclasses import dataclass

from .calibration_qwen36 import QWEN36_27B, TILE, Per, Qwen36Dims, Region, slice_programs, dram, l1, sharded
from .emulator.counters import Counts

PREFILL_CHUNK = 2048
GDN_CHUNK = 128  # the chunk-seq kernel's row granularity (tt/layer.py)
HIFI2, LOFI = 2, 1
CONV_CHANNELS_MAX = 4096  # per-device conv width that fits L1 (gdn/tp.py ``_conv1d_native_fits_l1``)


def _norm(r: Region, p: Per, t: int, gather: bool) -> None:
    """DistributedNorm in prefill: local statistics, their all-gather, the normalise; ``gather``: then the
    activation all-gather (skipped where the next matmul gathers it itself)."""
    r.op("ttnn.rms_norm_pre_all_gather", dram(1, 1, t, p.frac))
    r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * t * TILE * 4)
    r.op("ttnn.rms_norm_post_all_gather", dram(1, 1, t, p.frac), l1(1, 1, t, TILE * p.tp, dtype="FLOAT32"))
    if gather:
        r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * t * p.frac * 2)


def _agmm(r: Region, p: Per, t: int, n: int) -> None:
    """``all_gather_matmul_prefill``: the K-sharded norm output gathered inside the matmul (HiFi2, fp32 Dst) against
    the DRAM-sharded projection weight."""
    r.op("ttnn.experimental.all_gather_minimal_matmul_async", l1(1, 1, t, p.frac), sharded(p.d.hidden, n),
         work=(2 * t * p.d.hidden * n, HIFI2, True))
    r.ccl("ttnn.experimental.all_gather_minimal_matmul_async", (p.tp - 1) * t * p.frac * 2)


def gdn_prefill_mixer(r: Region, p: Per, t: int, carry: bool, last: bool) -> None:
    """``TPGatedDeltaNet.forward_prefill`` (Blackhole): fused in-projection, slices, native conv1d, chunked rule,
    state carry (``carry``: chunk-outer passes after the first) and capture (``last``), gated norm, fused
    out-projection + fp32 reduce-scatter."""
    d, c, w = p.d, p.qkv, p.qkvzab
    _agmm(r, p, t, w)
    ab_w = TILE * -(-2 * p.nv // TILE)
    for lo, hi in ((0, c), (c, c + p.vd), (c + p.vd, c + p.vd + ab_w)):
        r.op("ttnn.slice", l1(1, t, w), programs=slice_programs(lo, hi, w))
    for lo, hi in ((0, p.nv), (p.nv, 2 * p.nv)):
        r.op("ttnn.slice", l1(1, t, ab_w), programs=slice_programs(lo, hi, ab_w))
    # native conv1d, Blackhole TILE prologue: new_state (last K-1 rows), the carry/zero-pad concat, row-major
    # relayout, the conv chain per channel half, back to interleaved TILE, SiLU
    k1 = d.conv_taps - 1
    r.op("ttnn.slice", l1(1, t, c), programs=3)  # rows T-3..T: mid-tile
    r.op("ttnn.to_layout", l1(1, k1, c))
    r.op("ttnn.to_memory_config", l1(1, k1, c))
    if not carry:
        r.op("ttnn.zeros")
    r.op("ttnn.concat", dram(1, k1, c), l1(1, t, c), programs=4)  # a 3-row part: untilize both, concat, tilize
    r.op("ttnn.to_layout", dram(1, t + k1, c))
    halves = -(-c // CONV_CHANNELS_MAX)
    for _ in range(halves):
        for op in ("ttnn.interleaved_to_sharded", "ttnn.conv1d:halo", "ttnn.conv1d:move", "ttnn.conv1d"):
            r.op(op, dram(1, t + k1, c // halves))
    if halves > 1:
        r.op("ttnn.concat", l1(1, t, c // halves), l1(1, t, c // halves))
    r.op("ttnn.sharded_to_interleaved", l1(1, t, c))
    r.op("ttnn.to_layout", dram(1, t, c))
    r.op("ttnn.silu", dram(1, t, c))
    for lo, hi in ((0, p.kd), (p.kd, 2 * p.kd), (2 * p.kd, c)):
        r.op("ttnn.slice", dram(1, t, c), programs=slice_programs(lo, hi, c))
    r.op("ttnn.sigmoid", l1(1, t, p.nv))
    r.op("ttnn.add", l1(1, t, p.nv), dram(1, 1, p.nv))  # softplus(a + dt_bias), fused activation
    r.op("ttnn.multiply", dram(1, 1, p.nv), l1(1, t, p.nv))
    # the fused chunked delta rule (flat q/k/v, L2 norm and GQA in the kernel): its prep and scan programs
    dk = d.gdn_head_dim
    flops = t * p.nv * (6 * dk * dk + 4 * GDN_CHUNK * dk + 2 * GDN_CHUNK * dk)
    state = dram(1, p.nv, dk, dk, dtype="FLOAT32")
    r.op("ttnn.transformer.chunk_gated_delta_rule", dram(1, t, p.kd), dram(1, t, p.kd), dram(1, t, p.vd),
         *((state,) if carry else ()), work=(flops, HIFI2, True))
    r.op("ttnn.transformer.chunk_gated_delta_rule:prep", dram(1, t, c))
    if carry:
        r.op("ttnn.copy", state)  # final state into the persistent buffer
        r.op("ttnn.copy", dram(1, k1, c))  # conv carry
    if last:  # the decode conv window: a zero tap and the last K-1 inputs
        r.op("ttnn.copy", dram(1, 1, c))
        for _ in range(k1):
            r.op("ttnn.slice", dram(1, k1, c), programs=3)
            r.op("ttnn.reshape", l1(1, 1, c))
            r.op("ttnn.copy", l1(1, 1, c))
    # gated RMSNorm (head-major, fp32), heads to tokens, SiLU(z) gate
    r.op("ttnn.rms_norm", l1(1, p.nv, t, dk, dtype="FLOAT32"))
    r.op("ttnn.experimental.nlp_concat_heads", l1(1, p.nv, t, dk, dtype="FLOAT32"))
    r.op("ttnn.silu", dram(1, t, p.vd))
    r.op("ttnn.multiply", l1(1, t, p.vd, dtype="FLOAT32"), l1(1, t, p.vd))
    # out-projection fused with its fp32 reduce-scatter (matmul_reduce_scatter_prefill)
    r.op("ttnn.experimental.matmul_reduce_scatter_async", dram(1, 1, t, p.vd), dram(p.vd, d.hidden, dtype="BFLOAT8_B"),
         work=(2 * t * p.vd * d.hidden, HIFI2, True))
    r.ccl("ttnn.experimental.matmul_reduce_scatter_async", (p.tp - 1) * t * d.hidden * 4 // p.tp)


def attention_prefill_mixer(r: Region, p: Per, t: int, start: int) -> None:
    """``TPAttention.forward_prefill``: fused QKV+gate AG-matmul, head split, (1+w) q/k norms, partial RoPE, KV
    cache fill, causal SDPA over the cache up to ``start + t``, concat-heads, sigmoid gate, wo, reduce-scatter."""
    d = p.d
    nh, nkv, hd = p.nh, p.nkv, d.head_dim
    qkv3, gate = (nh + 2 * nkv) * hd, nh * hd
    _agmm(r, p, t, qkv3 + gate)
    r.op("ttnn.slice", dram(1, 1, t, qkv3 + gate))
    r.op("ttnn.slice", dram(1, 1, t, qkv3 + gate))
    r.op("ttnn.experimental.nlp_create_qkv_heads", l1(1, 1, t, qkv3))
    for heads in (nh, nkv):
        r.op("ttnn.rms_norm", l1(1, heads, t, hd))
        r.op("ttnn.multiply", l1(1, heads, t, hd), l1(1, 1, 1, hd))
    for heads in (nh, nkv):  # apply_partial_rope_prefill: slice, rotate, slice, concat
        r.op("ttnn.slice", l1(1, heads, t, hd))
        r.op("ttnn.experimental.rotary_embedding", l1(1, heads, t, d.rope_dim), dram(1, 1, t, d.rope_dim),
             dram(1, 1, t, d.rope_dim))
        r.op("ttnn.slice", l1(1, heads, t, hd))
        r.op("ttnn.concat", l1(1, heads, t, d.rope_dim), l1(1, heads, t, hd - d.rope_dim))
    for _ in range(nkv):  # fill_cache per KV head, K and V
        for _ in range(2):
            r.op("ttnn.slice", l1(1, nkv, t, hd))
            r.op("ttnn.fill_cache", l1(1, 1, t, hd))
    kv = TILE * -(-(start + t) // TILE)
    flops = 4 * nh * hd * (t * start + t * (t + 1) // 2)
    r.op("ttnn.transformer.scaled_dot_product_attention", l1(1, nh, t, hd), dram(1, nkv, kv, hd), dram(1, nkv, kv, hd),
         work=(flops, HIFI2, True))
    r.op("ttnn.experimental.nlp_concat_heads", dram(1, nh, t, hd))
    r.op("ttnn.sigmoid", dram(1, 1, t, gate))
    r.op("ttnn.multiply", l1(1, 1, t, gate), l1(1, 1, t, gate))
    r.op("ttnn.linear", dram(1, 1, t, gate), dram(gate, d.hidden, dtype="BFLOAT8_B"),
         work=(2 * t * gate * d.hidden, HIFI2, True))
    r.ccl("ttnn.experimental.reduce_scatter_minimal_async", (p.tp - 1) * t * d.hidden * 2 // p.tp)


def mlp_prefill(r: Region, p: Per, t: int) -> None:
    """``Qwen36MLP._forward_tp`` in prefill: 2D prefill matmuls (LoFi, fp32 Dst) on the interleaved weights, gate with
    SiLU fused, outputs in L1; the product; down; the reduce-scatter."""
    d = p.d
    for _ in range(2):
        r.op("ttnn.linear", dram(1, 1, t, d.hidden), dram(d.hidden, p.ff, dtype="BFLOAT4_B"),
             work=(2 * t * d.hidden * p.ff, LOFI, True))
    r.op("ttnn.mul", l1(1, 1, t, p.ff), l1(1, 1, t, p.ff))
    r.op("ttnn.linear", l1(1, 1, t, p.ff), dram(p.ff, d.hidden, dtype="BFLOAT8_B"),
         work=(2 * t * p.ff * d.hidden, LOFI, True))
    r.ccl("ttnn.experimental.reduce_scatter_minimal_async", (p.tp - 1) * t * d.hidden * 2 // p.tp)


def prefill_layer(kind: str, p: Per, t: int, start: int, carry: bool, last: bool) -> Region:
    r = Region(f"{kind} layer")
    _norm(r, p, t, gather=False)  # gathered inside the in-projection
    if kind == "gdn":
        gdn_prefill_mixer(r, p, t, carry, last)
    else:
        attention_prefill_mixer(r, p, t, start)
    r.op("ttnn.add", dram(1, 1, t, p.frac), dram(1, 1, t, p.frac))
    _norm(r, p, t, gather=True)
    mlp_prefill(r, p, t)
    r.op("ttnn.add", dram(1, 1, t, p.frac), dram(1, 1, t, p.frac))
    return r


def prefill_head(p: Per) -> Region:
    """The last row tile: final norm, the vocab-sharded LM head, the logits gathered for host sampling."""
    r = Region("head")
    r.op("ttnn.slice", dram(1, 1, TILE, p.frac))
    r.op("ttnn.rms_norm_pre_all_gather", dram(1, 1, TILE, p.frac))
    r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * TILE * TILE * 4)
    r.op("ttnn.rms_norm_post_all_gather", dram(1, 1, TILE, p.frac))
    r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * TILE * p.frac * 2)
    r.op("ttnn.linear", l1(1, 1, TILE, p.d.hidden), dram(p.d.hidden, p.vocab, dtype="BFLOAT8_B"),
         work=(2 * TILE * p.d.hidden * p.vocab, HIFI2, True))
    if p.tp > 1:
        r.ccl("ttnn.experimental.all_gather_async", (p.tp - 1) * TILE * p.vocab * 2)
    return r


@dataclass
class PrefillPass:
    """One pass of ``rows`` rows at ``start``: its counts (embed + layers), and whether it ran eagerly."""

    rows: int
    start: int
    eager: bool
    counts: Counts


@dataclass
class TTQwen36Prefill:
    tp: int
    prompt: int
    passes: list
    head: Counts
    readback_bytes: int


def tt_qwen36_prefill(tp: int, prompt: int, dims: Qwen36Dims = QWEN36_27B) -> TTQwen36Prefill:
    """Time-to-first-token work of Tenstorrent's qwen36 for a prompt of ``prompt`` tokens at ``tp`` devices (B = 1)."""
    if prompt < 1:
        raise ValueError(f"prompt {prompt} must be at least 1 token")
    p = Per(dims, tp)
    if prompt <= PREFILL_CHUNK:
        plan = [(GDN_CHUNK * -(-prompt // GDN_CHUNK), 0, True)]
    else:
        n = -(-prompt // PREFILL_CHUNK)
        plan = [(PREFILL_CHUNK, i * PREFILL_CHUNK, False) for i in range(n)]
    passes = []
    for i, (rows, start, eager) in enumerate(plan):
        c = Counts(f"prefill pass {i}: {rows} rows at {start}")
        emb = Region("embed")
        emb.op("ttnn.embedding", dram(1, rows, p.frac))
        c.add(emb.counts)
        carry, last = (not eager) and i > 0, i == len(plan) - 1
        c.add(prefill_layer("gdn", p, rows, start, carry, last).counts, dims.gdn_layers)
        c.add(prefill_layer("attention", p, rows, start, carry, last).counts, dims.attention_layers)
        passes.append(PrefillPass(rows, start, eager, c))
    return TTQwen36Prefill(tp, prompt, passes, prefill_head(p).counts, TILE * dims.vocab * 2)


__all__ = ["PREFILL_CHUNK", "PrefillPass", "TTQwen36Prefill", "tt_qwen36_prefill"]
