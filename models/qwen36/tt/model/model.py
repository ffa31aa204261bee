"""Qwen3.6 target model on a TP mesh (any width N that divides the heads): decoder layers, embedding,
final norm and the vocab-parallel LM head (each device computes V/N logits, one all_gather makes the full
row on every device: 1 collective of T x V x 4 bytes per step, and argmax/sampling then runs on device
without a second collective).

Host/device boundary (decode, the traced path):

    prepare_decode_inputs_host(tokens, pos)  -> host tensors (replicated mapping, torch -> ttnn, no device)
    copy_host_to_device(host, inputs)        -> writes the persistent DecodeInputs buffers in place
    decode_forward(inputs, state)            -> device only; traceable; returns DecodeOutputs (device)
    process_output_decode(outputs)           -> torch logits [rows, V] fp32 and argmax ids [rows]

Prefill (not traced) takes host token ids and runs chunk by chunk (``prefill_forward``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...config import FULL
from .attention import AttentionContext, TTGatedAttention
from .ccl import ccl_for
from .gdn import TTGatedDeltaNet
from .mlp import TTMLP
from .moe import TTMoE
from .decode_matmuls import decode_matmul_plan
from .model_config import (TensorGroup, TTModelArgs, activation_memory_config, compute_config_matmul,
                           compute_config_norm, kv_update_input_memory_config)
from .state import DecodeInputs, GDNLayerState, KVLayerState, TTModelState
from .weights import LayerWeights, ModelWeights, MoEWeights


def lm_head_logits(ttnn, args: TTModelArgs, lm_head, h, dtype):
    """This device's vocab slice of the logits, ``h`` [1, 1, T, H] (ACTIVATION dtype) @ ``lm_head`` [H, V/N] in
    ``dtype``, DRAM-interleaved. For T <= 32 rows (decode, the verify, MTP drafts, the last prefill row) the matmul
    runs the decode plan of ``args.decode_matmuls`` (``decode_matmuls.decode_matmul_plan``; the weight was placed for
    it at load): mcast_1d reads h where it is and writes the logits straight to DRAM (one program); dram_sharded
    reshards h into L1 and the logits back to DRAM for the all_gather (2 programs more). The target head and the MTP
    head share it, so both read the one LM-head weight the same way."""
    k, n = lm_head.shape[-2], lm_head.shape[-1]
    cfg = compute_config_matmul(ttnn, args.dtype_name(TensorGroup.LM_HEAD))
    mc = activation_memory_config(ttnn)
    plan = decode_matmul_plan(ttnn, args, TensorGroup.LM_HEAD, h.shape[-2], k, n,
                              h.device().compute_with_storage_grid_size())
    if plan is None:
        return ttnn.linear(h, lm_head, dtype=dtype, memory_config=mc, compute_kernel_config=cfg)
    if plan.input_memory_config is not None:
        h = ttnn.to_memory_config(h, plan.input_memory_config)
    out_mc = mc if plan.input_memory_config is None else plan.output_memory_config
    out = ttnn.linear(h, lm_head, dtype=dtype, memory_config=out_mc, program_config=plan.program_config,
                      compute_kernel_config=cfg)
    return out if out.memory_config() == mc else ttnn.to_memory_config(out, mc)


@dataclass
class DecodeOutputs:
    logits: Any  # [1, 1, rows, V] (LOGITS dtype), full vocab on every device
    tokens: Any  # [1, 1, rows] uint32 argmax
    hidden: Any  # [1, 1, rows, H] post-final-norm hidden (the MTP head's h_t)


class TTDecoderLayer:
    """Pre-norm residual block: mixer (GDN or gated attention) then SwiGLU MLP."""

    def __init__(self, args: TTModelArgs, w: LayerWeights, ttnn, mesh):
        self.args, self.w, self.ttnn = args, w, ttnn
        self.layer_type = w.layer_type
        if w.layer_type == FULL:
            self.mixer = TTGatedAttention(args, w.mixer, ttnn, mesh)
        else:
            self.mixer = TTGatedDeltaNet(args, w.mixer, ttnn, mesh)
        # the routed-expert block of the MoE sibling, else the dense SwiGLU MLP
        self.mlp = TTMoE(args, w.mlp, ttnn, mesh) if isinstance(w.mlp, MoEWeights) else TTMLP(args, w.mlp, ttnn, mesh)
        self.eps = args.cfg.rms_norm_eps

    def forward(self, x, state: GDNLayerState | KVLayerState, ctx: AttentionContext):
        ttnn, a = self.ttnn, self.args
        res = a.dtype(TensorGroup.RESIDUAL, ttnn)
        ncfg = compute_config_norm(ttnn)
        h = ttnn.rms_norm(x, epsilon=self.eps, weight=self.w.input_norm, compute_kernel_config=ncfg)
        if self.layer_type == FULL:
            h = self.mixer.forward(h, state, ctx)
        else:
            h = self.mixer.forward(h, state, ctx.mode, plan=ctx.gdn_plan)
        x = ttnn.add(x, h, dtype=res)
        # decode rows: the norm writes x where the MLP's decode matmuls read it (L1; no reshard program)
        mlp_in = getattr(self.mlp, "input_memory_config", lambda rows: None)(x.shape[-2])
        h = ttnn.rms_norm(x, epsilon=self.eps, weight=self.w.post_norm, compute_kernel_config=ncfg,
                          memory_config=mlp_in)
        return ttnn.add(x, self.mlp.forward(h), dtype=res)


class TTQwen36Model:
    def __init__(self, args: TTModelArgs, weights: ModelWeights, ttnn, mesh):
        self.args, self.w, self.ttnn, self.mesh = args, weights, ttnn, mesh
        self.layers = [TTDecoderLayer(args, lw, ttnn, mesh) for lw in weights.layers]
        self.replicate = ttnn.ReplicateTensorToMesh(mesh)
        # region(name) -> context manager around each part of a step ("embed", "layer3", "head"); a no-op
        # unless a probe installs the emulator's counter scopes (probes/decode_cost.py)
        self.region: Callable[[str], Any] = lambda name: contextlib.nullcontext()

    # ---- device pieces (traceable) ---------------------------------------------------------------
    def embed(self, tokens):
        """tokens [1, T] uint32 -> x [1, 1, T, H] in the residual dtype."""
        ttnn, a = self.ttnn, self.args
        rows = tokens.shape[-1]
        x = ttnn.embedding(tokens, self.w.embedding, layout=ttnn.TILE_LAYOUT, memory_config=activation_memory_config(ttnn))
        x = ttnn.reshape(x, [1, 1, rows, a.cfg.hidden_size])
        res = a.dtype(TensorGroup.RESIDUAL, ttnn)
        return x if x.dtype == res else ttnn.typecast(x, res)

    def rope_rows(self, rope_idx, mode: str = "decode"):
        """rope_idx [1, T] uint32 -> cos, sin (one gather each from the fp32 tables), in the layout
        ``rotary_embedding_hf`` takes: decode [1, T, 1, D] height-sharded (one row per core, each row its own
        position), prefill [1, 1, T, D] interleaved. Done once per step, shared by every attention layer."""
        ttnn = self.ttnn
        rows, d = rope_idx.shape[-1], self.args.cfg.head_dim
        out = []
        for table in (self.w.rope_cos, self.w.rope_sin):
            t = ttnn.embedding(rope_idx, table, layout=ttnn.TILE_LAYOUT)
            if mode == "decode":
                t = ttnn.to_memory_config(ttnn.reshape(t, [1, rows, 1, d]),
                                          kv_update_input_memory_config(ttnn, rows, d))
            elif mode == "prefill":
                t = ttnn.reshape(t, [1, 1, rows, d])
            else:
                raise ValueError(f"rope_rows mode must be 'decode' or 'prefill', got {mode!r}")
            out.append(t)
        return out[0], out[1]

    def layers_forward(self, x, state: TTModelState, ctx: AttentionContext):
        for i, (layer, st) in enumerate(zip(self.layers, state.layers)):
            with self.region(f"layer{i}"):
                x = layer.forward(x, st, ctx)
        return x

    def head(self, x, last_row_only: bool):
        """Final norm + vocab-parallel LM head + all_gather -> (logits [1,1,T',V], post-norm hidden [1,1,T,H])."""
        ttnn, a = self.ttnn, self.args
        rows = x.shape[2]
        hidden = ttnn.rms_norm(x, epsilon=a.cfg.rms_norm_eps, weight=self.w.final_norm,
                               compute_kernel_config=compute_config_norm(ttnn))
        h = ttnn.slice(hidden, [0, 0, rows - 1, 0], [1, 1, rows, a.cfg.hidden_size]) if last_row_only else hidden
        if h.dtype != a.dtype(TensorGroup.ACTIVATION, ttnn):
            h = ttnn.typecast(h, a.dtype(TensorGroup.ACTIVATION, ttnn))
        logits = lm_head_logits(ttnn, a, self.w.lm_head, h, a.dtype(TensorGroup.LOGITS, ttnn))
        if a.num_devices > 1:
            logits = ccl_for(ttnn, self.mesh).all_gather(logits, dim=3)
        return logits, hidden

    def decode_forward(self, inputs: DecodeInputs, state: TTModelState) -> DecodeOutputs:
        """One decode step over ``inputs.rows`` rows, device only (safe to capture in a trace)."""
        ttnn = self.ttnn
        with self.region("embed"):
            x = self.embed(inputs.tokens)
            cos, sin = self.rope_rows(inputs.rope_idx)
        ctx = AttentionContext("decode", cos, sin, state.page_table, pos=inputs.pos)
        x = self.layers_forward(x, state, ctx)
        with self.region("head"):
            logits, hidden = self.head(x, last_row_only=False)
            tokens = ttnn.argmax(logits, dim=-1)
        return DecodeOutputs(logits, tokens, hidden)

    # ---- host boundary -------------------------------------------------------------------------------
    def prepare_decode_inputs_host(self, tokens: list[int], pos: int | list[int]) -> dict:
        """Host tensors (same replicated mapping as the persistent buffers): one user's rows at pos, pos+1, ...
        (``pos`` an int), or one row per user b at ``pos[b]`` (``pos`` a list: a batched decode; -1 marks an
        inactive slot, whose cache write is skipped and whose RoPE row is 0)."""
        ttnn, rm = self.ttnn, self.ttnn.ROW_MAJOR_LAYOUT
        t = torch.tensor([tokens], dtype=torch.int32)
        if isinstance(pos, int):
            r = torch.arange(pos, pos + len(tokens), dtype=torch.int32)[None]
            p = torch.tensor([pos], dtype=torch.int32)
        else:
            if len(pos) != len(tokens):
                raise ValueError(f"batched decode: {len(tokens)} tokens but {len(pos)} positions (one row per user)")
            p = torch.tensor(pos, dtype=torch.int32)
            r = p.clamp(min=0)[None]
        return {"tokens": ttnn.from_torch(t, dtype=ttnn.uint32, layout=rm, mesh_mapper=self.replicate),
                "rope_idx": ttnn.from_torch(r, dtype=ttnn.uint32, layout=rm, mesh_mapper=self.replicate),
                "pos": ttnn.from_torch(p, dtype=ttnn.int32, layout=rm, mesh_mapper=self.replicate)}

    def copy_host_to_device(self, host: dict, inputs: DecodeInputs) -> None:
        for name, h in host.items():
            self.ttnn.copy_host_to_device_tensor(h, getattr(inputs, name))

    def to_host(self, t) -> torch.Tensor:
        """A replicated device tensor -> torch (device 0's copy)."""
        return self.ttnn.to_torch(self.ttnn.get_device_tensors(t)[0])

    def process_output_decode(self, out: DecodeOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.to_host(out.logits).float()
        return logits.reshape(-1, logits.shape[-1]), self.to_host(out.tokens).reshape(-1).to(torch.int64)

    # ---- prefill ---------------------------------------------------------------------------------------
    def prefill_chunk_context(self, start: int, rows: int, page_table, page_table_host: torch.Tensor
                              ) -> AttentionContext:
        """Attention inputs of the prefill rows at positions start..start+rows-1 (not traced: built from host
        values): cos/sin gathered at those positions, the cache's page table, and the chunk's own pages
        (``paged_fill_cache`` writes whole pages, so ``start`` is a multiple of block_size). Used by the target
        prefill and the MTP prefill, which keep separate caches and page tables."""
        ttnn, a = self.ttnn, self.args
        rm, mc = ttnn.ROW_MAJOR_LAYOUT, activation_memory_config(ttnn)
        rope_idx_1T = ttnn.from_torch(torch.arange(start, start + rows, dtype=torch.int32)[None], dtype=ttnn.uint32,
                                      layout=rm, device=self.mesh, memory_config=mc)
        pages = page_table_host[:, start // a.block_size: -(-(start + rows) // a.block_size)].contiguous()
        chunk_page_table = ttnn.from_torch(pages, dtype=ttnn.int32, layout=rm, device=self.mesh, memory_config=mc)
        cos_11TD, sin_11TD = self.rope_rows(rope_idx_1T, mode="prefill")
        return AttentionContext("prefill", cos_11TD, sin_11TD, page_table, chunk_start=start,
                                chunk_page_table=chunk_page_table)

    def prefill_forward(self, ids: torch.Tensor, state: TTModelState, all_rows: bool = False,
                        hidden_out: list | None = None) -> torch.Tensor:
        """Run prompt ``ids`` [T] from position ``state.pos`` in chunks of ``args.prefill_chunk``; advances the
        state. Returns fp32 logits [T, V] (all_rows) or [1, V] (last row). ``hidden_out`` (a list) receives each
        chunk's post-final-norm hidden [1, 1, rows, H] on device (the MTP prefill's h_t)."""
        ttnn, a = self.ttnn, self.args
        ids = ids.reshape(-1).to(torch.int32)
        start0 = state.pos
        if start0 % a.block_size:
            raise ValueError(f"prefill must start on a page boundary (pos {start0}, block_size {a.block_size})")
        if start0 + ids.numel() > a.max_seq_len:
            raise ValueError(f"prompt of {ids.numel()} tokens from position {start0} exceeds max_seq_len {a.max_seq_len}")
        rm, mc = ttnn.ROW_MAJOR_LAYOUT, activation_memory_config(ttnn)
        outs = []
        for off in range(0, ids.numel(), a.prefill_chunk):
            chunk = ids[off: off + a.prefill_chunk]
            rows, start = chunk.numel(), start0 + off
            tokens_1T = ttnn.from_torch(chunk[None], dtype=ttnn.uint32, layout=rm, device=self.mesh, memory_config=mc)
            ctx = self.prefill_chunk_context(start, rows, state.page_table, state.page_table_host)
            x = self.layers_forward(self.embed(tokens_1T), state, ctx)
            last = not all_rows and off + a.prefill_chunk >= ids.numel()
            if hidden_out is not None:
                hidden_out.append(ttnn.rms_norm(x, epsilon=a.cfg.rms_norm_eps, weight=self.w.final_norm,
                                                compute_kernel_config=compute_config_norm(ttnn)))
            if all_rows or last:
                logits, _ = self.head(x, last_row_only=not all_rows)
                outs.append(self.to_host(logits).float().reshape(-1, a.cfg.vocab_size))
            state.pos = start + rows
        return torch.cat(outs, 0)
