"""Prefix cache for the hybrid state: block-boundary checkpoints shared by requests, LRU eviction under a budget.

A hybrid model cannot resume a prefix from attention KV alone: the Gated DeltaNet recurrent and conv state at the
end of the prefix is needed too, and it summarises every token before it. So the cache is a tree of *blocks* of
``block_size`` tokens; the node of block i (tokens [iB, (i+1)B) after the tokens of its ancestors) holds what a
request needs to resume at position (i+1)B without re-reading tokens 0..(i+1)B-1:

* the attention KV rows of its own block (every full-attention layer),
* the GDN recurrent (fp32, as the live state keeps it) and conv state of every GDN layer *after* the block,
* the MTP layer's KV rows [iB-1, (i+1)B-1) (MTP row t is computed from the target's h_t and token x_{t+1}, so the
  block's last target row belongs to the next block's MTP segment) and the target's post-norm hidden of the block's
  last row (the first MTP row of the next segment reads it).

The node's payload is backend-owned and opaque here (torch tensors on the reference, device tensors on TT); this
class only keeps the tree, the references, the bytes and the LRU order, so one policy serves every backend.

Rules the backends rely on:
* **Exactness.** A payload is what the backend's block-segmented prefill produced at that boundary, bit for bit.
  The prefill of a prompt always runs in the same pieces (the blocks, then the tail), cold or warm, so a warm
  request restoring node i continues with exactly the forwards the cold request runs after boundary (i+1)B.
* **Only committed prefill state enters.** Nodes are inserted by the prefill (prompt blocks) and by ``fill``
  (a prefill without sampling, e.g. of a finished conversation turn). Decode and speculative steps never insert:
  drafts, rejected rows and aborted verifies cannot reach the cache, and decode-computed states (1-row forwards,
  recurrent GDN) would not equal a cold prefill's bits anyway.
* **References.** A request holds a :class:`Lease` on the nodes of its prefix while it runs. A node with a
  reference, or with children, is never evicted (evicting an inner node would strand its descendants); a payload
  is never modified after insertion, so a shared block is never overwritten either.
* **Budget.** ``budget_bytes`` bounds the payload bytes. An insert that does not fit evicts unreferenced leaves,
  least recently used first; if that is not enough the block is not cached (counted in ``stats.refused``) and the
  request goes on uncached from there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    tokens_reused: int = 0  # prompt tokens restored instead of computed
    tokens_computed: int = 0  # prompt tokens prefilled (reported by the backends)
    inserts: int = 0
    evictions: int = 0
    refused: int = 0  # blocks not cached: the budget was full of referenced blocks

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Node:
    """One cached block. ``tokens``: the block's token ids; ``end``: the position after it."""

    tokens: tuple[int, ...]
    parent: "Node | None"
    end: int
    payload: Any = None
    nbytes: int = 0
    refs: int = 0
    last_used: int = 0
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)


class Lease:
    """The nodes one request holds (a prefix chain): released together when the request ends."""

    def __init__(self, cache: "PrefixCache"):
        self.cache = cache
        self.nodes: list[Node] = []
        self.released = False

    def hold(self, node: Node) -> None:
        if self.released:
            raise RuntimeError("hold() on a released lease")
        node.refs += 1
        self.nodes.append(node)

    def release(self) -> None:
        """Drop every reference (idempotent: a request may be released by leave() and again by its owner)."""
        if self.released:
            return
        for n in self.nodes:
            n.refs -= 1
            assert n.refs >= 0, "reference count below zero"
        self.nodes = []
        self.released = True


