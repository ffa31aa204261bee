"""KV-cache updates: emulations and vectorised goldens (decode attention and rotary embedding: ``ops_attention``).

Semantics follow the op docstrings of ttnn 0.81.1:

* ``experimental.paged_update_cache(cache, input, update_idxs_tensor=pos, page_table=pt)``: in place,
  for each user b with ``pos[b] >= 0``: ``cache[pt[b, p // bs], h, p % bs, :] = input[0, b, h, :]`` for the
  cache's KV heads h (``p = pos[b] % cache_position_modulo`` when given); a page-table entry < 0 skips the
  row (vLLM pads page tables with -1). Without a page table the cache is ``[B, nkv, S, dh]`` and row
  ``b + batch_offset`` is written (row 0 for every user with ``share_cache=True``). Inputs must be FLOAT32/BFLOAT16; the
  written row is rounded to the cache dtype through ttnn's packer (bfp exponents are shared per 16
  datums of one row, so a row packs independently of the rest of its tile).
* ``experimental.paged_fused_update_cache(k_cache, k, v_cache, v, ...)``: both updates above in one program;
  the two inputs must be sharded over disjoint cores (the device op's validation).
* ``experimental.paged_fill_cache(cache, input, page_table, batch_idx=...)``: in place, input
  ``[nb, nkv, S, dh]``, token t of input row r goes to ``cache[pt[b_r, t // bs], :, t % bs, :]``;
  input dtype must equal the cache dtype (raw tile copy).
* ``experimental.indexed_fused_update_cache``: packed rows of two inputs written at physical cache rows (see
  :func:`indexed_fused_update_cache`).
"""

from __future__ import annotations

import torch

from .errors import EmulatorError, NotEmulatedError
from .op_accounting import add_bytes, bind_op, shard_ints
from .registry import device_op
from .tensor import EmuTensor, describe_tile, dtype_name, quantize_via_ttnn, shard_bytes, write_inplace
from .ttnn_import import ttnn


def _mesh_indices(t: EmuTensor, mesh_coords) -> list[int]:
    if mesh_coords is None:
        return list(range(t.num_shards))
    out = []
    for c in mesh_coords:
        coords = list(c)
        if len(coords) != 2 or coords[0] != 0:
            raise EmulatorError(f"mesh coordinate {coords} is outside the (1, {t.num_shards}) mesh")
        out.append(int(coords[1]))
    return sorted(out)


# ------------------------------------------------------------------------------------------------
# accounting: what these ops really read/write per device (not the whole cache they are handed)
# ------------------------------------------------------------------------------------------------
def _row_tiles_bytes(cache: EmuTensor, rows: int) -> int:
    """Bytes of the tiles holding ``rows`` token rows (one per user and KV head) of a TILE cache."""
    dh = cache.logical_shape_list[-1]
    return rows * shard_bytes([32, dh], cache.dtype, ttnn.TILE_LAYOUT)


def _update_rows(b) -> int:
    x, cache = b["input_tensor"], b["cache_tensor"]
    users = x.logical_shape_list[1]
    idx = b.get("update_idxs_tensor")
    if idx is not None:
        valid = int((idx.shards[0].reshape(-1)[:users] >= 0).sum())
    else:
        valid = sum(1 for p in list(b.get("update_idxs") or [])[:users] if p >= 0)
    return valid * cache.logical_shape_list[1]


def _update_read(args, kwargs):
    b = bind_op("ttnn.experimental.paged_update_cache", args, kwargs)
    d: dict = {}
    for k in ("input_tensor", "update_idxs_tensor", "page_table"):
        add_bytes(d, b.get(k))
    add_bytes(d, b["cache_tensor"], _row_tiles_bytes(b["cache_tensor"], _update_rows(b)))  # read-modify-write
    return d


def _update_written(args, kwargs):
    b = bind_op("ttnn.experimental.paged_update_cache", args, kwargs)
    d: dict = {}
    add_bytes(d, b["cache_tensor"], _row_tiles_bytes(b["cache_tensor"], _update_rows(b)))
    return d


def _fill_read(args, kwargs):
    b = bind_op("ttnn.experimental.paged_fill_cache", args, kwargs)
    d: dict = {}
    for k in ("input_tensor", "page_table", "batch_idx_tensor"):
        add_bytes(d, b.get(k))
    return d


