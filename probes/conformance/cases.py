"""Conformance cases for the hand-emulated ops, written from Tenstorrent's own tests for those ops.

Each case restates, in our words and at CI-sized shapes, what a tt-metal test (or op docstring) asserts:
the call form, the parametrisation, the reference formula and the tolerance. ``run_cases(ctx)`` runs them on
an emulated mesh (the probe ``qwen36 probe emu-conformance`` and ``tests/emulator/test_conformance.py`` both
use it). A case the emulator cannot express is listed with the reason instead of being dropped. They ship with
the probes, not with the emulator: nothing at run time loads them (tests/test_layering.py).

Sources (tenstorrent/tt-metal, read for facts):

* ``tests/ttnn/unit_tests/operations/transformers/test_paged_cache_mask.py``: paged_update_cache on a 1x2 mesh
  with ``mesh_coords`` selecting the devices that update; bf16 cache ``[32, 1, 32, 128]``; exact equality.
* ``tests/ttnn/unit_tests/operations/transformers/repro_paged_fill_cache_pagetable_row_hang.py``: paged_fill_cache
  with ``batch_idx_tensor`` (one row per user), 8 KV heads, block 32, bf16 and bfloat8_b caches.
* ``tests/ttnn/unit_tests/operations/sdpa/test_sdpa_decode_spec_multi_pos.py`` (``spec_multi_pos_tiles``): T in
  {4, 7, 11} candidates, block 64, head_dim 256, one KV head, bounds ``p..p+T-1`` at tile edges (p % 32 in
  {0, 1, 30, 31}) and chunk edges; spec vs the batched B == T form bit-identical where that test asserts it
  (``test_spec_multi_pos_is_bit_exact``: p = 1024 at 2k, p = 5000 at 8k; the groups' bit-exact test at 2k), else
  its sweep's bar (PCC >= 0.9999, 0.999 when the bounds straddle a k-chunk, and allclose 2e-2); both forms vs an
  fp32 per-candidate reference at PCC >= 0.99; also B = 2 groups.
* ``tests/ttnn/unit_tests/operations/transformers/test_fused_recurrent_gdn_golden.py``: the recurrence equals
  FLA's naive form, GQA equals repeat_interleave of q/k, T = K+1 per-token states equal K+1 chained single-token
  calls and the last per-token state equals the final state; K = V = 128, 4 key / 12 value heads.
* ``tests/ttnn/unit_tests/operations/transformers/test_gdn_state_inplace.py``: chunk_gated_delta_rule's model
  call form (flat ``[1, T, H*D]`` q/k/v, in-kernel L2 norm, chunk 32, ``output_head_major``).
* ``tests/nightly/t3000/ccl/test_minimal_all_gather_async.py`` (and the tg variant): all_gather_async on a
  ``[1, 1, 128, 512]``-class bf16 tensor, dim 3, Linear topology, DRAM, with tracing; exact equality.
* ``tests/ttnn/unit_tests/operations/transformers/test_rotary_embedding_hf_decode_baseline.py``:
  rotary_embedding_hf decode mode, (batch, heads, head_dim) in {(1, 32, 128), (8, 8, 128), (8, 16, 64),
  (32, 8, 64), ...}, bf16 input height-sharded with heads padded to 32, bf16 cos/sin ``[1, B, 1, D]`` sharded one
  32-row shard per user, HiFi4 + fp32 dest; reference ``x * cos + rotate_half(x) * sin`` (that test's bar is PCC
  0.90 while its kernel is fixed; the emulator is held to 0.9999 against an fp32 reference). Prefill mode as
  Tenstorrent's model code calls it (``[1, nh, S, D]`` interleaved, cos/sin ``[1, 1, S, D]``); the device
  validation (``rotary_embedding_hf_device_operation.cpp``) rejects an interleaved decode input.
* ``tests/ttnn/unit_tests/operations/transformers/test_paged_fused_update_cache.py``: K and V caches updated by
  one paged_fused_update_cache, 8 users, 1 or 8 heads, head_dim 128, block 64, shuffled page table, update index
  ``idx + 17 i`` with user 4 at -1 (skipped) for one head; inputs height-sharded on two disjoint 8-core grids;
  bf16 cache exact, bfloat8_b PCC >= 0.9995 over the whole cache and the updated rows.
* ``tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul.py``: sparse_matmul with nnz, dense A ``[1, 4, 16, 128]``
  against 8 experts ``[1, E, 128, 512]`` (bfloat8_b) with a random sparsity ``[1, 1, 4, E]``, both-sparse batched
  ``[1, 32, 16, 128]``, sparse A; every active block at PCC >= 0.999 vs torch. The indexed (``indices``) mode is
  from the 0.81.1 docstring (compact group axis, slot i = group indices[i]).
* ``tests/ttnn/unit_tests/operations/transformers/test_nlp_create_qkv_heads_decode.py``: the fused decode head split
  of ``[1, 1, B, (nq + 2 nkv) D]`` rows, (nq, nkv, D, B) in {(8, 1, 128, 8), (16, 2, 64, 32), (8, 4, 96, 32), ...},
  input width-sharded in [32, 32] shards (``min_width_shard``) with and without ``overlap_qk_coregrid``, output
  height-sharded; each of q, k, v against the torch split at PCC 0.9999 (the emulator is held to exact equality:
  the op copies). The interleaved-input form and the validation rules are from the device op
  (``nlp_create_qkv_heads_decode_device_operation.cpp``).
* ``tests/ttnn/unit_tests/operations/transformers/test_indexed_fused_update_cache.py``: K and V rows written at
  physical rows (``page * rows_per_page + row``, no page table), caches ``(1, 2, 128, 64)`` and ``(4, 2, 64, 64)``,
  9 packed rows at ``[1, 3, 31, 32, 33, 63, 64, -1, total_rows]`` (several rows share a page; -1 and out of range
  are skipped), replicated over a 2-device mesh; exact equality with the reference (and the op's golden); its
  validation cases (bf8 cache, uint32 or TILE indices, fewer indices than rows, mismatched shapes, unaligned
  pages, more than 256 rows).
* ttnn's layernorm device op (``layernorm_device_operation.cpp``): rms_norm rejects a HEIGHT_SHARDED input.
* rotary_embedding_llama: op docstring (cos/sin ``[1, 1 or nh, S, dh]``, decode mode) and the per-user decode
  transformation matrix form (one 32x32 tile per user).
* ``qwen36.probes.conformance.tt_tests`` (cases named ``tt_file:...``): three files restated whole,
  ``test_rotary_embedding_hf.py`` (the ``out_sharded`` grid, fp32, padded cos/sin in decode),
  ``test_indexed_fused_update_cache.py`` and ``test_sparse_matmul_indexed.py``; that module lists its sources.
"""

