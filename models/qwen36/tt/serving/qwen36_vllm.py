"""Qwen3.6 model class for the vllm-tt plugin (tenstorrent/vllm-tt-plugin): a thin adapter over
:class:`TTGenerator` (prefill, plain decode) and :class:`TTSpecBackend` with the device MTP drafter (verify +
on-device greedy acceptance + commit + next drafts). vLLM is not imported here (not a dependency); the plugin's
contract value types come from :mod:`qwen36.tt.serving.vllm_types`.

Written against the plugin's runner as it calls a model (model_runner.py, async_decode.py, worker.py, loader.py,
platform.py at tenstorrent/vllm-tt-plugin e3fc849; the speculative side from spec_decode.py, spec_admission.py,
model_runner.py and scheduler.py at 23f0fcbe), in the order the engine calls it:

    Qwen36ForCausalLM.get_max_tokens_all_users(...)          # worker: sizes vLLM's KV block pool
    Qwen36ForCausalLM.spec_plan(vllm_config, max_num_seqs, k)  # platform, when speculative_config is set
    model = Qwen36ForCausalLM.initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len=...,
                                                    tt_data_parallel=1, optimizations=None, vllm_config=...)
    kv = model.allocate_kv_cache_per_layer([(shape, dtype, idx), ...])   # vLLM's num_blocks, block_size
    model.warmup_model_prefill(enable_trace=False, kv_cache=kv, can_sample_on_device=False)
    model.warmup_model_decode(enable_trace=False, kv_cache=kv, max_batch_size=1, num_blocks=..., ...)
    model.warmup_model_prefill(enable_trace=True, ...); model.warmup_model_decode(enable_trace=True, ...)
    logits, rope_deltas = model.prefill_forward(tokens, page_table, kv, prompt_lens, start_pos=...)  # mrope form
    out = model.decode_forward(tokens=[B,1], page_table=..., kv_cache=kv, start_pos=[B],
                               rope_deltas_all_users=..., enable_trace=True, read_from_device=False)
    logits = model.process_decode_output_host(out, is_tokens=False)                           # [B, 1, V]
    # the synchronous runner (no async scheduling) sends the decode step as a one-token prefill continuation:
    logits, rope_deltas = model.prefill_forward(tokens[:, :n+1], ..., prompt_lens=[n+1], start_pos=[n])
    # speculative launch (method custom_class, no narrow decode: every decode step is a verify)
    v = model.decode_forward(tokens=[B,1+K], start_pos=[B,1+K], num_valid_drafts=[B], accepted_counts=[B],
                             spec_mode="argmax_ids", ...)                      # VerifyOutput(argmax_ids [B,1+K])
    d = model.propose_draft_tokens(K, committed [B,1+K], positions [B,1+K], accepted_counts [B], hidden=None)
    model.release_request(slot)                               # finished / preempted request

Paged KV: the model keeps its own cache layout ([num_blocks, Hkv/N, block_size, head_dim] per full-attention
layer) but allocates it with the number of blocks vLLM asks for and reads/writes through vLLM's block table:
each call copies the live row of ``page_table`` into the model's persistent page-table buffer (outside any
trace), so the traces keep pointing at one buffer whose contents follow vLLM. Block 0 is vLLM's null block: it
appears in the table past the blocks a request owns and is never written for positions the request owns.

Speculative step (our fused step, deferred-slot contract): vLLM sends ``tokens[0] = [pending, d_1..d_n,
placeholder..]`` with ``num_valid_drafts = n <= K``. We write the n drafts (placeholder columns as token 0: their
outputs are never read, the host walk stops at column n) and, for the device acceptor, a copy of the drafts
whose placeholder columns hold an id no argmax can equal (the vocabulary size), so the on-device greedy
acceptance is capped at n exactly as the host walk of ``argmax_ids`` is. The commit then happens on device with
that count a (slot a of the verify), and the next call's ``accepted_counts`` must say a+1 (slot = accepted_counts
- 1); since vLLM's greedy walk over the returned argmax ids derives the same a, the two agree by construction,
and anything else (a scheduler keeping fewer tokens) is refused, never silently rolled back.

Draft depth per step (``"spec_depth": "auto"`` in the plugin's ``--additional-config '{"tt": {...}}'``, or
``initialize_vllm_model(spec_depth="auto")``): vLLM's ``num_speculative_tokens`` K is then the verify block
width, i.e. the deepest step (capped by what the K+1-row verify holds, ``tt.verify.max_spec_tiles``), and before
every step the fitted depth controller (``speculative/depth.py``, the P150a cost table) picks K' <= K from the
accepted counts so far. ``propose_draft_tokens`` reports it: K' valid drafts (``num_valid`` = K', placeholder
columns after them); the runner's next verify then carries ``num_valid_drafts`` = K' and the model verifies K'+1
rows (the backend's per-depth traces). ``spec_plan`` reports K as ``effective_k`` (the widest block the runner
must reserve) and :meth:`Qwen36ForCausalLM.depth_plan` the depths and the K' of the next step.

Sampling: by default the plugin samples on the host from the returned logits (vLLM's own sampler: every
parameter, logprobs, seeds). With ``"sample_on_device_mode"`` in the launch's ``tt`` options it hands each call
``sampling_params`` (the plugin's ``TTSamplingParams``, per-row lists) and expects token ids back:
:func:`sampling_from_plugin` turns row 0 into our :class:`SamplingParams` (one validation, one error), the prefill's
token is picked on the host from the prompt's last row (as ``TTGenerator.generate`` does) and every decode token on
device inside the traced step (:class:`.sampler.DeviceSampler`, penalty counts updated in place), so a sequence
equals ``TTGenerator.generate`` with the same parameters and seed. What the plugin does not send this way it
samples on the host anyway (min_p, logit_bias, allowed/bad words, structured output, and logprobs below 8 devices:
``check_perform_device_sampling``); logprobs asked of the device are refused. Under speculation the plugin admits
greedy requests only (accept mode ``argmax_ids``), so a verify's ``sampling_params`` must be greedy without
penalties.

Batch: loaded with ``max_batch_size`` 1 (``--max-num-seqs 1``, what speculation needs) the
model serves one sequence (one GDN state slot, slot 0); rows past the first are accepted only as the padding rows
the runner sends (position -1; ``num_valid_drafts`` 0, ``accepted_counts`` 1) and get inert outputs, and a real
second user fails fast naming ``--max-num-seqs 1``. Loaded with ``max_batch_size`` N in 2..32 (a plain launch, host
or device sampling) it serves N sequences through :class:`_BatchServer` (the batched TT decoder, vLLM state slot j =
decoder slot j; how the plugin's calls map onto it is in that class and docs/serving.md, "Several sequences").
"""
from __future__ import annotations

import functools
import inspect
import os
import secrets
from pathlib import Path

import torch
from loguru import logger

from ...checkpoint import load_checkpoint
from ...config import FULL, LINEAR, Qwen36Config
from ...speculative.depth import DepthPolicy, cost_key
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ...speculative.sampling import SamplingParams, SamplingParamsError, TokenHistory, pick_token
from ...tt_ops.device import ttnn_for_mesh
from . import vllm_types as vt
from ..spec.accept import UNIFORMS_PER_ROW
from ..runtime.batch import DEFAULT_BUCKETS, FREE
from ..runtime.batch_buckets import BucketedBatchDecoder
from ..runtime.generator import TTGenerator
from ..model.model import TTQwen36Model
from ..model.model_config import PrecisionSetting, TTModelArgs
from ..spec.mtp_drafter import TTMTPDrafter
from ..spec.spec_backend import TTSpecBackend
from ..model.state import KVLayerState, allocate_state, new_layer_state
from ..spec.verify import max_spec_tiles
from ..model.weights import WeightLoader

MAX_BATCH = max(DEFAULT_BUCKETS)  # plain decode: one TTBatchDecoder slot per vLLM sequence
MAX_K = UNIFORMS_PER_ROW - 1  # the device acceptor draws K accept uniforms + 1 per row (one tile row)
DEPTH_MODES = ("fixed", "auto")
DEPTH_COSTS = "p150x2"  # the step-cost table the controller uses on cards (speculative/depth.py cost_key)
VLLM_SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS: a temperature below it means greedy
ONE_USER = ("this model was loaded for one sequence (one GDN state slot; speculative decoding serves one "
            "sequence): start vLLM with --max-num-seqs 1, or without speculation with --max-num-seqs up to "
            f"{MAX_BATCH}")


def _hf_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config must be a dict or have to_dict(), got {type(hf_config).__name__}")


def _uses_mrope(raw: dict) -> bool:
    """What vLLM's ``model_config.uses_mrope`` sees: an ``mrope_section`` in the (text) rope parameters. The runner
    then unpacks ``(logits, rope_deltas)`` from prefill and passes ``rope_deltas_all_users`` to decode."""
    for d in (raw, raw.get("text_config") or {}):
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.get(key)
            if isinstance(rope, dict) and rope.get("mrope_section") is not None:
                return True
    return False


def max_depth(cfg: Qwen36Config) -> int:
    """Deepest K this model verifies: the device acceptor's RNG row and the multi-position SDPA kernel's K+1 limit
    at the checkpoint's head_dim (``tt.verify.max_spec_tiles``)."""
    return min(MAX_K, max_spec_tiles(cfg.head_dim) - 1)


def spec_depth_mode(vllm_config) -> str:
    """``"auto"`` when the launch's ``additional_config`` says ``{"tt": {"spec_depth": "auto"}}`` (the plugin's
    user namespace for TT options), else ``"fixed"``."""
    add = getattr(vllm_config, "additional_config", None) or {}
    tt = add.get("tt", {}) if isinstance(add, dict) else {}
    mode = tt.get("spec_depth", "fixed") if isinstance(tt, dict) else "fixed"
    if mode not in DEPTH_MODES:
        raise ValueError(f"additional_config tt.spec_depth={mode!r}: choose one of {DEPTH_MODES}")
    return mode


def _row_value(sp, name: str, row: int):
    """Row ``row`` of one TTSamplingParams field: a per-row list / tuple / tensor, or one value for every row."""
    v = getattr(sp, name)
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, torch.Tensor):
        v = v.reshape(-1).tolist() if v.dim() else v.item()
        if not isinstance(v, list):
            return v
    v = list(v)
    if row >= len(v):
        raise SamplingParamsError(f"sampling_params.{name} has {len(v)} rows, row {row} was asked for")
    return v[row]


