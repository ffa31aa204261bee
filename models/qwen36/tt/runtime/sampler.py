"""Device sampling building blocks shared by the acceptor (tt/spec/accept.py) and the MTP drafter's sampled picks.

* :class:`UniformTable`: a persistent fp32 table of uniforms plus a device-resident row counter. A traced step
  gathers the row at the counter (``ttnn.embedding``) and advances the counter in place; no RNG op runs inside a
  trace (a captured ``ttnn.uniform`` would replay its captured seed every step). The table is (re)filled outside
  any capture: seeded ``ttnn.uniform`` in place (``source="device"``) or a seeded torch generator written with
  ``copy_host_to_device_tensor`` (``source="host"``: bit-identical on cards and the emulator).
* :func:`inverse_cdf_draw`: one categorical draw per row from unnormalised weights and one uniform.
* :class:`TokenCounts`: the penalty context (seen / output counts) on device, one per generation, shared by every
  reader and updated in place by the commit.
* :func:`penalize` and :func:`probs_from_logits`: the device twin of ``speculative.sampling``'s transform
  (penalties -> temperature -> min_p -> top-k -> top-p -> softmax) with one user's parameters as scalars, which
  the acceptor and the draft pick share; the plain-decode sampler runs the same steps with per-row operands.
* :func:`argmax_pick` and :class:`SampledDraftPick`: the ``pick`` hooks of the MTP draft chain (tt/spec/mtp.py).
* :class:`DeviceSampler`: plain decoding's token pick inside the traced decode step, for ``rows`` users at once
  (batch 1 is ``rows=1``): each row greedy or sampled with its own user's parameters and seeded stream, penalties
  from device-resident token counts updated in place, raw logprobs; only a few numbers per row cross to the host.
  :class:`SamplerStages` says which parts of the transform its traced step contains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from qwen36.speculative.sampling import SamplingParams, TokenLogprobs

from ..model.model_config import compute_config_exact_count

RNG_SOURCES = ("device", "host")


class UniformTable:
    """``[rows, width]`` fp32 uniforms on device (replicated) and a ``[1, 1, 1, 1]`` fp32 row counter.

    ``device_seed(refill_index) -> int`` gives the ``ttnn.uniform`` seed of each refill (nonzero: 0 means
    unseeded); ``host_seed`` seeds the torch generator of ``source="host"`` once. Owners pick seeds so that
    their streams are independent (the acceptor's and the draft pick's differ)."""

    def __init__(self, ttnn, mesh_device, rows: int, width: int, *, source: str,
                 device_seed: Callable[[int], int], host_seed: int):
        if source not in RNG_SOURCES:
            raise ValueError(f"rng must be one of {RNG_SOURCES}, got {source!r}")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rng_rows must be an int >= 1, got {rows!r}")
        self.ttnn, self.mesh, self.rows, self.width = ttnn, mesh_device, rows, width
        self.source, self.device_seed, self.host_seed = source, device_seed, host_seed
        self.refills = 0
        self._host_gen: torch.Generator | None = None
        self.table = self.counter = None

    def _replicated(self, x: torch.Tensor):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=self.mesh,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "UniformTable":
        """Table, counter and the zero the counter resets to (before any capture); then the first fill."""
        if self.table is None:
            self.table = self._replicated(torch.zeros(self.rows, self.width))
            self.counter = self._replicated(torch.zeros(1, 1, 1, 1))
            self._zero = self._replicated(torch.zeros(1, 1, 1, 1))
            self.refill()
        return self

    def refill(self) -> None:
        """(Re)fill the table and reset the counter to row 0. Outside any capture; allocates nothing on device."""
        if self.table is None:
            raise RuntimeError("UniformTable.allocate() first")
        ttnn = self.ttnn
        if self.source == "device":
            ttnn.uniform(self.table, 0.0, 1.0, self.device_seed(self.refills))
        else:
            if self._host_gen is None:
                self._host_gen = torch.Generator().manual_seed(self.host_seed)
            vals = torch.rand(self.rows, self.width, generator=self._host_gen)
            host = ttnn.from_torch(vals, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                                   mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
            ttnn.copy_host_to_device_tensor(host, self.table)
        ttnn.copy(self._zero, self.counter)
        self.refills += 1

    def restart(self) -> None:
        """Back to the stream's first fill (same seeds again): replays a run's draws from the start."""
        self.refills, self._host_gen = 0, None
        self.refill()

    # ---- device (traceable) -------------------------------------------------------------------------------
    def next_row(self, shape: list[int], index_base=None):
        """The row at the counter reshaped to ``shape``; advances the counter in place. With ``index_base`` (a
        device tensor) also returns ``index_base + counter`` (the row index used, read before the advance)."""
        ttnn = self.ttnn
        idx = ttnn.to_layout(ttnn.reshape(ttnn.typecast(self.counter, ttnn.uint32), [1, 1]), ttnn.ROW_MAJOR_LAYOUT)
        row = ttnn.reshape(ttnn.embedding(idx, self.table, layout=ttnn.TILE_LAYOUT), shape)
        index = None if index_base is None else ttnn.add(index_base, self.counter)
        ttnn.copy(ttnn.add(self.counter, 1.0), self.counter)
        return row, index

    def step_back(self) -> None:
        """Undo one :meth:`next_row` (an aborted step gives its row back)."""
        ttnn = self.ttnn
        ttnn.copy(ttnn.subtract(self.counter, 1.0), self.counter)


def inverse_cdf_draw(ttnn, weights, u):
    """weights ``[..., V]`` (>= 0, any total), u ``[..., 1]`` in [0, 1) -> fp32 index ``[..., 1]``:
    #{j : cdf_j <= u * total and cdf_j < total}. Zero-weight tokens are unreachable (the second test stops the
    count at the last token with mass, whatever rounding the cumulative sum does)."""
    cdf = ttnn.cumsum(weights, dim=3)
    total = ttnn.max(cdf, dim=3, keepdim=True)
    below = ttnn.multiply(ttnn.le(cdf, ttnn.multiply(u, total)), ttnn.lt(cdf, total))
    return ttnn.sum(below, dim=3, keepdim=True, compute_kernel_config=compute_config_exact_count(ttnn))


class TokenCounts:
    """The penalty context of one generation on device: ``seen`` (1 where a token is in the prompt or the output)
    and ``counts`` (occurrences in the output), ``[1, 1, 1, V]`` fp32 each, replicated, persistent.

    One object per generation, shared by everything that reads or commits the context: every depth's acceptor
    under ``--spec-k auto`` (a step of any depth must see the tokens every earlier step committed, whatever its
    depth), and the sampled draft pick through its acceptor. :meth:`start` writes it from the host once per
    generation (outside capture); :meth:`add` is the traced in-place update a commit makes."""

    def __init__(self, ttnn, mesh_device, vocab: int, rows: int = 1):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: token counts are carried in fp32 and would not be exact")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        self.ttnn, self.mesh, self.vocab, self.rows = ttnn, mesh_device, vocab, rows
        self.seen = self.counts = None

    def _host(self, x: torch.Tensor, device=None):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=device,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "TokenCounts":
        """Both buffers (before any capture), zero: ``[1, rows, 1, V]`` (one row per user of a batched acceptor)."""
        if self.seen is None:
            zeros = torch.zeros(1, self.rows, 1, self.vocab)
            self.seen, self.counts = self._host(zeros, self.mesh), self._host(zeros, self.mesh)
        return self

    def start(self, prompt_len: int, history: Sequence[int], row: int = 0) -> None:
        """``history`` = the prompt then every token emitted so far; the first ``prompt_len`` are the prompt.
        Host writes into the persistent buffers (row ``row``; the other rows keep their values), outside any
        capture."""
        if self.seen is None:
            raise RuntimeError("TokenCounts.allocate() first")
        if not isinstance(row, int) or not 0 <= row < self.rows:
            raise ValueError(f"row {row!r} out of range ({self.rows} rows)")
        if self.rows == 1:
            seen, counts = torch.zeros(1, 1, 1, self.vocab), torch.zeros(1, 1, 1, self.vocab)
        else:
            seen, counts = (t.reshape(1, self.rows, 1, self.vocab).clone() for t in self._read_all())
            seen[0, row], counts[0, row] = 0.0, 0.0
        seen[0, row, 0, torch.as_tensor(list(history), dtype=torch.long)] = 1.0
        out = torch.as_tensor(list(history[prompt_len:]), dtype=torch.long)
        counts[0, row, 0].index_add_(0, out, torch.ones(out.numel()))
        self.ttnn.copy_host_to_device_tensor(self._host(seen), self.seen)
        self.ttnn.copy_host_to_device_tensor(self._host(counts), self.counts)

    def add(self, added_111V) -> None:
        """Traced, in place: ``added`` ``[1, rows, 1, V]`` fp32 = how many times each token was just emitted."""
        ttnn = self.ttnn
        ttnn.copy(ttnn.add(self.counts, added_111V), self.counts)
        ttnn.copy(ttnn.maximum(self.seen, ttnn.gt(added_111V, 0.0)), self.seen)

    def _read_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        ttnn = self.ttnn
        return tuple(ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float().reshape(self.rows, self.vocab)
                     for t in (self.seen, self.counts))

    def read(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies (device 0's replica) of row ``row``'s (seen, counts), each ``[V]`` fp32: for tests and checks."""
        return tuple(t[row] for t in self._read_all())


