"""Generation on the TT model: loading, chunked prefill, teacher-forced logits; the decode steps are the slot
decoder's (tt/runtime/batch.py) at one slot.

A :class:`TTGenerator` owns one sequence: its state (one user's GDN/conv state, KV pages and page table) and a
``TTBatchDecoder(model, 1, state=<that state>, joins=False)`` over it. A prompt is prefilled straight into the
state (batch 1, optionally resuming from the prefix cache); the decoder then holds slot 0 at the state's position
and every decode step is its step, so plain decoding at one user runs the batched decoder's traced step and loop
at B = 1 (one decode/sample loop, one thinking-budget feed for every plain decoder).

Trace life cycle (the card rules, enforced by the emulator too; tt/runtime/trace.py ``StepTraces``):
  1. the first decode step after a prefill runs eagerly: it compiles every decode program and does real work;
  2. the next step captures the same step function (recorded, not executed), reading only persistent buffers:
     weights, state (GDN/conv/KV, page table) and the DecodeInputs buffers, and replays it;
  3. every later step writes its inputs with ``copy_host_to_device_tensor`` and replays the trace.
A new prompt releases the traces first (prefill allocates, which is not allowed while a trace is live).

    gen = TTGenerator.from_checkpoint(ckpt, "emulated-p150x2")
    tokens = gen.generate([prompt_ids], 32)[0].tokens
    res = gen.generate([prompt_ids], 32, SamplingParams(temperature=0.8, top_p=0.95, seed=1, logprobs=2))[0]

Plain decoding (``generate``) is ``generation.plain.plain_generate`` over tt/runtime/decode.py's ``TTDecoder``: one
prompt on this generator's own sequence (the decoder's slot 0), several on a bucket decoder. Every decode token is
picked on device inside the traced step (:class:`.sampler.DeviceSampler`, one row per user: argmax or a seeded draw
after penalties/temperature/min_p/top-k/top-p, penalty counts updated in place; its traced step holds only the
stages the parameters need), so a step reads back only the token id (and its logprobs when asked), never the logits
row. The prompt's last row is read once per generation (prefill), and its token is picked on the host by the same
transform (``generation.sampling.pick_token``). ``generate(keep_logits=True)`` picks on the host under the
parameters from every step's read-back logits row; ``decode_step`` is the decoder's full-logits step for callers
that need the row itself (the vLLM adapter's logits contract, numerics tests).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from ...checkpoint import load_checkpoint
from ...generation.plain import PlainResult, plain_generate
from ...generation.sampling import SamplingParams
from ..model.model import TTQwen36Model
from .batch import DEFAULT_BUCKETS, TTBatchDecoder, bucket_for
from .decode import DevicePicks, LogitsRows, TTDecoder
from .prefix import TTPrefillResult, prefill as tt_prefix_prefill
from ..model.model_config import PrecisionSetting, TTModelArgs
from .sampler import DeviceSampler
from .sampler_transform import SamplerStages
from ..model.state import TTModelState, allocate_state, reset_state
from ..model.weights import WeightLoader

DEFAULT_TRACE_REGION = 64 * 1024 * 1024  # bytes reserved for the decode trace (27B decode trace: a few MB)


def default_cache_dir(ckpt: str | Path) -> Path:
    """~/.cache/qwen36/tt/<name>-<hash of the checkpoint's path, file sizes and mtimes>: a changed checkpoint gets a
    fresh cache; TP width and dtype are part of each cache file name."""
    import hashlib

    ckpt = Path(ckpt).resolve()
    h = hashlib.sha256(str(ckpt).encode())
    for f in sorted(ckpt.glob("*.safetensors")) + sorted(ckpt.glob("*.json")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return Path.home() / ".cache" / "qwen36" / "tt" / f"{ckpt.name}-{h.hexdigest()[:12]}"


class TTGenerator:
    def __init__(self, model: TTQwen36Model, state: TTModelState, *, use_trace: bool = True, label: str = ""):
        self.model, self.state, self.label = model, state, label
        self.ttnn, self.mesh = model.ttnn, model.mesh
        # the one slot decoder over this generator's state: every decode step (full-logits or with the device
        # pick) is its step; slot 0 is held at state.pos before each (a prefill, here or a caller's, moves it)
        self.decoder = TTBatchDecoder(model, 1, use_trace=use_trace, state=state, joins=False)
        self.inputs = self.decoder.inputs  # the persistent decode input buffers (one row)
        self.sampler: DeviceSampler | None = None
        self.rng = "device"  # DeviceSampler's uniform source ("host": bit-identical draws on cards and emulator)
        self.ctx = None  # MeshContext when this generator opened the mesh
        self.ckpt: Path | None = None  # the checkpoint it was loaded from (from_checkpoint), for reference checks

    @property
    def use_trace(self) -> bool:
        return self.decoder.use_trace

    @use_trace.setter
    def use_trace(self, value: bool) -> None:
        self.decoder.use_trace = bool(value)

    @classmethod
    def from_checkpoint(cls, ckpt: str | Path, device: str, *, precision: str | PrecisionSetting = "performance",
                        max_seq_len: int = 2048, use_trace: bool = True, cache_dir: str | Path | None = None,
                        require_mtp: bool = False, progress: bool = True, mesh_kw: dict | None = None,
                        **args_kw) -> "TTGenerator":
        """Open ``device`` (a tt_ops.device name), load and convert the checkpoint. ``args_kw`` go to
        TTModelArgs (block_size, prefill_chunk); ``mesh_kw`` to ``open_mesh`` (e.g. ``{"numerics": "exact"}``)."""
        from qwen36.tt_ops.device import open_mesh

        ctx = open_mesh(device, trace_region_size=DEFAULT_TRACE_REGION if use_trace else 0, **(mesh_kw or {}))
        reader = load_checkpoint(ckpt, require_mtp=require_mtp)
        prec = precision if isinstance(precision, PrecisionSetting) else PrecisionSetting.named(precision)
        args = TTModelArgs.from_config(reader.config, ctx.num_devices, prec, max_seq_len=max_seq_len, **args_kw)
        weights = WeightLoader(reader, args, ctx.ttnn, ctx.mesh_device, cache_dir, progress=progress).load()
        model = TTQwen36Model(args, weights, ctx.ttnn, ctx.mesh_device)
        gen = cls(model, allocate_state(args, ctx.ttnn, ctx.mesh_device), use_trace=use_trace, label=ctx.label)
        gen.ctx, gen.ckpt = ctx, Path(ckpt)
        logger.info(f"[{ctx.label}] TT model loaded: tp={ctx.num_devices}, precision={prec.name}, trace={use_trace}")
        return gen

    @property
    def config(self):
        return self.model.args.cfg

    # ---- state / trace management ---------------------------------------------------------------------
    def release_trace(self) -> None:
        self.decoder.release()

    def reset(self) -> None:
        """Forget the sequence: release the traces, zero GDN/conv state, position 0."""
        self.release_trace()
        reset_state(self.state, self.ttnn)

    def _hold(self) -> None:
        """The decoder's slot 0 is this sequence, at its next position (state.pos)."""
        self.decoder.hold(0, self.state.pos)

    # ---- steps -------------------------------------------------------------------------------------------
    def prefill(self, ids: list[int] | torch.Tensor, all_rows: bool = False) -> torch.Tensor:
        """Reset and prefill a new prompt; returns fp32 logits [T, V] (all_rows) or [V] (last row)."""
        self.reset()
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        logits = self.model.prefill_forward(ids, self.state, all_rows=all_rows)
        return logits if all_rows else logits[-1]

    def decode_step(self, token: int) -> tuple[torch.Tensor, int]:
        """Feed ``token`` at position state.pos (the decoder's full-logits step at slot 0); returns (fp32 logits [V],
        argmax id)."""
        self._hold()
        logits, ids = self.decoder.step({0: int(token)})
        self.state.pos = self.decoder.pos[0]
        return logits[0], int(ids[0])

    def _sampler_for(self, params: SamplingParams) -> DeviceSampler:
        """A one-row device sampler whose traced step holds exactly the stages ``params`` needs (kept while they
        stay the same; allocated with no trace live). The caller starts its row with ``params``."""
        s, stages = self.sampler, SamplerStages.of([params], self.config.vocab_size)
        if s is None or s.stages != stages or s.rng != self.rng:
            if s is not None:
                s.release()
            s = DeviceSampler(self.ttnn, self.mesh, self.config.vocab_size, 1, stages=stages, rng=self.rng).allocate()
        return s

    def prefill_cached(self, prompt: list[int], cache) -> "TTPrefillResult":
        """Reset and prefill through the prefix cache (``tt/runtime/prefix.py``: resume from the longest cached block
        boundary, device copies only). The result's lease holds the prompt's blocks until released."""
        self.reset()
        return tt_prefix_prefill(self.model, self.state, list(prompt), cache)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, eos_ids=(), *, prefix_cache=None,
                 keep_logits: bool = False, thinking=None, buckets=None) -> list[PlainResult]:
        """Plain decoding of ``prompts`` (``generation.plain.plain_generate``), user i with ``params[i]`` (one for
        every user, or one each; default greedy) and its token limit (at least one token is emitted); tokens cut
        after EOS (kept). One prompt decodes on this generator's own sequence (its state, resuming from
        ``prefix_cache``'s cached block boundaries); several on a decoder of the smallest bucket holding them (one
        traced forward per step over its slots; each user's tokens are its own one-prompt tokens). Tokens are picked
        on device (a :class:`DeviceSampler` whose traced step holds the stages the users need; a step reads back
        ids only), or with ``keep_logits`` on the host from every step's logits row (kept in the results).
        ``thinking``: a ``generation.thinking.ThinkingBudget``: the phrase fed as decode rows (a TT prefill must
        start on a KV page boundary), each replacing the step's pick."""
        n = len(prompts)
        limits = [max(1, int(m)) for m in ([max_new_tokens] * n if isinstance(max_new_tokens, int) else max_new_tokens)]
        params = [SamplingParams()] * n if params is None else params
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        vocab = self.config.vocab_size
        if n == 1:
            if keep_logits:
                picks = LogitsRows(vocab, keep_logits=True)
            else:
                self.release_trace()  # the sampler may allocate: no trace live
                self.sampler = self._sampler_for(params[0])
                picks = DevicePicks(self.sampler)
            backend = _OwnSequence(self, picks, prefix_cache)
            try:
                return plain_generate(backend, prompts, limits, params, eos_ids, thinking=thinking)
            finally:
                backend.close()
        self.release_trace()
        dec = TTBatchDecoder(self.model, bucket_for(n, buckets or DEFAULT_BUCKETS), use_trace=self.use_trace,
                             prefix_cache=prefix_cache)
        sampler = None
        if keep_logits:
            picks = LogitsRows(vocab, keep_logits=True)
        else:
            sampler = DeviceSampler(self.ttnn, self.mesh, vocab, dec.slots, rng=self.rng,
                                    stages=SamplerStages.of(params, vocab)).allocate()
            picks = DevicePicks(sampler)
        try:
            return plain_generate(TTDecoder(dec, picks, self.label), prompts, limits, params, eos_ids,
                                  thinking=thinking)
        finally:
            dec.release()
            if sampler is not None:
                sampler.release()

    # ---- CLI contract (same as ReferenceTarget) ----------------------------------------------------------
    @torch.no_grad()
    def teacher_forced_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(ids, all_rows=True)

    def close(self) -> None:
        self.release_trace()
        if self.ctx is not None:
            self.ctx.close()


