"""Qwen3.6 model class for the vllm-tt plugin (tenstorrent/vllm-tt-plugin), written against its contract (DESIGN
section 5) as a THIN adapter over :class:`TTGenerator` (prefill, plain decode) and :class:`TTSpecBackend` with the
device MTP drafter (verify + acceptance + commit + next drafts). vLLM is not imported here (not a dependency).

    model = Qwen36ForCausalLM.initialize_vllm_model(hf_config, mesh_device, max_batch_size=1, max_seq_len=2048)
    kv = model.allocate_kv_cache()
    logits = model.prefill_forward(tokens, page_table, kv, prompt_lens)            # [1, 1, V] last-token logits
    logits = model.decode_forward(tok[:, None], page_table, kv, start_pos)         # plain decode, [1, 1, V]
    drafts, nv = model.propose_draft_tokens(K, committed, positions, accepted)     # [1, K], [1]
    ids = model.decode_forward(torch.cat([pending, drafts], 1), page_table, kv, start_pos,
                               num_valid_drafts=nv, accepted_counts=accepted, spec_mode=True)  # argmax [1, 1+K]

Mapping of the contract onto our fused speculative step (see also docs/tt_spec.md "vllm-tt plugin contract"):

* Our step is verify -> on-device greedy acceptance -> commit (state slot select, n' = n+a+1, pending' = bonus)
  -> MTP reseed + K-draft chain, all inside one verify call (traces A and B of TTSpecBackend). The contract's
  verify instead returns argmax ids and lets the *next* call tell the model which state slot to keep
  (``accepted_counts``; slot = accepted_counts-1). We commit eagerly with the device acceptor's count ``a`` and
  then VALIDATE: (1) the returned argmax ids imply the same ``a`` as the device acceptor (leading drafts equal to
  the previous row's argmax), else RuntimeError; (2) the next call's ``accepted_counts`` equals ``a+1`` (tokens
  emitted by the previous verify: a accepted drafts + the bonus; 1 right after the prefill = slot 0, the
  prefill's live state), else ValueError. Greedy acceptance is the only thing vLLM can derive from argmax ids,
  so for greedy both agree; a scheduler that keeps fewer tokens than a+1 (e.g. a stop string mid-run) is refused,
  not silently rolled back.
* ``propose_draft_tokens`` returns the drafts our device MTP already wrote into the persistent draft buffer (after
  the prefill: MTP prefill + chain; after a verify: the chain inside the commit trace). It moves no state. ``hidden``
  must be None: the MTP reads the verify's post-norm hidden on device.
* The verify writes the draft columns of ``tokens`` into the draft buffer before replaying, so drafts from any
  proposer are verified; column 0 must be the pending token (the last committed token) at ``start_pos`` = n.
* ``num_valid_drafts`` must equal K for every row (the device acceptor has no per-row draft mask: padded drafts
  could be accepted); fewer raises NotImplementedError.
* KV cache and page table: the model owns its paged caches and an identity page table (user 0 owns blocks
  0..blocks_per_seq-1). ``allocate_kv_cache`` returns those buffers; forwards accept ``kv_cache`` only if it is that
  object (or None) and ``page_table`` only if it is None or equals the identity table on the blocks in use.
* Batch: 1 user (max_batch_size=1, tt_data_parallel=1); more raises NotImplementedError. Greedy only on the
  vllm path (the public spec contract is greedy); ``read_from_device=False`` raises NotImplementedError.
* ``prefill_forward`` runs ``TTSpecBackend.prefill`` when the checkpoint has an MTP head (so the MTP gets the
  prompt's hidden states for its first drafts) and captures the last-row logits it computes; without MTP it runs
  ``TTGenerator.prefill``. Plain decode is ``TTGenerator.decode_step`` (eager step, capture, replay).
* Per sequence, the first call after ``prefill_forward`` picks the mode: plain ``decode_forward`` or spec
  (``propose_draft_tokens`` / verify). Mixing the two within one sequence raises (their state bookkeeping
  differs: plain decode advances the host position, the spec step advances the device-resident n).
"""
from __future__ import annotations

import os
from pathlib import Path
import torch
from loguru import logger

from ..checkpoint import load_checkpoint
from ..config import FULL, Qwen36Config
from ..speculative.mechanisms import DEFAULT_MECHANISM
from ..speculative.sampling import SamplingParams
from ..tt_ops.device import ttnn_for_mesh
from .generator import TTGenerator
from .model import TTQwen36Model
from .model_config import PrecisionSetting, TTModelArgs
from .mtp_drafter import TTMTPDrafter
from .spec_backend import TTSpecBackend
from .state import KVLayerState, allocate_state
from .weights import WeightLoader

MAX_BATCH = 1


def _hf_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config must be a dict or have to_dict(), got {type(hf_config).__name__}")


