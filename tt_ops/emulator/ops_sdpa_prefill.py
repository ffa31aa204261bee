"""Chunked prefill attention over a paged KV cache (``ttnn.transformer.chunked_scaled_dot_product_attention``).

Semantics are the 0.81.1 golden's (``ttnn.get_golden_function``): q ``[B, Hq, T, D]`` at absolute positions
``chunk_start .. chunk_start + T - 1``, K/V ``[P, Hkv, bs, D]`` pages in the order ``page_table[b]`` names, keys
``0 .. chunk_start + T - 1`` (causal: row i attends keys ``<= chunk_start + i``), query head h reads KV head
``h // (Hq / Hkv)``, scale ``D ** -0.5`` unless given, output in q's dtype.

The golden materialises the whole logical cache, repeats it to every query head and builds the full score matrix:
at a chunk 256 rows deep into a 262,144-token context with the 27B's 12 query heads per device that is about 6 GB
of fp64 per head copy of K. Here only the pages up to the chunk's end are gathered (in their stored dtype), each KV
head's query group is computed against them in key blocks of at most ``KEY_BLOCK`` positions, and the softmax is
exact in two passes (row maxima over every block, then ``exp(s - max)`` sums and their products with V), all in
fp64 (rule N8), rounded once to q's dtype. The result equals the golden's up to fp64 rounding
(``tests/emulator/test_chunked_sdpa.py`` checks the bf16 outputs are identical on random cases).

Validation from the docstring: ``chunk_start_idx`` must be a multiple of ``program_config.q_chunk_size`` and of
``program_config.k_chunk_size`` (the latter a workaround the docstring names, tt-metal issue 35225).

Accounting: the op reads q, the page table and the K and V pages up to the chunk's last row (the emulator's
default would charge the whole cache it is handed, every page of every user).
"""

from __future__ import annotations

import torch

from . import numerics
from .errors import EmulatorError, NotEmulatedError
from .goldens import assemble, dst_rule
from .op_accounting import add_bytes, bind_op
from .registry import device_op
from .tensor import shard_bytes
from .ttnn_import import ttnn

OP = "ttnn.transformer.chunked_scaled_dot_product_attention"
KEY_BLOCK = 8192  # keys per block of the two-pass softmax, at most (the fp64 score block is Hq/Hkv x T x block)
SCORE_BLOCK_ELEMENTS = 1 << 23  # and at most this many scores per block (64 MB of fp64)


def _start(b: dict) -> int:
    t = b.get("chunk_start_idx_tensor")
    if t is not None:
        return int(t.shards[0].reshape(-1)[0])
    return int(b.get("chunk_start_idx") or 0)


