"""Device-resident tables the samplers read and update in place (the plain-decode sampler, tt/runtime/sampler.py; the
acceptor, tt/spec/accept.py; the MTP drafter's sampled picks, tt/runtime/sampler_transform.py and tt/spec/mtp.py).

* :class:`UniformTable`: a persistent fp32 table of uniforms plus a device-resident row counter. A traced step
  gathers the row at the counter (``ttnn.embedding``) and advances the counter in place; no RNG op runs inside a
  trace (a captured ``ttnn.uniform`` would replay its captured seed every step). The table is (re)filled outside
  any capture: seeded ``ttnn.uniform`` in place (``source="device"``) or a seeded torch generator written with
  ``copy_host_to_device_tensor`` (``source="host"``: bit-identical on cards and the emulator). The seed maps of
  the draft picks' and plain decoding's streams (:func:`draft_uniform_seeds`, :func:`plain_sampler_seeds`) live
  here too, so that every stream's seeds are side by side.
* :class:`TokenCounts`: the penalty context (seen / output counts) on device, one per generation, shared by every
  reader and updated in place by the commit.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


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

    def buffers(self) -> list:
        """The table's device buffers (table, counter, the counter's reset value), for their owner to free."""
        return [self.table, self.counter, self._zero]

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


DRAFT_UNIFORMS_PER_ROW = 32  # one tile row of uniforms per chain: draft i uses column i (K <= 32)


def draft_uniform_seeds(seed: int):
    """(device_seed(refill), host_seed) of the draft picks' uniform stream for ``seed``: nonzero, deterministic per
    (seed, refill), a different affine map than the acceptor's seeds (independent streams). Shared by the
    single-user :class:`SampledDraftPick` and the batched MTP head's sampled chain (tt/spec/mtp.py)."""
    s = int(seed)
    return ((lambda refill: (s * 2_246_822_519 + refill * 3_266_489_917 + 0x5EED) % 0x7FFFFFFF or 1),
            (s * 0x9E3779B1 + 0x5EED) % (1 << 62))


def plain_sampler_seeds(seed: int):
    """(device_seed(refill), host_seed) of plain decoding's uniform stream for ``seed``: nonzero, deterministic per
    (seed, refill), an affine map of its own (not the acceptor's or the draft pick's). A row of
    :class:`DeviceSampler` is seeded with it when a user joins, so a user's draws are the same in whichever row and
    batch it runs."""
    s = int(seed)
    return ((lambda refill: (s * 1_597_334_677 + refill * 2_654_435_761 + 0x5A3D) % 0x7FFFFFFF or 1),
            (s * 0x85EBCA6B + 0x5A3D) % (1 << 62))