def _check_batch(n: int, what: str) -> None:
    if n > MAX_BATCH:
        raise NotImplementedError(f"{what}: batch {n} > {MAX_BATCH}; the Qwen3.6 TT port supports batch 1 only "
                                  f"(one user's GDN state / page table; max_batch_size must be 1)")


class _VllmSpecBackend(TTSpecBackend):
    """TTSpecBackend whose prefill also hands back the prompt's last-row logits (the contract returns logits)."""

    def prefill(self, prompt, params: SamplingParams = SamplingParams()):
        first = super().prefill(prompt, params)
        return first, self.prefill_logits


class Qwen36ForCausalLM:
    """The vllm-tt plugin's model class for Qwen3.6 (+ MTP speculative decoding), batch 1, TP over the mesh."""

    model_capabilities = {
        "supports_prefix_caching": False,
        "supports_async_decode": False,
        "supports_multimodal": False,
        "max_batch_size": MAX_BATCH,
        "spec_decode": {"method": "mtp", "acceptance": "greedy", "returns": "argmax_ids",
                        "requires_num_valid_drafts_equal_k": True},
    }

    def __init__(self, gen: TTGenerator, reader, mechanism: str = DEFAULT_MECHANISM, cache_dir=None):
        self.gen, self.model, self.state = gen, gen.model, gen.state
        self.reader = reader
        self.has_mtp = reader.config.has_mtp
        self.spec_backend = (_VllmSpecBackend(gen, mechanism, drafter=TTMTPDrafter(reader, cache_dir),
                                              use_trace=gen.use_trace) if self.has_mtp else None)
        self._kv_cache = None
        self._mode = None  # None (no sequence) | "new" (after prefill) | "plain" | "spec"
        self._accepted_count = None  # tokens emitted by the last spec call (1 right after prefill)

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations: str | None = None, *,
                              checkpoint: str | Path | None = None, cache_dir: str | Path | None = None,
                              block_size: int | None = None, prefill_chunk: int | None = None,
                              mechanism: str = DEFAULT_MECHANISM) -> "Qwen36ForCausalLM":
        """Build the model on an already opened ``mesh_device``. Weights come from ``checkpoint``, else
        hf_config's ``_name_or_path``, else ``HF_MODEL``; the checkpoint's config must equal ``hf_config``'s.
        ``optimizations``: None / "performance" / "accuracy" (our precision presets)."""
        _check_batch(int(max_batch_size), "initialize_vllm_model(max_batch_size)")
        if int(tt_data_parallel) != 1:
            raise NotImplementedError(f"tt_data_parallel={tt_data_parallel}: only 1 is supported (one TP=N model)")
        prec_name = "performance" if optimizations is None else optimizations
        if prec_name not in ("performance", "accuracy"):
            raise ValueError(f"optimizations={optimizations!r}: choose None, 'performance' or 'accuracy'")
        raw = _hf_dict(hf_config)
        cfg = Qwen36Config.from_dict(raw)
        path = checkpoint or raw.get("_name_or_path") or os.environ.get("HF_MODEL")
        if not path or not Path(path).is_dir():
            raise ValueError(f"no checkpoint directory: pass checkpoint=, or set hf_config._name_or_path / HF_MODEL "
                             f"(got {path!r})")
        reader = load_checkpoint(path)
        if reader.config != cfg:
            raise ValueError(f"hf_config does not match the checkpoint's config.json at {path}")
        ttnn = ttnn_for_mesh(mesh_device)
        n = mesh_device.get_num_devices()
        kw = {k: v for k, v in (("block_size", block_size), ("prefill_chunk", prefill_chunk)) if v is not None}
        args = TTModelArgs.from_config(cfg, n, PrecisionSetting.named(prec_name), max_seq_len=int(max_seq_len), **kw)
        weights = WeightLoader(reader, args, ttnn, mesh_device, cache_dir, progress=False).load()
        model = TTQwen36Model(args, weights, ttnn, mesh_device)
        gen = TTGenerator(model, allocate_state(args, ttnn, mesh_device), use_trace=True,
                          label=getattr(mesh_device, "label", "") or f"mesh x{n}")
        logger.info(f"vllm-tt Qwen3.6: tp={n}, precision={prec_name}, max_seq_len={max_seq_len}, mtp={cfg.has_mtp}")
        return cls(gen, reader, mechanism, cache_dir)

    def allocate_kv_cache(self, kv_cache_shape=None, dtype=None, num_layers: int | None = None) -> list:
        """The model's own paged caches, one [k, v] pair per full-attention layer (they are persistent buffers
        the traces point at, so they are not re-allocated; ``dtype`` is set by the precision preset)."""
        n_attn = sum(1 for t in self.model.args.cfg.layer_types if t == FULL)
        if num_layers is not None and int(num_layers) not in (n_attn, self.model.args.cfg.num_hidden_layers):
            raise ValueError(f"num_layers={num_layers}: model has {self.model.args.cfg.num_hidden_layers} layers, "
                             f"{n_attn} with a KV cache")
        if kv_cache_shape is not None:
            a = self.model.args
            blocks = int(kv_cache_shape[0])
            if blocks < a.blocks_per_seq:
                raise ValueError(f"kv_cache_shape {tuple(kv_cache_shape)}: {blocks} blocks < {a.blocks_per_seq} "
                                 f"needed for max_seq_len {a.max_seq_len} at block_size {a.block_size}")
        if self._kv_cache is None:
            self._kv_cache = [[s.k, s.v] for s in self.state.layers if isinstance(s, KVLayerState)]
        return self._kv_cache

    # ---- argument checks ---------------------------------------------------------------------------------
    def _check_common(self, tokens: torch.Tensor, page_table, kv_cache, read_from_device: bool = True,
                      sampling_params=None) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        _check_batch(tokens.shape[0], "tokens")
        if not read_from_device:
            raise NotImplementedError("read_from_device=False: this model returns host tensors only")
        if sampling_params is not None:
            raise NotImplementedError("on-device sampling (sampling_params) is not offered on the vllm path: "
                                      "greedy / host sampling from the returned logits only")
        if kv_cache is not None and kv_cache is not self._kv_cache:
            raise ValueError("kv_cache must be the list returned by this model's allocate_kv_cache()")
        if page_table is not None:
            pt = torch.as_tensor(page_table)
            _check_batch(pt.shape[0], "page_table")
            mine = self.state.page_table_host
            w = min(pt.shape[1], mine.shape[1])
            if not torch.equal(pt[:1, :w].to(mine.dtype), mine[:1, :w]):
                raise NotImplementedError("page_table differs from the model's identity page table (user 0 owns "
                                          "blocks 0..blocks_per_seq-1); vLLM-assigned block ids are not supported")
        return tokens

    # ---- prefill / plain decode ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, enable_trace: bool = False,
                        sampling_params=None, **kwargs) -> torch.Tensor:
        """Prefill user 0's prompt ``tokens[0, :prompt_lens[0]]``; returns fp32 last-token logits [1, 1, V]."""
        tokens = self._check_common(tokens, page_table, kv_cache, True, sampling_params)
        lens = torch.as_tensor(prompt_lens).reshape(-1)
        _check_batch(lens.numel(), "prompt_lens")
        prompt = tokens[0, : int(lens[0])].tolist()
        if self.spec_backend is not None:
            self.spec_backend.use_trace = self.gen.use_trace
            _, logits = self.spec_backend.prefill(prompt, SamplingParams())  # greedy; also keeps the MTP's h_t
        else:
            logits = self.gen.prefill(prompt)
        self._mode, self._accepted_count = "new", 1
        return logits.reshape(1, 1, -1)

    @torch.no_grad()
    def decode_forward(self, tokens, page_table, kv_cache, start_pos, *, enable_trace: bool = True,
                       read_from_device: bool = True, sampling_params=None, num_valid_drafts=None,
                       accepted_counts=None, spec_mode: bool = False, **kwargs):
        """Plain decode (tokens [1, 1]) -> fp32 logits [1, 1, V]; ``spec_mode=True`` (tokens [1, 1+K]) -> the
        verify: argmax ids [1, 1+K] (column K = bonus when all K drafts are accepted)."""
        tokens = self._check_common(tokens, page_table, kv_cache, read_from_device, sampling_params)
        start = int(torch.as_tensor(start_pos).reshape(-1)[0])
        _check_batch(torch.as_tensor(start_pos).numel(), "start_pos")
        if self._mode is None:
            raise RuntimeError("decode_forward before prefill_forward")
        if spec_mode:
            return self._verify(tokens, start, num_valid_drafts, accepted_counts, enable_trace)
        if num_valid_drafts is not None or accepted_counts is not None:
            raise ValueError("num_valid_drafts / accepted_counts given without spec_mode=True")
        if tokens.shape[1] != 1:
            raise ValueError(f"plain decode takes tokens [B, 1], got {tuple(tokens.shape)}; pass spec_mode=True "
                             f"for a verify")
        self._enter("plain")
        if start != self.state.pos:
            raise ValueError(f"start_pos {start} != the model's position {self.state.pos}")
        self.gen.use_trace = bool(enable_trace)
        logits, _ = self.gen.decode_step(int(tokens[0, 0]))
        return logits.reshape(1, 1, -1)

    def _enter(self, mode: str) -> None:
        if self._mode not in ("new", mode):
            raise RuntimeError(f"{mode} step in a sequence that runs {self._mode} steps: plain decode and spec "
                               f"steps cannot be mixed within one sequence (prefill a new one)")
        if mode == "spec" and self.spec_backend is None:
            raise NotImplementedError("speculative decoding needs the checkpoint's MTP head (mtp_num_hidden_layers"
                                      " = 0 here)")
        self._mode = mode

    # ---- spec decode -----------------------------------------------------------------------------------------
    def _check_accepted(self, accepted_counts) -> None:
        if accepted_counts is None:
            raise ValueError("spec step needs accepted_counts[B] (tokens emitted by the previous step; 1 after "
                             "the prefill)")
        ac = torch.as_tensor(accepted_counts).reshape(-1)
        _check_batch(ac.numel(), "accepted_counts")
        if int(ac[0]) != self._accepted_count:
            raise ValueError(f"accepted_counts[0]={int(ac[0])} but the previous step committed "
                             f"{self._accepted_count} tokens (state slot {self._accepted_count - 1}); our step commits "
                             f"eagerly with the device acceptor's count, a different slot is not supported")

    @torch.no_grad()
    def propose_draft_tokens(self, num_drafts: int, committed_tokens, committed_positions, accepted_counts,
                             hidden=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft ids [1, K] and num_valid [1] from the device MTP. ``committed_tokens`` [1, M]: the tokens the
        previous step emitted (M >= accepted_counts; the last of the first accepted_counts is the pending token),
        ``committed_positions`` [1]: the pending token's position."""
        if hidden is not None:
            raise NotImplementedError("hidden must be None: the MTP reads the verify's hidden state on device")
        self._enter("spec")
        self._check_accepted(accepted_counts)
        k = int(num_drafts)
        ct = torch.as_tensor(committed_tokens).reshape(len(torch.as_tensor(accepted_counts).reshape(-1)), -1)
        _check_batch(ct.shape[0], "committed_tokens")
        pending = int(ct[0, self._accepted_count - 1])
        pos = int(torch.as_tensor(committed_positions).reshape(-1)[0])
        if pending != self.spec_backend.history[-1] or pos != self.spec_backend.n:
            raise ValueError(f"committed token/position ({pending}, {pos}) != the model's pending token/position "
                             f"({self.spec_backend.history[-1]}, {self.spec_backend.n})")
        self._draft(k)
        drafts, _ = self.spec_backend.drafter.head.read_drafts()
        return torch.tensor([drafts], dtype=torch.int64), torch.tensor([k], dtype=torch.int64)

    def _draft(self, k: int) -> None:
        if self.spec_backend._phase != "drafted":
            self.spec_backend.draft(k)  # first call at this K: allocates, MTP prefill + first chain
        elif k != self.spec_backend._k:
            raise ValueError(f"verify with K={k} after propose_draft_tokens(K={self.spec_backend._k})")

    def _verify(self, tokens: torch.Tensor, start: int, num_valid_drafts, accepted_counts, enable_trace: bool):
        k = tokens.shape[1] - 1
        if k < 1:
            raise ValueError(f"verify needs tokens [B, 1+K] with K >= 1, got {tuple(tokens.shape)}")
        self._enter("spec")
        self._check_accepted(accepted_counts)
        if num_valid_drafts is None:
            raise ValueError("spec_mode=True needs num_valid_drafts[B]")
        nv = torch.as_tensor(num_valid_drafts).reshape(-1)
        _check_batch(nv.numel(), "num_valid_drafts")
        if int(nv[0]) != k:
            raise NotImplementedError(f"num_valid_drafts[0]={int(nv[0])} < K={k}: the device acceptor has no per-row "
                                      f"draft mask; every row must carry K valid drafts")
        row = [int(t) for t in tokens[0].tolist()]
        if row[0] != self.spec_backend.history[-1] or start != self.spec_backend.n:
            raise ValueError(f"verify row 0 (token {row[0]} at {start}) must be the pending token "
                             f"{self.spec_backend.history[-1]} at position {self.spec_backend.n}")
        self.spec_backend.use_trace = bool(enable_trace)
        self._draft(k)
        self.spec_backend.spec.write_drafts(row[1:])  # the drafts vLLM asks us to verify (MTP's or any proposer's)
        vout = self.spec_backend.verify(None)
        ids = self.model.to_host(vout.out.tokens).reshape(-1).to(torch.int64)[: k + 1]
        acc = self.spec_backend.accept(None, vout)
        host_a = 0
        while host_a < k and row[1 + host_a] == int(ids[host_a]):
            host_a += 1
        if host_a != acc.num_accepted:
            raise RuntimeError(f"device acceptor accepted {acc.num_accepted} drafts but the argmax ids imply {host_a}")
        self.spec_backend.commit(acc)
        self._accepted_count = acc.num_accepted + 1
        return ids.reshape(1, k + 1)

    def close(self) -> None:
        if self.spec_backend is not None:
            self.spec_backend.close()
        self.gen.release_trace()
