"""Device-work accounting on the emulated mesh.

Every op call that reaches a device (golden-backed or emulated) is one *device program* per device
(ttnn launches the same program on every device of the mesh). For each call we count, per device:

* ``programs``: device programs a card would launch (``programs.py``: one per op call, none for a pure view,
  untilize + op + tilize for unaligned tiled slices/concats, two for a synchronous all_reduce); ``per_op``
  counts calls,
* ``bytes_read``: tile-accurate bytes of every device-tensor *input* of the op, by dtype
  (bf16 2048 B / fp32 4096 B / bfloat8_b 1088 B / bfloat4_b 576 B per 32x32 tile; ROW_MAJOR tensors
  count element bytes),
* ``bytes_written``: tile-accurate bytes of the op outputs (also by dtype),
* ``collectives`` and ``collective_bytes``: CCL calls and the bytes each device sends over links
  (ring algorithms: all_gather (N-1)*shard, reduce_scatter (N-1)/N*input, all_reduce 2(N-1)/N*input).

Counts are kept in a stack of :class:`Counts` so that ``with ctx.counters.scope("decode") as c:`` yields
the counts of just that region, while the enclosing scopes and the global totals keep accumulating.
Trace replays add the counts recorded for the trace (captured once at capture time) - replay does the
same device work as the captured region.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Iterator


@dataclasses.dataclass
class Counts:
    name: str = "total"
    programs: int = 0
    bytes_read: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    bytes_written: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    collectives: int = 0
    collective_bytes: int = 0
    per_op: dict = dataclasses.field(default_factory=lambda: defaultdict(int))  # op calls per op name
    programs_per_op: dict = dataclasses.field(default_factory=lambda: defaultdict(int))  # programs per op name
    # per op name: bytes read by key (as ``bytes_read``), collective launches and collective bytes, so that the
    # cost model can charge each op's own bytes (a ranking of programs by modelled time)
    bytes_read_per_op: dict = dataclasses.field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    collectives_per_op: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    collective_bytes_per_op: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    # (op name, flops per device, fpu phases, fp32_dest_acc_en, sorted bytes-read items) -> calls: the compute work
    # of matmul-like programs (work.py), one key per distinct program, for the prefill compute term of the cost model
    compute_work: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    trace_replays: int = 0

    @property
    def bytes_read_total(self) -> int:
        return int(sum(self.bytes_read.values()))

    @property
    def flops_total(self) -> int:
        """Floating-point operations per device of the programs with a work term (work.py)."""
        return int(sum(key[1] * n for key, n in self.compute_work.items()))

    @property
    def bytes_written_total(self) -> int:
        return int(sum(self.bytes_written.values()))

    def add(self, other: "Counts", times: int = 1) -> None:
        self.programs += other.programs * times
        for k, v in other.bytes_read.items():
            self.bytes_read[k] += v * times
        for k, v in other.bytes_written.items():
            self.bytes_written[k] += v * times
        self.collectives += other.collectives * times
        self.collective_bytes += other.collective_bytes * times
        for k, v in other.per_op.items():
            self.per_op[k] += v * times
        for k, v in other.programs_per_op.items():
            self.programs_per_op[k] += v * times
        for op, reads in other.bytes_read_per_op.items():
            for k, v in reads.items():
                self.bytes_read_per_op[op][k] += v * times
        for k, v in other.collectives_per_op.items():
            self.collectives_per_op[k] += v * times
        for k, v in other.collective_bytes_per_op.items():
            self.collective_bytes_per_op[k] += v * times
        for k, v in other.compute_work.items():
            self.compute_work[k] += v * times
        self.trace_replays += other.trace_replays * times

    def add_op(self, op_name: str, read: dict, written: dict, collective_bytes: int | None = None,
               programs: int = 1, collectives: int = 1, work: tuple | None = None) -> None:
        """Count one op call: ``programs`` device programs (``programs.py``: 0 for a view, several for ops that
        run as untilize + op + tilize) and ``collectives`` collective launches when ``collective_bytes`` is given
        (``programs.collectives_for``: two for an all-reduce built from a reduce-scatter and an all-gather);
        ``work`` (work.py: flops, phases, fp32 Dst) keys the program's compute work with its own read bytes."""
        if work is not None and programs:
            self.compute_work[(op_name, *work, tuple(sorted(read.items())))] += 1
        self.programs += programs
        self.per_op[op_name] += 1
        self.programs_per_op[op_name] += programs
        for k, v in read.items():
            self.bytes_read[k] += v
            self.bytes_read_per_op[op_name][k] += v
        for k, v in written.items():
            self.bytes_written[k] += v
        if collective_bytes is not None:
            self.collectives += collectives
            self.collective_bytes += collective_bytes
            self.collectives_per_op[op_name] += collectives
            self.collective_bytes_per_op[op_name] += collective_bytes

    def copy(self, name: str | None = None) -> "Counts":
        c = Counts(name=name or self.name)
        c.add(self)
        return c

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "programs_per_device": self.programs,
            "bytes_read_per_device": dict(sorted(self.bytes_read.items())),
            "bytes_read_per_device_total": self.bytes_read_total,
            "bytes_written_per_device": dict(sorted(self.bytes_written.items())),
            "collectives": self.collectives,
            "collective_bytes_per_device": self.collective_bytes,
            "trace_replays": self.trace_replays,
            "per_op": dict(sorted(self.per_op.items())),
            "programs_per_op": dict(sorted(self.programs_per_op.items())),
        }


class Counters:
    """Resettable, scoped counters attached to one emulated mesh (``ctx.counters``)."""

    def __init__(self) -> None:
        self.total = Counts("total")
        self._stack: list[Counts] = []
        self._sinks: list[Counts] = []  # extra sinks (trace capture recording)

    def reset(self) -> None:
        self.total = Counts("total")
        for c in self._stack:
            fresh = Counts(c.name)
            c.__dict__.update(fresh.__dict__)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[Counts]:
        c = Counts(name)
        self._stack.append(c)
        try:
            yield c
        finally:
            self._stack.remove(c)

    @contextlib.contextmanager
    def _sink(self, c: Counts) -> Iterator[Counts]:
        self._sinks.append(c)
        try:
            yield c
        finally:
            self._sinks.remove(c)

    def _targets(self, include_sinks: bool = True):
        yield self.total
        yield from self._stack
        if include_sinks:
            yield from self._sinks

    def record_op(self, op_name: str, read: dict, written: dict, *, collective_bytes: int | None = None, live=True,
                  programs: int = 1, collectives: int = 1, work: tuple | None = None):
        """Record one op call. ``live=False`` records only into capture sinks (the op was recorded, not run)."""
        targets = list(self._targets()) if live else list(self._sinks)
        for c in targets:
            c.add_op(op_name, read, written, collective_bytes, programs, collectives, work)

    def record_replay(self, trace_counts: Counts) -> None:
        for c in self._targets(include_sinks=False):
            c.add(trace_counts)
            c.trace_replays += 1

    def snapshot(self) -> Counts:
        return self.total.copy("snapshot")
