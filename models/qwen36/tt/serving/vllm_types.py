"""The value types of the vllm-tt plugin's speculative contract (``SpecPlan``, ``SpecReject``, ``VerifyOutput``,
``DraftOutput``, ``PLACEHOLDER_TOKEN_ID``, the side-tensor check ``check_spec_side_tensors``) and of its on-device
sampling (``TTSamplingParams``).

When the plugin is importable its own classes are used: the runner checks what the model returns with
``isinstance`` against them, so an adapter must hand back exactly those. Without the plugin (CI, a host without
vLLM) the adapter still has to build and return these values, so this module defines stand-ins with the same
field names, defaults and the same validation the plugin's ``spec_decode`` module applies (written here from
reading it, tenstorrent/vllm-tt-plugin ``src/vllm_tt_plugin/spec_decode.py``). ``SOURCE`` says which ones are in
use; the adapter logs it at load time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:  # the plugin's own types: what its runner's isinstance checks expect
    from vllm_tt_plugin.spec_decode import (  # type: ignore[import-not-found]
        PLACEHOLDER_TOKEN_ID,
        DraftOutput,
        SpecPlan,
        SpecReject,
        VerifyOutput,
    )

    SOURCE = "vllm_tt_plugin.spec_decode"
except ImportError:
    SOURCE = "qwen36.tt.serving.vllm_types (plugin not installed)"

    #: tail marker of a padded draft column / short committed block (never a real token id)
    PLACEHOLDER_TOKEN_ID = -1
    _ACCEPT_MODES = ("logits", "argmax_ids", "fused_sample")
    _MODE_FIELDS = {"logits": ("logits",), "argmax_ids": ("argmax_ids",),
                    "fused_sample": ("accepted_token_ids", "accepted_counts")}
    _DRAFTER_STATES = ("internal", "paged", "shared_with_target")

    @dataclass(frozen=True)
    class SpecPlan:  # type: ignore[no-redef]
        """What the model serves at one (max_num_seqs, requested_k) point."""

        effective_k: int
        lanes_per_request: int
        extra_bytes_per_seq: int
        extra_bytes_per_token: int
        accept_modes: tuple[str, ...]
        drafter_state: str
        drafter_target_cache_requires: tuple[str, ...] = ()
        supports_narrow_decode: bool = False
        k_by_rows: tuple[tuple[int, int], ...] = ()  # (max_rows, k) draft caps by live rows; () = effective_k

        def __post_init__(self) -> None:
            if self.effective_k < 1 or self.lanes_per_request < 1:
                raise ValueError(f"SpecPlan: effective_k {self.effective_k} and lanes_per_request "
                                 f"{self.lanes_per_request} must be >= 1")
            if min(self.extra_bytes_per_seq, self.extra_bytes_per_token) < 0:
                raise ValueError("SpecPlan: byte fields must not be negative")
            modes = tuple(self.accept_modes)
            if not modes or any(m not in _ACCEPT_MODES for m in modes):
                raise ValueError(f"SpecPlan.accept_modes {modes} must be non-empty, from {_ACCEPT_MODES}")
            object.__setattr__(self, "accept_modes", modes)
            if self.drafter_state not in _DRAFTER_STATES:
                raise ValueError(f"SpecPlan.drafter_state {self.drafter_state!r} not in {_DRAFTER_STATES}")
            object.__setattr__(self, "drafter_target_cache_requires", tuple(self.drafter_target_cache_requires))

        @property
        def block_width(self) -> int:
            return 1 + self.effective_k

        def draft_cap(self, live_rows: int) -> int:
            """Most drafts per row of a verify with ``live_rows`` live rows (the runner truncates to it)."""
            for max_rows, k in self.k_by_rows:
                if live_rows <= max_rows:
                    return k
            if self.k_by_rows:
                raise ValueError(f"SpecPlan.k_by_rows {self.k_by_rows} does not cover {live_rows} live rows")
            return self.effective_k

    @dataclass(frozen=True)
    class SpecReject:  # type: ignore[no-redef]
        reason: str
        supported_k: tuple[int, ...] = ()

        def __post_init__(self) -> None:
            if not self.reason.strip():
                raise ValueError("SpecReject.reason must explain the refusal")
            object.__setattr__(self, "supported_k", tuple(self.supported_k))
            if any(k < 1 for k in self.supported_k):
                raise ValueError(f"SpecReject.supported_k must hold K >= 1, got {self.supported_k}")

    @dataclass(frozen=True)
    class DraftOutput:  # type: ignore[no-redef]
        draft_token_ids: Any  # [B, K] int32
        num_valid: Any = None  # [B] int32 or None (= every row offers K)
        draft_scores: Any = None

    @dataclass(frozen=True)
    class VerifyOutput:  # type: ignore[no-redef]
        spec_mode: str
        argmax_ids: Any = None  # [B, 1+K]
        logits: Any = None
        accepted_token_ids: Any = None
        accepted_counts: Any = None
        hidden: Any = None

        def __post_init__(self) -> None:
            need = _MODE_FIELDS.get(self.spec_mode)
            if need is None:
                raise ValueError(f"VerifyOutput.spec_mode {self.spec_mode!r} is not one of {_ACCEPT_MODES}")
            missing = [f for f in need if getattr(self, f) is None]
            if missing:
                raise ValueError(f"VerifyOutput({self.spec_mode!r}) needs {missing}")

ACCEPT_MODE_ARGMAX_IDS = "argmax_ids"


def check_spec_side_tensors_stand_in(num_valid_drafts, accepted_counts, rows: int, num_drafts: int,
                                     call: str = "verify") -> None:
    """The domain both sides of the contract check for the two ``[B]`` tensors beside a verify block: both present,
    shape ``[rows]``, int32 (what the runner builds), ``num_valid_drafts`` in ``[0, K]`` and ``accepted_counts`` (a
    count, never 0) in ``[1, 1 + K]``, on every row, padding rows included. The plugin's
    ``spec_decode.check_spec_side_tensors`` (newer sources) is used instead when installed."""
    import torch

    for name, t, low, high in (("num_valid_drafts", num_valid_drafts, 0, num_drafts),
                               ("accepted_counts", accepted_counts, 1, 1 + num_drafts)):
        if t is None:
            raise ValueError(f"{call} {name} must be present")
        if tuple(t.shape) != (rows,):
            raise ValueError(f"{call} {name} must be [{rows}], got {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise ValueError(f"{call} {name} must be int32, got {t.dtype}")
        bad = t[(t < low) | (t > high)]
        if bad.numel():
            raise ValueError(f"{call} {name} entries must lie in [{low}, {high}], got {bad.tolist()}")


try:  # newer plugin sources only (older spec_decode modules lack it, hence a guard of its own)
    from vllm_tt_plugin.spec_decode import check_spec_side_tensors  # type: ignore[import-not-found]
except ImportError:
    check_spec_side_tensors = check_spec_side_tensors_stand_in

try:  # the plugin's per-step sampling payload (model_input.py; imports vLLM, hence a separate guard)
    from vllm_tt_plugin.model_input import TTSamplingParams  # type: ignore[import-not-found]

    SAMPLING_SOURCE = "vllm_tt_plugin.model_input"
except ImportError:
    SAMPLING_SOURCE = "qwen36.tt.serving.vllm_types (plugin not installed)"

    @dataclass(frozen=True)
    class TTSamplingParams:  # type: ignore[no-redef]
        """Per-row sampling values of one prefill / decode call when the launch samples on device: one entry per
        row of the (padded) batch. The runner hands the model Python lists (``.tolist()`` of its tensors), with a
        request without a seed as None; same field names, order and defaults as the plugin's
        ``vllm_tt_plugin.model_input.TTSamplingParams`` (checked against a vendored copy of that file by
        tests/tt/serving/test_vllm_sampling.py)."""

        temperature: Any
        top_k: Any
        top_p: Any
        presence_penalty: Any = 0.0
        frequency_penalty: Any = 0.0
        repetition_penalty: Any = 1.0
        seed: Any = 0
        num_logprobs: Any = None
        enable_log_probs: Any = None

#: how the runner encodes "no logprobs" in ``num_logprobs`` (input_batch.py LOGPROBS_NONE_SENTINEL; 0 = only the
#: sampled token's logprob, n = also the top n)
LOGPROBS_NONE = -2
#: how the runner's tensors encode "no seed" (input_batch.py SEED_NONE_SENTINEL); the lists it hands the model
#: carry None instead, but a tensor-form payload may still hold it
SEED_NONE = -1

__all__ = ["ACCEPT_MODE_ARGMAX_IDS", "LOGPROBS_NONE", "PLACEHOLDER_TOKEN_ID", "SAMPLING_SOURCE", "SEED_NONE",
           "DraftOutput", "SOURCE", "SpecPlan", "SpecReject", "TTSamplingParams", "VerifyOutput",
           "check_spec_side_tensors", "check_spec_side_tensors_stand_in"]


def current_vllm_config():
    """The engine's ``VllmConfig`` while vLLM has it set (its worker sets it around KV-cache allocation,
    ``WorkerWrapperBase.initialize_from_config``), else None (no vLLM, or outside that window). The plugin at
    e3fc849 passes no ``vllm_config`` to ``initialize_vllm_model``; the launch's prefix-caching settings are read
    here instead."""
    try:
        from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found]
    except ImportError:
        return None
    return get_current_vllm_config_or_none()
