"""Batched plain decode that changes its bucket with the number of users: one :class:`TTBatchDecoder` per bucket,
users moved between them on device.

A decode step costs what its bucket costs (B rows of activations, the B-slot GDN ring, B users' KV reads), so a
server whose load varies should run the smallest bucket that holds its users. :class:`BucketedBatchDecoder` keeps
the caller's slot numbers stable (``0 .. capacity-1``, the largest bucket) and maps each held slot to a row of the
current bucket's decoder:

* a user joining when every row of the current bucket is held moves everyone to the next bucket that holds them
  (``grow``);
* when the users have fitted a smaller bucket for ``shrink_after`` consecutive steps, they move down to the
  smallest bucket that holds them (``shrink``); the patience keeps a server whose load hovers at a bucket boundary
  from moving its state back and forth every step (a move reads and rewrites every GDN state row, docs/tt_runtime.md);
* ``slot_remap`` (the vLLM-tt contract: row i takes the state of slot ``remap[i]``) only relabels which row holds
  which slot: no state moves on device.

Trace rules. Every bucket's state, decode inputs and index buffers are allocated by the constructor, before any
trace exists, and :meth:`warm` runs one eager step of every bucket while no trace is live (an eager step allocates
its outputs, which rule 4 of docs/emulator_traces.md forbids once a trace is live). After that each bucket captures its
step once, on its first traced step, and keeps it: moving between buckets never re-captures. The KV pages are one
pool shared by all buckets (the largest bucket's; slot s owns the pages of page-table row s by default, or what
:meth:`set_page_table` says, e.g. vLLM's block table), so a move copies page-table rows, never KV. The GDN
recurrent and conv rows move with one ``ttnn.embedding`` row gather per state tensor, from the old bucket's
rows (plus one zero row for the new bucket's free rows) into the new bucket's persistent buffers.

Sampling (``sampling=True``): every bucket also has a :class:`.sampler.DeviceSampler` of the bucket's rows with
every stage of the transform (any mix of users can join without a new capture) whose row r samples for the user in
row r; a move carries the moving users' sampler rows (parameters, penalty rows, uniform
tables and counters, host stream state) through the host, from the old bucket's sampler into the new one's.

Memory: every bucket holds its own GDN state (the sum of the bucket sizes, 1 + 8 + 32 = 41 slots with the
default buckets, against 32 for the largest alone).
"""
from __future__ import annotations

import torch

from .batch import DEFAULT_BUCKETS, FREE, TTBatchDecoder
from .decode import sampled_step
from ..model.model import TTQwen36Model
from .sampler import DeviceSampler
from ..model.state import GDNLayerState, KVLayerState

SHRINK_AFTER = 16  # steps the users must fit a smaller bucket before they move down to it


