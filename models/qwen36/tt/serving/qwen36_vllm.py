"""Qwen3.6 model class for the vllm-tt plugin (tenstorrent/vllm-tt-plugin): a thin adapter over
:class:`BucketedBatchDecoder` (prefill and plain decode of 1..32 sequences) and, in a speculative launch, :class:`TTGenerator`
+ :class:`TTSpecBackend` with the device MTP drafter (verify + on-device greedy acceptance + commit + next drafts). vLLM is not imported here (not a dependency); the plugin's
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
:func:`sampling_from_plugin` turns each row into our :class:`SamplingParams` (one validation, one error), the prefill's
token is picked on the host from the prompt's last row (as ``TTGenerator.generate`` does) and every decode token on
device inside the traced step (:class:`.sampler.DeviceSampler`, penalty counts updated in place), so a sequence
equals ``TTGenerator.generate`` with the same parameters and seed. What the plugin does not send this way it
samples on the host anyway (min_p, logit_bias, allowed/bad words, structured output, and logprobs below 8 devices:
``check_perform_device_sampling``); logprobs asked of the device are refused. Under speculation the plugin admits
greedy requests only (accept mode ``argmax_ids``), so a verify's ``sampling_params`` must be greedy without
penalties.

Servers: the class maps each plugin call onto the launch's server and does nothing else; each server gets what it
uses (the model or generator, the speculative backend, the block tables) as constructor arguments. A plain launch (no
speculative K; ``max_batch_size`` N in 1..32, host or device sampling) is :class:`.vllm_batch.BatchServer` (the
batched TT decoder, vLLM state slot j = decoder slot j, one sequence is bucket 1; how the plugin's calls map onto it
is in that class and docs/serving.md, "Plain launches"); a speculative launch (``--max-num-seqs 1``) is
:class:`.vllm_one.OneSequenceServer` (one GDN state slot; every verify is the engine's ``SpecBatch.step`` on a
``TTSpecBackend`` with ``capped_accept``; rows past the first are accepted only as the runner's padding rows, a real
second user fails fast naming ``--max-num-seqs 1``). Argument conversion and the block tables live in
:mod:`.vllm_args`, the failure policy in :mod:`.vllm_failure`.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from loguru import logger

from ...checkpoint import load_checkpoint
from ...config import FULL, Qwen36Config
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ...tt_ops.device import ttnn_for_mesh
from . import vllm_types as vt
from ..runtime.generator import TTGenerator
from ..model.model import TTQwen36Model
from ..model.model_config import PrecisionSetting, TTModelArgs
from ..speculative.mtp_drafter import TTMTPDrafter
from ..speculative.build import build_spec_backend
from ..model.state import KVLayerState, allocate_state, new_layer_state
from ..speculative.verify import max_spec_tiles
from ..model.weights import WeightLoader
from .vllm_args import (DEPTH_COSTS, DEPTH_MODES, MAX_BATCH, MAX_K, ONE_USER, BlockTables, DecodeHandle, batch_rows,
                        config_uses_mrope, hf_dict, max_depth, prefill_chunk_option, sampling_from_plugin,
                        spec_depth_mode)
from .vllm_batch import BatchServer
from .vllm_failure import DeviceStepFailed, stops_on_device_failure
from .vllm_one import SPEC_PREFIX, OneSequenceServer, depth_controller, spec_bytes
from .vllm_prefix import PrefixConfig

__all__ = ["DecodeHandle", "DeviceStepFailed", "Qwen36ForCausalLM", "sampling_from_plugin", "stops_on_device_failure"]


class Qwen36ForCausalLM:
    """The vllm-tt plugin's model class for Qwen3.6 (+ MTP speculative decoding at one sequence), TP over the mesh."""

    # Keys as the plugin reads them (platform.py / spec_admission.py / async_decode.py; docs/MODEL_CAPABILITIES.md
    # there); absent keys default to False / () / 1 on the plugin side. "max_batch_size" is ours (the plugin does not
    # read it): the most sequences a plain launch decodes per step, enforced at load.
    model_capabilities = {
        # a prefill from start_pos > 0: a prefix hit (vLLM's cached blocks hold its KV; the GDN state comes from the
        # model's checkpoints, vllm_prefix.py) or a chunk of a long prompt; speculative launches refuse both
        # (spec_plan). The plugin at e3fc849 gates chunked prefill by model type, not by this key (docs/vllm_prefix.md)
        "supports_chunked_prefill": True,
        "supports_prefix_caching": True,
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

    def __init__(self, model: TTQwen36Model, reader, mechanism: str = DEFAULT_MECHANISM, cache_dir=None, *,
                 gen: TTGenerator | None = None, uses_mrope: bool = False, spec_k: int | None = None,
                 spec_depth: str = "fixed", depth_costs: str = DEPTH_COSTS, max_batch_size: int = 1,
                 prefix: PrefixConfig | None = None):
        """``gen``: the speculative launch's one-sequence generator (its state is the sequence's KV + GDN state);
        a plain launch has none: its batched decoder holds every sequence's state, vLLM's KV pool included."""
        self.model, self.gen = model, gen
        if max_batch_size > 1 and spec_k:
            raise NotImplementedError(f"speculative K={spec_k} with max_batch_size={max_batch_size}: {ONE_USER}")
        if bool(spec_k) != (gen is not None):
            raise ValueError("a speculative launch takes its one-sequence TTGenerator (gen=), a plain launch none")
        self.reader = reader
        self.has_mtp = reader.config.has_mtp
        if spec_depth not in DEPTH_MODES:
            raise ValueError(f"spec_depth={spec_depth!r}: choose one of {DEPTH_MODES}")
        if spec_depth == "auto" and not spec_k:
            raise ValueError("spec_depth='auto' needs the launch's num_speculative_tokens (the deepest step)")
        self.spec_depth, self.depth_costs = spec_depth, depth_costs
        self.uses_mrope = uses_mrope
        self.spec_k = spec_k  # K of the launch's speculative_config (warmup compiles that step), None = plain
        self.max_batch_size = int(max_batch_size)
        self._prefix = prefix  # None: read from the launch's vLLM config when its KV pool is allocated
        self.blocks = BlockTables(model.args)  # vLLM's block tables against the KV pool (its size once allocated)
        # the MTP drafter and the speculative backend only where a launch speculates (a plain launch never drafts):
        # vLLM hands each verify its own drafts, so the backend caps acceptance at their count (capped_accept)
        self.spec_backend = None
        if spec_k and self.has_mtp:
            # auto: every depth the controller may pick gets its traces (the launch's controller, fresh)
            depth = (depth_controller(min(int(spec_k), max_depth(reader.config)), depth_costs)
                     if spec_depth == "auto" else None)
            self.spec_backend = build_spec_backend(gen, TTMTPDrafter(reader, cache_dir), depth=depth,
                                                   mechanism=mechanism, use_trace=gen.use_trace, capped_accept=True)
        # the server of the launch: plain decode of 1..32 sequences on the batched decoder (vLLM state slot j =
        # decoder slot j; one sequence is bucket 1, the same code path), or the speculative sequence of a launch
        # with a speculative K; ``batch`` is the batch server, None in a speculative launch
        # ``state``: the model state whose full-attention layers vLLM's pool replaces (allocate_kv_cache*): the
        # generator's in a speculative launch, the batched decoder's (its largest bucket's, shared by every bucket)
        # in a plain one
        if spec_k:
            self.state = gen.state
            self.server = OneSequenceServer(gen, self.spec_backend, self.blocks, spec_k=spec_k, spec_depth=spec_depth,
                                            depth_costs=depth_costs, uses_mrope=uses_mrope)
        else:
            self.server = BatchServer(model, max_batch_size, self.blocks, uses_mrope=uses_mrope)
            self.state = self.server.kv_state
        self.batch = None if spec_k else self.server
        self._kv_cache = None
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
            hf = hf_dict(vllm_config.model_config.hf_config)
            cfg = Qwen36Config.from_dict(hf)
            max_len = int(getattr(vllm_config.model_config, "max_model_len", cfg.max_position_embeddings))
            mode = spec_depth_mode(vllm_config)
        except Exception as e:  # noqa: BLE001 - the contract forbids raising here
            return vt.SpecReject(f"cannot read the model config from vllm_config: {e}")
        if not cfg.has_mtp:
            return vt.SpecReject("the checkpoint has no MTP head (mtp_num_hidden_layers = 0): nothing drafts")
        if int(max_num_seqs) != 1:
            return vt.SpecReject(f"max_num_seqs={max_num_seqs}: {ONE_USER}")
        if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
            return vt.SpecReject(SPEC_PREFIX)
        k, k_max = int(requested_k), max_depth(cfg)
        supported = tuple(range(1, k_max + 1))
        if not 1 <= k <= k_max:
            return vt.SpecReject(f"num_speculative_tokens={k}: this model verifies 1..{k_max} drafts (device acceptor "
                                 f"<= {MAX_K}; K+1-row SDPA verify <= {max_spec_tiles(cfg.head_dim)} rows at head_dim "
                                 f"{cfg.head_dim})", supported)
        depths = depth_controller(k).depths if mode == "auto" else (k,)
        # lanes_per_request: decode rows one speculating request occupies while verifying (spec_decode.SpecPlan);
        # the verify runs the 1+K candidates as 1+K rows of the decoder
        return vt.SpecPlan(effective_k=max(depths), lanes_per_request=1 + max(depths),
                           extra_bytes_per_seq=spec_bytes(cfg, depths, max_len), extra_bytes_per_token=0,
                           accept_modes=(vt.ACCEPT_MODE_ARGMAX_IDS,), drafter_state="internal",
                           supports_narrow_decode=False)

    def depth_plan(self) -> dict:
        """What the speculative step does: mode, the depths it may use, and the depth of the next step (auto: the
        controller's choice for the live sequence's next step, None while no sequence is live)."""
        if self.spec_depth == "fixed":
            return {"mode": "fixed", "depths": (self.spec_k,) if self.spec_k else (), "next_k": self.spec_k}
        return self.server.depth_plan()

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: str | None = None, vllm_config=None, *,
                              checkpoint: str | Path | None = None, cache_dir: str | Path | None = None,
                              block_size: int | None = None, prefill_chunk: int | None = None,
                              mechanism: str = DEFAULT_MECHANISM, spec_k: int | None = None,
                              spec_depth: str | None = None, depth_costs: str = DEPTH_COSTS,
                              prefix: PrefixConfig | None = None) -> "Qwen36ForCausalLM":
        """Build the model on an already opened ``mesh_device``. Weights come from ``checkpoint``, else
        hf_config's ``_name_or_path``, else ``HF_MODEL``; the checkpoint's config must equal ``hf_config``'s.
        ``optimizations``: None / "performance" / "accuracy" (our precision presets). ``vllm_config`` (passed by
        newer plugin loaders) supplies vLLM's KV ``block_size``, the speculative K and (``additional_config``
        ``{"tt": {"spec_depth": "auto"}}``) the depth mode, unless given explicitly. ``depth_costs``: the device
        name whose step-cost table the depth controller uses (``speculative.depth.cost_key``; the P150a table by
        default). ``prefix``: the prefix-cache checkpoints (default: from the launch's vLLM config when the KV pool is
        allocated: ``PrefixConfig.from_tt_options``)."""
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
        if prefill_chunk is None:
            prefill_chunk = prefill_chunk_option(vllm_config)
        raw = hf_dict(hf_config)
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
        # a speculative launch decodes its one sequence on a TTGenerator (its own KV + GDN state); a plain launch's
        # sequences all live in the batched decoder's state, so it allocates no generator
        gen = (TTGenerator(model, allocate_state(args, ttnn, mesh_device), use_trace=True,
                           label=getattr(mesh_device, "label", "") or f"mesh x{n}") if spec_k is not None else None)
        logger.info(f"vllm-tt Qwen3.6: tp={n}, precision={prec_name}, max_seq_len={max_seq_len}, "
                    f"block_size={args.block_size}, mtp={cfg.has_mtp}, spec_k={spec_k}, spec_depth={spec_depth}")
        return cls(model, reader, mechanism, cache_dir, gen=gen, uses_mrope=config_uses_mrope(raw), spec_k=spec_k,
                   spec_depth=spec_depth, depth_costs=depth_costs, max_batch_size=int(max_batch_size), prefix=prefix)

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
        attention layers. Without a shape, the caches the launch decodes into are returned (a speculative launch's
        one sequence of max_seq_len; a plain launch's batched decoder's)."""
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
        extra = self.server.scratch_pages  # pages past vLLM's blocks that only the model names (vllm_prefix.py)
        for i in self._attn_layers():
            old = self.state.layers[i]
            self.model.ttnn.deallocate(old.k)  # the launch's own cache: vLLM's pool replaces it
            self.model.ttnn.deallocate(old.v)
            self.state.layers[i] = self._kv_state(num_blocks + extra)
        self.blocks.num_blocks = num_blocks
        self.server.on_kv_pool(num_blocks, self.prefix_config())
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

        return new_layer_state(_Blocks(), self.model.ttnn, self.model.mesh, FULL)

    def prefix_config(self) -> PrefixConfig:
        """The launch's prefix-cache checkpoints: as given to ``initialize_vllm_model``, else from the engine's vLLM
        config (prefix caching or chunked prefill on, the ``tt`` options; ``vt.current_vllm_config``), else off."""
        if self._prefix is not None:
            return self._prefix
        vc = vt.current_vllm_config()
        if vc is None:
            return PrefixConfig.off()
        add = getattr(vc, "additional_config", None) or {}
        tt = add.get("tt", {}) if isinstance(add, dict) else {}
        on = bool(getattr(vc.cache_config, "enable_prefix_caching", False)) or bool(
            getattr(vc.scheduler_config, "enable_chunked_prefill", False))
        return PrefixConfig.from_tt_options(tt if isinstance(tt, dict) else {}, on, self.max_batch_size)

    def _release_traces(self) -> None:
        if self.gen is not None:
            self.gen.release_trace()
        self.server.release_traces()
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
        if remap is not None:
            self.server.check_remap(remap)
        deltas = kwargs.get("rope_deltas_all_users")
        if deltas is not None and any(float(x) != 0 for x in torch.as_tensor(deltas, dtype=torch.float64).reshape(-1)):
            raise NotImplementedError(f"rope_deltas_all_users={list(deltas)}: text-only model, mrope deltas are 0")

    # ---- the plugin's calls, each mapped onto the launch's server ----------------------------------------------
    @stops_on_device_failure
    @torch.no_grad()
    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, enable_trace: bool = False,
                        sampling_params=None, start_pos=None, empty_slots=None, **kwargs):
        """Prefill each row ``tokens[i, :prompt_lens[i]]`` into the blocks of ``page_table[i]`` (state slot
        ``empty_slots[i]``), or continue a live sequence by one token (the synchronous runner's decode step);
        returns fp32 last-token logits [B, 1, V] (with ``sampling_params``: the sampled ids [B, 1] int32), or
        ``(out, rope_deltas [B])`` when the config uses mrope (text only: every delta is 0). Prefill runs eagerly
        (``enable_trace`` is accepted and has no effect)."""
        self._check_common(kv_cache, kwargs)
        tokens = batch_rows(tokens, "tokens")
        lens = torch.as_tensor(prompt_lens).reshape(-1)
        if tokens.dim() != 2 or lens.numel() != tokens.shape[0]:
            raise ValueError(f"tokens [B, T] and prompt_lens [B] disagree: {tuple(tokens.shape)}, {tuple(lens.shape)}")
        return self.server.prefill(tokens, lens, start_pos, page_table, empty_slots, sampling_params, enable_trace)

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
        tokens = batch_rows(tokens, "tokens")
        if tokens.dim() != 2 or tokens.shape[0] < 1:
            raise ValueError(f"tokens must be [B, T] with at least one row, got shape {tuple(tokens.shape)}")
        if start_pos is None:
            raise ValueError("decode_forward needs start_pos")
        pos = torch.as_tensor(start_pos)
        if pos.shape[0] != tokens.shape[0]:
            raise ValueError(f"start_pos rows {pos.shape[0]} != tokens rows {tokens.shape[0]}")
        return self.server.decode(tokens, pos, page_table, bool(enable_trace), read_from_device, sampling_params,
                                  num_valid_drafts, accepted_counts, spec_mode, kwargs)

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

    @stops_on_device_failure
    @torch.no_grad()
    def propose_draft_tokens(self, num_drafts: int, committed_tokens, committed_positions, accepted_counts,
                             hidden=None):
        """``DraftOutput(draft_token_ids [B, K] int32, num_valid [B] int32)`` from the device MTP: the drafts its
        chain already wrote after the last commit (moves no state). ``committed_tokens`` [B, 1+K]: this step's
        committed block; entry ``accepted_counts - 1`` of row 0 is the pending token. Padding rows get
        placeholder ids and ``num_valid`` 0. ``hidden`` is None: the MTP reads the verify hidden on device."""
        return self.server.propose(num_drafts, committed_tokens, committed_positions, accepted_counts, hidden)

    # ---- request lifecycle ---------------------------------------------------------------------------------
    def release_request(self, slot: int) -> None:
        """A finished / preempted request: forget its sequence (its state is overwritten by the next prefill)."""
        self.server.release(int(slot))

    def note_state_slots_moved(self, old_to_new: dict) -> None:
        self.server.check_moved({int(a): int(b) for a, b in dict(old_to_new).items() if int(a) != int(b)})

    # ---- warmup --------------------------------------------------------------------------------------------
    def _warm_prompt_lens(self) -> list[int]:
        """Prompt lengths that exercise every prefill program shape: one partial chunk and a full chunk + a
        partial one (prefill runs in ``prefill_chunk`` pieces)."""
        a = self.model.args
        room = a.max_seq_len - (self.spec_k or 0) - 2
        return sorted({min(1, room), min(a.prefill_chunk + 1, room)})

    @stops_on_device_failure
    @torch.no_grad()
    def warmup_model_prefill(self, kv_cache=None, enable_trace: bool = False, can_sample_on_device: bool = False,
                             **_) -> None:
        """Compile the prefill programs for every chunk shape (dummy prompts, no request exists yet: any block
        is scratch). Prefill is not traced, so the ``enable_trace=True`` pass has nothing to capture."""
        if enable_trace or self.already_warmed_up_prefill:
            return
        self.server.warmup_prefill(self._warm_prompt_lens())
        self.already_warmed_up_prefill = True

    @stops_on_device_failure
    @torch.no_grad()
    def warmup_model_decode(self, kv_cache=None, enable_trace: bool = False, max_batch_size: int = 1,
                            num_blocks: int | None = None, can_sample_on_device: bool = False, **_) -> None:
        """Compile (``enable_trace=False``: one eager step) and then capture (``True``: eager step + capture +
        one replay) the decode step of this launch: plain decode, or the K-draft verify + commit + MTP chain when
        the launch speculates (``can_sample_on_device`` in a plain launch: also the device-sampled step, greedy and
        stochastic with penalties). A prefill re-captures (it allocates), so the request's own capture on its second
        step reuses the programs compiled here and allocates no new program-cache entries."""
        slots = self.server.slots
        if int(max_batch_size) > slots:
            raise NotImplementedError(f"warmup max_batch_size={max_batch_size} > the {slots} sequence(s) this model "
                                      f"was loaded for" + ("" if slots > 1 else f": {ONE_USER}"))
        self.server.warmup_decode(3 if enable_trace else 1, bool(enable_trace), bool(can_sample_on_device))

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