class _OwnSequence(TTDecoder):
    """A generator's own sequence as the one slot of plain decoding: a join resets it and prefills straight into its
    state (through ``prefix_cache``: the prompt's blocks held until it leaves), then holds the decoder's slot 0 at
    the sequence's position; leaving keeps the state (the generator's) at its position."""

    def __init__(self, gen: TTGenerator, picks, prefix_cache=None):
        super().__init__(gen.decoder, picks, gen.label or "tt")
        self.gen, self.cache = gen, prefix_cache
        self.pre: TTPrefillResult | None = None
        self.joined = False

    def free_slots(self) -> list[int]:
        return [] if self.joined else [0]

    def join(self, slot: int, prompt, params: SamplingParams, forced: int | None = None):
        if self.cache is None:
            logits, self.pre = self.gen.prefill(prompt), None
        else:
            self.pre = self.gen.prefill_cached(prompt, self.cache)
            logits = self.pre.logits
        self.joined = True
        self.decoder.hold(0, self.gen.state.pos)
        pick = self.picks.start(0, prompt, params, logits, forced)
        pick.prefill = self.pre
        return pick

    def leave(self, slot: int) -> None:
        self.gen.state.pos = self.decoder.pos[0]
        self.picks.stop(0)
        if self.pre is not None and self.pre.lease is not None:
            self.pre.lease.release()
        self.pre, self.joined = None, False

    def close(self) -> None:
        """A generation that stopped early (an error) leaves too."""
        if self.joined:
            self.leave(0)