def _fill_written(args, kwargs):
    b = bind_op("ttnn.experimental.paged_fill_cache", args, kwargs)
    d: dict = {}
    add_bytes(d, b["cache_tensor"], b["input_tensor"].bytes_per_device())
    return d


# ------------------------------------------------------------------------------------------------
# cache updates
# ------------------------------------------------------------------------------------------------
def _check_update_input(op: str, input_tensor: EmuTensor):
    if dtype_name(input_tensor.dtype) not in ("FLOAT32", "BFLOAT16"):
        raise EmulatorError(
            f"{op}: input_tensor must be FLOAT32 or BFLOAT16 (got {dtype_name(input_tensor.dtype)}); the op repacks "
            "into the cache dtype itself - do not pre-cast K/V to the cache's block-float dtype"
        )


@device_op("ttnn.experimental.paged_update_cache", read_bytes=_update_read, written_bytes=_update_written)
def paged_update_cache(
    cache_tensor,
    input_tensor,
    *,
    update_idxs=(),
    update_idxs_tensor=None,
    share_cache=None,
    page_table=None,
    batch_offset=0,
    compute_kernel_config=None,
    mesh_coords=None,
    block_size=None,
    num_kv_heads=None,
    cache_position_modulo=None,
):
    op = "ttnn.experimental.paged_update_cache"
    _check_update_input(op, input_tensor)
    if block_size is not None or num_kv_heads is not None:
        raise NotEmulatedError(f"{op}: block_size/num_kv_heads view overrides are not emulated")
    new_shards = list(cache_tensor.shards)
    for i in _mesh_indices(cache_tensor, mesh_coords):
        cache = cache_tensor.shards[i].clone()
        x = input_tensor.shards[i]
        if x.ndim != 4 or x.shape[0] != 1:
            raise EmulatorError(f"{op}: input must be [1, B, nkv, head_dim], got {list(x.shape)}")
        users = x.shape[1]
        pos = shard_ints(update_idxs_tensor, i) if update_idxs_tensor is not None else torch.tensor(
            list(update_idxs), dtype=torch.int64)
        if pos.numel() < users:
            raise EmulatorError(f"{op}: {pos.numel()} update positions for {users} users")
        pos = pos[:users]
        nkv = cache.shape[1]
        if x.shape[2] < nkv:
            raise EmulatorError(f"{op}: input has {x.shape[2]} KV-head rows, cache has {nkv}")
        if x.shape[-1] != cache.shape[-1]:
            raise EmulatorError(f"{op}: head_dim {x.shape[-1]} != cache head_dim {cache.shape[-1]}")
        valid = pos >= 0
        b_idx = torch.arange(users)[valid]
        p = pos[valid]
        rows = x[0, b_idx, :nkv, :]  # [n, nkv, dh]
        rows = quantize_via_ttnn(rows.reshape(-1, rows.shape[-1]), cache_tensor.dtype).reshape(rows.shape)
        rows = rows.to(cache.dtype)
        if page_table is not None:
            pt = page_table.shards[i].to(torch.int64)
            bs = cache.shape[2]
            if cache_position_modulo is not None:
                m = int(cache_position_modulo)
                if m <= 0 or m % bs or m > pt.shape[1] * bs:
                    raise EmulatorError(f"{op}: cache_position_modulo {m} must be a positive multiple of {bs} "
                                        f"<= {pt.shape[1] * bs}")
                p = p % m
            if bool((p // bs >= pt.shape[1]).any()):
                raise EmulatorError(f"{op}: position beyond the page table capacity {pt.shape[1] * bs}")
            blocks = pt[b_idx, p // bs]
            if bool((blocks >= cache.shape[0]).any()):
                raise EmulatorError(f"{op}: page table entry beyond the {cache.shape[0]} cache blocks")
            keep = blocks >= 0  # a -1 page-table entry is skipped, as for paged_fill_cache
            cache[blocks[keep], :, (p % bs)[keep], :] = rows[keep]
        else:
            if cache_position_modulo is not None:
                raise EmulatorError(f"{op}: cache_position_modulo needs a page_table")
            if bool((p >= cache.shape[2]).any()):
                raise EmulatorError(f"{op}: position beyond the cache length {cache.shape[2]}")
            # share_cache: the program factory sets the per-user cache stride to 0 (cache_batch_num_tiles = 0),
            # so every user writes the one shared cache row
            row = torch.zeros_like(b_idx) if share_cache else b_idx + int(batch_offset)
            if bool((row >= cache.shape[0]).any()):
                raise EmulatorError(f"{op}: cache batch {cache.shape[0]} has no row {int(row.max())}")
            cache[row, :, p, :] = rows
        new_shards[i] = cache
    write_inplace(cache_tensor, new_shards)
    return cache_tensor


def _fused_pairs(args, kwargs):
    """paged_fused_update_cache's call as two paged_update_cache bindings (cache, input, shared index kwargs)."""
    b = bind_op("ttnn.experimental.paged_fused_update_cache", args, kwargs)
    shared = {k: v for k, v in b.items() if k not in ("cache_tensor1", "input_tensor1", "cache_tensor2", "input_tensor2")}
    return [dict(shared, cache_tensor=b[f"cache_tensor{j}"], input_tensor=b[f"input_tensor{j}"]) for j in (1, 2)]


def _fused_update_read(args, kwargs):
    d: dict = {}
    for j, b in enumerate(_fused_pairs(args, kwargs)):
        for k in ("input_tensor",) + (("update_idxs_tensor", "page_table") if j == 0 else ()):  # indices read once
            add_bytes(d, b.get(k))
        add_bytes(d, b["cache_tensor"], _row_tiles_bytes(b["cache_tensor"], _update_rows(b)))
    return d


def _fused_update_written(args, kwargs):
    d: dict = {}
    for b in _fused_pairs(args, kwargs):
        add_bytes(d, b["cache_tensor"], _row_tiles_bytes(b["cache_tensor"], _update_rows(b)))
    return d


def _shard_cores(t: EmuTensor) -> set:
    mc = t.memory_config()
    if not mc.is_sharded() or mc.shard_spec is None:
        return set()
    return {(c.x, c.y) for c in ttnn.corerange_to_cores(mc.shard_spec.grid)}


@device_op("ttnn.experimental.paged_fused_update_cache", read_bytes=_fused_update_read,
           written_bytes=_fused_update_written)
def paged_fused_update_cache(cache_tensor1, input_tensor1, cache_tensor2, input_tensor2, *, update_idxs=(),
                             update_idxs_tensor=None, share_cache=None, page_table=None, batch_offset=0,
                             compute_kernel_config=None, mesh_coords=None):
    """K and V updates of :func:`paged_update_cache` in one program. The device op has the two inputs written by
    disjoint core sets, and rejects inputs whose shard grids overlap (Tenstorrent's callers reshard one of them,
    e.g. ``overlap_qk_coregrid=False``); that rule is enforced here."""
    op = "ttnn.experimental.paged_fused_update_cache"
    shared = _shard_cores(input_tensor1) & _shard_cores(input_tensor2)
    if shared:
        raise EmulatorError(f"{op}: input_tensor1 and input_tensor2 are sharded over overlapping cores "
                            f"{sorted(shared)[:4]}...; the fused update needs them on disjoint cores")
    for cache, x in ((cache_tensor1, input_tensor1), (cache_tensor2, input_tensor2)):
        paged_update_cache(cache, x, update_idxs=update_idxs, update_idxs_tensor=update_idxs_tensor,
                           share_cache=share_cache, page_table=page_table, batch_offset=batch_offset,
                           compute_kernel_config=compute_kernel_config, mesh_coords=mesh_coords)
    return cache_tensor1, cache_tensor2


@device_op("ttnn.experimental.paged_fill_cache", read_bytes=_fill_read, written_bytes=_fill_written)
def paged_fill_cache(
    cache_tensor,
    input_tensor,
    page_table,
    *,
    batch_idx_tensor=None,
    batch_idx=0,
    compute_kernel_config=None,
    mesh_coords=None,
    block_size=None,
    cache_position_modulo=None,
    valid_seq_len_tensor=None,
):
    op = "ttnn.experimental.paged_fill_cache"
    if input_tensor.dtype != cache_tensor.dtype:
        raise EmulatorError(
            f"{op}: input dtype {dtype_name(input_tensor.dtype)} must match the cache dtype "
            f"{dtype_name(cache_tensor.dtype)} (raw tile copy; cast prefill K/V to the cache dtype first)"
        )
    if block_size is not None or cache_position_modulo is not None or valid_seq_len_tensor is not None:
        raise NotEmulatedError(f"{op}: block_size / cache_position_modulo / valid_seq_len_tensor are not emulated")
    new_shards = list(cache_tensor.shards)
    for i in _mesh_indices(cache_tensor, mesh_coords):
        cache = cache_tensor.shards[i].clone()
        x = input_tensor.shards[i]
        pt = page_table.shards[i].to(torch.int64)
        nb, nkv, seq, dh = x.shape
        if nkv != cache.shape[1] or dh != cache.shape[3]:
            raise EmulatorError(f"{op}: input {list(x.shape)} does not fit cache {list(cache.shape)}")
        if batch_idx_tensor is not None:
            users = shard_ints(batch_idx_tensor, i)[:nb]
        else:
            if nb != 1:
                raise EmulatorError(f"{op}: input batch {nb} needs batch_idx_tensor (batch_idx covers one row)")
            users = torch.tensor([int(batch_idx)])
        bs = cache.shape[2]
        if seq > pt.shape[1] * bs:
            raise EmulatorError(f"{op}: {seq} tokens exceed the page table capacity {pt.shape[1] * bs}")
        t = torch.arange(seq)
        for r in range(nb):
            blocks = pt[users[r], t // bs]
            if bool((blocks >= cache.shape[0]).any()):
                raise EmulatorError(f"{op}: page table entry beyond the {cache.shape[0]} cache blocks")
            # a negative entry (vLLM pads page tables with -1) is skipped by the kernel; never index from the end
            keep = blocks >= 0
            cache[blocks[keep], :, (t % bs)[keep], :] = x[r].permute(1, 0, 2)[keep].to(cache.dtype)
        new_shards[i] = cache
    write_inplace(cache_tensor, new_shards)
    return cache_tensor


@device_op("ttnn.update_cache")
def update_cache(cache, input, update_idx, *, batch_offset=0, compute_kernel_config=None):
    """Vectorised in-place update of a non-paged cache [B, nkv, S, dh] at one position for all users."""
    _check_update_input("ttnn.update_cache", input)
    new = []
    for i in range(cache.num_shards):
        c = cache.shards[i].clone()
        x = input.shards[i]  # [1, B, nkv, dh]
        users = x.shape[1]
        rows = quantize_via_ttnn(x[0, :, : c.shape[1], :].reshape(-1, x.shape[-1]), cache.dtype)
        c[int(batch_offset): int(batch_offset) + users, :, int(update_idx), :] = rows.reshape(
            users, c.shape[1], -1).to(c.dtype)
        new.append(c)
    write_inplace(cache, new)
    return cache


@device_op("ttnn.fill_cache")
def fill_cache(cache_tensor, input_tensor, batch_idx, *, update_idx=0):
    """In-place prefill of a non-paged cache row: cache[batch_idx, :, update_idx:update_idx+S] = input[0]."""
    new = []
    for i in range(cache_tensor.num_shards):
        c = cache_tensor.shards[i].clone()
        x = input_tensor.shards[i]
        s = x.shape[2]
        c[int(batch_idx), :, int(update_idx): int(update_idx) + s, :] = quantize_via_ttnn(
            x[0], cache_tensor.dtype).to(c.dtype)
        new.append(c)
    write_inplace(cache_tensor, new)
    return cache_tensor


# ------------------------------------------------------------------------------------------------
# indexed (physical-row) fused cache update
# ------------------------------------------------------------------------------------------------
def _indexed_rows(b) -> int:
    """Valid (written) rows x heads of an indexed_fused_update_cache call (device 0; indices are replicated)."""
    cache, x, idx = b["cache_tensor1"], b["input_tensor1"], b["physical_update_idxs_tensor"]
    p, nh, bs, _ = cache.logical_shape_list
    rows = x.logical_shape_list[2]
    i = idx.shards[0].reshape(-1)[:rows].to(torch.int64)
    return int(((i >= 0) & (i < p * bs)).sum()) * nh


def _indexed_read(args, kwargs):
    b = bind_op("ttnn.experimental.indexed_fused_update_cache", args, kwargs)
    d: dict = {}
    for k in ("input_tensor1", "input_tensor2", "physical_update_idxs_tensor"):
        add_bytes(d, b[k])
    for k in ("cache_tensor1", "cache_tensor2"):  # read-modify-write of the row's tile
        add_bytes(d, b[k], _row_tiles_bytes(b[k], _indexed_rows(b)))
    return d


def _indexed_written(args, kwargs):
    b = bind_op("ttnn.experimental.indexed_fused_update_cache", args, kwargs)
    d: dict = {}
    for k in ("cache_tensor1", "cache_tensor2"):
        add_bytes(d, b[k], _row_tiles_bytes(b[k], _indexed_rows(b)))
    return d


def _check_indexed_topology(op, named) -> None:
    """The mesh rules of the 0.81.1 docstring and Tenstorrent's test (``test_indexed_fused_update_cache.py``): the four
    cache/input tensors share one mesh topology, sharded over heads (dim 1) and/or head_dim (dim 3) or replicated;
    cache page/row sharding (dims 0 and 2) is refused (the op would need per-device index remapping); the indices are
    replicated. Checked where the emulator knows a tensor's distribution (``EmuTensor.dist``: from_torch / as_tensor /
    allocations); the index check by value below covers indices computed on device."""
    dists = {}
    for name, t in named:
        if t.dist is None:
            continue
        shape, placements = t.dist
        rank = len(t.logical_shape_list)
        dims = tuple(p[1] % rank if p[0] == "shard" else None for p in placements)
        dists[name] = (tuple(shape), dims)
        if name == "physical_update_idxs_tensor":
            if any(d is not None for d in dims):
                raise EmulatorError(f"{op}: physical_update_idxs_tensor must be replicated across mesh axes")
        elif any(d in (0, 2) for d in dims):
            raise EmulatorError(f"{op}: {name} is sharded over the mesh by cache pages/rows (dim "
                                f"{[d for d in dims if d in (0, 2)][0]}); cache page/row sharding requires "
                                "physical-index remapping, which the op does not support")
    data = [(n, d) for n, d in dists.items() if n != "physical_update_idxs_tensor"]
    for n, d in data[1:]:
        if d != data[0][1]:
            raise EmulatorError(f"{op}: {data[0][0]} and {n} must use identical mesh topology (got {data[0][1]} "
                                f"vs {d})")


@device_op("ttnn.experimental.indexed_fused_update_cache", read_bytes=_indexed_read, written_bytes=_indexed_written)
def indexed_fused_update_cache(cache_tensor1, input_tensor1, cache_tensor2, input_tensor2,
                               physical_update_idxs_tensor):
    """Packed rows of two inputs written into two caches in one program, at physical rows (0.81.1 docstring):
    input ``[1, nh, R, D]`` row i goes to ``cache[idx[i] // bs, :, idx[i] % bs, :]`` (cache ``[P, nh, bs, D]``);
    entries < 0 or >= P * bs are skipped; no page-table translation. Validation as documented: caches and inputs
    interleaved BFLOAT16 TILE, caches (and inputs) of identical shapes, page rows a tile multiple, 1 <= R <= 256,
    indices INT32 ROW_MAJOR ``[1, N]`` with R <= N <= 256, replicated over the mesh (tt-metal's op tests). Rows are
    written in index order (the device serialises a worker's rows, so a later row wins a shared target). A mesh
    shards the four tensors alike (heads or head_dim) and replicates the indices; shards are updated per device."""
    op = "ttnn.experimental.indexed_fused_update_cache"
    idx = physical_update_idxs_tensor
    named = (("cache_tensor1", cache_tensor1), ("input_tensor1", input_tensor1),
             ("cache_tensor2", cache_tensor2), ("input_tensor2", input_tensor2),
             ("physical_update_idxs_tensor", idx))
    for i, (a_name, a) in enumerate(named):  # Tenstorrent's test: every pair of bound tensors, rejected by name
        for b_name, b in named[i + 1:]:
            if a is b or (isinstance(a, EmuTensor) and isinstance(b, EmuTensor)
                          and (a if a._base is None else a._base) is (b if b._base is None else b._base)):
                raise EmulatorError(f"{op}: {a_name} and {b_name} must not alias the same device buffer")
    for name, t in named[:4]:
        if not isinstance(t, EmuTensor) or not t.on_device:
            raise EmulatorError(f"{op}: {name} must be a device tensor")
        if dtype_name(t.dtype) != "BFLOAT16":
            raise EmulatorError(f"{op}: {name} must use BFLOAT16 (got {dtype_name(t.dtype)})")
        if t.layout != ttnn.TILE_LAYOUT or t.memory_config().is_sharded():
            raise EmulatorError(f"{op}: {name} must be an interleaved TILE tensor (got {t.layout}, "
                                f"{t.memory_config().memory_layout})")
        if t._tile is not None:
            raise EmulatorError(f"{op}: {name} must use the default non-transposed 32x32 tile (got "
                                f"{describe_tile(t._tile)})")
    _check_indexed_topology(op, named)
    # the device op's messages (strings of 0.81.1's library; Tenstorrent's test matches on them), in the order its
    # test needs: shapes, page alignment and source rows before the index tensor's own checks
    if cache_tensor1.logical_shape_list != cache_tensor2.logical_shape_list:
        raise EmulatorError(f"{op}: cache_tensor1 and cache_tensor2 must have identical shapes")
    if input_tensor1.logical_shape_list != input_tensor2.logical_shape_list:
        raise EmulatorError(f"{op}: input_tensor1 and input_tensor2 must have identical shapes")
    cs, xs = cache_tensor1.logical_shape_list, input_tensor1.logical_shape_list
    if len(cs) != 4 or len(xs) != 4 or xs[0] != 1 or xs[1] != cs[1] or xs[3] != cs[3]:
        raise EmulatorError(f"{op}: input {xs} must be [1, num_heads, packed_rows, head_dim] of cache {cs}")
    if cs[2] % 32:
        raise EmulatorError(f"{op}: cache_tensor1 rows per physical page must be tile aligned (got {cs[2]} rows)")
    rows = xs[2]
    if rows > 256:
        raise EmulatorError(f"{op}: input_tensor1 supports at most 256 source rows (got {rows})")
    if rows < 1:
        raise EmulatorError(f"{op}: input_tensor1 has no source rows")
    if not isinstance(idx, EmuTensor) or not idx.on_device:
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must be a device tensor")
    if dtype_name(idx.dtype) != "INT32":
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must use INT32 (got {dtype_name(idx.dtype)})")
    if idx.layout != ttnn.ROW_MAJOR_LAYOUT:
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must use ROW_MAJOR layout (got {idx.layout.name})")
    if idx.memory_config().is_sharded():
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must use interleaved memory")
    if len(idx.logical_shape_list) != 2 or idx.logical_shape_list[0] != 1:
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must have shape [1, num_rows] (got "
                            f"{idx.logical_shape_list})")
    n_idx = idx.logical_shape_list[1]
    if n_idx < rows:
        raise EmulatorError(f"{op}: physical_update_idxs_tensor has fewer entries than the packed input has rows "
                            f"({n_idx} < {rows})")
    if n_idx > 256:
        raise EmulatorError(f"{op}: physical_update_idxs_tensor supports at most 256 entries (got {n_idx})")
    if any(list(sh.shape) != list(idx.shards[0].shape) or not torch.equal(sh, idx.shards[0]) for sh in idx.shards):
        raise EmulatorError(f"{op}: physical_update_idxs_tensor must be replicated across mesh axes (the same "
                            "physical rows on every device)")
    new = []
    for cache_t, x_t in ((cache_tensor1, input_tensor1), (cache_tensor2, input_tensor2)):
        shards = []
        for i in range(cache_t.num_shards):
            cache = cache_t.shards[i].clone()
            p, _, bs, _ = cache.shape
            phys = idx.shards[i].reshape(-1).to(torch.int64)
            x = x_t.shards[i].to(cache.dtype)
            for r in range(rows):
                j = int(phys[r])
                if 0 <= j < p * bs:
                    cache[j // bs, :, j % bs, :] = x[0, :, r, :]
            shards.append(cache)
        new.append(shards)
    write_inplace(cache_tensor1, new[0])
    write_inplace(cache_tensor2, new[1])
    return cache_tensor1, cache_tensor2
