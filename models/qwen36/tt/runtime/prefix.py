"""Prefill through the prefix cache on the TT model (the cache itself, ``qwen36.prefix_cache``, is the reference's).

The TT payload of a cached block lives on the device, and snapshot and restore are device copies, no host round
trip:
* GDN recurrent (fp32) and conv state after the block: ``ttnn.clone`` of the state buffers; restored with
  ``ttnn.copy`` into the persistent buffers (which a captured decode trace keeps pointing at);
* attention KV of the block: one ``ttnn.slice`` per KV page (a block is whole pages: the cache's block size is a
  multiple of the paged-KV block size) of the physical pages the request's page-table row names; restored with
  ``paged_fill_cache`` (a raw tile copy) into the pages the *restoring* request's row names, so a request whose
  pages differ from the one that cached the block (another slot, another server block table) restores correctly.

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
from ..model.state import GDNLayerState, KVLayerState, TTModelState

_BYTES = {"bfloat16": 2.0, "float32": 4.0, "bfloat8_b": 1088 / 1024, "bfloat4_b": 576 / 1024, "int32": 4.0,
          "uint32": 4.0}


def _nbytes(t) -> int:
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
    nbytes = (sum(_nbytes(t) for ks, vs in kv for t in ks + vs) + sum(_nbytes(r) + _nbytes(c) for r, c in gdn)
              + sum(_nbytes(h) for h in hid))
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
            lease: Lease | None = None, hidden_out: list | None = None, insert: bool = True) -> TTPrefillResult:
    """Prefill ``prompt`` into ``view`` (GDN buffers of one user, the KV caches and the user's page-table row; at
    position 0, GDN state zero). Without ``cache``: ``model.prefill_forward`` over the whole prompt, as before.
    ``insert=False``: reuse cached blocks but cache no new ones (the pieces are the same either way): a snapshot
    allocates device buffers that outlive the call, which is not allowed while a decode trace is live."""
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
            pl = _snapshot(model, view, p, p + b, hs)
            node = cache.insert(parent, prompt[p:p + b], pl, pl.nbytes, lease)
            if node is None or node.payload is not pl:
                pl.release()  # not cached (budget) or an equal block was already there
            parent, caching = node, node is not None
        p += b
    logits = model.prefill_forward(ids[p:], view, hidden_out=hidden_out)[-1]
    cache.stats.tokens_computed += n - len(chain) * b
    return TTPrefillResult(logits, len(chain) * b, n - len(chain) * b, lease)
