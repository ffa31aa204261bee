"""Prefill through the prefix cache on the TT model (the cache itself, ``qwen36.prefix_cache``, is the reference's).

The TT payload of a cached block lives on the device, and snapshot and restore are device copies, no host round
trip:
* GDN recurrent (fp32) and conv state after the block: ``ttnn.clone`` of the state buffers; restored with
  ``ttnn.copy`` into the persistent buffers (which a captured decode trace keeps pointing at);
* attention KV of the block: one ``ttnn.slice`` per KV page (a block is whole pages: the cache's block size is a
  multiple of the paged-KV block size) of the physical pages the request's page-table row names; restored with
  ``paged_fill_cache`` (a raw tile copy) into the pages the *restoring* request's row names, so a request whose
  pages differ from the one that cached the block (another slot, another server block table) restores correctly.

Under a live decode trace a snapshot may not allocate (a buffer allocated after capture can share addresses a replay
writes). A decoder that caches blocks while its trace is live owns a :class:`TTBlockPool`: the device buffers of
``blocks`` cached blocks, allocated before any capture; a snapshot is then a copy into a free pool slot (the slices
it copies from are scratch that dies inside the join), an evicted block gives its slot back, and when every slot is
taken the least recently used unheld block is evicted first (none evictable: the block is not cached).

Exactness as on the reference: with a cache the prompt always runs in the same pieces (blocks of ``block_size``
rows, each one ``prefill_forward`` from the block's first position, then the tail), so a warm request continues with
exactly the forwards a cold one runs after the restored boundary, on bit-identical state. The MTP layer's rows are
not cached on TT: a block keeps the target's post-norm hidden rows instead (at the 27B shapes 10 KiB per token,
against 64 KiB of KV), and the speculative backend's MTP prefill runs over every prompt row from position 0, cold
and warm alike, from hidden rows that are bit-identical either way. Why: a block's MTP segment starts one row before
the block (MTP row t reads x_{t+1}), and the TT MTP prefill writes whole KV pages from position 0; recomputing the
one MTP layer costs about 1/65 of the 27B prompt's prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...errors import UserError
from ...prefix_cache import Lease, Node, PrefixCache
from ..model.model_config import TensorGroup, activation_memory_config
from ..model.state import GDNLayerState, KVLayerState, TTModelState

_BYTES = {"bfloat16": 2.0, "float32": 4.0, "bfloat8_b": 1088 / 1024, "bfloat4_b": 576 / 1024, "int32": 4.0,
          "uint32": 4.0}


def shard_nbytes(t) -> int:
    """Bytes of one device's shard (block-float formats with their shared exponents)."""
    name = str(t.dtype).split(".")[-1].lower()
    vol = 1
    for d in t.shape:
        vol *= int(d)
    return int(vol * _BYTES.get(name, 4.0))


@dataclass
class TTBlockPayload:
    kv: list[tuple[list[Any], list[Any]]]  # per attention layer: k pages, v pages (each [1, Hkv/N, page, D])
    gdn: list[tuple[Any, Any]]  # per GDN layer: recurrent, conv clones (device)
    hidden: list[Any]  # the block's post-final-norm hidden rows (device [1, 1, rows, H] per prefill chunk)
    nbytes: int  # per device
    ttnn: Any = None

    def release(self) -> None:
        """Free the device buffers (the cache evicted the block, or it was not cached)."""
        for ks, vs in self.kv:
            for t in ks + vs:
                self.ttnn.deallocate(t)
        for rec, conv in self.gdn:
            self.ttnn.deallocate(rec)
            self.ttnn.deallocate(conv)
        for h in self.hidden:
            self.ttnn.deallocate(h)
        self.kv, self.gdn, self.hidden = [], [], []


@dataclass
class PooledPayload:
    """A cached block held in a :class:`TTBlockPool` slot (the fields :func:`_restore` reads, as TTBlockPayload)."""

    kv: list[tuple[list[Any], list[Any]]]
    gdn: list[tuple[Any, Any]]
    hidden: list[Any]
    nbytes: int
    pool: "TTBlockPool"
    index: int

    def release(self) -> None:
        """The cache evicted the block (or did not cache it): its slot is free again (the buffers stay)."""
        self.pool.give_back(self.index)