def _read(args, kwargs):
    b = bind_op(OP, args, kwargs)
    q, k, v, pt = b["input_tensor_q"], b["input_tensor_k"], b["input_tensor_v"], b["page_table_tensor"]
    d: dict = {}
    for t in (q, pt, b.get("chunk_start_idx_tensor")):
        add_bytes(d, t)
    _, nkv, bs, dh = k.logical_shape_list
    users, rows = q.logical_shape_list[0], q.logical_shape_list[2]
    blocks = users * min(pt.logical_shape_list[-1], -(-(_start(b) + rows) // bs))
    add_bytes(d, k, blocks * shard_bytes([1, nkv, bs, dh], k.dtype, ttnn.TILE_LAYOUT))
    add_bytes(d, v, blocks * shard_bytes([1, nkv, bs, dh], v.dtype, ttnn.TILE_LAYOUT))
    return d


def _check(b: dict, start: int) -> None:
    for name in ("paged_cache_geometry", "sliding_window_size", "attention_sink"):
        if b.get(name) is not None:
            raise NotEmulatedError(f"{OP}: {name} is not emulated")
    q, k = b["input_tensor_q"], b["input_tensor_k"]
    if len(q.logical_shape_list) != 4 or len(k.logical_shape_list) != 4:
        raise EmulatorError(f"{OP}: q must be [b, nqh, s, dh] and the caches [blocks, nkv, block, dh]")
    hq, hkv = q.logical_shape_list[1], k.logical_shape_list[1]
    if hq % hkv:
        raise EmulatorError(f"{OP}: {hq} query heads do not divide over {hkv} KV heads")
    if q.logical_shape_list[3] != k.logical_shape_list[3]:
        raise EmulatorError(f"{OP}: q head dim {q.logical_shape_list[3]} != cache head dim {k.logical_shape_list[3]}")
    if start < 0:
        raise EmulatorError(f"{OP}: chunk_start_idx {start} is negative")
    pc = b.get("program_config")
    if pc is not None:
        for name in ("q_chunk_size", "k_chunk_size"):
            size = int(getattr(pc, name))
            if start % size:
                raise EmulatorError(f"{OP}: chunk_start_idx {start} must be a multiple of program_config.{name} "
                                    f"({size})")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
           key_block: int = KEY_BLOCK) -> torch.Tensor:
    """Causal GQA attention of one user in fp64: q [Hq, T, D], keys/values [Hkv, S, D] (S = start + T or fewer),
    row i of q at absolute position start + i. Two-pass softmax over key blocks."""
    hq, rows, _ = q.shape
    hkv, s_len, _ = keys.shape
    g = hq // hkv
    key_block = max(32, min(key_block, SCORE_BLOCK_ELEMENTS // (g * rows)))
    qpos = start + torch.arange(rows)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hkv):
        qg = q[h * g:(h + 1) * g].to(torch.float64)  # [g, T, D]
        blocks = [(j, min(s_len, j + key_block)) for j in range(0, s_len, key_block)]

        def scores(j0: int, j1: int) -> torch.Tensor:
            s = torch.matmul(qg, keys[h, j0:j1].to(torch.float64).transpose(-1, -2)) * scale  # [g, T, j1 - j0]
            masked = torch.arange(j0, j1).view(1, -1) > qpos.view(-1, 1)  # key after the row's position
            return s.masked_fill(masked, float("-inf"))

        row_max = torch.full((g, rows, 1), float("-inf"), dtype=torch.float64)
        for j0, j1 in blocks:
            row_max = torch.maximum(row_max, scores(j0, j1).amax(-1, keepdim=True))
        total = torch.zeros((g, rows, 1), dtype=torch.float64)
        acc = torch.zeros(qg.shape[:-1] + (values.shape[-1],), dtype=torch.float64)
        for j0, j1 in blocks:
            p = torch.exp(scores(j0, j1) - row_max)
            total += p.sum(-1, keepdim=True)
            acc += torch.matmul(p, values[h, j0:j1].to(torch.float64))
        out[h * g:(h + 1) * g] = acc / total
    return out


@device_op(OP, read_bytes=_read)
def chunked_sdpa(input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, *args, **kwargs):
    b = bind_op(OP, (input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor) + args, kwargs)
    start = _start(b)
    _check(b, start)
    users, hq, rows, dh = input_tensor_q.logical_shape_list
    scale = dh ** -0.5 if b.get("scale") is None else float(b["scale"])
    results = []
    for i in range(input_tensor_q.num_shards):
        pt = page_table_tensor.shards[i].to(torch.int64).reshape(page_table_tensor.shards[i].shape[0], -1)
        kc, vc = input_tensor_k.shards[i], input_tensor_v.shards[i]
        pages, hkv, bs, _ = kc.shape
        key_len = min(pt.shape[-1] * bs, start + rows)
        nblk = -(-key_len // bs)
        outs = []
        for u in range(users):
            row = pt[u, :nblk]
            if bool(((row < 0) | (row >= pages)).any()):
                raise EmulatorError(f"{OP}: page table row {u} names a block outside [0, {pages})")
            keys = kc[row].permute(1, 0, 2, 3).reshape(hkv, nblk * bs, dh)[:, :key_len]
            values = vc[row].permute(1, 0, 2, 3).reshape(hkv, nblk * bs, dh)[:, :key_len]
            outs.append(attend(input_tensor_q.shards[i][u], keys, values, start, scale))
        results.append(torch.stack(outs))
    if numerics.is_strict(input_tensor_q):
        results = dst_rule(results, (input_tensor_q,), kwargs, input_tensor_q)
    return assemble(OP, results, (input_tensor_q,), kwargs, input_tensor_q)


__all__ = ["KEY_BLOCK", "attend", "chunked_sdpa"]
