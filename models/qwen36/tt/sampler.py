"""Device sampling building blocks shared by the acceptor (tt/accept.py) and the MTP drafter's sampled picks.

* :class:`UniformTable`: a persistent fp32 table of uniforms plus a device-resident row counter. A traced step
  gathers the row at the counter (``ttnn.embedding``) and advances the counter in place; no RNG op runs inside a
  trace (a captured ``ttnn.uniform`` would replay its captured seed every step). The table is (re)filled outside
  any capture: seeded ``ttnn.uniform`` in place (``source="device"``) or a seeded torch generator written with
  ``copy_host_to_device_tensor`` (``source="host"``: bit-identical on cards and the emulator).
* :func:`inverse_cdf_draw`: one categorical draw per row from unnormalised weights and one uniform.
* :class:`TokenCounts`: the penalty context (seen / output counts) on device, one per generation, shared by every
  reader and updated in place by the commit.
* :func:`penalize` and :func:`probs_from_logits`: the device twin of ``speculative.sampling``'s transform
  (penalties -> temperature -> min_p -> top-k -> top-p -> softmax), the one implementation the acceptor, the draft
  pick and the plain-decode sampler share.
* :func:`argmax_pick` and :class:`SampledDraftPick`: the ``pick`` hooks of the MTP draft chain (tt/mtp.py).
* :class:`DeviceSampler`: plain decoding's token pick inside the traced decode step (greedy or sampled, penalties
  from device-resident token counts updated in place, raw logprobs); only a few numbers cross to the host.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from qwen36.speculative.sampling import SamplingParams, TokenLogprobs

from .model_config import compute_config_exact_count

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

    def __init__(self, ttnn, mesh_device, vocab: int):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: token counts are carried in fp32 and would not be exact")
        self.ttnn, self.mesh, self.vocab = ttnn, mesh_device, vocab
        self.seen = self.counts = None

    def _host(self, x: torch.Tensor, device=None):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=device,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "TokenCounts":
        """Both buffers (before any capture), zero."""
        if self.seen is None:
            zeros = torch.zeros(1, 1, 1, self.vocab)
            self.seen, self.counts = self._host(zeros, self.mesh), self._host(zeros, self.mesh)
        return self

    def start(self, prompt_len: int, history: Sequence[int]) -> None:
        """``history`` = the prompt then every token emitted so far; the first ``prompt_len`` are the prompt.
        Host writes into the persistent buffers, outside any capture."""
        if self.seen is None:
            raise RuntimeError("TokenCounts.allocate() first")
        seen = torch.zeros(1, 1, 1, self.vocab)
        seen[..., torch.as_tensor(list(history), dtype=torch.long)] = 1.0
        counts = torch.zeros(1, 1, 1, self.vocab)
        out = torch.as_tensor(list(history[prompt_len:]), dtype=torch.long)
        counts[0, 0, 0].index_add_(0, out, torch.ones(out.numel()))
        self.ttnn.copy_host_to_device_tensor(self._host(seen), self.seen)
        self.ttnn.copy_host_to_device_tensor(self._host(counts), self.counts)

    def add(self, added_111V) -> None:
        """Traced, in place: ``added`` ``[1, 1, 1, V]`` fp32 = how many times each token was just emitted."""
        ttnn = self.ttnn
        ttnn.copy(ttnn.add(self.counts, added_111V), self.counts)
        ttnn.copy(ttnn.maximum(self.seen, ttnn.gt(added_111V, 0.0)), self.seen)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies (device 0's replica) of (seen, counts), each ``[V]`` fp32: for tests and checks."""
        ttnn = self.ttnn
        return tuple(ttnn.to_torch(ttnn.get_device_tensors(t)[0]).reshape(self.vocab) for t in (self.seen, self.counts))


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
    single-user :class:`SampledDraftPick` and the batched MTP head's sampled chain (tt/mtp.py)."""
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
    (seed, refill), an affine map of its own (not the acceptor's or the draft pick's). Shared by the batch-1
    :class:`DeviceSampler` and the batched sampler (tt/batch_sampler.py), so a user's draws are the same in both."""
    s = int(seed)
    return ((lambda refill: (s * 1_597_334_677 + refill * 2_654_435_761 + 0x5A3D) % 0x7FFFFFFF or 1),
            (s * 0x85EBCA6B + 0x5A3D) % (1 << 62))


