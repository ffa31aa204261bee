"""The vllm-tt plugin's call arguments in our terms, and our return forms: the launch limits and their one-line
refusal (``ONE_USER``), the HF config dict and its mrope flag, the launch's ``tt.spec_depth`` option, the plugin's
per-row sampling payload -> :class:`SamplingParams` (:func:`sampling_from_plugin`), vLLM's block-table rows
(:class:`BlockTables`), and :class:`DecodeHandle` (what ``decode_forward(read_from_device=False)`` returns). Pure host
code: no device, no model."""
from __future__ import annotations

import torch

from ...config import Qwen36Config
from ...generation.sampling import SamplingParams, SamplingParamsError
from . import vllm_types as vt
from ..runtime.batch import DEFAULT_BUCKETS
from ..speculative.accept import UNIFORMS_PER_ROW
from ..speculative.verify import max_spec_tiles

MAX_BATCH = max(DEFAULT_BUCKETS)  # plain decode: one TTBatchDecoder slot per vLLM sequence
MAX_K = UNIFORMS_PER_ROW - 1  # the device acceptor draws K accept uniforms + 1 per row (one tile row)
DEPTH_MODES = ("fixed", "auto")
DEPTH_COSTS = "p150x2"  # the step-cost table the controller uses on cards (speculative/depth.py cost_key)
VLLM_SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS: a temperature below it means greedy
ONE_USER = ("this model was loaded for one sequence (one GDN state slot; speculative decoding serves one "
            "sequence): start vLLM with --max-num-seqs 1, or without speculation with --max-num-seqs up to "
            f"{MAX_BATCH}")


def hf_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config must be a dict or have to_dict(), got {type(hf_config).__name__}")


def config_uses_mrope(raw: dict) -> bool:
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


# The served model's prefill chunk: the prefix cache's checkpoint grid too (a hit restores the GDN state at a multiple
# of it and re-prefills from there, exact only at the cold prefill's own chunk boundaries; docs/vllm_prefix.md). 256
# keeps hits fine-grained (a 4k turn on a cached 3.8k prefix re-prefills 256 rows); the model's own default, 2,048,
# amortises the weights over longer chunks for a cold long prompt (docs/cost_figures.md). A launch picks with
# additional_config {"tt": {"prefill_chunk": N}}.
SERVED_PREFILL_CHUNK = 256


def prefill_chunk_option(vllm_config) -> int:
    """The launch's ``additional_config`` ``tt.prefill_chunk`` (a positive multiple of the KV page, checked where the
    model's args are made), else :data:`SERVED_PREFILL_CHUNK`."""
    add = getattr(vllm_config, "additional_config", None) or {}
    tt = add.get("tt", {}) if isinstance(add, dict) else {}
    n = tt.get("prefill_chunk", SERVED_PREFILL_CHUNK) if isinstance(tt, dict) else SERVED_PREFILL_CHUNK
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"additional_config tt.prefill_chunk={n!r}: a positive integer expected")
    return n


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


def batch_rows(x, what: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 0:
        raise ValueError(f"{what} must have a batch dimension, got a scalar")
    return t


class BlockTables:
    """vLLM's block-table rows in the model's page-table form, checked against the KV pool: ``num_blocks`` is the
    model's own count until vLLM's pool replaces the caches (``Qwen36ForCausalLM.allocate_kv_cache*`` sets it)."""

    def __init__(self, args):
        self.args = args  # TTModelArgs: blocks_per_seq, block_size, max_seq_len
        self.num_blocks = args.num_blocks

    def row(self, page_table: torch.Tensor, i: int, tokens: int | None = None) -> torch.Tensor:
        """Row ``i`` of vLLM's block table as a ``blocks_per_seq`` int32 row. Entries past blocks_per_seq must be the
        null block 0 and every id must index the pool. With ``tokens`` (what the sequence holds after the call),
        entries past the blocks those tokens cover become the null block 0."""
        a = self.args
        bps, limit = a.blocks_per_seq, self.num_blocks
        row = page_table[i].to(torch.int32)
        if row.numel() > bps and bool((row[bps:] != 0).any()):
            raise ValueError(f"page_table row {i} names blocks past blocks_per_seq={bps} (max_seq_len "
                             f"{a.max_seq_len}): {row[bps:].tolist()}")
        if int(row.min()) < 0 or int(row.max()) >= limit:
            raise ValueError(f"page_table row {i} has block ids outside [0, {limit}): {row.tolist()}")
        new = torch.zeros(bps, dtype=torch.int32)
        w = min(bps, row.numel())
        if tokens is not None:
            w = min(w, -(-tokens // a.block_size))
        new[:w] = row[:w]
        return new

    def warm(self) -> torch.Tensor:
        """[1, blocks_per_seq]: scratch blocks for warmup (no request exists yet), never vLLM's null block 0."""
        return (1 + torch.arange(self.args.blocks_per_seq, dtype=torch.int32) % (self.num_blocks - 1))[None]


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
