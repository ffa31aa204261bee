"""Test-side access to TT building blocks: host tensors laid out for the device acceptor's inputs, and the MTP
head's KV cache as torch (snapshot / restore). Production code never needs these: on the real path the inputs
are produced on device and the KV cache never leaves it."""
from __future__ import annotations

import torch


def _check_host_shape(x: torch.Tensor, want: tuple, what: str) -> torch.Tensor:
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if list(x.shape) != [1, *want]:
        raise ValueError(f"{what} shape {list(x.shape)} != [1, B, rows, V] = [1, {', '.join(map(str, want))}]")
    return x


def acceptor_host_logits(acc, logits: torch.Tensor, dtype=None):
    """torch [B, R, V] or [1, B, R, V] -> host tensor laid out for ``acc`` (a DeviceAcceptor): replicated, or
    sharded along V when its logits are vocab-sharded (for copy_host_to_device_tensor / to_device)."""
    ttnn = acc.ttnn
    x = _check_host_shape(logits, (acc.batch, acc.rows, acc.vocab), "logits")
    mapper = (ttnn.ShardTensorToMesh(acc.mesh, dim=3) if acc.logits_layout == "vocab_sharded"
              else ttnn.ReplicateTensorToMesh(acc.mesh))
    return ttnn.from_torch(x, dtype=dtype or ttnn.float32, layout=ttnn.TILE_LAYOUT, mesh_mapper=mapper)


def acceptor_host_drafts(acc, drafts: torch.Tensor):
    """torch [B, K] (or [1, B, 1, K]) int -> host uint32 ROW_MAJOR tensor, replicated."""
    ttnn = acc.ttnn
    d = torch.as_tensor(drafts).to(torch.int64)
    if d.dim() == 2:
        d = d.reshape(1, d.shape[0], 1, d.shape[1])
    if list(d.shape) != [1, acc.batch, 1, acc.k]:
        raise ValueError(f"drafts shape {list(drafts.shape)} != [B={acc.batch}, K={acc.k}]")
    if d.numel() and (int(d.min()) < 0 or int(d.max()) >= acc.vocab):
        raise ValueError(f"draft token ids must be in [0, {acc.vocab}); got min {int(d.min())} max {int(d.max())}")
    return ttnn.from_torch(d, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(acc.mesh))


def acceptor_host_draft_probs(acc, probs: torch.Tensor):
    """torch [B, K, V] fp32 -> host tensor, full vocab replicated on every device (what stochastic() takes)."""
    ttnn = acc.ttnn
    x = _check_host_shape(probs, (acc.batch, acc.k, acc.vocab), "draft_probs")
    return ttnn.from_torch(x.float(), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(acc.mesh))


def _k_head_order(head) -> torch.Tensor:
    """The device K cache stores each head's dims in the RoPE order (weights.rope_head_permutation)."""
    from qwen36.tt.model.weights import rope_head_permutation

    c = head.args.cfg
    return rope_head_permutation(c.head_dim, c.rotary_dim)


def mtp_kv_to_host(head) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP K, V of ``head`` (a TTMTPHead) as [Hkv, max_len, D] (all devices' heads, position-major), head dims in
    the reference's order (K is un-permuted)."""
    ttnn = head.ttnn
    out = []
    for cache in (head.kv.k, head.kv.v):
        c = ttnn.to_torch(cache, mesh_composer=ttnn.ConcatMeshToTensor(head.mesh, dim=1)).float()
        nb, hkv, bs, d = c.shape
        c = c[head.page_table_host[0].long()]  # logical block order
        out.append(c.permute(1, 0, 2, 3).reshape(hkv, nb * bs, d))
    k = torch.empty_like(out[0])
    k[..., _k_head_order(head)] = out[0]
    return k, out[1]


def mtp_kv_from_host(head, k: torch.Tensor, v: torch.Tensor) -> None:
    """Overwrite the MTP KV buffers of ``head`` in place from [Hkv, max_len, D] in the reference's head-dim order
    (what :func:`mtp_kv_to_host` returns)."""
    ttnn = head.ttnn
    for cache, x in ((head.kv.k, k[..., _k_head_order(head)]), (head.kv.v, v)):
        hkv, s, d = x.shape
        bs = head.args.block_size
        paged = x.reshape(hkv, s // bs, bs, d).permute(1, 0, 2, 3).contiguous()
        host = ttnn.from_torch(paged, dtype=cache.dtype, layout=ttnn.TILE_LAYOUT,
                               mesh_mapper=ttnn.ShardTensorToMesh(head.mesh, dim=1))
        ttnn.copy_host_to_device_tensor(host, cache)


def layer_kv_from_host(model, kv, page_table_host: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Overwrite a target attention layer's paged KV (``kv``: a KVLayerState of ``model``, a TTQwen36Model) with one
    user's K, V [Hkv, S, D] in the reference's head-dim order (K is stored permuted on device), placing logical block
    j in the physical page ``page_table_host[0, j]``; pages no logical block names keep their contents."""
    from qwen36.tt.model.weights import rope_head_permutation

    ttnn, c, bs = model.ttnn, model.args.cfg, model.args.block_size
    for cache, x in ((kv.k, k[..., rope_head_permutation(c.head_dim, c.rotary_dim)]), (kv.v, v)):
        full = ttnn.to_torch(cache, mesh_composer=ttnn.ConcatMeshToTensor(model.mesh, dim=1)).float()
        hkv, s, d = x.shape
        blocks = x.reshape(hkv, s // bs, bs, d).permute(1, 0, 2, 3)
        full[page_table_host[0, : s // bs].long()] = blocks.float()
        host = ttnn.from_torch(full, dtype=cache.dtype, layout=ttnn.TILE_LAYOUT,
                               mesh_mapper=ttnn.ShardTensorToMesh(model.mesh, dim=1))
        ttnn.copy_host_to_device_tensor(host, cache)
