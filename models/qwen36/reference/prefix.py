"""Prefill through the prefix cache on the reference model (``qwen36.prefix_cache``: the tree, references, LRU).

    res = prefill(model, state, prompt, cache=cache, mtp=mtp_state)   # state: a fresh batch-1 ModelState
    res.logits        # [1, V] fp32: the last prompt row's logits
    res.reseed_hidden # [1, m, H]: h_t for t = res.reseed_pos0 .. n-1 (the MTP rows still to compute)
    res.lease.release()  # when the request ends

With a cache the prompt runs in fixed pieces: block after block from the restored boundary, each block one forward
of ``block_size`` rows (and one MTP forward over its shifted rows), then the tail (at least one token: the last
row's logits are needed). A cold request runs the same pieces from position 0, so from any boundary on a warm and
a cold request run the same forwards on the same inputs: bit-identical logits and states (what the tests assert).
Without a cache the prompt is one forward, as before (the pieces round differently in the last bits: a T-row
matmul is not bitwise a sum of smaller ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..prefix_cache import Lease, Node, PrefixCache
from .state import GDNState, KVCache, ModelState, MTPState


@dataclass
class BlockPayload:
    """One cached block on the reference (torch tensors, batch 1, never modified after insertion)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: k, v rows of the block [1, Hkv, B, D]
    gdn: list[tuple[torch.Tensor, torch.Tensor]]  # per GDN layer: recurrent [1, Hv, Dk, Dv] fp32, conv after it
    mtp: tuple[torch.Tensor, torch.Tensor] | None  # MTP k, v rows [iB-1, (i+1)B-1) ([0, B-1) for block 0)
    hidden: torch.Tensor  # [1, 1, H]: target post-norm hidden of the block's last row

    def nbytes(self) -> int:
        ts = [t for pair in self.kv + self.gdn for t in pair] + list(self.mtp or ()) + [self.hidden]
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, V] fp32, last prompt row
    reseed_hidden: torch.Tensor  # [1, n - reseed_pos0, H]: target h_t for the MTP rows still to compute
    reseed_pos0: int
    reused: int  # prompt tokens restored from the cache
    computed: int  # prompt tokens run through the target
    lease: Lease | None = None

    def reseed_tokens(self, prompt: Sequence[int], first: int, device) -> torch.Tensor:
        """x_{t+1} for t = reseed_pos0 .. n-1: the prompt after reseed_pos0, then the first generated token."""
        return torch.tensor([list(prompt[self.reseed_pos0 + 1:]) + [first]], device=device)


def _restore(state: ModelState, mtp: MTPState | None, chain: list[Node], block: int) -> None:
    gdn_layers = [s for s in state.layers if isinstance(s, GDNState)]
    kv_layers = [s for s in state.layers if isinstance(s, KVCache)]
    for i, node in enumerate(chain):
        pl: BlockPayload = node.payload
        lo, hi = i * block, (i + 1) * block
        for cache, (k, v) in zip(kv_layers, pl.kv):
            cache.k[:, :, lo:hi] = k
            cache.v[:, :, lo:hi] = v
        if mtp is not None:
            mlo = max(lo - 1, 0)
            mtp.kv.k[:, :, mlo:hi - 1] = pl.mtp[0]
            mtp.kv.v[:, :, mlo:hi - 1] = pl.mtp[1]
    last: BlockPayload = chain[-1].payload
    for g, (rec, conv) in zip(gdn_layers, last.gdn):
        g.recurrent, g.conv = rec.clone(), conv.clone()  # the live state never aliases a cached tensor


def _snapshot(state: ModelState, mtp: MTPState | None, lo: int, hi: int, hidden: torch.Tensor) -> BlockPayload:
    kv = [(s.k[:, :, lo:hi].clone(), s.v[:, :, lo:hi].clone()) for s in state.layers if isinstance(s, KVCache)]
    gdn = [(s.recurrent.clone(), s.conv.clone()) for s in state.layers if isinstance(s, GDNState)]
    m = None
    if mtp is not None:
        mlo = max(lo - 1, 0)
        m = (mtp.kv.k[:, :, mlo:hi - 1].clone(), mtp.kv.v[:, :, mlo:hi - 1].clone())
    return BlockPayload(kv, gdn, m, hidden.clone())


