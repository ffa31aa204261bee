"""The sampling transform on device, shared by the acceptor (tt/spec/accept.py), the MTP drafter's sampled picks and
the plain-decode sampler (tt/runtime/sampler.py).

* :func:`inverse_cdf_draw`: one categorical draw per row from unnormalised weights and one uniform.
* :func:`penalize` and :func:`probs_from_logits`: the device twin of ``generation.sampling``'s transform
  (penalties -> temperature -> min_p -> top-k -> top-p -> softmax) with one user's parameters as scalars, which
  the acceptor and the draft pick share.
* :class:`SamplerStages`, :func:`row_values`, :func:`penalize_rows` and :func:`probs_rows`: the same steps with
  per-row operands (each row its own user's parameters; a row whose parameter is off holds the neutral value),
  which the plain-decode sampler and the acceptor's per-row params (``stages=``) share.
* :func:`argmax_pick` and :class:`SampledDraftPick`: the ``pick`` hooks of the MTP draft chain (tt/spec/mtp.py).

The tables these read (uniforms, token counts) are in tt/runtime/sampler_tables.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from qwen36.generation.sampling import SamplingParams

from ..model.model_config import compute_config_exact_count
from .sampler_tables import DRAFT_UNIFORMS_PER_ROW, UniformTable, draft_uniform_seeds


def inverse_cdf_draw(ttnn, weights, u):
    """weights ``[..., V]`` (>= 0, any total), u ``[..., 1]`` in [0, 1) -> fp32 index ``[..., 1]``:
    #{j : cdf_j <= u * total and cdf_j < total}. Zero-weight tokens are unreachable (the second test stops the
    count at the last token with mass, whatever rounding the cumulative sum does)."""
    cdf = ttnn.cumsum(weights, dim=3)
    total = ttnn.max(cdf, dim=3, keepdim=True)
    below = ttnn.multiply(ttnn.le(cdf, ttnn.multiply(u, total)), ttnn.lt(cdf, total))
    return ttnn.sum(below, dim=3, keepdim=True, compute_kernel_config=compute_config_exact_count(ttnn))


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
    top-p. Device twin of ``generation.sampling.probs_from_logits`` after its penalties."""
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
