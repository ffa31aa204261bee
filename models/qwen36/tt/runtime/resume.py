"""Resuming a sequence in the middle of its prompt when its attention KV lives in a block pool the model does not own
(vLLM's automatic prefix caching): GDN checkpoints at prefill-grid boundaries, a ledger of which KV pages hold the
prefill's bits, and the plan that prefills only what must be computed, bit-identical to a cold prefill.

Facts this rests on (``tests/tt/runtime/test_resume.py`` checks them on the emulated mesh):

* a prefill row depends only on the tokens up to it and on the GDN state its forward started from, not on how many
  rows the forward has or on the tokens after it;
* that state was rounded to fp32 at the end of the forward before (the chunked kernel keeps it wider inside one), so
  a prompt cut into more forwards gives other rows after the cut (a 100-token prompt cut at 64: 0.023 in the last
  row's logits); a decode step (one row, the recurrent form) gives other bits than a prefill row.

So the **canonical computation** of a prompt is the prefill in pieces of ``grid`` rows from position 0 (the model's
``prefill_chunk``, which ``prefill_forward`` already uses), the last piece shorter: the state at a grid boundary is a
function of the tokens before it, and every KV row a prefill piece writes when it starts at a grid boundary from the
canonical state is the canonical row, whatever the piece's length. A cold prefill is that computation; a resumed one
restores the canonical GDN state at a grid boundary u (a checkpoint) and runs the same pieces from u, so its rows
and states are the cold run's.

A prefix hit at position s (a multiple of the KV page: vLLM caches whole blocks) rarely falls on the grid. The plan
restores the newest checkpoint at a grid boundary q <= u = grid * floor(s / grid) and recomputes the rows [q, s)
inside the canonical pieces; their KV writes go to scratch pages the model owns (the pool's cached pages are read,
never written: those bits are equal anyway). A checkpoint that was evicted costs recomputation, never exactness.

**Pages that do not hold the prefill's bits.** A block that a decode step wrote (a sequence's generated tokens, or
the tail of its prompt completed by decode rows) holds the recurrent form's bits, yet vLLM caches it like any other
and hands it to a resumed request (its own generated tokens) or to a prompt that repeats another request's output.
The :class:`PageLedger` records, per physical page, the token chain of the canonical rows written into it and which
sequence's decode steps wrote it. A hit's pages count only up to the first page the ledger does not vouch for; the
plan recomputes from the grid boundary below it and rewrites the unvouched pages with the canonical rows (a
*repair*: the one case a cached page is written). Its bits were written by one sequence's decode steps and only that
sequence reads them; the caller checks that it has stopped (:meth:`ResumePlan.repairs` names the writers).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ...config import FULL
from ..model.state import GDNLayerState, new_layer_state
from .prefix import shard_nbytes


def chain_keys(tokens: Sequence[int], page: int, upto: int | None = None) -> list[bytes]:
    """``keys[j]`` identifies tokens[: page * (j + 1)] (a hash chain over whole pages, as vLLM's block hashes are
    built; the model is not given vLLM's hashes, and its own depend only on the tokens): one key per whole page of
    ``tokens[:upto]``."""
    n = len(tokens) if upto is None else min(upto, len(tokens))
    arr = np.asarray(list(tokens[: n - n % page]), dtype=np.int64)
    keys, prev = [], b""
    for j in range(n // page):
        prev = hashlib.blake2b(prev + arr[j * page:(j + 1) * page].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


# ---- GDN checkpoints -------------------------------------------------------------------------------------------
class CheckpointPool:
    """Device buffers for ``slots`` GDN checkpoints (every GDN layer's recurrent + conv state of one sequence),
    allocated at construction, before any trace capture: saving and restoring are device copies into and out of
    them, allowed while a decode trace is live."""

    def __init__(self, model, slots: int, gdn_layers: int | None = None):
        """``gdn_layers``: checkpoints of the first that many GDN layers only (a cost probe that builds one layer);
        default every GDN layer of the model."""
        if slots < 0:
            raise ValueError(f"checkpoint slots must be >= 0, got {slots}")
        a, ttnn = model.args, model.ttnn
        self.ttnn = ttnn
        gdn = [t for t in a.cfg.layer_types if t != FULL][:gdn_layers]
        self.slots = [[new_layer_state(a, ttnn, model.mesh, t, slots=1) for t in gdn] for _ in range(slots)]
        self.nbytes = sum(shard_nbytes(s.recurrent) + shard_nbytes(s.conv) for s in self.slots[0]) if self.slots else 0

    def __len__(self) -> int:
        return len(self.slots)

    def save(self, index: int, layers: list[GDNLayerState]) -> None:
        for src, dst in zip(layers, self.slots[index]):
            self.ttnn.copy(src.recurrent, dst.recurrent)
            self.ttnn.copy(src.conv, dst.conv)

    def load(self, index: int, layers: list[GDNLayerState]) -> None:
        for src, dst in zip(self.slots[index], layers):
            self.ttnn.copy(src.recurrent, dst.recurrent)
            self.ttnn.copy(src.conv, dst.conv)

    def release(self) -> None:
        for slot in self.slots:
            for s in slot:
                self.ttnn.deallocate(s.recurrent)
                self.ttnn.deallocate(s.conv)
        self.slots = []


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which grid boundaries of a prefilled prompt keep a checkpoint: the ``last`` ones at or before the prompt's
    last token (a conversation's next turn repeats the prompt up to a few tokens before its end, so its hit lands
    there), and every ``every`` tokens (long shared prefixes; 0: none). The pool's size bounds them all (LRU)."""

    last: int = 2
    every: int = 0

    def wants(self, boundary: int, prompt_len: int, grid: int) -> bool:
        if boundary <= 0 or boundary > prompt_len - 1:
            return False
        newest = grid * ((prompt_len - 1) // grid)
        return newest - boundary < self.last * grid or (self.every > 0 and boundary % self.every == 0)


@dataclass
class ResumeStats:
    """Counters of the served prefills (what the plugin's calls asked for and what it cost)."""

    prefills: int = 0  # sequences prefilled (cold or resumed)
    hits: int = 0  # prefills that started past position 0 (vLLM's cached prefix)
    hit_tokens: int = 0  # tokens vLLM reported cached
    computed_tokens: int = 0  # rows the prefills ran (recomputed ones included)
    recomputed_tokens: int = 0  # rows below a hit run again (from the checkpoint's boundary to the hit)
    restores: int = 0  # checkpoints restored
    restored_tokens: int = 0  # the positions restored (tokens not run)
    misses: int = 0  # hits whose grid boundary had no checkpoint (an earlier one or position 0 served them)
    saves: int = 0
    evictions: int = 0
    repaired_pages: int = 0  # cached pages rewritten with the prefill's rows (their decode bits were not canonical)
    unsafe_repairs: int = 0  # of those, pages whose writing sequence might still be decoding

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class CheckpointStore:
    """GDN checkpoints keyed by the token chain at grid boundaries, in a :class:`CheckpointPool`, least recently used
    evicted first. Restoring is an immediate copy, so nothing holds a checkpoint afterwards."""

    def __init__(self, pool: CheckpointPool, grid: int, page: int, policy: CheckpointPolicy = CheckpointPolicy(),
                 stats: ResumeStats | None = None):
        if grid % page:
            raise ValueError(f"the prefill grid {grid} must be a multiple of the KV page {page}")
        self.pool, self.grid, self.page, self.policy = pool, grid, page, policy
        self.stats = stats if stats is not None else ResumeStats()
        self.entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (pool slot, position)
        self.free = list(range(len(pool)))

    def newest_at_or_before(self, keys: list[bytes], limit: int) -> tuple[int, int | None]:
        """The deepest stored grid boundary q <= ``limit`` on the chain ``keys`` (one per page): (q, pool slot), or
        (0, None) when none is stored."""
        for q in range(self.grid * (limit // self.grid), 0, -self.grid):
            if q // self.page > len(keys):
                continue
            key = keys[q // self.page - 1]
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
                return q, hit[0]
        return 0, None

    def has(self, key: bytes) -> bool:
        return key in self.entries

    def save(self, key: bytes, position: int, layers: list[GDNLayerState]) -> bool:
        """Copy ``layers`` (the canonical state at ``position``) into a slot, evicting the least recently used entry
        when the pool is full; False with a pool of no slots."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        if not len(self.pool):
            return False
        if not self.free:
            _, (slot, _) = self.entries.popitem(last=False)
            self.free.append(slot)
            self.stats.evictions += 1
        slot = self.free.pop()
        self.pool.save(slot, layers)
        self.entries[key] = (slot, position)
        self.stats.saves += 1
        return True

    def clear(self) -> None:
        self.free = list(range(len(self.pool)))
        self.entries.clear()


# ---- which pages hold the canonical rows -----------------------------------------------------------------------
class PageLedger:
    """Per physical KV page: the token chain key of the canonical rows a prefill wrote into it (whole pages only),
    or the sequence whose decode steps wrote into it. A page is canonical for a request when its key is the
    request's key for that page index."""

    def __init__(self):
        self.canon: dict[int, bytes] = {}
        self.decoded_by: dict[int, int] = {}

    def vouches(self, page: int, key: bytes) -> bool:
        return self.canon.get(int(page)) == key

    def prefilled(self, page: int, key: bytes) -> None:
        self.canon[int(page)] = key
        self.decoded_by.pop(int(page), None)

    def decoded(self, page: int, writer: int) -> None:
        self.canon.pop(int(page), None)
        self.decoded_by[int(page)] = writer

    def forget(self, page: int) -> None:
        self.canon.pop(int(page), None)
        self.decoded_by.pop(int(page), None)

    def clear(self) -> None:
        self.canon.clear()
        self.decoded_by.clear()


# ---- the plan ----------------------------------------------------------------------------------------------------
@dataclass
class ResumePlan:
    """How to prefill tokens[:end] into a sequence whose KV rows [0, cached) are in its pages already.

    ``start``: the first row run (a grid boundary); ``checkpoint``: the pool slot restored there (None: position 0,
    zero state); ``divert``: page indices whose rows are run but written to scratch pages (read-only cached pages);
    ``own_from``: the first page index that belongs to the sequence alone (zeroed, then written); ``repairs``:
    cached page indices rewritten with the canonical rows, with the sequence that decoded into each (None: not
    known); ``saves``: grid boundaries to checkpoint (key, position); ``target``: the grid boundary the plan would
    have restored with every checkpoint kept (``start`` < ``target``: the checkpoint there was not held)."""

    end: int
    cached: int
    start: int
    target: int
    checkpoint: int | None
    divert: set[int]
    own_from: int
    repairs: dict[int, int | None] = field(default_factory=dict)
    saves: list[tuple[bytes, int]] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    @property
    def recomputed(self) -> int:
        return max(0, self.cached - self.start)


def plan_resume(tokens: Sequence[int], end: int, cached: int, row: Sequence[int], ledger: PageLedger,
                store: CheckpointStore | None, grid: int, page: int) -> ResumePlan:
    """The plan for prefilling ``tokens[:end]`` whose rows [0, ``cached``) are in the pages ``row`` names (vLLM's
    cached prefix, or the sequence's own earlier prefill chunks). Whole pages below ``cached`` that the ledger
    vouches for are read, never written; the others are rewritten with the canonical rows (repairs), and the state
    is rebuilt from the grid boundary below the first of them."""
    if not 0 <= cached < end <= len(tokens):
        raise ValueError(f"resume needs 0 <= cached ({cached}) < end ({end}) <= tokens ({len(tokens)})")
    keys = chain_keys(tokens, page, end)
    full = cached // page  # pages wholly below the cached position
    good = [ledger.vouches(row[j], keys[j]) for j in range(full)]
    first_bad = next((j for j in range(full) if not good[j]), full)
    u = grid * (min(first_bad * page, cached) // grid)
    if store is not None:
        q, slot = store.newest_at_or_before(keys, u)
    else:
        q, slot = 0, None
    divert = {j for j in range(q // page, full) if good[j]}
    repairs = {j: ledger.decoded_by.get(int(row[j])) for j in range(first_bad, full) if not good[j]}
    saves = [] if store is None else [(keys[b // page - 1], b) for b in range(q + grid, end, grid)
                                      if store.policy.wants(b, end, grid) and not store.has(keys[b // page - 1])]
    return ResumePlan(end=end, cached=cached, start=q, target=u, checkpoint=slot, divert=divert, own_from=full,
                      repairs=repairs, saves=saves, keys=keys)


def write_row(row: torch.Tensor, plan: ResumePlan, lo: int, hi: int, scratch: Sequence[int], page: int) -> torch.Tensor:
    """The host page-table row for the piece [lo, hi): pages in ``plan.divert`` write to ``scratch`` pages (one per
    page of the piece); reads go through the device row, which keeps the real pages."""
    out = row.clone()
    for n, j in enumerate(range(lo // page, -(-hi // page))):
        if j in plan.divert:
            out[0, j] = int(scratch[n])
    return out


def run_pieces(model, view, ids: torch.Tensor, plan: ResumePlan, store: CheckpointStore | None,
               scratch: Sequence[int], gdn_layers: list[GDNLayerState]) -> torch.Tensor:
    """Run the canonical pieces [plan.start, plan.end) on ``view`` (the sequence's batch-1 state at plan.start,
    restored by the caller), one ``prefill_forward`` per grid piece with its write row, checkpointing the grid
    boundaries the plan asks for. Returns the last row's fp32 logits [V]."""
    a = model.args
    grid, page = a.prefill_chunk, a.block_size
    row = view.page_table_host.clone()
    want = dict((b, k) for k, b in plan.saves)
    logits = None
    view.pos = plan.start
    for lo in range(plan.start, plan.end, grid):
        hi = min(lo + grid, plan.end)
        view.page_table_host = write_row(row, plan, lo, hi, scratch, page)
        logits = model.prefill_forward(ids[lo:hi], view)[-1]
        if hi in want and store is not None:
            store.save(want[hi], hi, gdn_layers)
    view.page_table_host = row
    return logits