def sampling_from_plugin(sp, vocab: int, fresh_seed: int, row: int = 0) -> SamplingParams:
    """The plugin's per-row sampling payload (``TTSamplingParams``: lists from the runner's ``submit_prefill`` /
    ``submit_decode``, or its tensors) -> our :class:`SamplingParams` for batch row ``row``.

    Reads the runner's encodings back into vLLM's meanings: ``top_k`` "off" arrives as the vocabulary size (the
    input batch normalises 0 / -1 / >= V to V) and becomes 0; ``top_k`` 1 arrives with ``top_p`` 0 (the input
    batch forces it, so that a fixed-candidate device sampler degenerates to argmax) and becomes top_p 1 (top_k 1
    alone already keeps one token); a request without a seed (None, or the tensors' sentinel -1) samples with
    ``fresh_seed`` (the caller draws one per request, so the request is not reproducible, as in vLLM); a
    temperature below vLLM's epsilon is greedy, as vLLM classifies the request (the runner copies it verbatim). Values
    outside their range raise :class:`SamplingParamsError` naming the parameter; logprobs asked of the device raise
    NotImplementedError (the runner asks a model for them only on 8- and 32-device meshes, and samples on the host
    otherwise)."""
    num_lp = _row_value(sp, "num_logprobs", row)
    enable_lp = _row_value(sp, "enable_log_probs", row)
    if bool(enable_lp) if enable_lp is not None else num_lp is not None and int(num_lp) >= 0:
        raise NotImplementedError(f"sampling_params asks for logprobs on device (num_logprobs={num_lp}): this model "
                                  f"returns sampled ids only; run without sample_on_device_mode, or let the runner "
                                  f"sample logprob requests on the host (it does below 8 devices)")
    temperature = _row_value(sp, "temperature", row)
    top_k, top_p = _row_value(sp, "top_k", row), _row_value(sp, "top_p", row)
    seed = _row_value(sp, "seed", row)
    try:
        if isinstance(top_k, float) and top_k.is_integer():
            top_k = int(top_k)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and (top_k <= 0 or top_k >= vocab):
            top_k = 0  # the runner's "consider every token"
        if top_k == 1 and top_p == 0.0:
            top_p = 1.0  # the runner's argmax encoding of top_k=1
        if isinstance(temperature, (int, float)) and 0 <= temperature < VLLM_SAMPLING_EPS:
            temperature = 0.0  # vLLM's SamplingParams.sampling_type: GREEDY below its epsilon
        if temperature == 0.0:
            seed = 0  # greedy draws nothing; one value keeps the device sampler of a greedy request reusable
        elif seed is None or seed == vt.SEED_NONE:
            seed = int(fresh_seed)
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              repetition_penalty=_row_value(sp, "repetition_penalty", row),
                              presence_penalty=_row_value(sp, "presence_penalty", row),
                              frequency_penalty=_row_value(sp, "frequency_penalty", row))
    except SamplingParamsError as e:
        raise SamplingParamsError(f"vllm-tt sampling_params row {row}: {e}") from None


