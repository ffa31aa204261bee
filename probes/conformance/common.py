"""What the emulator's conformance-case modules share: the case record, PCC, device upload/readback helpers, the
refusal check and the source of each case (``cases_*``, ``kda``, ``kda_scan`` and ``gdn_chunk`` build their cases
from it)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class Case:
    op: str
    name: str
    source: str
    fn: Callable | None = None  # fn(ttnn, mesh) -> None; raises AssertionError on a mismatch
    skip: str | None = None  # why the emulator cannot express this case
    ci: bool = True  # in the CI subset (tests/emulator/test_conformance.py); the probe runs every case


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = a.norm() * b.norm()
    return 1.0 if den == 0 else float((a @ b) / den)


def on_mesh(ttnn, mesh, x, dtype=None, layout=None, mapper=None):
    return ttnn.from_torch(x, dtype=dtype or ttnn.bfloat16, layout=layout or ttnn.TILE_LAYOUT, device=mesh,
                           mesh_mapper=mapper)


def device0(ttnn, mesh, t):
    """Device 0's shard as torch."""
    return ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()


def expect_rejected(fn, needle):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the emulator's EmulatorError or a card's TT_FATAL
        assert needle in str(e), str(e)
    else:
        raise AssertionError(f"accepted a call the device op rejects ({needle})")


# where each case comes from (tenstorrent/tt-metal files, read for facts; cases.py's module doc says what each asserts)
SRC_PAGED_MASK = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_paged_cache_mask.py"
SRC_FILL = "tt-metal tests/ttnn/unit_tests/operations/transformers/repro_paged_fill_cache_pagetable_row_hang.py"
SRC_SPEC = "tt-metal tests/ttnn/unit_tests/operations/sdpa/test_sdpa_decode_spec_multi_pos.py"
SRC_GDN = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_fused_recurrent_gdn_golden.py"
SRC_CHUNK = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_gdn_state_inplace.py"
SRC_AG = "tt-metal tests/nightly/t3000/ccl/test_minimal_all_gather_async.py"
SRC_DOC = "ttnn 0.81.1 op docstring"
SRC_FUSED_UPDATE = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_paged_fused_update_cache.py"
SRC_ROPE_HF = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_rotary_embedding_hf_decode_baseline.py"
SRC_CREATE_HEADS = "tt-metal tests/tt_eager/python_api_testing/unit_testing/misc/test_nlp_create_qkv_heads_decode.py"
SRC_CREATE_HEADS_HOST = ("tt-metal ttnn/cpp/ttnn/operations/experimental/transformer/nlp_create_qkv_heads_decode/"
                         "nlp_create_qkv_heads_decode.cpp (host wrapper)")
SRC_INDEXED_UPDATE = "tt-metal tests/ttnn/unit_tests/operations/transformers/test_indexed_fused_update_cache.py"
SRC_LAYERNORM_OP = "tt-metal ttnn/cpp/ttnn/operations/normalization/layernorm/device/layernorm_device_operation.cpp"
SRC_SPARSE = "tt-metal tests/ttnn/unit_tests/operations/matmul/test_sparse_matmul.py"