class TTBlockPool:
    """Device buffers for ``blocks`` cached blocks of ``block`` tokens, allocated at construction (before any trace
    capture) in the shapes a snapshot of ``view`` takes: per attention layer the block's K and V pages, per GDN
    layer one recurrent + conv state of ``view``'s (batch-1) shape, the block's hidden rows per prefill chunk."""

    def __init__(self, model, view: TTModelState, block: int, blocks: int):
        if blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {blocks}")
        ttnn, a = model.ttnn, model.args
        if block % a.block_size:
            raise PrefixBlockError(f"prefix cache block size {block} must be a multiple of the paged-KV block size "
                                   f"{a.block_size}")
        self.block, self.ttnn = block, ttnn
        chunks = [min(a.prefill_chunk, block - i) for i in range(0, block, a.prefill_chunk)]
        res, mc = a.dtype(TensorGroup.RESIDUAL, ttnn), activation_memory_config(ttnn)
        rep = ttnn.ReplicateTensorToMesh(model.mesh)

        def hidden_rows() -> list:
            return [ttnn.from_torch(torch.zeros(1, 1, r, a.cfg.hidden_size), dtype=res, layout=ttnn.TILE_LAYOUT,
                                    device=model.mesh, memory_config=mc, mesh_mapper=rep) for r in chunks]

        # each slot: a snapshot of the block [0, block) of ``view`` (only its buffers' shapes matter here)
        self.slots = [_snapshot(model, view, 0, block, hidden_rows()) for _ in range(blocks)]
        self.nbytes = self.slots[0].nbytes
        self.free = list(range(blocks))

    def give_back(self, index: int) -> None:
        if index in self.free:
            raise RuntimeError(f"pool slot {index} given back twice")
        self.free.append(index)

    def snapshot(self, model, view: TTModelState, lo: int, hi: int, hidden: list, cache: PrefixCache,
                 keep: Node | None) -> PooledPayload | None:
        """Copy the block [lo, hi) of ``view`` into a free slot, evicting the cache's least recently used unheld
        block (never ``keep``) when none is free; None when nothing can be evicted."""
        while not self.free:
            if not cache.evict_lru(keep):
                return None
        ttnn, a = self.ttnn, model.args
        index = self.free.pop(0)
        slot = self.slots[index]
        kv, gdn, hid = slot.kv, slot.gdn, slot.hidden
        pages = _pages(view, lo, hi, a.block_size)
        for s, (ks, vs) in zip([s for s in view.layers if isinstance(s, KVLayerState)], kv):
            for cache_t, dst in ((s.k, ks), (s.v, vs)):
                _, h, page, d = (int(x) for x in cache_t.shape)
                for p, buf in zip(pages, dst):
                    ttnn.copy(ttnn.slice(cache_t, [p, 0, 0, 0], [p + 1, h, page, d]), buf)
        for s, (rec, conv) in zip([s for s in view.layers if isinstance(s, GDNLayerState)], gdn):
            ttnn.copy(s.recurrent, rec)
            ttnn.copy(s.conv, conv)
        if len(hidden) != len(hid):
            raise RuntimeError(f"a block's prefill gave {len(hidden)} hidden chunks, the pool holds {len(hid)}")
        for h, buf in zip(hidden, hid):
            ttnn.copy(h, buf)
        return PooledPayload(kv, gdn, hid, self.nbytes, self, index)

    def release(self) -> None:
        for slot in self.slots:
            slot.release()
        self.slots, self.free = [], []


@dataclass
class TTPrefillResult:
    logits: torch.Tensor  # [V] fp32, last prompt row
    reused: int
    computed: int
    lease: Lease | None = None