class PrefixCache:
    """Tree of cached blocks. ``block_size``: tokens per block (the backend states why its choice; docs/chat.md);
    ``budget_bytes``: the most payload bytes held; ``with_mtp``: payloads carry the MTP layer's KV (needed by
    speculative requests; plain requests fill it too so that one cache serves both)."""

    def __init__(self, block_size: int, budget_bytes: int, with_mtp: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.block_size, self.budget_bytes, self.with_mtp = block_size, budget_bytes, with_mtp
        self.root = Node((), None, 0)
        self.bytes = 0
        self.stats = CacheStats()
        self._clock = 0

    # ---- lookup ---------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, tokens: Sequence[int], limit: int | None = None) -> list[Node]:
        """The longest chain of cached blocks that is a prefix of ``tokens`` and ends at or before ``limit``
        (default len(tokens)). Marks them used (LRU). Does not take references: see :meth:`lease`."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        b, node, chain = self.block_size, self.root, []
        while node.end + b <= limit:
            child = node.children.get(tuple(tokens[node.end: node.end + b]))
            if child is None:
                break
            chain.append(child)
            node = child
        t = self._tick()
        for n in chain:
            n.last_used = t
        return chain

    def lookup(self, tokens: Sequence[int], lease: Lease, limit: int | None = None) -> list[Node]:
        """:meth:`match`, with the chain held by ``lease`` and the statistics counted."""
        chain = self.match(tokens, limit)
        for n in chain:
            lease.hold(n)
        self.stats.lookups += 1
        self.stats.hits += bool(chain)
        self.stats.tokens_reused += len(chain) * self.block_size
        return chain

    def lease(self) -> Lease:
        return Lease(self)

    # ---- insertion / eviction -------------------------------------------------------------------
    def child(self, parent: Node | None, block: Sequence[int]) -> Node | None:
        return (parent or self.root).children.get(tuple(block))

    def insert(self, parent: Node | None, block: Sequence[int], payload: Any, nbytes: int, lease: Lease) -> Node | None:
        """Cache ``payload`` as the block ``block`` after ``parent`` (None: the first block) and hold it in
        ``lease``. An existing node for that block wins (its payload is the same computation's bits) and the new
        payload is dropped. Returns None when the budget cannot make room (the block stays uncached)."""
        parent = parent or self.root
        block = tuple(block)
        if len(block) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(block)}")
        if parent is not self.root and parent.payload is None:
            raise RuntimeError("insert under an evicted node")
        node = parent.children.get(block)
        if node is None:
            if not self._make_room(nbytes, keep=parent):
                self.stats.refused += 1
                return None
            node = Node(block, parent, parent.end + self.block_size, payload, nbytes)
            parent.children[block] = node
            self.bytes += nbytes
            self.stats.inserts += 1
        node.last_used = self._tick()
        lease.hold(node)
        return node

    def evict_lru(self, keep: Node | None = None) -> bool:
        """Evict the least recently used block that no request holds and that has no cached continuation (never
        ``keep``); False when there is none. For owners whose payload slots run out before the byte budget."""
        leaves = self._evictable(keep)
        if not leaves:
            return False
        self._evict(min(leaves, key=lambda n: n.last_used))
        return True

    def _evictable(self, keep: Node) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children and n.refs == 0 and n is not keep:
                out.append(n)
        return out

    def _make_room(self, nbytes: int, keep: Node) -> bool:
        if nbytes > self.budget_bytes:
            return False
        while self.bytes + nbytes > self.budget_bytes:
            leaves = self._evictable(keep)
            if not leaves:
                return False
            self._evict(min(leaves, key=lambda n: n.last_used))
        return True

    def _evict(self, node: Node) -> None:
        assert node.refs == 0 and not node.children
        del node.parent.children[node.tokens]
        self.bytes -= node.nbytes
        release = getattr(node.payload, "release", None)  # device payloads free their buffers
        if release is not None:
            release()
        node.payload = None
        self.stats.evictions += 1

    # ---- inspection -----------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check(self) -> None:
        """Internal invariants (tests call it): bytes add up, no negative references, budget held."""
        nodes = self.nodes()
        assert sum(n.nbytes for n in nodes) == self.bytes, "byte count drifted"
        assert all(n.refs >= 0 for n in nodes)
        assert self.bytes <= self.budget_bytes, f"{self.bytes} bytes held over the budget {self.budget_bytes}"