@dataclass(frozen=True)
class Pages:
    """A generator's KV page size and prefill chunk (``TTModelArgs.block_size`` / ``prefill_chunk``; None: the
    model defaults, 64-token pages and 256-row chunks)."""

    block_size: int | None = None
    prefill_chunk: int | None = None

    def args(self) -> dict:
        return {k: v for k, v in (("block_size", self.block_size), ("prefill_chunk", self.prefill_chunk)) if v is not None}

    def seq_len(self, max_len: int) -> int:
        """Room for ``max_len`` tokens in whole pages, two pages at least."""
        block = self.block_size or TTModelArgs.block_size
        return max(2 * block, -(-int(max_len) // block) * block)


# The pages of short contexts (the test and probe checkpoints, tens to hundreds of tokens): 32-token pages, so a
# 40-token prompt already crosses one, and 64-row prefill chunks (two pages).
SMALL_PAGES = Pages(block_size=32, prefill_chunk=64)
# The command line's speculative runs: 32-token pages (the sequence's KV rounded to them), default chunks.
SPEC_PAGES = Pages(block_size=32)


def build_generator(ckpt, device: str, *, precision: str | PrecisionSetting = "performance", dtype=None,
                    require_mtp: bool = False, cache_dir: str | Path | None | bool = True, max_len: int | None = None,
                    pages: Pages = Pages(), **kw) -> TTGenerator:
    """The one builder of a :class:`TTGenerator` (the command line, chat, probes, test support). ``dtype`` is the
    reference model's torch dtype; the TT model's numerics are set by the precision preset instead. Weight caches go
    to ``default_cache_dir(ckpt)`` (``cache_dir=True``), a given directory, or nowhere (``None``/``False``).
    ``max_len``: the longest sequence it must hold (prompt + new tokens + the verify's rows), rounded up to whole
    ``pages`` (else ``max_seq_len=`` in ``kw``, or 2048). ``kw``: ``max_seq_len``, ``use_trace``, ``progress``,
    ``mesh_kw`` (``TTGenerator.from_checkpoint``)."""
    if cache_dir is True:
        cache_dir = default_cache_dir(ckpt)
    elif cache_dir is False:
        cache_dir = None
    if dtype is not None:
        logger.info(f"TT target: --dtype {dtype} applies to the reference model; using precision preset '{precision}'")
    if max_len is not None:
        if "max_seq_len" in kw:
            raise ValueError("build_generator takes max_len (rounded to whole pages) or max_seq_len, not both")
        kw["max_seq_len"] = pages.seq_len(max_len)
    return TTGenerator.from_checkpoint(ckpt, device, precision=precision, require_mtp=require_mtp, cache_dir=cache_dir,
                                       **pages.args(), **kw)