@torch.no_grad()
def prefill(model, state: ModelState, prompt: Sequence[int], cache: PrefixCache | None = None,
            mtp: MTPState | None = None, lease: Lease | None = None) -> PrefillResult:
    """Prefill ``prompt`` into ``state`` (fresh, batch 1, position 0). With ``cache``: resume from the longest
    cached block boundary before the last token, run the remaining blocks one forward each (inserting them into
    the cache) and then the tail. ``mtp``: the request's MTP state (rows of the cached and computed blocks are
    written into it); a cache ``with_mtp`` needs the MTP rows even for a plain request, which then passes None
    and gets a scratch MTP state. The returned lease holds the prompt's cached blocks until the request ends."""
    n = len(prompt)
    if n == 0:
        raise ValueError("empty prompt")
    if state.pos != 0:
        raise ValueError(f"prefill needs a fresh state at position 0, got position {state.pos}")
    dev = model.embed_tokens.weight.device
    ids = torch.tensor([list(prompt)], device=dev)
    if cache is None:
        out = model(ids, state)
        return PrefillResult(out.logits[:, -1], out.hidden, 0, 0, n)
    if mtp is None and cache.with_mtp:
        if model.mtp is None:
            raise ValueError("this prefix cache keeps MTP rows but the model has no MTP head: build it with_mtp=False")
        mtp = model.new_mtp_state(1, n)
    if not cache.with_mtp:
        mtp = None  # a cache without MTP rows (a model without the head): speculative requests are refused below
    lease = lease or cache.lease()
    b = cache.block_size
    chain = cache.lookup(prompt, lease, limit=n - 1)  # at least the last token is computed (its logits)
    p = len(chain) * b
    h_prev = None
    if chain:
        _restore(state, mtp, chain, b)
        h_prev = chain[-1].payload.hidden
    state.pos = p
    parent, caching = (chain[-1] if chain else None), True
    while p + b <= n - 1:  # a block is cacheable when the token after it is known (its last MTP row needs it)
        out = model(ids[:, p:p + b], state)
        if mtp is not None:
            hid = out.hidden[:, : b - 1] if p == 0 else torch.cat([h_prev, out.hidden[:, : b - 1]], dim=1)
            lo = max(p - 1, 0)
            if hid.shape[1]:
                model.mtp_forward(ids[:, lo + 1: p + b], hid, lo, mtp)
        if caching:
            payload = _snapshot(state, mtp, p, p + b, out.hidden[:, -1:])
            parent = cache.insert(parent, prompt[p:p + b], payload, payload.nbytes(), lease)
            caching = parent is not None  # a refused block ends caching for this prompt (no orphan children)
        h_prev = out.hidden[:, -1:]
        p += b
    out = model(ids[:, p:], state)
    cache.stats.tokens_computed += n - len(chain) * b
    if mtp is not None:
        mtp.pos = max(p - 1, 0)
    hidden = out.hidden if p == 0 else torch.cat([h_prev, out.hidden], dim=1)
    return PrefillResult(out.logits[:, -1], hidden, max(p - 1, 0), len(chain) * b, n - len(chain) * b, lease)


def fill(model, prompt: Sequence[int], cache: PrefixCache, max_len: int | None = None) -> int:
    """Put every whole block of ``prompt`` before its last token into the cache (the same pieces a request's
    prefill runs), holding nothing afterwards: e.g. a finished conversation turn, between turns, so that the next
    turn's prefill computes only its new tokens. Returns the tokens computed."""
    state = model.new_state(1, max_len or len(prompt))
    res = prefill(model, state, prompt, cache)
    res.lease.release()
    return res.computed