def _rows(x, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 0:
        raise ValueError(f"{what} must have a batch dimension, got a scalar")
    return t


class _VllmSpecBackend(TTSpecBackend):
    """TTSpecBackend whose join replaces the last sequence (the prompt's last-row logits, which the vllm-tt
    contract returns, are its ``prefill_logits``) and whose greedy acceptor reads a separate draft buffer
    (``accept_drafts``) in which the placeholder columns of a short row hold an id no argmax equals, so acceptance
    stops at ``num_valid_drafts`` like vLLM's host walk."""

    _accept_bufs: dict = {}

    @property
    def accept_drafts(self):
        return self._accept_bufs[self._k]

    def join(self, slot: int, prompt, params: SamplingParams = SamplingParams()) -> int:
        """A new sequence replaces the last one (this path has one sequence slot and no explicit leave)."""
        if self.history:
            self._phase = "idle"  # an outstanding proposal belonged to the replaced sequence
            self.leave(slot)
        return super().join(slot, prompt, params)

    def _alloc_accept_drafts(self, ks) -> None:
        ttnn = self.ttnn
        self._accept_bufs = {k: ttnn.from_torch(torch.zeros(1, 1, 1, k, dtype=torch.int32), dtype=ttnn.uint32,
                                                layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                                                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
                             for k in ks}

    def _setup(self, k: int) -> None:
        super()._setup(k)
        self._alloc_accept_drafts([k])

    def _setup_depths(self, k_first: int) -> None:
        self.release()  # before allocating: no trace may be live
        self._alloc_accept_drafts(self.depths)
        super()._setup_depths(k_first)

    def write_accept_drafts(self, ids: list[int]) -> None:
        x = torch.tensor(ids, dtype=torch.int32).reshape(1, 1, 1, self._k)
        self.ttnn.copy_host_to_device_tensor(self.step_state.host(x, self.accept_drafts), self.accept_drafts)

    def _verify_and_accept(self):
        if not self.params.greedy:
            raise NotImplementedError("the vllm path verifies greedily (accept mode argmax_ids)")
        vout = self.step_state.verify()
        return vout, self.acceptor.greedy(vout.out.logits, self.accept_drafts)


class DeviceStepFailed(RuntimeError):
    """A plugin call failed inside the device work of a step; the model refuses every later call (stop and restart
    the server; on cards reset the devices first)."""


def _raised_here(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__") == __name__


def _call_rows(fn, self, args, kwargs) -> str:
    """The rows of a plugin call, for the failure message: count, start positions and state slots."""
    try:
        named = inspect.signature(fn).bind_partial(self, *args, **kwargs).arguments
    except TypeError:
        named = dict(kwargs)
    tokens = named.get("tokens")
    parts = []
    if tokens is not None and hasattr(tokens, "shape"):
        parts.append(f"{tokens.shape[0]} rows")
    for key in ("start_pos", "empty_slots"):
        v = named.get(key)
        if v is not None:
            parts.append(f"{key} {[int(x) for x in torch.as_tensor(v).reshape(-1).tolist()]}")
    return ", ".join(parts) or "no rows"


def stops_on_device_failure(fn):
    """Wrap a plugin entry point that drives the device. An exception from below the adapter (the model, ttnn: on
    cards tt-metal raises RuntimeError for an op that fails on the host, TT_FATAL/TT_THROW, and for a dispatch
    timeout after a kernel hang) has left the step half done: earlier ops of the step already updated GDN/conv
    state and KV in place, and a fault inside a replayed trace cannot be located or undone. So the call fails
    with :class:`DeviceStepFailed` naming the call, its rows and the op's error, and every later call is refused
    with the same reason; vLLM 0.25.1 then stops the engine (an exception out of ``execute_model`` is fatal to its
    engine core). The adapter's own refusals of a call (ValueError / NotImplementedError, or any exception this
    module raises from its checks, such as the TypeError for side tensors sent without ``spec_mode``) are raised
    before the device is touched and leave the model serving."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        failed = getattr(self, "_device_failure", None)
        if failed is not None:
            raise DeviceStepFailed(f"{fn.__name__} refused: an earlier step failed on the device ({failed}); the "
                                   f"device state cannot be trusted: restart the server (on cards reset the devices)")
        try:
            return fn(self, *args, **kwargs)
        except (ValueError, NotImplementedError):
            raise
        except Exception as err:
            if isinstance(err, DeviceStepFailed) or _raised_here(err):
                raise
            self._device_failure = f"{fn.__name__} ({_call_rows(fn, self, args, kwargs)}): {type(err).__name__}: {err}"
            logger.error(f"vllm-tt: device step failed in {self._device_failure}; this model serves nothing more")
            raise DeviceStepFailed(f"device step failed in {self._device_failure}; the requests of this call are "
                                   f"lost and the model refuses further calls: restart the server (on cards reset "
                                   f"the devices first)") from err
    return call


class DecodeHandle:
    """What ``decode_forward(read_from_device=False)`` returns: the step's logits [B, 1, V] fp32, or with
    ``sampling_params`` the sampled ids [B, 1] int32 (``tokens``; ``logits`` is then None).

    The generator reads the logits to host inside its step (one readback per step either way), so this split
    defers nothing yet; it exists so the plugin's synchronous path (which always asks for ``read_from_device=
    False`` and then calls :meth:`Qwen36ForCausalLM.process_decode_output_host`) runs. ``supports_async_decode``
    stays False: no readback overlaps the next step."""

    def __init__(self, logits: torch.Tensor | None = None, tokens: torch.Tensor | None = None):
        if (logits is None) == (tokens is None):
            raise ValueError("DecodeHandle holds logits or tokens, exactly one")
        self.logits, self.tokens = logits, tokens

    @property
    def host(self) -> torch.Tensor:
        return self.logits if self.tokens is None else self.tokens


class Qwen36ForCausalLM:
    """The vllm-tt plugin's model class for Qwen3.6 (+ MTP speculative decoding at one sequence), TP over the mesh."""

    # Keys as the plugin reads them (platform.py / spec_admission.py / async_decode.py; docs/MODEL_CAPABILITIES.md
    # there); absent keys default to False / () / 1 on the plugin side. "max_batch_size" is ours (the plugin does not
    # read it): the most sequences a plain launch decodes per step, enforced at load.
    model_capabilities = {
        # a prompt is prefilled in one call (start_pos > 0 is refused, but for the one-token decode continuation)
        "supports_chunked_prefill": False,
        "supports_prefix_caching": False,
        # with "sample_on_device_mode" in the launch's tt options the plain decode samples on device (DeviceSampler);
        # without it (the default) vLLM samples on host from the returned logits
        "supports_sample_on_device": True,
        "supports_async_decode": False,  # the logits are read inside the step (DecodeHandle)
        "output_tokens_per_step": 1,
        "supports_spec_decode": True,  # spec_plan still rejects a checkpoint without an MTP head
        # custom_class: the model's MTP drafts on device (device_propose) from the target's hidden state
        # (hidden_feed: what an MTP head declares, spec_admission.py), which stays on device (no handle crosses)
        "spec_requirements": ("device_propose", "hidden_feed"),
        "spec_hidden_handoff": ("on_device",),
        "supports_async_spec_decode": False,
        "max_batch_size": MAX_BATCH,
    }

    def __init__(self, gen: TTGenerator, reader, mechanism: str = DEFAULT_MECHANISM, cache_dir=None, *,
                 uses_mrope: bool = False, spec_k: int | None = None, spec_depth: str = "fixed",
                 depth_costs: str = DEPTH_COSTS, max_batch_size: int = 1):
        self.gen, self.model, self.state = gen, gen.model, gen.state
        if max_batch_size > 1 and spec_k:
            raise NotImplementedError(f"speculative K={spec_k} with max_batch_size={max_batch_size}: {ONE_USER}")
        # several sequences: plain decode through the batched decoder, one slot per vLLM state slot
        self.batch = _BatchServer(self, max_batch_size) if max_batch_size > 1 else None
        self.reader = reader
        self.has_mtp = reader.config.has_mtp
        if spec_depth not in DEPTH_MODES:
            raise ValueError(f"spec_depth={spec_depth!r}: choose one of {DEPTH_MODES}")
        if spec_depth == "auto" and not spec_k:
            raise ValueError("spec_depth='auto' needs the launch's num_speculative_tokens (the deepest step)")
        self.spec_depth, self.depth_costs = spec_depth, depth_costs
        self.controller = None  # the depth controller of the live sequence (auto)
        self._first_k = None  # auto: the depth chosen for a sequence's first step
        depths = self._new_controller(reader.config, spec_k).depths if spec_depth == "auto" else None
        self.spec_backend = (_VllmSpecBackend(gen, mechanism, drafter=TTMTPDrafter(reader, cache_dir),
                                              use_trace=gen.use_trace, depths=depths)
                             if self.has_mtp else None)
        self.uses_mrope = uses_mrope
        self.spec_k = spec_k  # K of the launch's speculative_config (warmup compiles that step), None = plain
        self._kv_cache = None
        self._mode = None  # None (no sequence) | "new" (after prefill) | "plain" | "spec"
        self._accepted_count = None  # tokens committed by the last spec call (1 right after prefill)
        self._prompt: list[int] | None = None  # the live sequence's prefilled tokens
        self._request_seed = None  # the seed of a live request that carries none (drawn at its prefill)
        self._sampling: SamplingParams | None = None  # the device-sampled sequence's params (None: logits)
        self._emitted: list[int] = []  # tokens the device-sampled sequence emitted (the plugin's output tokens)
        self.already_warmed_up_prefill = False
        logger.info(f"vllm-tt contract types from {vt.SOURCE}; sampling payload from {vt.SAMPLING_SOURCE}")

    # ---- configuration-time classmethods -------------------------------------------------------------------
    @classmethod
    def get_max_tokens_all_users(cls, model_name=None, num_devices=None, tt_data_parallel: int = 1,
                                 max_model_len: int = 0, max_num_seqs: int = 1, **_) -> int:
        """KV tokens vLLM may hand out: ``max_num_seqs`` sequences of ``max_model_len`` (the worker adds a block per user and
        sizes ``num_blocks`` from this; vLLM's null block 0 comes out of the same pool)."""
        return int(max_model_len) * max(1, min(int(max_num_seqs), MAX_BATCH))

    @classmethod
    def spec_plan(cls, vllm_config, max_num_seqs: int, requested_k: int):
        """``SpecPlan`` for (max_num_seqs, requested_k), or ``SpecReject`` with the K that would work. Never
        raises (the plugin's rule): every refusal is a SpecReject with the reason. With ``tt.spec_depth`` auto,
        ``effective_k`` is the deepest step (the block width the runner reserves); the depth of each step is the
        controller's choice, reported per step by ``propose_draft_tokens`` (``num_valid``) and
        :meth:`depth_plan`."""
        try:
            hf = _hf_dict(vllm_config.model_config.hf_config)
            cfg = Qwen36Config.from_dict(hf)
            max_len = int(getattr(vllm_config.model_config, "max_model_len", cfg.max_position_embeddings))
            mode = spec_depth_mode(vllm_config)
        except Exception as e:  # noqa: BLE001 - the contract forbids raising here
            return vt.SpecReject(f"cannot read the model config from vllm_config: {e}")
        if not cfg.has_mtp:
            return vt.SpecReject("the checkpoint has no MTP head (mtp_num_hidden_layers = 0): nothing drafts")
        if int(max_num_seqs) != 1:
            return vt.SpecReject(f"max_num_seqs={max_num_seqs}: {ONE_USER}")
        k, k_max = int(requested_k), max_depth(cfg)
        supported = tuple(range(1, k_max + 1))
        if not 1 <= k <= k_max:
            return vt.SpecReject(f"num_speculative_tokens={k}: this model verifies 1..{k_max} drafts (device acceptor "
                                 f"<= {MAX_K}; K+1-row SDPA verify <= {max_spec_tiles(cfg.head_dim)} rows at head_dim "
                                 f"{cfg.head_dim})", supported)
        depths = cls._controller(k).depths if mode == "auto" else (k,)
        # lanes_per_request: decode rows one speculating request occupies while verifying (spec_decode.SpecPlan);
        # the verify runs the 1+K candidates as 1+K rows of the decoder
        return vt.SpecPlan(effective_k=max(depths), lanes_per_request=1 + max(depths),
                           extra_bytes_per_seq=cls._spec_bytes(cfg, depths, max_len), extra_bytes_per_token=0,
                           accept_modes=(vt.ACCEPT_MODE_ARGMAX_IDS,), drafter_state="internal",
                           supports_narrow_decode=False)

    @staticmethod
    def _controller(k_max: int, costs: str = DEPTH_COSTS):
        return DepthPolicy.load().controller(cost_key(costs), k_max=k_max)

    def _new_controller(self, cfg: Qwen36Config, k_max: int):
        self.controller = self._controller(min(int(k_max), max_depth(cfg)), self.depth_costs)
        self._first_k = None
        return self.controller

    def depth_plan(self) -> dict:
        """What the speculative step does: mode, the depths it may use, and the depth of the next step (auto: the
        controller's choice for the live sequence, None before its first step is chosen)."""
        if self.spec_depth == "fixed":
            return {"mode": "fixed", "depths": (self.spec_k,) if self.spec_k else (), "next_k": self.spec_k}
        be = self.spec_backend
        nxt = be.next_depth if be is not None and be.depth is not None else self._first_k
        return {"mode": "auto", "depths": tuple(self.controller.depths), "next_k": nxt,
                "costs": self.controller.describe()}

    @staticmethod
    def _spec_bytes(cfg: Qwen36Config, depths, max_len: int) -> int:
        """Declared device bytes of one speculating sequence over the whole mesh (the plugin records, does not yet
        budget, this): the K+1 fp32 GDN recurrent-state candidate slots of the shadow commit for every depth the
        step may use (one ring per depth), plus the MTP head's own bf16 KV cache for ``max_len`` tokens. An
        estimate from the config, not a measurement."""
        n_gdn = sum(1 for t in cfg.layer_types if t == LINEAR)
        slots = sum(int(k) + 1 for k in depths)
        gdn = slots * n_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        mtp_kv = cfg.mtp_num_hidden_layers * 2 * max_len * cfg.num_key_value_heads * cfg.head_dim * 2
        return int(gdn + mtp_kv)

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: str | None = None, vllm_config=None, *,
                              checkpoint: str | Path | None = None, cache_dir: str | Path | None = None,
                              block_size: int | None = None, prefill_chunk: int | None = None,
                              mechanism: str = DEFAULT_MECHANISM, spec_k: int | None = None,
                              spec_depth: str | None = None, depth_costs: str = DEPTH_COSTS) -> "Qwen36ForCausalLM":
        """Build the model on an already opened ``mesh_device``. Weights come from ``checkpoint``, else
        hf_config's ``_name_or_path``, else ``HF_MODEL``; the checkpoint's config must equal ``hf_config``'s.
        ``optimizations``: None / "performance" / "accuracy" (our precision presets). ``vllm_config`` (passed by
        newer plugin loaders) supplies vLLM's KV ``block_size``, the speculative K and (``additional_config``
        ``{"tt": {"spec_depth": "auto"}}``) the depth mode, unless given explicitly. ``depth_costs``: the device
        name whose step-cost table the depth controller uses (``speculative.depth.cost_key``; the P150a table by
        default)."""
        if not 1 <= int(max_batch_size) <= MAX_BATCH:
            raise NotImplementedError(f"max_batch_size={max_batch_size}: this model decodes 1..{MAX_BATCH} sequences "
                                      f"per step (the largest decode bucket); start vLLM with --max-num-seqs <= "
                                      f"{MAX_BATCH}")
        if int(tt_data_parallel) != 1:
            raise NotImplementedError(f"tt_data_parallel={tt_data_parallel}: only 1 is supported (one TP=N model)")
        prec_name = "performance" if optimizations is None else optimizations
        if prec_name not in ("performance", "accuracy"):
            raise ValueError(f"optimizations={optimizations!r}: choose None, 'performance' or 'accuracy'")
        if vllm_config is not None:
            cache = getattr(vllm_config, "cache_config", None)
            if block_size is None and getattr(cache, "block_size", None):
                block_size = int(cache.block_size)
            sc = getattr(vllm_config, "speculative_config", None)
            if spec_k is None and sc is not None and getattr(sc, "num_speculative_tokens", None):
                spec_k = int(sc.num_speculative_tokens)
            if spec_depth is None:
                spec_depth = spec_depth_mode(vllm_config)
        spec_depth = spec_depth or "fixed"
        raw = _hf_dict(hf_config)
        cfg = Qwen36Config.from_dict(raw)
        path = checkpoint or raw.get("_name_or_path") or os.environ.get("HF_MODEL")
        if not path or not Path(path).is_dir():
            raise ValueError(f"no checkpoint directory: pass checkpoint=, or set hf_config._name_or_path / HF_MODEL "
                             f"(got {path!r})")
        reader = load_checkpoint(path)
        if reader.config != cfg:
            raise ValueError(f"hf_config does not match the checkpoint's config.json at {path}")
        if spec_k is not None and int(max_batch_size) > 1:
            raise NotImplementedError(f"speculative K={spec_k} with max_batch_size={max_batch_size}: {ONE_USER}")
        if spec_k is not None and not cfg.has_mtp:
            raise ValueError(f"speculative K={spec_k} requested but the checkpoint has no MTP head")
        if spec_k is not None and not 1 <= int(spec_k) <= max_depth(cfg):
            raise ValueError(f"speculative K={spec_k}: this model verifies 1..{max_depth(cfg)} drafts")
        ttnn = ttnn_for_mesh(mesh_device)
        n = mesh_device.get_num_devices()
        kw = {k: v for k, v in (("block_size", block_size), ("prefill_chunk", prefill_chunk)) if v is not None}
        args = TTModelArgs.from_config(cfg, n, PrecisionSetting.named(prec_name), max_seq_len=int(max_seq_len), **kw)
        weights = WeightLoader(reader, args, ttnn, mesh_device, cache_dir, progress=False).load()
        model = TTQwen36Model(args, weights, ttnn, mesh_device)
        gen = TTGenerator(model, allocate_state(args, ttnn, mesh_device), use_trace=True,
                          label=getattr(mesh_device, "label", "") or f"mesh x{n}")
        logger.info(f"vllm-tt Qwen3.6: tp={n}, precision={prec_name}, max_seq_len={max_seq_len}, "
                    f"block_size={args.block_size}, mtp={cfg.has_mtp}, spec_k={spec_k}, spec_depth={spec_depth}")
        return cls(gen, reader, mechanism, cache_dir, uses_mrope=_uses_mrope(raw), spec_k=spec_k,
                   spec_depth=spec_depth, depth_costs=depth_costs, max_batch_size=int(max_batch_size))

    # ---- KV cache ------------------------------------------------------------------------------------------
    def _attn_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.state.layers) if isinstance(s, KVLayerState)]

    def allocate_kv_cache_per_layer(self, per_layer_specs) -> list:
        """One ``(shape, dtype, tensor_index)`` per full-attention layer, in layer order, as the runner builds them:
        shape = (num_blocks, kv_heads per device, block_size, head_dim). The caches are (re)allocated with vLLM's
        ``num_blocks`` (before any trace is captured); the element dtype stays the precision preset's."""
        specs = list(per_layer_specs)
        ids = self._attn_layers()
        if len(specs) != len(ids):
            raise ValueError(f"{len(specs)} KV cache specs for {len(ids)} full-attention layers")
        shapes = {tuple(int(x) for x in s[0]) for s in specs}
        if len(shapes) != 1:
            raise ValueError(f"per-layer KV shapes differ ({sorted(shapes)}); every Qwen3.6 attention layer has one")
        return self._allocate(shapes.pop(), specs[0][1])

    def allocate_kv_cache(self, kv_cache_shape=None, dtype=None, num_layers: int | None = None) -> list:
        """Legacy uniform form: ``(num_blocks, kv_heads per device, block_size, head_dim)`` for ``num_layers``
        attention layers. Without a shape, the model's own caches (one sequence of max_seq_len) are returned."""
        n_attn = len(self._attn_layers())
        if num_layers is not None and int(num_layers) not in (n_attn, self.model.args.cfg.num_hidden_layers):
            raise ValueError(f"num_layers={num_layers}: model has {self.model.args.cfg.num_hidden_layers} layers, "
                             f"{n_attn} with a KV cache")
        if kv_cache_shape is None:
            if self._kv_cache is None:
                self._kv_cache = [[s.k, s.v] for s in self.state.layers if isinstance(s, KVLayerState)]
            return self._kv_cache
        return self._allocate(tuple(int(x) for x in kv_cache_shape), dtype)

    def _allocate(self, shape: tuple, dtype) -> list:
        a, c = self.model.args, self.model.args.cfg
        want = (a.hkv_d, a.block_size, c.head_dim)
        if len(shape) != 4 or shape[1:] != want:
            raise ValueError(f"kv_cache_shape {shape}: expected (num_blocks, {want[0]} kv heads per device, block_size "
                             f"{want[1]}, head_dim {want[2]}); vLLM's --block-size must equal the model's block_size")
        num_blocks = shape[0]
        if num_blocks < 2:
            raise ValueError(f"kv_cache_shape {shape}: need at least the null block and one block")
        self._release_traces()  # caches are persistent buffers the traces point at: replace them before capture
        for i in self._attn_layers():
            old = self.state.layers[i]
            self.gen.ttnn.deallocate(old.k)  # the model's own one-sequence cache: vLLM's pool replaces it
            self.gen.ttnn.deallocate(old.v)
            self.state.layers[i] = self._kv_state(num_blocks)
            if self.batch is not None:  # the batched decoder reads and writes the same pool
                self.batch.dec.replace_kv(i, self.state.layers[i])
        self.num_blocks = num_blocks
        if self.batch is not None:
            self.batch.fit_page_tables(num_blocks)
        if dtype is not None:
            logger.info(f"KV cache: {num_blocks} blocks of {a.block_size} tokens; vLLM's dtype {dtype} noted, the "
                        f"element dtype follows the precision preset")
        self._kv_cache = [[s.k, s.v] for s in self.state.layers if isinstance(s, KVLayerState)]
        return self._kv_cache

    def _kv_state(self, num_blocks: int) -> KVLayerState:
        """A full-attention layer's paged cache with ``num_blocks`` blocks (same layout / dtype as state.py's)."""
        a = self.model.args

        class _Blocks:  # new_layer_state sizes the cache from args.num_blocks; ask for vLLM's count instead
            def __getattr__(self, name):
                return num_blocks if name == "num_blocks" else getattr(a, name)

        return new_layer_state(_Blocks(), self.gen.ttnn, self.gen.mesh, FULL)

    def _release_traces(self) -> None:
        self.gen.release_trace()
        if self.batch is not None:
            self.batch.dec.release()
        if self.spec_backend is not None:
            self.spec_backend.release()

    # ---- per-call argument handling ------------------------------------------------------------------------
    def _check_common(self, kv_cache, kwargs: dict) -> None:
        if kv_cache is not None and self._kv_cache is not None and kv_cache is not self._kv_cache:
            raise ValueError("kv_cache must be the list returned by this model's allocate_kv_cache[_per_layer]()")
        if kwargs.get("page_tables_per_layer") is not None or kwargs.get("page_tables_per_group") is not None:
            pts = kwargs.get("page_tables_per_layer") or kwargs.get("page_tables_per_group")
            if any(not torch.equal(torch.as_tensor(p), torch.as_tensor(pts[0])) for p in pts):
                raise NotImplementedError("per-layer block tables differ; every Qwen3.6 attention layer shares one")
        remap = kwargs.get("slot_remap")
        if remap is not None and self.batch is None:
            r = torch.as_tensor(remap).reshape(-1)
            if r.numel() and int(r[0]) != 0:
                raise NotImplementedError(f"slot_remap {r.tolist()}: row 0 must read slot 0 ({ONE_USER})")
        deltas = kwargs.get("rope_deltas_all_users")
        if deltas is not None and any(float(x) != 0 for x in torch.as_tensor(deltas, dtype=torch.float64).reshape(-1)):
            raise NotImplementedError(f"rope_deltas_all_users={list(deltas)}: text-only model, mrope deltas are 0")

    def _live_rows(self, positions: torch.Tensor, what: str) -> None:
        """Row 0 is the sequence; every other row must be a padding row (position -1 in the first column)."""
        first = positions.reshape(positions.shape[0], -1)[:, 0]
        live = [i for i in range(1, first.numel()) if int(first[i]) >= 0]
        if live:
            raise NotImplementedError(f"{what}: rows {live} carry a second live request; {ONE_USER}")

    def _bind_page_table(self, page_table) -> None:
        """Copy the sequence's row of vLLM's block table into the model's persistent page-table buffer (host ->
        device, outside any trace) when it changed. Entries past the model's blocks_per_seq must be the null
        block 0; every id must index the allocated cache."""
        if page_table is None:
            return
        pt = torch.as_tensor(page_table)
        if pt.dim() != 2:
            raise ValueError(f"page_table must be [B, max_blocks], got shape {tuple(pt.shape)}")
        row = pt[0].to(torch.int32)
        bps = self.model.args.blocks_per_seq
        if row.numel() > bps and bool((row[bps:] != 0).any()):
            raise ValueError(f"page_table row 0 names blocks past blocks_per_seq={bps} (max_seq_len "
                             f"{self.model.args.max_seq_len}): {row[bps:].tolist()}")
        limit = getattr(self, "num_blocks", self.model.args.num_blocks)
        if int(row.min()) < 0 or int(row.max()) >= limit:
            raise ValueError(f"page_table row 0 has block ids outside [0, {limit}): {row.tolist()}")
        new = torch.zeros(bps, dtype=torch.int32)
        w = min(bps, row.numel())
        new[:w] = row[:w]
        host = self.state.page_table_host
        if torch.equal(host[0], new):
            return
        host[0] = new
        ttnn, dev = self.gen.ttnn, self.state.page_table
        h = ttnn.from_torch(host.clone(), dtype=dev.dtype, layout=dev.layout,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(dev.device()))
        ttnn.copy_host_to_device_tensor(h, dev)

    # ---- prefill -------------------------------------------------------------------------------------------
    @stops_on_device_failure
    @torch.no_grad()
    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, enable_trace: bool = False,
                        sampling_params=None, start_pos=None, empty_slots=None, **kwargs):
        """Prefill the sequence ``tokens[0, :prompt_lens[0]]`` into the blocks of ``page_table[0]``; returns fp32
        last-token logits [B, 1, V], or ``(logits, rope_deltas [B])`` when the config uses mrope (text only: every
        delta is 0). Prefill runs eagerly (``enable_trace`` is accepted and has no effect)."""
        self._check_common(kv_cache, kwargs)
        tokens = _rows(tokens, "tokens")
        lens = torch.as_tensor(prompt_lens).reshape(-1)
        if tokens.dim() != 2 or lens.numel() != tokens.shape[0]:
            raise ValueError(f"tokens [B, T] and prompt_lens [B] disagree: {tuple(tokens.shape)}, {tuple(lens.shape)}")
        if self.batch is not None:
            return self.batch.prefill(tokens, lens, start_pos, page_table, empty_slots, sampling_params)
        if tokens.shape[0] > 1:
            raise NotImplementedError(f"prefill of {tokens.shape[0]} requests in one call: {ONE_USER}")
        start = 0 if start_pos is None else int(torch.as_tensor(start_pos).reshape(-1)[0])
        if empty_slots is not None and list(empty_slots) != [0]:
            raise NotImplementedError(f"empty_slots={list(empty_slots)}: the only state slot is 0; {ONE_USER}")
        if start != 0:
            return self._one_token_continuation(tokens, start, int(lens[0]), page_table, enable_trace,
                                                sampling_params)
        self._bind_page_table(page_table)
        prompt = tokens[0, : int(lens[0])].tolist()
        logits = self._prefill(prompt)
        out = logits.reshape(1, 1, -1)
        if sampling_params is not None:  # sample_on_device_mode "all": the runner expects the first token
            out = torch.tensor([[self._first_token(prompt, logits, sampling_params)]], dtype=torch.int32)
        if self.uses_mrope:
            return out, torch.zeros(1, dtype=torch.int64)
        return out

    def _one_token_continuation(self, tokens, start: int, end: int, page_table, enable_trace: bool,
                                sampling_params):
        """A prefill call that continues the live sequence by exactly one token is that sequence's next decode step.

        The plugin's synchronous runner sends decode steps this way: its ``_prepare_model_inputs`` classifies a
        request as "still prefilling" while ``num_computed_tokens < num_tokens``, and after a step's token is
        applied to its input batch that holds for the next step too (the scheduler counts the new token as not
        yet computed), so the step arrives as ``prefill_forward(tokens[:, :n+1], start_pos=[n], prompt_lens=[n+1])``
        and expects the prefill's return form. Anything else that starts past 0 (a cached prefix, a real chunked
        prefill) is refused."""
        if self._mode not in ("new", "plain") or start != self.state.pos or end != start + 1:
            raise NotImplementedError(f"prefill start_pos=[{start}], prompt_lens=[{end}]: a prefill continues no "
                                      f"cached prefix here (run vLLM without prefix caching / chunked prefill); only the "
                                      f"one-token continuation of the live sequence (its next decode step) is served")
        if tokens[0, : len(self._prompt)].tolist() != self._prompt:
            raise ValueError("prefill continuation: its tokens do not start with the live sequence's prompt")
        self._bind_page_table(page_table)
        pos = torch.full((tokens.shape[0],), -1, dtype=torch.int32)  # rows past 0: padding (position -1)
        pos[0] = start
        out = self.decode_forward(tokens[:, start: start + 1], None, None, pos, enable_trace=enable_trace,
                                  read_from_device=True, sampling_params=sampling_params)
        if self.uses_mrope:
            return out, torch.zeros(tokens.shape[0], dtype=torch.int64)
        return out

    def _prefill(self, prompt: list[int]) -> torch.Tensor:
        if self.spec_backend is not None:
            self.spec_backend.use_trace = self.gen.use_trace
            self.spec_backend.join(0, prompt, SamplingParams())  # greedy; also keeps the MTP's h_t
            logits = self.spec_backend.prefill_logits
            if self.spec_depth == "auto":  # a new sequence: acceptance estimates start from the fitted prior
                self._new_controller(self.model.args.cfg, self.spec_k)
        else:
            logits = self.gen.prefill(prompt)
        self._mode, self._accepted_count = "new", 1
        self._prompt, self._sampling, self._emitted = list(prompt), None, []
        self._request_seed = secrets.randbits(31)  # used only if the request carries no seed
        return logits

    # ---- sampling (sample_on_device_mode) ------------------------------------------------------------------
    def _request_params(self, sampling_params) -> SamplingParams:
        """Row 0 of the plugin's payload as our params; within one sequence they must stay the same."""
        params = sampling_from_plugin(sampling_params, self.model.args.cfg.vocab_size, self._request_seed)
        if self._sampling is not None and params != self._sampling:
            raise ValueError(f"sampling_params changed within one sequence ({self._sampling.describe()} -> "
                             f"{params.describe()}): a new request starts with a prefill")
        if self.spec_k and (not params.greedy or params.penalized):
            raise NotImplementedError(f"speculative launch: {params.describe()} requested, but the verify serves "
                                      f"greedy requests without penalties only (accept mode argmax_ids; the plugin "
                                      f"admits no other request under speculation)")
        return params

    def _first_token(self, prompt: list[int], logits: torch.Tensor, sampling_params) -> int:
        """The prefill's token from the prompt's last row, picked on the host with the request's params (as
        ``TTGenerator.generate`` picks it); a plain launch then starts the device sampler for the decode steps."""
        params = self._request_params(sampling_params)
        gen = params.generator() if not params.greedy else None
        tok = int(pick_token(logits.reshape(1, -1), params, gen,
                             TokenHistory(prompt, self.model.args.cfg.vocab_size).now()))
        if not self.spec_k:
            self._start_sampler(params, tok)
        return tok

    def _start_sampler(self, params: SamplingParams, first: int) -> None:
        """Device sampling for the live sequence: the sampler of ``params`` (re)allocated while no trace is live
        (the prefill released them), penalty state from the prompt and ``first``, the seeded stream restarted."""
        self.gen.release_trace()  # the sample trace reads the sampler's buffers: never live across a swap
        self.gen.sampler = self.gen._sampler_for(params)
        self.gen.sampler.start(0, params, self._prompt, first)
        self._sampling, self._emitted = params, [first]

    def _check_history(self, prompt_tokens, output_tokens) -> None:
        """The plugin's token history (sent with device sampling when a penalty is on) must be the sequence the
        device penalty state was built from."""
        if prompt_tokens is None and output_tokens is None:
            return
        pt = [int(t) for t in torch.as_tensor(prompt_tokens)[0].tolist() if int(t) != -1]
        ot = [int(t) for t in torch.as_tensor(output_tokens)[0].tolist() if int(t) != -1]
        if pt != self._prompt or ot != self._emitted:
            raise ValueError(f"the runner's token history (prompt {len(pt)} tokens, output {len(ot)}) differs from the "
                             f"sequence the device penalty state holds (prompt {len(self._prompt)}, output "
                             f"{len(self._emitted)}): a request resumed after preemption re-prefills its output as "
                             f"prompt, which the penalty state cannot tell apart")

    # ---- decode / verify -----------------------------------------------------------------------------------
    @stops_on_device_failure
    @torch.no_grad()
    def decode_forward(self, tokens, page_table=None, kv_cache=None, start_pos=None, *, enable_trace: bool = True,
                       read_from_device: bool = True, sampling_params=None, num_valid_drafts=None,
                       accepted_counts=None, spec_mode=None, **kwargs):
        """Plain decode (tokens [B, 1], start_pos [B]) -> fp32 logits [B, 1, V] (or a :class:`DecodeHandle` with
        ``read_from_device=False``). With ``spec_mode="argmax_ids"`` (tokens / start_pos [B, 1+K]) -> the verify:
        ``VerifyOutput(argmax_ids [B, 1+K] int32)``; column j < n is the choice draft j must match, column n the
        correction/bonus (n = num_valid_drafts of the row)."""
        self._check_common(kv_cache, kwargs)
        tokens = _rows(tokens, "tokens")
        if tokens.dim() != 2 or tokens.shape[0] < 1:
            raise ValueError(f"tokens must be [B, T] with at least one row, got shape {tuple(tokens.shape)}")
        if start_pos is None:
            raise ValueError("decode_forward needs start_pos")
        pos = torch.as_tensor(start_pos)
        if pos.shape[0] != tokens.shape[0]:
            raise ValueError(f"start_pos rows {pos.shape[0]} != tokens rows {tokens.shape[0]}")
        if self.batch is not None:
            if spec_mode is not None or num_valid_drafts is not None or accepted_counts is not None:
                raise NotImplementedError(f"a speculative step in a launch of several sequences: {ONE_USER}")
            return self.batch.decode(tokens, pos, page_table, kwargs.get("slot_remap"), enable_trace,
                                     read_from_device, sampling_params)
        self._live_rows(pos, "decode_forward")
        if self._mode is None:
            raise RuntimeError("decode_forward with no live sequence (prefill_forward first)")
        self._bind_page_table(page_table)
        if spec_mode is not None:
            if sampling_params is not None:
                self._request_params(sampling_params)  # greedy without penalties, or refused
            out = self._verify(tokens, pos, num_valid_drafts, accepted_counts, spec_mode, enable_trace)
            return out
        if num_valid_drafts is not None or accepted_counts is not None:
            # a TypeError, as the plugin's reference model raises: a caller that sends the side tensors and forgets
            # the mode called this wrong and must not get a plain decode back
            raise TypeError("num_valid_drafts / accepted_counts arrive together with spec_mode, never without")
        if tokens.shape[1] != 1:
            raise ValueError(f"plain decode takes tokens [B, 1], got {tuple(tokens.shape)}")
        self._enter("plain")
        start = int(pos.reshape(-1)[0])
        if start != self.state.pos:
            raise ValueError(f"start_pos {start} != the sequence's next position {self.state.pos} (decode continues "
                             f"the prefilled sequence; a resumed request is prefilled again)")
        self.gen.use_trace = bool(enable_trace)
        if sampling_params is not None:
            return self._sampled_decode(tokens, sampling_params, read_from_device, kwargs)
        if self._sampling is not None:
            raise RuntimeError("decode without sampling_params in a sequence sampled on device: one sequence is "
                               "sampled on device or on the host throughout")
        logits, _ = self.gen.decode_step(int(tokens[0, 0]))
        out = torch.zeros(tokens.shape[0], 1, logits.shape[-1], dtype=torch.float32)
        out[0, 0] = logits
        return out if read_from_device else DecodeHandle(out)

    def _sampled_decode(self, tokens, sampling_params, read_from_device: bool, kwargs: dict):
        """Plain decode step whose token the device picks (the traced decode + DeviceSampler step)."""
        params = self._request_params(sampling_params)
        tok_in = int(tokens[0, 0])
        if self._sampling is None:
            # sample_on_device_mode "decode_only": vLLM sampled the prefill's token on the host; it is this input
            if self.state.pos != len(self._prompt):
                raise RuntimeError("sampling_params on a sequence whose earlier decode steps returned logits: one "
                                   "sequence is sampled on device or on the host throughout")
            self._start_sampler(params, tok_in)
        elif tok_in != self._emitted[-1]:
            raise ValueError(f"decode input token {tok_in} != the token this model sampled last ({self._emitted[-1]})")
        self._check_history(kwargs.get("prompt_tokens"), kwargs.get("output_tokens"))
        tok, _ = self.gen.sample_step(tok_in)
        self._emitted.append(tok)
        out = torch.zeros(tokens.shape[0], 1, dtype=torch.int32)  # padding rows: token 0, never read
        out[0, 0] = tok
        return out if read_from_device else DecodeHandle(tokens=out)

    def read_decode_output(self, tt_out, async_read: bool = False):
        """Host copy of a decode output; with ``async_read`` the plugin's ``(output, events)`` pair (no events:
        the logits are already on host, see :class:`DecodeHandle`)."""
        host = tt_out.host if isinstance(tt_out, DecodeHandle) else tt_out
        return (host, []) if async_read else host

    def process_decode_output_host(self, tt_out, is_tokens: bool = False):
        """[B, 1, V] fp32 logits, or with ``is_tokens`` (the runner sampled on device) the ids [B, 1] int32, from
        what decode_forward / read_decode_output returned."""
        if not isinstance(tt_out, DecodeHandle):
            return tt_out
        if is_tokens != (tt_out.tokens is not None):
            raise ValueError(f"process_decode_output_host(is_tokens={is_tokens}) but the decode "
                             f"{'sampled on device' if tt_out.tokens is not None else 'returned logits'}: the runner "
                             f"passes sampling_params exactly when it expects tokens")
        return tt_out.host

    def _enter(self, mode: str) -> None:
        if self._mode not in ("new", mode):
            raise RuntimeError(f"{mode} step in a sequence that runs {self._mode} steps: plain decode and spec "
                               f"steps cannot be mixed within one sequence (prefill a new one)")
        if mode == "spec" and self.spec_backend is None:
            raise NotImplementedError("speculative decoding needs the checkpoint's MTP head (mtp_num_hidden_layers"
                                      " = 0 here)")
        self._mode = mode

    def _check_accepted(self, accepted_counts, rows: int) -> None:
        if accepted_counts is None:
            raise ValueError("spec step needs accepted_counts[B] (tokens the previous step committed; 1 after the "
                             "prefill)")
        ac = torch.as_tensor(accepted_counts).reshape(-1)
        if ac.numel() != rows:
            raise ValueError(f"accepted_counts has {ac.numel()} rows, the block {rows}")
        if int(ac[0]) != self._accepted_count:
            raise ValueError(f"accepted_counts[0]={int(ac[0])} selects state slot {int(ac[0]) - 1}, but the device "
                             f"committed slot {self._accepted_count - 1} ({self._accepted_count} tokens): our step "
                             f"commits on device with the greedy count, a different slot is not supported")

    def _verify(self, tokens, pos, num_valid_drafts, accepted_counts, spec_mode, enable_trace: bool):
        if spec_mode != vt.ACCEPT_MODE_ARGMAX_IDS:
            raise NotImplementedError(f"spec_mode={spec_mode!r}: this model serves {vt.ACCEPT_MODE_ARGMAX_IDS!r}")
        b, k = tokens.shape[0], tokens.shape[1] - 1
        if k < 1 or b < 1 or tuple(pos.shape) != tuple(tokens.shape):
            raise ValueError(f"verify needs tokens and start_pos [B, 1+K] with at least one row and K >= 1, got "
                             f"{tuple(tokens.shape)} and {tuple(pos.shape)}")
        # the contract's domain for the side tensors, on every row (padding rows too): both sides check the same
        vt.check_spec_side_tensors(num_valid_drafts, accepted_counts, b, k)
        self._enter("spec")
        self._check_accepted(accepted_counts, b)
        if num_valid_drafts is None:
            raise ValueError("spec_mode needs num_valid_drafts[B]")
        nv_all = torch.as_tensor(num_valid_drafts).reshape(-1)
        nv = int(nv_all[0])
        if nv_all.numel() != b or not 0 <= nv <= k:
            raise ValueError(f"num_valid_drafts {nv_all.tolist()} must be [B={b}] in [0, K={k}]")
        row = [int(t) for t in tokens[0].tolist()]
        prow = [int(p) for p in pos[0].tolist()]
        n = self.spec_backend.n
        if row[0] != self.spec_backend.history[-1] or prow[0] != n:
            raise ValueError(f"verify row 0 (token {row[0]} at {prow[0]}) must be the pending token "
                             f"{self.spec_backend.history[-1]} at position {n}")
        if prow[: nv + 1] != list(range(n, n + nv + 1)):
            raise ValueError(f"verify positions {prow[: nv + 1]} != {list(range(n, n + nv + 1))}")
        self.spec_backend.use_trace = bool(enable_trace)
        kd = self._step_depth(k)  # the depth of this step: the block width, or (auto) the controller's choice
        if nv > kd:
            raise ValueError(f"num_valid_drafts={nv} but this step drafted {kd} (propose_draft_tokens' num_valid)")
        self._draft(kd)
        drafts = row[1: nv + 1]
        vocab = self.model.args.cfg.vocab_size
        self.spec_backend.step_state.write_drafts(drafts + [0] * (kd - nv))  # placeholder columns: any valid id, never read
        self.spec_backend.write_accept_drafts(drafts + [vocab] * (kd - nv))  # never equal to an argmax: acceptance <= n
        vout = self.spec_backend.verify(None)
        ids = self.model.to_host(vout.out.tokens).reshape(-1).to(torch.int64)[: kd + 1]
        acc = self.spec_backend.accept(None, vout)[0]
        host_a = 0
        while host_a < nv and drafts[host_a] == int(ids[host_a]):
            host_a += 1
        if host_a != acc.num_accepted:
            raise RuntimeError(f"device acceptor accepted {acc.num_accepted} drafts but the argmax ids imply {host_a}")
        if self.spec_depth == "auto":
            # the next depth, from the count accept() just read (no other device read), before the commit drafts it
            if nv:
                self.controller.observe(nv, acc.num_accepted)
            self.spec_backend.plan_next_depths({0: self.controller.choose()})
        self.spec_backend.commit({0: acc})
        self._accepted_count = acc.num_accepted + 1
        out = torch.zeros(b, k + 1, dtype=torch.int32)  # padding rows / columns past this step's depth: never read
        out[0, : kd + 1] = ids.to(torch.int32)
        return vt.VerifyOutput(spec_mode=vt.ACCEPT_MODE_ARGMAX_IDS, argmax_ids=out, hidden=None)

    def _step_depth(self, width: int) -> int:
        """Depth of the open step: the block width K (fixed), or the depth the last commit drafted at (auto; the
        controller's first choice for a sequence's first step)."""
        if self.spec_depth == "fixed":
            return width
        if width < self.controller.k_max:
            raise ValueError(f"verify block width K={width} < the deepest step {self.controller.k_max}")
        be = self.spec_backend
        if be.depth is not None:
            return be.next_depth
        if self._first_k is None:
            self._first_k = self.controller.choose()
        return self._first_k

    def _draft(self, k: int) -> None:
        if self.spec_backend.phase != "drafted":
            self.spec_backend.draft({0: k})  # first call at this K: allocates, MTP prefill + first chain
        elif k != self.spec_backend.depth:
            raise ValueError(f"verify with K={k} after propose_draft_tokens(K={self.spec_backend.depth})")

    @stops_on_device_failure
    @torch.no_grad()
    def propose_draft_tokens(self, num_drafts: int, committed_tokens, committed_positions, accepted_counts,
                             hidden=None):
        """``DraftOutput(draft_token_ids [B, K] int32, num_valid [B] int32)`` from the device MTP: the drafts its
        chain already wrote after the last commit (moves no state). ``committed_tokens`` [B, 1+K]: this step's
        committed block; entry ``accepted_counts - 1`` of row 0 is the pending token. Padding rows get
        placeholder ids and ``num_valid`` 0. ``hidden`` is None: the MTP reads the verify hidden on device."""
        if hidden is not None:
            raise NotImplementedError("hidden must be None: the MTP reads the verify's hidden state on device "
                                      "(spec_hidden_handoff on_device)")
        ct = _rows(committed_tokens, "committed_tokens")
        cp = torch.as_tensor(committed_positions)
        b, width = ct.shape[0], int(num_drafts)
        if ct.dim() != 2 or tuple(cp.shape) != tuple(ct.shape) or b < 1 or ct.shape[1] != width + 1:
            raise ValueError(f"propose needs committed tokens and positions of one shape [B, 1+K] (K = num_drafts "
                             f"= {width}, at least one row), got {tuple(ct.shape)} and {tuple(cp.shape)}")
        vt.check_spec_side_tensors(torch.zeros(b, dtype=torch.int32), accepted_counts, b, width, call="propose")
        self._enter("spec")
        self._check_accepted(accepted_counts, b)
        k = self._step_depth(width)
        pending = int(ct.reshape(b, -1)[0, self._accepted_count - 1])
        if pending != self.spec_backend.history[-1]:
            raise ValueError(f"committed token {pending} (entry {self._accepted_count - 1}) != the model's pending "
                             f"token {self.spec_backend.history[-1]}")
        self._draft(k)
        drafts, _ = self.spec_backend.drafter.head.read_drafts()
        ids = torch.full((b, width), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        ids[0, :k] = torch.tensor(drafts, dtype=torch.int32)
        nv = torch.zeros(b, dtype=torch.int32)
        nv[0] = k  # auto: the controller's depth for this step (<= the width vLLM reserved)
        return vt.DraftOutput(draft_token_ids=ids, num_valid=nv)

    # ---- request lifecycle ---------------------------------------------------------------------------------
    def release_request(self, slot: int) -> None:
        """A finished / preempted request: forget the sequence (its GDN state is zeroed by the next prefill)."""
        if self.batch is not None:
            self.batch.release(int(slot))
            return
        if int(slot) != 0:
            raise ValueError(f"release_request(slot={slot}): the only state slot is 0")
        if self.spec_backend is not None and self.spec_backend.phase == "drafted":
            self.spec_backend.abort()  # the outstanding proposal belongs to the released request
        self._mode, self._accepted_count = None, None
        self._prompt, self._sampling, self._emitted, self._request_seed = None, None, [], None

    def note_state_slots_moved(self, old_to_new: dict) -> None:
        moved = {int(a): int(b) for a, b in dict(old_to_new).items() if int(a) != int(b)}
        if moved and self.batch is not None:
            raise NotImplementedError(f"state slots moved {moved} outside a decode call: this model moves state "
                                      f"with decode_forward's slot_remap (a permutation applied on device)")
        if moved:
            raise NotImplementedError(f"state slots moved {moved}: the only state slot is 0 ({ONE_USER})")

    # ---- warmup --------------------------------------------------------------------------------------------
    def _warm_prompt_lens(self) -> list[int]:
        """Prompt lengths that exercise every prefill program shape: one partial chunk and a full chunk + a
        partial one (prefill runs in ``prefill_chunk`` pieces)."""
        a = self.model.args
        room = a.max_seq_len - (self.spec_k or 0) - 2
        return sorted({min(1, room), min(a.prefill_chunk + 1, room)})

    def _warm_page_table(self) -> torch.Tensor:
        """Scratch blocks for warmup (no request exists yet), never vLLM's null block 0."""
        limit = getattr(self, "num_blocks", self.model.args.num_blocks)
        return (1 + torch.arange(self.model.args.blocks_per_seq, dtype=torch.int32) % (limit - 1))[None]

    @stops_on_device_failure
    @torch.no_grad()
    def warmup_model_prefill(self, kv_cache=None, enable_trace: bool = False, can_sample_on_device: bool = False,
                             **_) -> None:
        """Compile the prefill programs for every chunk shape (dummy prompts, no request exists yet: any block
        is scratch). Prefill is not traced, so the ``enable_trace=True`` pass has nothing to capture."""
        if enable_trace or self.already_warmed_up_prefill:
            return
        if self.batch is not None:
            self.batch.warmup_prefill(self._warm_prompt_lens())
            self.already_warmed_up_prefill = True
            return
        self._bind_page_table(self._warm_page_table())
        for n in self._warm_prompt_lens():
            self._prefill([i % self.model.args.cfg.vocab_size for i in range(1, n + 1)])
        self.already_warmed_up_prefill = True
        self.release_request(0)

    @stops_on_device_failure
    @torch.no_grad()
    def warmup_model_decode(self, kv_cache=None, enable_trace: bool = False, max_batch_size: int = 1,
                            num_blocks: int | None = None, can_sample_on_device: bool = False, **_) -> None:
        """Compile (``enable_trace=False``: one eager step) and then capture (``True``: eager step + capture +
        one replay) the decode step of this launch: plain decode, or the K-draft verify + commit + MTP chain when
        the launch speculates (``can_sample_on_device`` in a plain launch: also the device-sampled step, greedy and
        stochastic with penalties). A prefill re-captures (it allocates), so the request's own capture on its second
        step reuses the programs compiled here and allocates no new program-cache entries."""
        slots = self.batch.dec.slots if self.batch is not None else 1
        if int(max_batch_size) > slots:
            raise NotImplementedError(f"warmup max_batch_size={max_batch_size} > the {slots} sequence(s) this model "
                                      f"was loaded for" + ("" if self.batch is not None else f": {ONE_USER}"))
        if self.batch is not None:
            self.batch.warmup_decode(3 if enable_trace else 1, bool(enable_trace), bool(can_sample_on_device))
            return
        self._bind_page_table(self._warm_page_table())
        steps = 3 if enable_trace else 1
        self.gen.use_trace = bool(enable_trace)
        prompt = [1, 2]
        first = int(self._prefill(prompt).argmax())
        if self.spec_k:
            k = self.spec_k
            self.spec_backend.use_trace = bool(enable_trace)
            pos, tok, ac, block = len(prompt), first, 1, [first]
            for i in range(steps):  # as the runner: the first verify after a prefill carries no drafts
                nv, drafts = 0, [vt.PLACEHOLDER_TOKEN_ID] * k
                if i:
                    pad = [vt.PLACEHOLDER_TOKEN_ID] * (k + 1 - len(block))
                    d = self.propose_draft_tokens(k, torch.tensor([block + pad], dtype=torch.int32),
                                                  torch.tensor([list(range(pos - ac + 1, pos + 1)) + [-1] * len(pad)],
                                                               dtype=torch.int32),
                                                  torch.tensor([ac], dtype=torch.int32))
                    nv, drafts = int(d.num_valid[0]), d.draft_token_ids[0].tolist()  # auto: nv <= k
                v = self.decode_forward(torch.tensor([[tok] + drafts]), None, None,
                                        torch.tensor([[pos + j if j <= nv else -1 for j in range(k + 1)]]),
                                        enable_trace=enable_trace,
                                        num_valid_drafts=torch.tensor([nv], dtype=torch.int32),
                                        accepted_counts=torch.tensor([ac], dtype=torch.int32),
                                        spec_mode=vt.ACCEPT_MODE_ARGMAX_IDS)
                a = self._accepted_count - 1
                block = v.argmax_ids[0, : a + 1].tolist()
                tok, pos, ac = block[-1], pos + a + 1, a + 1
        else:
            tok = first
            for i in range(steps):
                logits = self.decode_forward(torch.tensor([[tok]]), None, None, torch.tensor([len(prompt) + i]),
                                             enable_trace=enable_trace)
                tok = int(logits[0, -1].argmax())
            if can_sample_on_device:
                # the device-sampled step, greedy and stochastic with every penalty (all of the sampler's programs)
                for sp in (vt.TTSamplingParams(temperature=[0.0], top_k=[1], top_p=[0.0], seed=[None],
                                               num_logprobs=[vt.LOGPROBS_NONE], enable_log_probs=[False]),
                           vt.TTSamplingParams(temperature=[1.0], top_k=[8], top_p=[0.9], presence_penalty=[0.5],
                                               frequency_penalty=[0.5], repetition_penalty=[1.1], seed=[0],
                                               num_logprobs=[vt.LOGPROBS_NONE], enable_log_probs=[False])):
                    self.release_request(0)
                    tok = int(self._first_token(prompt, self._prefill(prompt), sp))
                    for i in range(steps):
                        out = self.decode_forward(torch.tensor([[tok]]), None, None,
                                                  torch.tensor([len(prompt) + i]), enable_trace=enable_trace,
                                                  sampling_params=sp)
                        tok = int(out[0, 0])
        self.release_request(0)

    # ---- shutdown ------------------------------------------------------------------------------------------
    def modules(self):
        """No torch modules (the weights live on the mesh). vLLM's engine walks ``model.modules()`` when it is
        garbage-collected (``LLMEngine._cleanup_instance_caches``) and raised AttributeError at exit without this."""
        return iter(())

    def release_persistent_capture(self) -> None:
        """Called once by the runner before the mesh closes: release every trace."""
        self._release_traces()

    def close(self) -> None:
        if self.spec_backend is not None:
            self.spec_backend.close()
        self._release_traces()


class _BatchServer:
    """Several vLLM sequences on one :class:`TTBatchDecoder` (plain decode, logits to vLLM's host sampler).

    vLLM state slot j is decoder slot j. The plugin names each prefilling row's slot (``empty_slots``) and, before
    a decode call, the permutation that takes every request's state to its row (``slot_remap``, applied on
    device). Its synchronous runner sends every decode step as a one-token prefill continuation (see
    :meth:`Qwen36ForCausalLM._one_token_continuation`); a continuation row names no source slot, only a
    destination, so the source is the slot whose fed tokens are the row's ``tokens[:start_pos]`` (two slots with
    the same tokens hold the same state), and the continuing states are moved to their destinations by one
    on-device permutation before the step. The plugin does not tell a model when a request finishes (a finished
    request's slot is simply named again by a later prefill), so a prefill into a held slot replaces it, and until
    then a finished request's slot counts as held (the decoder shrinks to a smaller bucket only below that)."""

    def __init__(self, owner: "Qwen36ForCausalLM", slots: int):
        self.owner = owner
        # the decode buckets below max_num_seqs, and max_num_seqs itself: a step runs the smallest that holds the
        # live sequences (the runner pads every decode to max_num_seqs rows; the padding costs nothing here)
        buckets = tuple(b for b in DEFAULT_BUCKETS if b < slots) + (slots,)
        self.dec = BucketedBatchDecoder(owner.model, buckets, use_trace=True, sampling=True)
        self.fed: list[list[int] | None] = [None] * slots  # tokens whose state each slot holds (None: free)
        # per slot: prompt length, the request's seed if it carries none (drawn at its prefill), the params its device
        # sampler row holds (None: never sampled on device), the token the device sampled last (None: the last token
        # came from vLLM's host sampler, so the penalty row must be rewritten before the next device step)
        self.meta: list[dict | None] = [None] * slots

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _page_rows(self, page_table, slots: dict[int, int], tokens: dict[int, int] | None = None) -> None:
        """Row i of vLLM's block table -> decoder slot ``slots[i]``'s page-table row, for the rows in ``slots`` (the
        rows that carry a sequence in this call; the other slots keep theirs). With ``tokens`` (row -> tokens the
        sequence holds after this call), entries past the blocks those tokens cover become the null block 0: the
        runner does not clear a row's tail when another request takes the row, so it can still name a block a
        live request owns, and a prefill zeroes every page of its row before writing."""
        if page_table is None:
            return
        pt = torch.as_tensor(page_table)
        if pt.dim() != 2 or pt.shape[0] <= max(slots, default=-1):
            raise ValueError(f"page_table must be [B > {max(slots, default=-1)}, max_blocks], got shape "
                             f"{tuple(pt.shape)}")
        a = self.owner.model.args
        bps, limit = a.blocks_per_seq, getattr(self.owner, "num_blocks", a.num_blocks)
        table = self.dec.page_table_host
        for i, slot in slots.items():
            row = pt[i].to(torch.int32)
            if row.numel() > bps and bool((row[bps:] != 0).any()):
                raise ValueError(f"page_table row {i} names blocks past blocks_per_seq={bps} (max_seq_len "
                                 f"{a.max_seq_len}): {row[bps:].tolist()}")
            if int(row.min()) < 0 or int(row.max()) >= limit:
                raise ValueError(f"page_table row {i} has block ids outside [0, {limit}): {row.tolist()}")
            new = torch.zeros(bps, dtype=torch.int32)
            w = min(bps, row.numel())
            if tokens is not None:
                w = min(w, -(-tokens[i] // a.block_size))
            new[:w] = row[:w]
            table[slot] = new
        self.dec.set_page_table(table)

    def fit_page_tables(self, num_blocks: int) -> None:
        """After vLLM's pool replaced the model's own cache: every page-table row no request has set yet (the
        decoder's default rows, in every bucket) names blocks of that pool. A padded row of a step still reads its
        row's pages (its output is discarded), so a block id past a small pool would read outside it (the emulator
        refuses it; on cards it reads whatever lies there). Ids wrap into 1..num_blocks-1, never the null block."""
        def fit(t: torch.Tensor) -> torch.Tensor:
            return torch.where(t >= num_blocks, 1 + t % (num_blocks - 1), t).to(torch.int32)

        for d in self.dec.decs.values():
            d.set_page_table(fit(d.state.page_table_host))
        self.dec.set_page_table(fit(self.dec.page_table_host))

    def _remap(self, remap: list[int]) -> None:
        self.dec.slot_remap(remap)  # validates; identity does nothing
        self.fed = [self.fed[j] for j in remap]
        self.meta = [self.meta[j] for j in remap]

    def _free(self, slot: int) -> None:
        if self.dec.pos[slot] != FREE:
            self.dec.leave(slot)
        self.fed[slot], self.meta[slot] = None, None

    def _row_params(self, sampling_params, row: int, slot: int) -> SamplingParams:
        vocab = self.owner.model.args.cfg.vocab_size
        params = sampling_from_plugin(sampling_params, vocab, self.meta[slot]["seed"], row=row)
        held = self.meta[slot]["params"]
        if held is not None and params != held:
            raise ValueError(f"sampling_params row {row} changed within one sequence ({held.describe()} -> "
                             f"{params.describe()}): a new request starts with a prefill")
        return params

    def _device_tokens(self, sampling_params, feed: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One device-sampled step: ``feed`` = {slot: (row, token)}; each slot's sampler row is (re)started or
        resynced first when its last token did not come from it."""
        for slot, (row, tok) in feed.items():
            m = self.meta[slot]
            params = self._row_params(sampling_params, row, slot)
            history = self.fed[slot] + [tok]
            if m["params"] is None:  # first device step of this sequence: its prompt and emitted tokens so far
                self.dec.start_sampling(slot, params, history[: m["prompt_len"]], history[m["prompt_len"]])
                self.dec.resync_sampling(slot, m["prompt_len"], history)
                m["params"] = params
            elif m["last"] != tok:
                self.dec.resync_sampling(slot, m["prompt_len"], history)
        got = self.dec.sample_step({slot: tok for slot, (_, tok) in feed.items()})
        for slot, t in got.items():
            self.meta[slot]["last"] = t
        return got

    def _logits_out(self, rows: int, got: dict[int, torch.Tensor], read: bool = True):
        vocab = self.owner.model.args.cfg.vocab_size
        out = torch.zeros(rows, 1, vocab, dtype=torch.float32)  # rows not served: zeros, never read
        for i, lg in got.items():
            out[i, 0] = lg
        return out

    # ---- the plugin's calls ----------------------------------------------------------------------------------
    def prefill(self, tokens, lens, start_pos, page_table, empty_slots, sampling_params):
        rows = tokens.shape[0]
        starts = (torch.zeros(rows, dtype=torch.int64) if start_pos is None
                  else torch.as_tensor(start_pos).reshape(-1).to(torch.int64))
        slots = list(range(rows)) if empty_slots is None else [int(x) for x in empty_slots]
        if starts.numel() != rows or len(slots) != rows:
            raise ValueError(f"prefill of {rows} rows with start_pos {starts.tolist()} and empty_slots {slots}")
        if len(set(slots)) != rows or any(not 0 <= x < self.dec.slots for x in slots):
            raise ValueError(f"empty_slots {slots}: distinct slots in [0, {self.dec.slots}) expected")
        new, cont = [], {}  # rows prefilled from position 0; row -> source slot of a one-token continuation
        taken: set[int] = set()
        for i in range(rows):
            start, end = int(starts[i]), int(lens[i])
            if start == 0:
                new.append(i)
                continue
            if end != start + 1:
                raise NotImplementedError(f"prefill row {i}: start_pos={start}, prompt_lens={end}: a prefill continues "
                                          f"no cached prefix here (run vLLM without prefix caching / chunked prefill); "
                                          f"only the one-token continuation of a live sequence is served")
            seq = tokens[i, :start].tolist()
            src = next((j for j in range(self.dec.slots) if j not in taken and self.fed[j] == seq), None)
            if src is None:
                raise ValueError(f"prefill row {i} continues a sequence of {start} tokens that no state slot holds")
            taken.add(src)
            cont[i] = src
        # one permutation moves every continuing state to its destination slot (sources of nothing stay put when
        # they can); a new prompt's destination then receives whatever was left there and is overwritten
        dest = {slots[i]: src for i, src in cont.items()}
        remap = [dest.get(t) for t in range(self.dec.slots)]
        spare = [j for j in range(self.dec.slots) if j not in taken]
        for t in range(self.dec.slots):
            if remap[t] is None and t in spare:
                remap[t] = t
                spare.remove(t)
        for t in range(self.dec.slots):
            if remap[t] is None:
                remap[t] = spare.pop(0)
        self._remap(remap)
        self._page_rows(page_table, dict(enumerate(slots)), {i: int(lens[i]) for i in range(rows)})
        got, ids = {}, {}
        vocab = self.owner.model.args.cfg.vocab_size
        for i in new:
            slot, prompt = slots[i], tokens[i, : int(lens[i])].tolist()
            self._free(slot)  # a finished request's slot named again: the plugin never said it finished
            got[i] = self.dec.join(slot, prompt)
            self.fed[slot] = prompt
            self.meta[slot] = {"prompt_len": len(prompt), "seed": secrets.randbits(31), "params": None, "last": None}
            if sampling_params is not None:  # the first token from the prompt's last row, on the host
                params = self._row_params(sampling_params, i, slot)
                gen = params.generator() if not params.greedy else None
                ids[i] = int(pick_token(got[i].reshape(1, -1), params, gen, TokenHistory(prompt, vocab).now()))
                self.dec.start_sampling(slot, params, prompt, ids[i])
                self.meta[slot].update(params=params, last=ids[i])
        if cont:
            feed = {}
            for i in cont:
                slot, start = slots[i], int(starts[i])
                if self.dec.pos[slot] != start:
                    raise RuntimeError(f"slot {slot} is at position {self.dec.pos[slot]}, row {i} continues at {start}")
                feed[slot] = int(tokens[i, start])
            if sampling_params is not None:
                picked = self._device_tokens(sampling_params, {slots[i]: (i, feed[slots[i]]) for i in cont})
                ids.update({i: picked[slots[i]] for i in cont})
            else:
                logits, _ = self.dec.step(feed)
                for i in cont:
                    got[i] = logits[slots[i]]
                    self.meta[slots[i]]["last"] = None  # vLLM samples this step's token on the host
            for i in cont:
                self.fed[slots[i]].append(feed[slots[i]])
        if sampling_params is not None:
            out = torch.zeros(rows, 1, dtype=torch.int32)
            for i, t in ids.items():
                out[i, 0] = t
        else:
            out = self._logits_out(rows, got)
        if self.owner.uses_mrope:
            return out, torch.zeros(rows, dtype=torch.int64)
        return out

    def decode(self, tokens, pos, page_table, slot_remap, enable_trace: bool, read_from_device: bool,
               sampling_params):
        if sampling_params is not None:
            raise NotImplementedError(f"sampling_params (sample_on_device_mode) with {self.dec.slots} sequences: "
                                      f"{ONE_USER}")
        if tokens.shape[1] != 1:
            raise ValueError(f"plain decode takes tokens [B, 1], got {tuple(tokens.shape)}")
        rows = tokens.shape[0]
        if rows > self.dec.slots:
            raise ValueError(f"decode of {rows} rows, this model holds {self.dec.slots} sequences")
        if slot_remap is not None:  # row i reads (and from now on owns) the state of slot remap[i]
            self._remap([int(x) for x in torch.as_tensor(slot_remap).reshape(-1).tolist()])
        p = pos.reshape(-1)
        live = [i for i in range(rows) if int(p[i]) >= 0]
        for i in live:
            if self.dec.pos[i] != int(p[i]):
                raise ValueError(f"decode row {i} at position {int(p[i])}, but state slot {i} holds "
                                 f"{'no sequence' if self.dec.pos[i] == FREE else f'one at {self.dec.pos[i]}'}")
        self._page_rows(page_table, {i: i for i in live}, {i: int(p[i]) + 1 for i in live})
        self.dec.use_trace = bool(enable_trace)
        feed = {i: int(tokens[i, 0]) for i in live}
        logits, _ = self.dec.step(feed)
        for i in live:
            self.fed[i].append(feed[i])
            self.meta[i]["last"] = None  # vLLM samples this step's token on the host
        out = self._logits_out(rows, {i: logits[i] for i in live})
        return out if read_from_device else DecodeHandle(out)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.dec.slots:
            raise ValueError(f"release_request(slot={slot}): state slots are 0..{self.dec.slots - 1}")
        self._free(slot)

    # ---- warmup ----------------------------------------------------------------------------------------------
    def _warm_table(self) -> None:
        self._page_rows(self.owner._warm_page_table().expand(self.dec.slots, -1), {i: i for i in range(self.dec.slots)})

    def warmup_prefill(self, lens: list[int]) -> None:
        self._warm_table()
        vocab = self.owner.model.args.cfg.vocab_size
        for n in lens:
            self._free(0)
            self.dec.join(0, [i % vocab for i in range(1, n + 1)])
        self._free(0)

    def warmup_decode(self, steps: int, enable_trace: bool, sampled: bool = False) -> None:
        """Compile (and with ``enable_trace`` capture and replay) the B-slot step: one user in slot 0, every other
        row padded (the same program whichever rows are live); with ``sampled`` also the device-sampled step."""
        self._warm_table()
        self._free(0)
        self.dec.warm()
        tok = int(self.dec.join(0, [1, 2]).argmax())
        self.dec.use_trace = enable_trace
        for _ in range(steps):
            _, ids = self.dec.step({0: tok})
            tok = int(ids[0])
        if sampled:
            self.dec.start_sampling(0, SamplingParams(temperature=1.0, top_k=8, top_p=0.9, repetition_penalty=1.1,
                                                      seed=0), [1, 2], tok)
            for _ in range(steps):
                tok = self.dec.sample_step({0: tok})[0]
        self._free(0)