def _pages(view: TTModelState, lo: int, hi: int, page: int) -> list[int]:
    return [int(p) for p in view.page_table_host[0, lo // page: hi // page]]


def _snapshot(model, view: TTModelState, lo: int, hi: int, hidden: list) -> TTBlockPayload:
    ttnn, a = model.ttnn, model.args
    kv = []
    for s in view.layers:
        if isinstance(s, KVLayerState):
            pair = []
            for cache in (s.k, s.v):
                _, h, page, d = (int(x) for x in cache.shape)
                pair.append([ttnn.slice(cache, [p, 0, 0, 0], [p + 1, h, page, d]) for p in _pages(view, lo, hi, a.block_size)])
            kv.append((pair[0], pair[1]))
    gdn = [(ttnn.clone(s.recurrent), ttnn.clone(s.conv)) for s in view.layers if isinstance(s, GDNLayerState)]
    hid = [ttnn.clone(h) for h in hidden]
    nbytes = (sum(shard_nbytes(t) for ks, vs in kv for t in ks + vs)
              + sum(shard_nbytes(r) + shard_nbytes(c) for r, c in gdn) + sum(shard_nbytes(h) for h in hid))
    return TTBlockPayload(kv, gdn, hid, nbytes, ttnn)


def _restore(model, view: TTModelState, chain: list[Node], block: int) -> None:
    ttnn, a = model.ttnn, model.args
    rm = ttnn.ROW_MAJOR_LAYOUT
    kv_layers = [s for s in view.layers if isinstance(s, KVLayerState)]
    for i, node in enumerate(chain):
        pl: TTBlockPayload = node.payload
        for j, phys in enumerate(_pages(view, i * block, (i + 1) * block, a.block_size)):
            table = ttnn.from_torch(torch.tensor([[phys]], dtype=torch.int32), dtype=ttnn.int32, layout=rm,
                                    device=model.mesh)
            for s, (ks, vs) in zip(kv_layers, pl.kv):
                ttnn.experimental.paged_fill_cache(s.k, ks[j], table, batch_idx=0)
                ttnn.experimental.paged_fill_cache(s.v, vs[j], table, batch_idx=0)
    last: TTBlockPayload = chain[-1].payload
    for s, (rec, conv) in zip([s for s in view.layers if isinstance(s, GDNLayerState)], last.gdn):
        ttnn.copy(rec, s.recurrent)
        ttnn.copy(conv, s.conv)


class PrefixBlockError(UserError, ValueError):
    """A prefix-cache block size the TT KV layout cannot hold."""


def check_block_size(cache: PrefixCache, model) -> None:
    page = model.args.block_size
    if cache.block_size % page:
        raise PrefixBlockError(f"prefix cache block size {cache.block_size} must be a multiple of the paged-KV block size "
                         f"{page} (a cached block is whole KV pages; a TT prefill starts on a page boundary)")


@torch.no_grad()
def prefill(model, view: TTModelState, prompt: Sequence[int], cache: PrefixCache | None = None,
            lease: Lease | None = None, hidden_out: list | None = None, insert: bool = True,
            pool: TTBlockPool | None = None) -> TTPrefillResult:
    """Prefill ``prompt`` into ``view`` (GDN buffers of one user, the KV caches and the user's page-table row; at
    position 0, GDN state zero). Without ``cache``: ``model.prefill_forward`` over the whole prompt, as before.
    ``insert=False``: reuse cached blocks but cache no new ones (the pieces are the same either way): a snapshot
    allocates device buffers that outlive the call, which is not allowed while a decode trace is live, unless
    ``pool`` holds them (a copy into a slot allocated before capture)."""
    n = len(prompt)
    if n == 0:
        raise ValueError("empty prompt")
    if view.pos != 0:
        raise ValueError(f"prefill needs a fresh state at position 0, got position {view.pos}")
    ids = torch.tensor(list(prompt), dtype=torch.int64)
    if cache is None:
        return TTPrefillResult(model.prefill_forward(ids, view, hidden_out=hidden_out)[-1], 0, n)
    check_block_size(cache, model)
    lease = lease or cache.lease()
    b = cache.block_size
    chain = cache.lookup(prompt, lease, limit=n - 1)
    p = len(chain) * b
    if chain:
        _restore(model, view, chain, b)
        if hidden_out is not None:  # the cached rows' hiddens (the MTP prefill reads every prompt row's h_t)
            hidden_out += [h for node in chain for h in node.payload.hidden]
    view.pos = p
    parent, caching = (chain[-1] if chain else None), insert
    while p + b <= n - 1:
        hs: list = []
        model.prefill_forward(ids[p:p + b], view, hidden_out=hs)
        if hidden_out is not None:
            hidden_out += hs
        if caching:
            block_ids = prompt[p:p + b]
            have = cache.child(parent, block_ids)
            if have is not None:  # an equal block is cached already (its bits are this computation's): hold it
                pl = None
            elif pool is not None:
                pl = pool.snapshot(model, view, p, p + b, hs, cache, keep=parent)
            else:
                pl = _snapshot(model, view, p, p + b, hs)
            if have is None and pl is None:  # the pool is full of blocks held by running requests
                cache.stats.refused += 1
                node = None
            else:
                node = cache.insert(parent, block_ids, pl, pl.nbytes if pl is not None else have.nbytes, lease)
                if pl is not None and (node is None or node.payload is not pl):
                    pl.release()  # not cached (budget)
            parent, caching = node, node is not None
        p += b
    logits = model.prefill_forward(ids[p:], view, hidden_out=hidden_out)[-1]
    cache.stats.tokens_computed += n - len(chain) * b
    return TTPrefillResult(logits, len(chain) * b, n - len(chain) * b, lease)