SAMPLER_HEAD_COLS = 3  # result columns before the top-n: token id, its raw logprob, its rank


class DeviceSampler:
    """Plain decoding's pick, on device and traceable: logits ``[1, 1, 1, V]`` of the decode row -> one persistent
    ROW_MAJOR fp32 result ``[1, 1, 1, 3 + 2n]`` = ``[token, logprob, rank, top-n ids, top-n logprobs]`` (the
    logprob columns only when ``params.logprobs`` is set). That result is all the host reads per step.

    * greedy: argmax of the (penalised) logits, on a ROW_MAJOR view (multi-core on cards; ties: lowest index);
    * sampled: :func:`probs_from_logits` then :func:`inverse_cdf_draw` with one uniform from a
      :class:`UniformTable` row (column 0) per step; the host calls :meth:`before_step` (outside capture) before
      every execution to refill the table when used up;
    * penalties: ``seen`` (prompt or output) and ``counts`` (output occurrences) ``[1, 1, 1, V]`` fp32 live on
      device; :meth:`start` writes them once per generation (prompt and first token), and every step adds its
      token in place (the step's state update, inside the trace);
    * logprobs: raw (vLLM's default ``raw_logprobs``): log-softmax of the unpenalised logits; the token's own,
      its rank and the top ``n`` by ``ttnn.topk``.
    """

    def __init__(self, ttnn, mesh_device, vocab: int, params: SamplingParams, *, rng: str = "device",
                 rng_rows: int = 1024):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: sampled ids are counted in fp32 and would not be exact")
        self.ttnn, self.mesh, self.vocab, self.params = ttnn, mesh_device, vocab, params
        self.n_top = params.logprobs if params.logprobs is not None else None
        self.width = 1 if self.n_top is None else SAMPLER_HEAD_COLS + 2 * self.n_top
        device_seed, host_seed = plain_sampler_seeds(params.seed)
        self.uniforms = None if params.greedy else UniformTable(
            ttnn, mesh_device, rng_rows, DRAFT_UNIFORMS_PER_ROW, source=rng, device_seed=device_seed,
            host_seed=host_seed)
        self.rng_rows = rng_rows
        self.rows_used = 0  # host mirror of the device counter
        self.allocated = False

    def _replicated(self, x: torch.Tensor, layout=None, device=True):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=layout or ttnn.TILE_LAYOUT,
                               device=self.mesh if device else None, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "DeviceSampler":
        """Every constant, state and result buffer (before any capture); fills the uniform table."""
        if self.allocated:
            return self
        ttnn, v = self.ttnn, self.vocab
        self._ckc = compute_config_exact_count(ttnn)
        self.c_vocab_idx = self._replicated(torch.arange(v, dtype=torch.float32).reshape(1, 1, 1, v))
        if self.params.penalized:
            self.seen = self._replicated(torch.zeros(1, 1, 1, v))
            self.counts = self._replicated(torch.zeros(1, 1, 1, v))
        self.result = self._replicated(torch.zeros(1, 1, 1, self.width), layout=ttnn.ROW_MAJOR_LAYOUT)
        if self.uniforms is not None:
            self.uniforms.allocate()
        self.allocated = True
        return self

    def release(self) -> None:
        """Free the device buffers (no trace may be live that reads them)."""
        if not self.allocated:
            return
        names = ["c_vocab_idx", "result"] + (["seen", "counts"] if self.params.penalized else [])
        tensors = [getattr(self, n) for n in names]
        if self.uniforms is not None:
            tensors += [self.uniforms.table, self.uniforms.counter, self.uniforms._zero]
        for t in tensors:
            self.ttnn.deallocate(t)
        self.allocated = False

    def start(self, prompt: Sequence[int], first: int) -> None:
        """A new generation (outside any capture): penalty state from the prompt and the first (prefill) token,
        and the uniform stream back to its first fill (a seeded run replays)."""
        if not self.allocated:
            raise RuntimeError("DeviceSampler.allocate() first")
        ttnn = self.ttnn
        if self.params.penalized:
            seen = torch.zeros(1, 1, 1, self.vocab)
            seen[..., torch.as_tensor(list(prompt) + [first], dtype=torch.long)] = 1.0
            counts = torch.zeros(1, 1, 1, self.vocab)
            counts[..., first] = 1.0
            ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
            ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)
        if self.uniforms is not None:
            self.uniforms.restart()
            self.rows_used = 0

    def before_step(self) -> None:
        """Host bookkeeping before each step execution (outside capture): refill the table when used up."""
        if self.uniforms is None:
            return
        if self.rows_used >= self.rng_rows:
            self.uniforms.refill()
            self.rows_used = 0
        self.rows_used += 1

    # ---- device (traceable) ------------------------------------------------------------------------------
    def pick(self, logits_111V):
        """-> the persistent result (see the class docstring); updates the penalty counts in place."""
        ttnn, p = self.ttnn, self.params
        raw = logits_111V if logits_111V.dtype == ttnn.float32 else ttnn.typecast(logits_111V, ttnn.float32)
        x = penalize(ttnn, raw, p, getattr(self, "seen", None), getattr(self, "counts", None))
        if p.greedy:
            am = ttnn.argmax(ttnn.to_layout(x, ttnn.ROW_MAJOR_LAYOUT), dim=3, keepdim=True)  # multi-core layout
            tok = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        else:
            row, _ = self.uniforms.next_row([1, 1, 1, DRAFT_UNIFORMS_PER_ROW])
            u = ttnn.slice(row, [0, 0, 0, 0], [1, 1, 1, 1])
            tok = inverse_cdf_draw(ttnn, probs_from_logits(ttnn, x, p, self._ckc), u)
        cols = [tok]
        onehot = None
        if p.penalized or self.n_top is not None:
            onehot = ttnn.eq(self.c_vocab_idx, tok)  # [1, 1, 1, V]
        if p.penalized:
            ttnn.copy(ttnn.add(self.counts, onehot), self.counts)
            ttnn.copy(ttnn.maximum(self.seen, onehot), self.seen)
        if self.n_top is not None:
            cols += self._logprobs(raw, onehot)
        res = cols[0] if len(cols) == 1 else ttnn.concat(cols, dim=3)
        ttnn.copy(ttnn.to_layout(res, ttnn.ROW_MAJOR_LAYOUT), self.result)
        return self.result

    def _logprobs(self, raw, onehot) -> list:
        """Raw log-softmax of the unprocessed logits: [own, rank, top-n ids, top-n values] columns."""
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
    def read(self) -> tuple[int, TokenLogprobs | None]:
        """The one readback per step (device 0's replica of the small result) -> (token, logprobs or None)."""
        ttnn = self.ttnn
        row = ttnn.to_torch(ttnn.get_device_tensors(self.result)[0]).reshape(-1).double().tolist()
        tok = int(row[0])
        if not 0 <= tok < self.vocab:
            raise RuntimeError(f"device sampler returned token {tok} outside [0, {self.vocab})")
        if self.n_top is None:
            return tok, None
        n = self.n_top
        ids, vals = row[SAMPLER_HEAD_COLS: SAMPLER_HEAD_COLS + n], row[SAMPLER_HEAD_COLS + n:]
        return tok, TokenLogprobs(tok, row[1], int(row[2]), [(int(i), v) for i, v in zip(ids, vals)])