def penalize(ttnn, x, params: SamplingParams, seen, counts):
    """fp32 logits ``[..., V]`` after vLLM's repetition, frequency and presence penalties. ``seen`` (0/1: in the
    prompt or the output) and ``counts`` (occurrences in the output) are fp32 tensors broadcastable to ``x``."""
    if not params.penalized:
        return x
    r = params.repetition_penalty
    if r != 1.0:
        scaled = ttnn.where(ttnn.gt(x, 0.0), ttnn.multiply(x, 1.0 / r), ttnn.multiply(x, r))
        x = ttnn.where(seen, scaled, x)
    if params.frequency_penalty != 0.0:
        x = ttnn.subtract(x, ttnn.multiply(counts, params.frequency_penalty))
    if params.presence_penalty != 0.0:
        x = ttnn.subtract(x, ttnn.multiply(ttnn.gt(counts, 0.0), params.presence_penalty))
    return x


def probs_from_logits(ttnn, x, params: SamplingParams, ckc):
    """fp32 (penalised) logits ``[1, B, rows, V]`` -> fp32 probabilities: temperature (x * 1/T), min_p (drop
    x < max + log(min_p), i.e. p < min_p * p_max), top-k (keep x >= k-th largest, ties kept), top-p (drop a token
    when the mass of the tokens sorted before it is >= top_p), softmax. One descending sort serves top-k and
    top-p. Device twin of ``speculative.sampling.probs_from_logits`` after its penalties."""
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0 (greedy decoding uses argmax)")
    b, rows, vocab = (int(x.shape[i]) for i in (1, 2, 3))
    x = ttnn.multiply(x, 1.0 / params.temperature)
    if params.min_p > 0.0:
        floor = ttnn.add(ttnn.max(x, dim=3, keepdim=True), math.log(params.min_p))
        x = ttnn.where(ttnn.lt(x, floor), float("-inf"), x)
    use_k = 0 < params.top_k < vocab
    use_p = params.top_p < 1.0
    if use_k or use_p:
        sorted_x, order = ttnn.sort(x, dim=3, descending=True)
        if use_k:
            kth = ttnn.slice(sorted_x, [0, 0, 0, params.top_k - 1], [1, b, rows, params.top_k])
            x = ttnn.where(ttnn.lt(x, kth), float("-inf"), x)
            # the masked tokens sort last; the kept ones keep their order
            sorted_x = ttnn.where(ttnn.lt(sorted_x, kth), float("-inf"), sorted_x)
        if use_p:
            sp = ttnn.softmax(sorted_x, dim=3, numeric_stable=True, compute_kernel_config=ckc)
            mass_before = ttnn.subtract(ttnn.cumsum(sp, dim=3), sp)
            drop_sorted = ttnn.ge(mass_before, params.top_p)
            drop = ttnn.scatter(drop_sorted, 3, order, drop_sorted)  # back to vocab order (order is a permutation)
            x = ttnn.where(drop, float("-inf"), x)
    return ttnn.softmax(x, dim=3, numeric_stable=True, compute_kernel_config=ckc)


