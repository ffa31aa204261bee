"""Three of Tenstorrent's op test files, restated case by case (same parametrisation, same calls, same checks, in our
words) so that the emulator can be run against each file's whole grid.

``TT_FILES`` maps each file to its cases (``conformance_tt_rotary``, ``conformance_tt_cache``,
``conformance_tt_sparse``); every case is a ``conformance_tt_base.TTCase`` with the mesh it needs (``"device"``: the
file's single-device fixture, ``"mesh2"``: its two-device ``mesh_device``). ``cases(Case)`` gives the ones the
conformance suite (``qwen36.testing.emulator_conformance``, ``qwen36 probe emu-conformance``) carries: every case of the
indexed cache update and indexed sparse matmul files, and the rotary file's cases that exercise what those files
found (every ``out_sharded`` case, the fp32 cases, the padded-cos/sin decode case) plus one interleaved case per
shape; a few small ones run in CI. ``run_file(source)`` runs a whole file's grid and counts passed, failed and skipped
(a check to run by hand; the whole rotary grid takes minutes).

Sources (tenstorrent/tt-metal, read for facts):

* ``tests/tt_eager/python_api_testing/unit_testing/misc/test_rotary_embedding_hf.py``: prefill ``[W, Z, Y, X]`` in
  {[1, 1, 128, 64], [1, 71, 128, 64], [32, 1, 32, 64], [32, 71, 32, 64]} as ``[1, W*Z, Y, X]`` with cos/sin
  ``[1, 1, 2048, X]``; the legacy decode shapes in prefill mode with cos/sin rows of one ``token_idx`` in
  {0, 128, 129, 1024, 1025}; input height-sharded or interleaved, output ``MemoryConfig(HEIGHT_SHARDED, L1)``
  *without a shard spec* or the default; bf16/bf8 input and cos/sin (fp32 cases separately); HiFi4 + fp32 dest;
  PCC >= 0.99 against ``x * cos + rotate_half(x) * sin``. Decode per user: 32 users, 8 heads padded to 32, head
  dim 128, input height-sharded on a 4x8 grid, cos/sin ``[1, 32, 1, 128]`` padded with zero rows to
  ``[1, 32, 32, 128]`` and moved with ``interleaved_to_sharded`` onto one ``[32, 128]`` shard per user.
* ``tests/ttnn/unit_tests/operations/experimental/indexed_page_cache/test_indexed_fused_update_cache.py``: packed
  rows scattered to physical cache rows (exact equality), program-cache reuse, trace replay, a 128-worker case,
  the golden function, 13 validation cases matched on the device op's message, replicated and tensor-parallel
  two-device meshes and their refusals.
* ``tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul_indexed.py``: the indexed/gather mode of
  ``sparse_matmul`` (non-monotonic ids, bf8/bf4 weights, 16 or 256 groups, compact A, cache reuse with new ids,
  no-indices path, preallocated output, per-group bias over 36 configs) and its host-side contract matched on the
  device op's message.
"""

from __future__ import annotations

from .conformance_tt_base import TTCase
from .conformance_tt_cache import indexed_cases
from .conformance_tt_rotary import rope_cases
from .conformance_tt_sparse import sparse_cases

ROPE_FILE = "tt-metal tests/tt_eager/python_api_testing/unit_testing/misc/test_rotary_embedding_hf.py"
INDEXED_FILE = ("tt-metal tests/ttnn/unit_tests/operations/experimental/indexed_page_cache/"
                "test_indexed_fused_update_cache.py")
SPARSE_FILE = "tt-metal tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul_indexed.py"

TT_FILES: dict[str, list[TTCase]] = {ROPE_FILE: rope_cases(), INDEXED_FILE: indexed_cases(),
                                     SPARSE_FILE: sparse_cases()}


def cases(case_type) -> list:
    """The cases the conformance suite carries, as ``case_type(op, name, source, fn, skip, ci)`` objects (the suite's
    own case class; passed in so that this module does not import the suite that registers it)."""
    return [case_type(c.op, f"tt_file:{c.name}", src, c.fn, skip=c.skip, ci=c.ci)
            for src, cs in TT_FILES.items() for c in cs if c.suite]


def run_file(source: str) -> dict:
    """Run every case of one file on the emulated mesh each case names (``device``: emulated-p150, ``mesh2``:
    emulated-p150x2, opened for each case as the file's fixtures do); returns counts and the failures."""
    from ..tt_ops.device import open_mesh

    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for c in TT_FILES[source]:
        if c.skip:
            counts["skipped"] += 1
            continue
        device = "emulated-p150" if c.mesh == "device" else "emulated-p150x2"
        try:
            with open_mesh(device, trace_region_size=c.trace_region) as ctx:
                c.fn(ctx.ttnn, ctx.mesh_device)
            counts["passed"] += 1
        except Exception as e:  # noqa: BLE001 - a failing case is a finding: count it, keep going
            counts["failed"] += 1
            failures.append((c.name, f"{type(e).__name__}: {str(e)[:300]}"))
    return {"counts": counts, "failures": failures}