class BucketedBatchDecoder:
    def __init__(self, model: TTQwen36Model, buckets=DEFAULT_BUCKETS, *, use_trace: bool = True,
                 shrink_after: int = SHRINK_AFTER, sampling: bool = False, rng: str = "device"):
        buckets = tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be positive slot counts, got {buckets}")
        if shrink_after < 1:
            raise ValueError(f"shrink_after must be >= 1, got {shrink_after}")
        self.model, self.ttnn, self.buckets, self.shrink_after = model, model.ttnn, buckets, shrink_after
        self.slots = buckets[-1]  # the caller's slot numbers: 0 .. capacity-1
        self.decs = {b: TTBatchDecoder(model, b, use_trace=use_trace) for b in buckets}
        top = self.decs[self.slots]
        for b, dec in self.decs.items():  # one KV pool: the largest bucket's
            if b == self.slots:
                continue
            for i, st in enumerate(dec.state.layers):
                if isinstance(st, KVLayerState):
                    self.ttnn.deallocate(st.k)
                    self.ttnn.deallocate(st.v)
                    dec.state.layers[i] = top.state.layers[i]
        # with ``sampling``: one device sampler per bucket (tt/runtime/sampler.py, every stage), its rows follow the users
        self.samplers = ({b: DeviceSampler(self.ttnn, model.mesh, model.args.cfg.vocab_size, b, rng=rng).allocate()
                          for b in buckets} if sampling else None)
        # slot s's pages: row s of the largest bucket's identity table, until set_page_table says otherwise
        self._pages = top.state.page_table_host.clone()
        self.cur = buckets[0]
        self.row: dict[int, int] = {}  # held slot -> row of the current bucket
        self.fits_smaller = 0  # consecutive steps the users fitted a smaller bucket
        self.moves: list[tuple[int, int]] = []  # (from, to) of every bucket change, in order

    # ---- views in the caller's slot numbers ---------------------------------------------------------------------
    @property
    def dec(self) -> TTBatchDecoder:
        return self.decs[self.cur]

    @property
    def use_trace(self) -> bool:
        return self.dec.use_trace

    @use_trace.setter
    def use_trace(self, value: bool) -> None:
        for d in self.decs.values():
            d.use_trace = bool(value)

    @property
    def pos(self) -> list[int]:
        return [self.dec.pos[self.row[s]] if s in self.row else FREE for s in range(self.slots)]

    @property
    def page_table_host(self) -> torch.Tensor:
        return self._pages.clone()

    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.row]

    @property
    def prefills(self) -> dict:
        """Held slot -> its user's prefill result (tokens reused / computed), in the caller's slot numbers."""
        return {s: self.dec.prefills[r] for s, r in self.row.items() if r in self.dec.prefills}

    @property
    def captures(self) -> int:
        return sum(d.captures for d in self.decs.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range (capacity {self.slots})")

    def _sync_pages(self) -> None:
        """The current bucket's page table: row r = the pages of the slot it holds (free rows keep theirs)."""
        table = self.dec.state.page_table_host.clone()
        for s, r in self.row.items():
            table[r] = self._pages[s]
        self.dec.set_page_table(table)

    def set_page_table(self, table: torch.Tensor) -> None:
        """Pages of every slot ([capacity, blocks_per_seq]: row s = slot s's blocks of the shared pool)."""
        table = torch.as_tensor(table, dtype=torch.int32)
        if tuple(table.shape) != tuple(self._pages.shape):
            raise ValueError(f"page table {tuple(table.shape)}: expected {tuple(self._pages.shape)}")
        self._pages = table.clone()
        self._sync_pages()

    # ---- warmup and bucket moves ----------------------------------------------------------------------------------
    @torch.no_grad()
    def warm(self) -> None:
        """One eager step of every bucket that has not stepped yet and holds no user, while no trace is live (call
        before the first traced step; :meth:`step` calls it when no trace is live). Every row of such a step is
        padded, and a padded row rewrites its GDN slot with values nobody reads: harmless in a bucket nobody
        holds, a user's state lost in the current one, whose own first step is its eager step instead."""
        for b, d in self.decs.items():
            if d.traces.completed == 0 and not d.traces.steps and all(p == FREE for p in d.pos):
                d.step({})
                if self.samplers is not None:  # the sampled step's programs too (its own trace later)
                    sampled_step(d, self.samplers[b], {}, traced=False)

    def _move(self, to: int) -> None:
        """Every held slot to bucket ``to`` (rows 0..n-1 in the order of their current rows), on device."""
        src, dst = self.decs[self.cur], self.decs[to]
        held = sorted(self.row, key=self.row.get)
        if len(held) > to:
            raise ValueError(f"{len(held)} users do not fit bucket {to}")
        idx = [self.row[s] for s in held] + [src.slots] * (to - len(held))  # src.slots: the zeroed scratch row
        ttnn, rm = self.ttnn, self.ttnn.ROW_MAJOR_LAYOUT
        src.zero_scratch()
        dst.write_ids(torch.tensor([idx]), dst.gather_idx)
        with src.scratch_scope():
            for st_src, sc, st_dst in zip(src.state.layers, src.scratch, dst.state.layers):
                if not isinstance(st_src, GDNLayerState):
                    continue
                for buf, extra, out_buf in ((st_src.recurrent, sc.recurrent, st_dst.recurrent),
                                            (st_src.conv, sc.conv, st_dst.conv)):
                    table = ttnn.concat([buf, extra], dim=0)
                    if table.layout != rm:
                        table = ttnn.to_layout(table, rm)
                    table = ttnn.reshape(table, [src.slots + 1, buf.logical_volume() // src.slots])
                    out = ttnn.embedding(dst.gather_idx, table, layout=rm, dtype=out_buf.dtype)  # [1, to, W]
                    out = ttnn.reshape(out, list(out_buf.shape))
                    if out_buf.layout != rm:
                        out = ttnn.to_layout(out, out_buf.layout)
                    ttnn.copy(out, out_buf)
        if self.samplers is not None:  # sampler rows via the host (parameters, penalty rows, uniform streams)
            self.samplers[to].import_rows(list(range(len(held))),
                                          self.samplers[self.cur].export_rows([self.row[s] for s in held]))
        dst.pos = [src.pos[self.row[s]] for s in held] + [FREE] * (to - len(held))
        src.pos = [FREE] * src.slots
        self.moves.append((self.cur, to))
        self.row = {s: r for r, s in enumerate(held)}
        self.cur = to
        self.fits_smaller = 0
        self._sync_pages()

    def _smallest_holding(self, users: int) -> int:
        return next(b for b in self.buckets if users <= b)

    # ---- users ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, slot: int, prompt) -> torch.Tensor:
        """Prefill ``prompt`` into free ``slot``; grows to the next bucket first when every row is held."""
        self._check_slot(slot)
        if slot in self.row:
            raise ValueError(f"slot {slot} is held (position {self.pos[slot]}); leave() it first")
        if not self.dec.free_slots():
            self._move(self._smallest_holding(len(self.row) + 1))
        r = self.dec.free_slots()[0]
        self.row[slot] = r
        self._sync_pages()
        try:
            return self.dec.join(r, prompt)
        except BaseException:
            del self.row[slot]
            raise

    def leave(self, slot: int) -> None:
        self._check_slot(slot)
        if slot not in self.row:
            return
        self.dec.leave(self.row.pop(slot))

    def slot_remap(self, remap) -> None:
        """Row i takes over the state of slot ``remap[i]`` (a permutation of all capacity slots): the slots are
        relabelled, nothing moves on device."""
        remap = [int(r) for r in (remap.tolist() if isinstance(remap, torch.Tensor) else remap)]
        if sorted(remap) != list(range(self.slots)):
            raise ValueError(f"slot_remap must be a permutation of 0..{self.slots - 1}, got {remap}")
        self.row = {i: self.row[j] for i, j in enumerate(remap) if j in self.row}
        self._pages = self._pages[remap].contiguous()
        self._sync_pages()

    @torch.no_grad()
    def _before_step(self, tokens: dict[int, int]) -> None:
        """Checks the fed slots, warms the current bucket if its trace is not captured yet, and moves down first
        when the users have fitted a smaller bucket for ``shrink_after`` steps."""
        for s in tokens:
            self._check_slot(s)
            if s not in self.row:
                raise ValueError(f"slot {s} has no user (join it first)")
        if self.dec.use_trace and self.dec.traces.completed == 0:  # this bucket's next step would run eagerly
            if any(d.traces.steps for d in self.decs.values()):
                raise RuntimeError(f"bucket {self.cur} has not been warmed while another bucket's trace is live: "
                                   f"call warm() before the first traced step (and after a release)")
            self.warm()
        smaller = self._smallest_holding(max(1, len(self.row)))
        self.fits_smaller = self.fits_smaller + 1 if smaller < self.cur else 0
        if smaller < self.cur and self.fits_smaller >= self.shrink_after:
            self._move(smaller)

    def step(self, tokens: dict[int, int], read_logits: bool = True):
        """One decode step of the current bucket; moves down first when the users have fitted a smaller bucket for
        ``shrink_after`` steps. Returns (logits [capacity, V] or None, ids [capacity]) in slot numbers; rows of
        slots not fed are zeros."""
        self._before_step(tokens)
        logits, ids = self.dec.step({self.row[s]: t for s, t in tokens.items()}, read_logits=read_logits)
        out_ids = torch.zeros(self.slots, dtype=ids.dtype)
        out_logits = torch.zeros(self.slots, logits.shape[-1]) if logits is not None else None
        for s in tokens:
            out_ids[s] = ids[self.row[s]]
            if logits is not None:
                out_logits[s] = logits[self.row[s]]
        return out_logits, out_ids

    def replace_kv(self, layer: int, kv: KVLayerState) -> None:
        """Every bucket's full-attention layer ``layer`` reads and writes ``kv`` (e.g. vLLM's block pool) from now
        on; the pool it replaces is freed. No trace may be live (the traces point at the old pool)."""
        if any(d.traces.steps for d in self.decs.values()):
            raise RuntimeError("replace_kv with a live trace: release() first")
        old = self.decs[self.slots].state.layers[layer]
        if not isinstance(old, KVLayerState):
            raise ValueError(f"layer {layer} has no KV cache")
        if old is not kv:
            self.ttnn.deallocate(old.k)
            self.ttnn.deallocate(old.v)
        for d in self.decs.values():
            d.state.layers[layer] = kv

    # ---- sampling (constructed with ``sampling=True``) -----------------------------------------------------------
    def _sampler(self) -> DeviceSampler:
        if self.samplers is None:
            raise RuntimeError("this decoder was built without sampling=True")
        return self.samplers[self.cur]

    def start_sampling(self, slot: int, params, prompt, first: int) -> None:
        """Slot ``slot``'s user samples with ``params`` from now on (its first token ``first`` was picked on the
        host from the prompt's last row)."""
        self._sampler().start(self.row[slot], params, prompt, first)

    def resync_sampling(self, slot: int, prompt_len: int, history) -> None:
        self._sampler().resync(self.row[slot], prompt_len, history)

    @torch.no_grad()
    def sample_step(self, tokens: dict[int, int]) -> dict[int, int]:
        """One decode step with every fed slot's token picked on device by its own parameters (the bucket's
        sampled trace); moves down first like :meth:`step`. Returns {slot: token}."""
        self._sampler()  # refuses a decoder built without sampling before anything moves
        self._before_step(tokens)
        out = sampled_step(self.dec, self._sampler(), {self.row[s]: t for s, t in tokens.items()})
        return {s: out[self.row[s]][0] for s in tokens}

    def release(self) -> None:
        """Release every bucket's traces (buffers stay: the decoder can go on, capturing again)."""
        for d in self.decs.values():
            d.release()

    def close(self) -> None:
        """Release the traces and free the samplers' buffers."""
        self.release()
        if self.samplers is not None:
            for smp in self.samplers.values():
                smp.release()
            self.samplers = None