from __future__ import annotations

import traceback

from . import cases_heads_sparse as hs
from . import cases_kv_gdn as kv
from . import tt_tests
from .common import Case
from .gdn_chunk import CASES as GDN_CHUNK_CASES
from .kda import CASES as KDA_CASES
from .kda_scan import CASES as KDA_SCAN_CASES

# The order of the cases as they were first listed (records list them in this order).
CASES: list[Case] = (hs.SPARSE + kv.PAGED_CACHES + kv.SPEC_DECODE + kv.GDN + kv.ROPE_LLAMA_PREFILL + hs.ROPE_HF_PREFILL
                     + kv.ROPE_LLAMA_DECODE + hs.COLLECTIVES + kv.FUSED_UPDATE + hs.ROPE_HF_DECODE + hs.HEADS_AND_NORM
                     + hs.INDEXED + hs.ROPE_HF_I2S
                     # Tenstorrent's op test files restated case by case, in their own modules (tt_tests)
                     + tt_tests.cases(Case)
                     # the KDA convolution / gated norm and the fused GDN ops live in their own modules
                     + KDA_CASES + GDN_CHUNK_CASES + KDA_SCAN_CASES)


def run_cases(ctx, only_ops: set[str] | None = None, ci_only: bool = False) -> list[dict]:
    """Run the cases on ``ctx`` (an emulated MeshContext); one result dict per case."""
    if not getattr(ctx, "is_emulated", False):
        raise RuntimeError("the conformance cases check the emulator; open an emulated-* device")
    out = []
    for c in CASES:
        if (only_ops and c.op not in only_ops) or (ci_only and not c.ci):
            continue
        r = {"op": c.op, "case": c.name, "source": c.source}
        if c.skip:
            r.update(status="skipped", reason=c.skip)
        else:
            try:
                c.fn(ctx.ttnn, ctx.mesh_device)
                r["status"] = "passed"
            except Exception as e:  # a failing case is a finding: record it, keep going
                r.update(status="failed", reason=f"{type(e).__name__}: {e}",
                         where=traceback.format_exc(limit=3).splitlines()[-3:])
        out.append(r)
    return out


def summarize(results: list[dict]) -> dict:
    per: dict[str, dict] = {}
    for r in results:
        d = per.setdefault(r["op"], {"passed": 0, "failed": 0, "skipped": 0})
        d[r["status"]] += 1
    return per