def argmax_pick(ttnn):
    """Default pick: fp32 logits [1, 1, 1, V] -> argmax token [1, 1, 1, 1] uint32 (lowest index on ties)."""
    return lambda logits_111V: ttnn.argmax(logits_111V, dim=3, keepdim=True)


DRAFT_UNIFORMS_PER_ROW = 32  # one tile row of uniforms per chain: draft i uses column i (K <= 32)


def draft_uniform_seeds(seed: int):
    """(device_seed(refill), host_seed) of the draft picks' uniform stream for ``seed``: nonzero, deterministic per
    (seed, refill), a different affine map than the acceptor's seeds (independent streams). Shared by the
    single-user :class:`SampledDraftPick` and the batched MTP head's sampled chain (tt/spec/mtp.py)."""
    s = int(seed)
    return ((lambda refill: (s * 2_246_822_519 + refill * 3_266_489_917 + 0x5EED) % 0x7FFFFFFF or 1),
            (s * 0x9E3779B1 + 0x5EED) % (1 << 62))


class SampledDraftPick:
    """Sampling ``pick`` for the MTP draft chain: each draft is drawn from ``probs_fn(logits)`` (pass
    ``DeviceAcceptor.probs_from_logits``: the target's temperature/top-k/top-p transform, so rejection sampling
    is exact) by :func:`inverse_cdf_draw` with one uniform, and the K draft distributions are written to the
    persistent :attr:`draft_probs` ``[1, 1, K, V]`` fp32 (what ``DeviceAcceptor.stochastic`` takes as
    ``draft_probs``).

    Uniforms: a :class:`UniformTable` ``[rng_rows, 32]``, one row per chain (:meth:`begin_chain`), draft i uses
    column i. Its seeds are derived from ``seed`` differently from the acceptor's, so draft and acceptance draws
    are independent streams. The host must call :meth:`before_chain` (outside capture) once before every chain
    *execution* (eager run or trace replay): it refills the table when all rows are used (host mirror of the
    device counter, no readback).
    """

    def __init__(self, ttnn, mesh_device, k: int, vocab: int, probs_fn: Callable[[Any], Any], seed: int = 0, *,
                 rng: str = "device", rng_rows: int = 1024):
        if not isinstance(k, int) or not 1 <= k <= DRAFT_UNIFORMS_PER_ROW:
            raise ValueError(f"k must be an int in [1, {DRAFT_UNIFORMS_PER_ROW}] (one uniform per draft per "
                             f"{DRAFT_UNIFORMS_PER_ROW}-wide RNG row), got {k!r}")
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: sampled ids are counted in fp32 and would not be exact")
        self.ttnn, self.mesh, self.k, self.vocab = ttnn, mesh_device, k, vocab
        self.probs_fn, self.seed, self.rng, self.rng_rows = probs_fn, int(seed), rng, rng_rows
        device_seed, host_seed = draft_uniform_seeds(self.seed)
        self.uniforms = UniformTable(ttnn, mesh_device, rng_rows, DRAFT_UNIFORMS_PER_ROW, source=rng,
                                     device_seed=device_seed, host_seed=host_seed)
        self.allocated = False
        self.rows_used = 0  # host mirror of the device counter
        self._row = None
        self._probs: list = []

    @property
    def refills(self) -> int:
        return self.uniforms.refills

    def allocate(self) -> "SampledDraftPick":
        """Uniform table, counter and the persistent draft_probs buffer (before any capture); fills the table."""
        if self.allocated:
            return self
        ttnn = self.ttnn
        self.draft_probs = ttnn.from_torch(torch.zeros(1, 1, self.k, self.vocab), dtype=ttnn.float32,
                                           layout=ttnn.TILE_LAYOUT, device=self.mesh,
                                           mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        self.uniforms.allocate()
        self.allocated = True
        return self

    def refill(self) -> None:
        """(Re)fill the uniform table, reset the counter. Outside any capture; allocates nothing on device."""
        if not self.allocated:
            raise RuntimeError("SampledDraftPick.allocate() first")
        self.uniforms.refill()
        self.rows_used = 0

    def before_chain(self) -> None:
        """Host bookkeeping before each chain execution (outside capture): refill when the table is used up."""
        if self.rows_used >= self.rng_rows:
            self.refill()
        self.rows_used += 1

    # ---- device (traceable) ------------------------------------------------------------------------------
    def begin_chain(self) -> None:
        self._row, _ = self.uniforms.next_row([1, 1, 1, DRAFT_UNIFORMS_PER_ROW])
        self._probs = []

    def __call__(self, logits_111V):
        """fp32 logits [1, 1, 1, V] -> sampled token [1, 1, 1, 1] uint32; records the distribution."""
        if self._row is None:
            raise RuntimeError("SampledDraftPick: begin_chain() must run before the chain's first pick")
        ttnn, i = self.ttnn, len(self._probs)
        if i >= self.k:
            raise RuntimeError(f"SampledDraftPick: more than k={self.k} picks in one chain")
        probs_111V = self.probs_fn(logits_111V)  # fp32, sums to 1 over the kept tokens
        u_1111 = ttnn.slice(self._row, [0, 0, 0, i], [1, 1, 1, i + 1])
        tok_1111 = inverse_cdf_draw(ttnn, probs_111V, u_1111)
        self._probs.append(probs_111V)
        return ttnn.typecast(tok_1111, ttnn.uint32)

    def end_chain(self) -> None:
        ttnn = self.ttnn
        if len(self._probs) != self.k:
            raise RuntimeError(f"SampledDraftPick: chain made {len(self._probs)} picks, expected k={self.k}")
        ttnn.copy(self._probs[0] if self.k == 1 else ttnn.concat(self._probs, dim=2), self.draft_probs)
        self._row, self._probs = None, []


def plain_sampler_seeds(seed: int):
    """(device_seed(refill), host_seed) of plain decoding's uniform stream for ``seed``: nonzero, deterministic per
    (seed, refill), an affine map of its own (not the acceptor's or the draft pick's). A row of
    :class:`DeviceSampler` is seeded with it when a user joins, so a user's draws are the same in whichever row and
    batch it runs."""
    s = int(seed)
    return ((lambda refill: (s * 1_597_334_677 + refill * 2_654_435_761 + 0x5A3D) % 0x7FFFFFFF or 1),
            (s * 0x85EBCA6B + 0x5A3D) % (1 << 62))


SAMPLER_HEAD_COLS = 3  # result columns before the top-n: token id, its raw logprob, its rank

# Per-row parameter rows [1, 1, B, 1] of DeviceSampler and the value of a row whose parameter is off: each leaves
# the row's values exactly unchanged (x * 1, x - 0; a top-k index of V - 1 keeps all, a top-p threshold of 2 drops
# none, a min_p floor of -inf drops none; "greedy" 1 selects the argmax).
_NEUTRAL = {"greedy": 1.0, "inv_temp": 1.0, "log_min_p": float("-inf"), "kth": None, "top_p": 2.0,
            "rep": 1.0, "inv_rep": 1.0, "freq": 0.0, "pres": 0.0}
_STAGE_PARAMS = {"greedy": ("greedy",), "sampled": ("inv_temp",), "min_p": ("log_min_p",), "top_k": ("kth",),
                 "top_p": ("top_p",), "repetition": ("rep", "inv_rep"), "frequency": ("freq",),
                 "presence": ("pres",)}


@dataclass(frozen=True)
class SamplerStages:
    """Which parts of the transform a :class:`DeviceSampler`'s traced pick contains. A stage costs its device
    programs every step whatever the rows' values, so a sampler holds only what its users need: the batch-1
    generator builds ``SamplerStages.of([params])`` (greedy without penalties is one argmax), a server whose users
    are not known in advance :meth:`every`. A row whose parameters need a stage the sampler lacks is refused when
    it joins. ``logprobs``: the top-n width of the logprob columns (None: no logprob columns)."""
    greedy: bool = False
    sampled: bool = False
    min_p: bool = False
    top_k: bool = False
    top_p: bool = False
    repetition: bool = False
    frequency: bool = False
    presence: bool = False
    logprobs: int | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> "SamplerStages":
        """The stages these users need (the union over them)."""
        need = [cls._needs(p, vocab) for p in params]
        lps = [p.logprobs for p in params if p.logprobs is not None]
        return cls(**{f: any(n[f] for n in need) for f in _STAGE_PARAMS}, logprobs=max(lps) if lps else None)

    @classmethod
    def every(cls, logprobs: int | None = None) -> "SamplerStages":
        return cls(**{f: True for f in _STAGE_PARAMS}, logprobs=logprobs)

    @staticmethod
    def _needs(p: SamplingParams, vocab: int) -> dict[str, bool]:
        s = not p.greedy
        return {"greedy": p.greedy, "sampled": s, "min_p": s and p.min_p > 0.0, "top_k": s and 0 < p.top_k < vocab,
                "top_p": s and p.top_p < 1.0, "repetition": p.repetition_penalty != 1.0,
                "frequency": p.frequency_penalty != 0.0, "presence": p.presence_penalty != 0.0}

    def missing(self, p: SamplingParams, vocab: int) -> list[str]:
        """The stages ``p`` needs that these lack (empty: ``p`` can join)."""
        out = [f for f, on in self._needs(p, vocab).items() if on and not getattr(self, f)]
        if p.logprobs is not None and (self.logprobs is None or p.logprobs > self.logprobs):
            out.append(f"logprobs={p.logprobs}")
        return out

    @property
    def penalized(self) -> bool:
        return self.repetition or self.frequency or self.presence


def neutral_value(key: str, vocab: int) -> float:
    """The operand value of a row whose parameter ``key`` is off (see :data:`_NEUTRAL`)."""
    return float(vocab - 1) if _NEUTRAL[key] is None else _NEUTRAL[key]


def row_operand_keys(stages: SamplerStages) -> list[str]:
    """The per-row operands a traced step with ``stages`` reads ("greedy" only when both kinds of rows are in it)."""
    keys = [k for f, ks in _STAGE_PARAMS.items() if getattr(stages, f) for k in ks]
    if not (stages.greedy and stages.sampled):
        keys = [k for k in keys if k != "greedy"]  # one kind of row: no per-row selection
    return keys


def row_values(p: SamplingParams, vocab: int) -> dict[str, float]:
    """One user's per-row operand values (every key; a parameter that is off gets its neutral value)."""
    return {"greedy": 1.0 if p.greedy else 0.0,
            "inv_temp": 1.0 if p.greedy else 1.0 / p.temperature,
            "log_min_p": math.log(p.min_p) if p.min_p > 0.0 else float("-inf"),
            "kth": float(p.top_k - 1) if 0 < p.top_k < vocab else float(vocab - 1),
            "top_p": p.top_p if p.top_p < 1.0 else 2.0,
            "rep": p.repetition_penalty, "inv_rep": 1.0 / p.repetition_penalty,
            "freq": p.frequency_penalty, "pres": p.presence_penalty}


def penalize_rows(ttnn, x, stages: SamplerStages, ops: dict, seen, counts):
    """:func:`penalize` with per-row operands ``ops`` (fp32, broadcastable to ``x`` with one value per user) for the
    penalty stages in ``stages``; ``seen`` / ``counts`` broadcastable to ``x``."""
    if stages.repetition:
        scaled = ttnn.where(ttnn.gt(x, 0.0), ttnn.multiply(x, ops["inv_rep"]), ttnn.multiply(x, ops["rep"]))
        x = ttnn.where(seen, scaled, x)
    if stages.frequency:
        x = ttnn.subtract(x, ttnn.multiply(counts, ops["freq"]))
    if stages.presence:
        x = ttnn.subtract(x, ttnn.multiply(ttnn.gt(counts, 0.0), ops["pres"]))
    return x


def probs_rows(ttnn, x, stages: SamplerStages, ops: dict, c_vocab_idx, ckc):
    """Temperature, min_p, top-k, top-p, softmax with per-row operands ``ops`` (:func:`probs_from_logits`'s steps,
    an operand where that function takes a scalar). ``x`` fp32 ``[..., V]``; ``c_vocab_idx`` ``[1, 1, 1, V]`` fp32
    0..V-1. Shared by :class:`DeviceSampler` (operands ``[1, 1, B, 1]``) and the acceptor (``[1, B, 1, 1]``)."""
    x = ttnn.multiply(x, ops["inv_temp"])
    if stages.min_p:
        floor = ttnn.add(ttnn.max(x, dim=3, keepdim=True), ops["log_min_p"])
        x = ttnn.where(ttnn.lt(x, floor), float("-inf"), x)
    if stages.top_k or stages.top_p:
        sorted_x, order = ttnn.sort(x, dim=3, descending=True)
        if stages.top_k:  # the row's k-th largest: the sorted value at its own index
            kth = ttnn.max(ttnn.where(ttnn.eq(c_vocab_idx, ops["kth"]), sorted_x, float("-inf")), dim=3,
                           keepdim=True)
            x = ttnn.where(ttnn.lt(x, kth), float("-inf"), x)
            # the masked tokens sort last; the kept ones keep their order
            sorted_x = ttnn.where(ttnn.lt(sorted_x, kth), float("-inf"), sorted_x)
        if stages.top_p:
            sp = ttnn.softmax(sorted_x, dim=3, numeric_stable=True, compute_kernel_config=ckc)
            mass_before = ttnn.subtract(ttnn.cumsum(sp, dim=3), sp)
            drop_sorted = ttnn.ge(mass_before, ops["top_p"])
            drop = ttnn.scatter(drop_sorted, 3, order, drop_sorted)  # back to vocab order (a permutation)
            x = ttnn.where(drop, float("-inf"), x)
    return ttnn.softmax(x, dim=3, numeric_stable=True, compute_kernel_config=ckc)


class DeviceSampler:
    """Plain decoding's pick for ``rows`` users at once, on device and traceable: logits ``[1, 1, B, V]`` (one row
    per user) -> one persistent ROW_MAJOR fp32 result ``[1, 1, B, 1]``, or with logprob columns
    ``[1, 1, B, 3 + 2n]`` = ``[token, logprob, rank, top-n ids, top-n logprobs]`` per row. That result is all the
    host reads per step. Batch 1 is ``rows=1``.

    Every row samples with its own user's :class:`SamplingParams`: the parameters are per-row device tensors
    ``[1, 1, B, 1]`` that :meth:`start` writes when a user joins a row (outside capture), so one captured step
    serves any mix of users whose needs the sampler's :class:`SamplerStages` cover; a row whose parameter is off
    holds the neutral value, which leaves its values exactly unchanged. Per row, after vLLM's order:

    * penalties: ``seen`` (prompt or output) and ``counts`` (output occurrences) ``[1, 1, B, V]`` fp32 on device,
      written for a joining user's row (prompt and first token) and updated in place by every step with the row's
      token (inside the trace);
    * greedy rows: argmax of the penalised logits, on a ROW_MAJOR view (multi-core on cards; ties: lowest index);
    * sampled rows: temperature, min_p, top-k, top-p, softmax (the steps of :func:`probs_from_logits`, with a
      per-row operand where that function takes a scalar; one descending sort serves top-k and top-p), then
      :func:`inverse_cdf_draw` with one uniform from the row's own :class:`UniformTable` (column 0 of one table
      row per step), seeded by :func:`plain_sampler_seeds` of the user's seed and restarted when the user joins:
      a user's draws do not depend on its row or its neighbours. The host calls :meth:`before_step` (outside
      capture) before every execution: it refills a row's table when used up (every row's counter advances once
      per step);
    * a step with both kinds of rows computes both picks and selects per row;
    * logprobs: raw (vLLM's default ``raw_logprobs``): log-softmax of the unpenalised logits; the token's own,
      its rank and the top ``n`` by ``ttnn.topk`` (n = ``stages.logprobs``; a row that asked for fewer reads its
      first ones).

    Operands are fp32 tensors, so a per-row value enters the arithmetic as the fp32 number a card's binary op
    receives for a scalar (tt-metal packs a float scalar as fp32 for fp32 operands).
    """

    def __init__(self, ttnn, mesh_device, vocab: int, rows: int = 1, *, stages: SamplerStages | None = None,
                 rng: str = "device", rng_rows: int = 1024):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: sampled ids are counted in fp32 and would not be exact")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        if rng not in RNG_SOURCES:
            raise ValueError(f"rng must be one of {RNG_SOURCES}, got {rng!r}")
        self.ttnn, self.mesh, self.vocab, self.rows = ttnn, mesh_device, vocab, rows
        self.rng, self.rng_rows = rng, rng_rows
        self.stages = SamplerStages.every() if stages is None else stages
        st = self.stages
        if not (st.greedy or st.sampled):
            raise ValueError("a sampler needs the greedy or the sampled stage (or both)")
        self.n_top = st.logprobs
        self.width = 1 if self.n_top is None else SAMPLER_HEAD_COLS + 2 * self.n_top
        seeds = plain_sampler_seeds(0)  # each row's are its user's, set by start()
        self.uniforms = [UniformTable(ttnn, mesh_device, rng_rows, DRAFT_UNIFORMS_PER_ROW, source=rng,
                                      device_seed=seeds[0], host_seed=seeds[1])
                         for _ in range(rows)] if st.sampled else []
        self.rows_used = [0] * rows  # host mirror of each row's uniform counter
        self.params: list[SamplingParams | None] = [None] * rows
        self.host = {k: torch.full((1, 1, rows, 1), neutral_value(k, vocab)) for k in row_operand_keys(st)}
        self.allocated = False

    def _replicated(self, x: torch.Tensor, layout=None, device=True):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=layout or ttnn.TILE_LAYOUT,
                               device=self.mesh if device else None, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def _dev0(self, t) -> torch.Tensor:
        return self.ttnn.to_torch(self.ttnn.get_device_tensors(t)[0]).float()

    def allocate(self) -> "DeviceSampler":
        """Every per-row parameter, penalty, constant, uniform and result buffer (before any capture); fills the
        uniform tables."""
        if self.allocated:
            return self
        ttnn, v, b = self.ttnn, self.vocab, self.rows
        self._ckc = compute_config_exact_count(ttnn)
        self.c_vocab_idx = self._replicated(torch.arange(v, dtype=torch.float32).reshape(1, 1, 1, v))
        self.dev = {k: self._replicated(t) for k, t in self.host.items()}
        if self.stages.penalized:
            self.seen = self._replicated(torch.zeros(1, 1, b, v))
            self.counts = self._replicated(torch.zeros(1, 1, b, v))
        self.result = self._replicated(torch.zeros(1, 1, b, self.width), layout=ttnn.ROW_MAJOR_LAYOUT)
        for u in self.uniforms:
            u.allocate()
        self.allocated = True
        return self

    def release(self) -> None:
        """Free the device buffers (no trace may be live that reads them)."""
        if not self.allocated:
            return
        ts = [self.c_vocab_idx, self.result, *self.dev.values()]
        if self.stages.penalized:
            ts += [self.seen, self.counts]
        for u in self.uniforms:
            ts += [u.table, u.counter, u._zero]
        for t in ts:
            self.ttnn.deallocate(t)
        self.allocated = False

    # ---- host: users ------------------------------------------------------------------------------------------
    def _check_row(self, row: int) -> None:
        if not self.allocated:
            raise RuntimeError("DeviceSampler.allocate() first")
        if not isinstance(row, int) or not 0 <= row < self.rows:
            raise ValueError(f"row {row!r} out of range ({self.rows} rows)")

    def _write_penalties(self, rows: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Rewrite the given rows' (seen [V], counts [V]); the other rows keep their device values (read back
        first, unless every row is rewritten)."""
        if not self.stages.penalized:
            return
        ttnn, b, v = self.ttnn, self.rows, self.vocab
        if len(rows) == b:
            seen, counts = torch.zeros(1, 1, b, v), torch.zeros(1, 1, b, v)
        else:
            seen, counts = (self._dev0(t).reshape(1, 1, b, v) for t in (self.seen, self.counts))
        for r, (s, c) in rows.items():
            seen[0, 0, r], counts[0, 0, r] = s, c
        ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
        ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)

    def _history_rows(self, prompt_len: int, history: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seen, counts = torch.zeros(self.vocab), torch.zeros(self.vocab)
        seen[torch.as_tensor(list(history), dtype=torch.long)] = 1.0
        out = torch.as_tensor(list(history[prompt_len:]), dtype=torch.long)
        counts.index_add_(0, out, torch.ones(out.numel()))
        return seen, counts

    def _write_params(self) -> None:
        for k, t in self.host.items():
            self.ttnn.copy_host_to_device_tensor(self._replicated(t, device=False), self.dev[k])

    def start(self, row: int, params: SamplingParams, prompt: Sequence[int], first: int) -> None:
        """Row ``row`` now samples for a user with ``params`` whose prompt is ``prompt`` and whose first (prefill)
        token was ``first``: its parameter rows, its penalty rows and its uniform stream (restarted at the seed's
        first fill, so a seeded run replays). Outside any capture."""
        self._check_row(row)
        missing = self.stages.missing(params, self.vocab)
        if missing:
            raise ValueError(f"row {row}: {params.describe()} needs {', '.join(missing)}, which this sampler's "
                             f"traced step does not contain (its stages: {self.stages})")
        p = params
        vals = row_values(p, self.vocab)
        for k, t in self.host.items():
            t[0, 0, row, 0] = vals[k]
        self._write_params()
        self._write_penalties({row: self._history_rows(len(prompt), list(prompt) + [int(first)])})
        if self.uniforms:
            u = self.uniforms[row]
            u.device_seed, u.host_seed = plain_sampler_seeds(p.seed)
            u.restart()
        self.rows_used[row] = 0
        self.params[row] = params

    def resync(self, row: int, prompt_len: int, history: Sequence[int]) -> None:
        """Rewrite row ``row``'s penalty rows from its whole ``history`` (prompt then every emitted token) after
        tokens it did not sample (a step sampled elsewhere); the parameters and the uniform stream go on."""
        self._check_row(row)
        self._write_penalties({row: self._history_rows(prompt_len, history)})

    def export_rows(self, rows: list[int]) -> list[dict]:
        """Everything of the given rows (parameters, penalty rows, uniform table, counter and host stream state)
        on the host, for :meth:`import_rows` into another sampler with the same stages (a bucket move). Outside
        any capture."""
        b, v = self.rows, self.vocab
        pen = ([t.reshape(b, v) for t in (self._dev0(self.seen), self._dev0(self.counts))]
               if self.stages.penalized else None)
        out = []
        for r in rows:
            d = {"params": self.params[r], "host": {k: float(t[0, 0, r, 0]) for k, t in self.host.items()},
                 "penalties": None if pen is None else (pen[0][r].clone(), pen[1][r].clone()),
                 "rows_used": self.rows_used[r]}
            if self.uniforms:
                u = self.uniforms[r]
                d.update(table=self._dev0(u.table), counter=self._dev0(u.counter),
                         rng=(u.device_seed, u.host_seed, u.refills, u._host_gen))
            out.append(d)
        return out

    def import_rows(self, rows: list[int], data: list[dict]) -> None:
        for r, d in zip(rows, data):
            self._check_row(r)
            if d["host"].keys() != self.host.keys():
                raise ValueError(f"import_rows: rows of a sampler with other stages ({sorted(d['host'])} vs "
                                 f"{sorted(self.host)})")
        ttnn = self.ttnn
        for r, d in zip(rows, data):
            for k, val in d["host"].items():
                self.host[k][0, 0, r, 0] = val
            if self.uniforms:
                u = self.uniforms[r]
                ttnn.copy_host_to_device_tensor(self._replicated(d["table"], device=False), u.table)
                ttnn.copy_host_to_device_tensor(self._replicated(d["counter"], device=False), u.counter)
                u.device_seed, u.host_seed, u.refills, u._host_gen = d["rng"]
            self.rows_used[r], self.params[r] = d["rows_used"], d["params"]
        self._write_params()
        self._write_penalties({r: d["penalties"] for r, d in zip(rows, data)})

    def before_step(self) -> None:
        """Host bookkeeping before each step execution (outside capture): every row's uniform counter advances once
        per step; a table used up is refilled."""
        for r, u in enumerate(self.uniforms):
            if self.rows_used[r] >= self.rng_rows:
                u.refill()
                self.rows_used[r] = 0
            self.rows_used[r] += 1

    # ---- device (traceable) ------------------------------------------------------------------------------
    def pick(self, logits_11BV):
        """fp32 (or bf16) logits [1, 1, B, V] -> the persistent result (see the class docstring); updates the
        penalty rows in place."""
        ttnn, st, d, b = self.ttnn, self.stages, self.dev, self.rows
        raw = logits_11BV if logits_11BV.dtype == ttnn.float32 else ttnn.typecast(logits_11BV, ttnn.float32)
        x = penalize_rows(ttnn, raw, st, d, self.seen, self.counts) if st.penalized else raw
        if st.greedy:
            am = ttnn.argmax(ttnn.to_layout(x, ttnn.ROW_MAJOR_LAYOUT), dim=3, keepdim=True)  # multi-core layout
            tok = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        if st.sampled:
            rows = [u.next_row([1, 1, 1, DRAFT_UNIFORMS_PER_ROW])[0] for u in self.uniforms]
            urow = rows[0] if b == 1 else ttnn.concat(rows, dim=2)
            u = ttnn.slice(urow, [0, 0, 0, 0], [1, 1, b, 1])
            drawn = inverse_cdf_draw(ttnn, self._probs(x), u)
            tok = ttnn.where(d["greedy"], tok, drawn) if st.greedy else drawn
        cols = [tok]
        onehot = None
        if st.penalized or self.n_top is not None:
            onehot = ttnn.eq(self.c_vocab_idx, tok)  # [1, 1, B, V]
        if st.penalized:
            ttnn.copy(ttnn.add(self.counts, onehot), self.counts)
            ttnn.copy(ttnn.maximum(self.seen, onehot), self.seen)
        if self.n_top is not None:
            cols += self._logprobs(raw, onehot)
        res = cols[0] if len(cols) == 1 else ttnn.concat(cols, dim=3)
        ttnn.copy(ttnn.to_layout(res, ttnn.ROW_MAJOR_LAYOUT), self.result)
        return self.result

    def _probs(self, x):
        return probs_rows(self.ttnn, x, self.stages, self.dev, self.c_vocab_idx, self._ckc)

    def _logprobs(self, raw, onehot) -> list:
        """Raw log-softmax of the unprocessed logits, per row: [own, rank, top-n ids, top-n values] columns."""
        ttnn, ckc = self.ttnn, self._ckc
        shifted = ttnn.subtract(raw, ttnn.max(raw, dim=3, keepdim=True))
        lse = ttnn.log(ttnn.sum(ttnn.exp(shifted), dim=3, keepdim=True, compute_kernel_config=ckc))
        lp = ttnn.subtract(shifted, lse)
        own = ttnn.sum(ttnn.multiply(lp, onehot), dim=3, keepdim=True, compute_kernel_config=ckc)
        rank = ttnn.add(ttnn.sum(ttnn.gt(lp, own), dim=3, keepdim=True, compute_kernel_config=ckc), 1.0)
        out = [own, rank]
        if self.n_top:
            vals, idx = ttnn.topk(lp, self.n_top, dim=3)
            out += [ttnn.typecast(ttnn.to_layout(idx, ttnn.TILE_LAYOUT), ttnn.float32), vals]
        return out

    # ---- host ----------------------------------------------------------------------------------------------
    def read(self) -> list[tuple[int, TokenLogprobs | None]]:
        """The one readback per step (device 0's replica of the small result) -> per row (token, logprobs or None:
        logprobs for the rows whose user asked, its own top-n). Rows without a user hold meaningless tokens."""
        res = self._dev0(self.result).double().reshape(self.rows, self.width).tolist()
        toks = [int(r[0]) for r in res]
        if any(not 0 <= t < self.vocab for t in toks):
            raise RuntimeError(f"device sampler returned tokens outside [0, {self.vocab}): {toks}")
        out = []
        for r, (tok, row) in enumerate(zip(toks, res)):
            p = self.params[r]
            if self.n_top is None or p is None or p.logprobs is None:
                out.append((tok, None))
                continue
            n, c = p.logprobs, SAMPLER_HEAD_COLS
            ids, vals = row[c: c + n], row[c + self.n_top: c + self.n_top + n]
            out.append((tok, TokenLogprobs(tok, row[1], int(row[2]), [(int(i), v) for i, v in zip(ids, vals)])))
        return out
