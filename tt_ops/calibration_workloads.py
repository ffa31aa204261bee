"""Published Blackhole decode workloads restated as emulator counts, for pinning the calibrated cost model.

Each workload is built from its model's shapes and its program list, into the same :class:`Counts` the emulator
fills (programs per op name, bytes read per dtype and placement), and charged by the same
:class:`~qwen36.tt_ops.cost_model.CalibratedP150aModel` as our own decode. Nothing here is a typed-in total.

Llama-3.1-8B on one P150 (tt-metal ``models/tt_transformers``, traced decode), the anchors:

* tt-metal PR 55080 ("Speed up Llama 3.1 8B decode on P150", ``simple_text_demo.py``, batch 32): average decode
  time 30.53 ms with one DRAM reader per bank ("Main"), 23.76 ms with two readers for QKV, attention output,
  gate/up and down ("This PR"; the LM head keeps one);
* tt-metal ``models/tt_transformers/PERF.md``: 33.6 t/s/u at batch 1 on P150 (bfp4 MLP / bfp8 attention,
  generation 200): 29.76 ms per step, one reader per bank (it predates PR 54242's multi-reader option).

Program list of one decoder layer on one device, restated from reading ``models/tt_transformers/tt/attention.py``
(``forward_decode``), ``mlp.py`` (``forward``, decode mode) and ``decoder.py``; on a 1x1 mesh ``tt_all_reduce`` /
``tt_all_gather`` return their input (no program). ``ttnn.reshape`` calls there are views (no program).
Bytes: DRAM-sharded weights over the 8 banks as the emulator counts them (whole padded bank shards, tile-accurate
block-float bytes: :func:`~qwen36.tt_ops.emulator.tensor.shard_bytes`); activations live in L1 (width-/height-
sharded: not charged); the paged KV cache is bfloat8_b (``attention.py`` allocates it so) and SDPA decode reads each
user's K and V blocks up to its position; ``paged_update_cache`` reads one row tile per KV head and user.
Context of the batch-32 demo: 128-token prompts (``input_data_questions_prefill_128.json``) and 200 generated tokens,
so the mean attended context is 228 positions (an assumption stated here; 128-328 spans the run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .emulator.counters import Counts
from .emulator.tensor import shard_bytes

TILE = 32
P150_DRAM_BANKS = 8


@dataclass(frozen=True)
class DecoderShapes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lm_head_splits: int
    kv_block: int = 32


LLAMA31_8B = DecoderShapes(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                           vocab=128256, lm_head_splits=4)

# (op name, programs) per decoder layer, in call order (module doc)
LLAMA_LAYER_PROGRAMS = (
    ("ttnn.rms_norm", 1),                                            # attention_norm
    ("ttnn.linear", 1),                                              # wqkv, DRAM-sharded
    ("ttnn.sharded_to_interleaved", 1),                              # qkv -> L1 interleaved for the head split
    ("ttnn.experimental.nlp_create_qkv_heads_decode", 1),
    ("ttnn.experimental.rotary_embedding_llama", 2),                 # q, k
    ("ttnn.experimental.paged_update_cache", 2),                     # k, v
    ("ttnn.transformer.paged_scaled_dot_product_attention_decode", 1),
    ("ttnn.to_memory_config", 1),                                    # SDPA output -> concat-heads input
    ("ttnn.experimental.nlp_concat_heads_decode", 1),
    ("ttnn.matmul", 1),                                              # wo, DRAM-sharded
    ("ttnn.to_memory_config", 1),                                    # -> DECODE_RESIDUAL_MEMCFG
    ("ttnn.add", 1),                                                 # residual
    ("ttnn.rms_norm", 1),                                            # ff_norm
    ("ttnn.linear", 2),                                              # w1, w3, DRAM-sharded
    ("ttnn.mul", 1),                                                 # silu(w1) * w3
    ("ttnn.to_memory_config", 1),                                    # w2 input grid
    ("ttnn.linear", 1),                                              # w2, DRAM-sharded
    ("ttnn.to_memory_config", 1),                                    # MLP output memory config
    ("ttnn.add", 1),                                                 # residual
)


def llama_step_programs(shapes: DecoderShapes) -> tuple:
    """Programs outside the layers: token embedding + reshard to the residual layout, the RoPE cos/sin lookups, the
    final norm, the LM head in ``lm_head_splits`` DRAM-sharded matmuls each resharded out, their concat, argmax."""
    s = shapes.lm_head_splits
    return (("ttnn.embedding", 1), ("ttnn.to_memory_config", 1), ("ttnn.embedding", 2), ("ttnn.rms_norm", 1),
            ("ttnn.linear", s), ("ttnn.to_memory_config", s), ("ttnn.concat", 1), ("ttnn.argmax", 1))


def dram_sharded_weight_bytes(k: int, n: int, dtype: str, banks: int = P150_DRAM_BANKS) -> int:
    """Bytes the emulator counts for a [k, n] weight width-sharded over ``banks`` DRAM banks (padded bank shards:
    tt/model/model_config.py ``dram_sharded_weight_memory_config``, emulator/namespace.py ``_read_bytes_of``)."""
    w = -(-n // (TILE * banks)) * TILE
    return banks * _tile_bytes([k, w], dtype)


def _tile_bytes(shape, dtype: str) -> int:
    from .emulator.ttnn_import import ttnn

    return shard_bytes(shape, getattr(ttnn, dtype.lower()), ttnn.TILE_LAYOUT)


def shard_width_tiles(n: int, banks: int = P150_DRAM_BANKS) -> int:
    return -(-n // (TILE * banks))


@dataclass
class Workload:
    """A restated decode step: its counts and what they were built from."""

    name: str
    counts: Counts
    readers: dict = field(default_factory=dict)  # weight name -> readers per bank
    weight_bytes: int = 0
    kv_bytes: int = 0


def llama31_8b_decode(batch: int, context: int, readers: int = 1, shapes: DecoderShapes = LLAMA31_8B) -> Workload:
    """One traced decode step of Llama-3.1-8B on one P150 (module doc). ``readers``: readers per DRAM bank for the
    QKV, attention output, gate/up and down weights (PR 55080 uses 2 where the bank shard width divides evenly,
    else 1: the device op's rule, emulator/dram_sharded_readers.py); the LM head keeps one."""
    from .emulator.dram_sharded_readers import readers_rule_violation

    h, ff, d = shapes.hidden, shapes.intermediate, shapes.head_dim
    qkv_n = (shapes.heads + 2 * shapes.kv_heads) * d
    weights = {"wqkv": (h, qkv_n, "BFLOAT8_B"), "wo": (shapes.heads * d, h, "BFLOAT8_B"),
               "w1": (h, ff, "BFLOAT4_B"), "w3": (h, ff, "BFLOAT4_B"), "w2": (ff, h, "BFLOAT4_B")}
    c = Counts(f"llama-3.1-8b decode step, batch {batch}, context {context}, {readers} reader(s) per bank")
    chosen = {}
    wbytes = 0
    for name, (k, n, dtype) in weights.items():
        r = readers if readers_rule_violation(shard_width_tiles(n), -(-n // TILE), P150_DRAM_BANKS, readers) is None \
            else 1
        chosen[name] = r
        key = f"{dtype}@dram_sharded/{P150_DRAM_BANKS}" + (f"x{r}" if r > 1 else "")
        b = dram_sharded_weight_bytes(k, n, dtype) * shapes.layers
        c.bytes_read[key] += b
        wbytes += b
    split = shapes.vocab // shapes.lm_head_splits
    head = dram_sharded_weight_bytes(h, split, "BFLOAT8_B") * shapes.lm_head_splits
    c.bytes_read[f"BFLOAT8_B@dram_sharded/{P150_DRAM_BANKS}"] += head
    chosen["lm_head"] = 1
    wbytes += head
    # paged KV (bfloat8_b): SDPA decode reads K and V blocks up to each user's position; the cache update reads one
    # row tile of K and of V per KV head and user
    blocks = -(-context // shapes.kv_block)
    kv_sdpa = 2 * shapes.kv_heads * _tile_bytes([blocks * shapes.kv_block, d], "BFLOAT8_B")
    kv_update = 2 * shapes.kv_heads * _tile_bytes([TILE, d], "BFLOAT8_B")
    kv = (kv_sdpa + kv_update) * batch * shapes.layers
    c.bytes_read["BFLOAT8_B"] += kv
    for op, n in LLAMA_LAYER_PROGRAMS:
        c.programs_per_op[op] += n * shapes.layers
        c.per_op[op] += n * shapes.layers
    for op, n in llama_step_programs(shapes):
        c.programs_per_op[op] += n
        c.per_op[op] += n
    c.programs = int(sum(c.programs_per_op.values()))
    return Workload(c.name, c, chosen, wbytes, kv)


# ---- the published anchors (measured by their authors; read from the cited sources) --------------------------
@dataclass(frozen=True)
class Anchor:
    name: str
    measured_ms: float
    source: str
    batch: int
    context: int
    readers: int


LLAMA_ANCHORS = (
    Anchor("llama-3.1-8b p150 b32 1 reader", 30.53,
           "tt-metal PR 55080 table, 'Average decode time', Main (one reader per bank)", 32, 228, 1),
    Anchor("llama-3.1-8b p150 b32 2 readers", 23.76,
           "tt-metal PR 55080 table, 'Average decode time', This PR (two readers per bank)", 32, 228, 2),
    Anchor("llama-3.1-8b p150 b1", 1e3 / 33.6,
           "tt-metal models/tt_transformers/PERF.md: Llama-3.1-8B, P150, 33.6 t/s/u (bfp4 MLP / bfp8 attention, "
           "batch 1, generation 200)", 1, 228, 1),
)


def anchor_workload(a: Anchor) -> Workload:
    return llama31_8b_decode(a.batch, a.context, a.readers)


__all__ = ["Anchor", "DecoderShapes", "LLAMA31_8B", "LLAMA_ANCHORS", "LLAMA_LAYER_PROGRAMS", "Workload",
           "anchor_workload", "dram_sharded_weight_bytes", "llama31_8b_decode", "llama_step_programs"]


# ---- measured Qwen3.6-27B decode figures of other code, shown beside ours by `qwen36 report` ----------------------
# Tenstorrent's own qwen36 restated and pinned (its pre-fused program list at TP=2 and TP=4, the serving baseline
# among them): tt_ops/calibration_qwen36*.py, ``QWEN36_ANCHORS``. These rows are what the report lists beside our
# figures; the fused-GDN TPOT is another program list (a comparison there) and the third party's port is not restated.
@dataclass(frozen=True)
class Reference:
    name: str
    ms_per_token: float
    hardware: str
    source: str


QWEN36_27B_REFERENCES = (
    Reference("Tenstorrent qwen36, fused GDN decode, TPOT", 30.4, "P300x2 (4 Blackhole dies, TP=4)",
              "tt-metal models/demos/blackhole/qwen36/BENCHMARKS.md: vllm bench serve, ISL 128 / OSL 128, "
              "concurrency 1, TPOT 30.4 ms optimized (30.9 ms at ISL 4096)"),
    Reference("Tenstorrent qwen36, before fused GDN decode, TPOT", 41.4, "P300x2 (4 Blackhole dies, TP=4)",
              "tt-metal models/demos/blackhole/qwen36/BENCHMARKS.md: same table, baseline column"),
    Reference("Thatch-cloud port through vLLM, client tok/s", 1e3 / 19.27, "2x P150a (TP=2)",
              "Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B docs/baseline-2026-09-05.md: 19.27 tok/s per stream "
              "at 4,078 input tokens, concurrency 1 (host sampling, logprobs=1; 19.45 at 109 tokens)"),
)
