"""Pure-torch Qwen3.6 target model + MTP head: the numerics oracle (CPU or CUDA, no ttnn).

    model = Qwen36Model.from_checkpoint(path)          # validated, lazily loaded
    state = model.new_state(batch=1, max_len=512)
    out = model(tokens, state)                         # prefill (chunked GDN), advances state
    out = model(next_token[:, None], state)            # decode (recurrent GDN)
    out = model(rows, state, per_token_states=True)    # K+1-row verify with per-row GDN states

MTP (Qwen3.6's multi-token-prediction layer): u = fc([norm_e(embed(x_{t+1})), norm_h(h_t)]); one full-attention decoder layer with its
own KV cache at the target's positions; mtp.norm; shared lm_head. h_t is the target's post-norm hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..checkpoint import CheckpointReader, load_checkpoint
from ..config import FULL, Qwen36Config
from .attention import GatedAttention
from .gdn import GatedDeltaNet, GDNPerToken
from .layers import RMSNorm, SwiGLU
from .moe import SparseMoE
from .state import GDNState, KVCache, ModelState, MTPState


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention) then SwiGLU (a sparse MoE block when the
    config has experts). Also the MTP layer."""

    def __init__(self, cfg: Qwen36Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == FULL:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, pos0: int, state: KVCache | GDNState | None, *, gdn_mode: str = "auto",
                per_token: bool = False) -> tuple[torch.Tensor, GDNPerToken | None]:
        extra = None
        h = self.input_layernorm(x)
        if self.layer_type == FULL:
            h = self.self_attn(h, pos0, state)
        else:
            h, extra = self.linear_attn(h, state, mode=gdn_mode, per_token=per_token)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), extra


class MTPHead(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, pos0: int,
                cache: KVCache | None = None) -> torch.Tensor:
        """token_embeds = embed(x_{t+1}), hidden = h_t, both [B, T, H], rows at positions pos0.. -> post-norm [B, T, H]."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(token_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        u, _ = self.layers[0](u, pos0, cache)
        return self.norm(u)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T, vocab] fp32
    hidden: torch.Tensor  # [B, T, H] post-final-norm (the MTP's h_t)
    gdn_per_token: dict[int, GDNPerToken] | None = None  # layer index -> per-row states (verify slots)


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [B, K] int64
    logits: torch.Tensor  # [B, K, vocab] fp32 draft logits (before any sampling transform)


class Qwen36Model(nn.Module):
    def __init__(self, cfg: Qwen36Config, with_mtp: bool | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, t) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with_mtp = cfg.has_mtp if with_mtp is None else with_mtp
        self.mtp = MTPHead(cfg) if with_mtp else None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu",
                        with_mtp: bool | None = None, require_mtp: bool = False) -> "Qwen36Model":
        """Validate headers, then load tensor by tensor (the checkpoint is never materialised at once)."""
        reader = load_checkpoint(path, require_mtp=require_mtp)
        return cls.from_reader(reader, dtype=dtype, device=device, with_mtp=with_mtp)

    @classmethod
    def from_reader(cls, reader: CheckpointReader, *, dtype=torch.float32, device="cpu",
                    with_mtp: bool | None = None) -> "Qwen36Model":
        with_mtp = reader.has_mtp if with_mtp is None else with_mtp
        with torch.device("meta"):
            model = cls(reader.config, with_mtp=with_mtp)
        params = dict(model.named_parameters())
        wanted = [n for n in reader.names if n in params]
        for name, tensor in reader.iter_tensors(wanted, dtype=dtype):
            module_path, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_path)
            setattr(module, leaf, nn.Parameter(tensor.to(device), requires_grad=False))
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
        if still_meta:
            raise ValueError(f"{reader.path}: parameters not loaded: {still_meta}")
        return model.eval()

    # ---- state ----------------------------------------------------------------------------------
    def new_state(self, batch: int = 1, max_len: int = 2048, device=None, kv_dtype=None) -> ModelState:
        p = self.embed_tokens.weight
        device = device or p.device
        dtype = kv_dtype or p.dtype
        cfg = self.config
        layers = []
        for layer in self.layers:
            if layer.layer_type == FULL:
                layers.append(KVCache.empty(batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device))
            else:
                layers.append(layer.linear_attn.new_state(batch, dtype, device))
        return ModelState(layers, 0)

    def new_mtp_state(self, batch: int = 1, max_len: int = 2048, device=None) -> MTPState:
        if self.mtp is None:
            raise ValueError("this model was built without the MTP head (checkpoint has no 'mtp.*' tensors)")
        p = self.embed_tokens.weight
        cfg = self.config
        return MTPState(KVCache.empty(batch, cfg.num_key_value_heads, max_len, cfg.head_dim, p.dtype, device or p.device))

    # ---- forward --------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ w.t()).float()

    def forward(self, tokens: torch.Tensor, state: ModelState | None = None, *, gdn_mode: str = "auto",
                per_token_states: bool = False) -> ForwardOutput:
        """tokens [B, T] at positions state.pos..; advances ``state`` (GDN by reassignment, KV rows in place)."""
        pos0 = 0 if state is None else state.pos
        x = self.embed_tokens(tokens)
        per_tok: dict[int, GDNPerToken] = {}
        for i, layer in enumerate(self.layers):
            x, extra = layer(x, pos0, None if state is None else state.layers[i], gdn_mode=gdn_mode,
                             per_token=per_token_states)
            if extra is not None:
                per_tok[i] = extra
        h = self.norm(x)
        if state is not None:
            state.pos = pos0 + tokens.shape[1]
        return ForwardOutput(self.logits(h), h, per_tok if per_token_states else None)

    def mtp_forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, pos0: int,
                    mtp_state: MTPState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows t = pos0.. from (x_{t+1}, h_t); writes MTP KV rows pos0.. -> (logits fp32, post-norm hidden)."""
        if self.mtp is None:
            raise ValueError("this model was built without the MTP head (checkpoint has no 'mtp.*' tensors)")
        h = self.mtp(self.embed_tokens(next_tokens), hidden, pos0, None if mtp_state is None else mtp_state.kv)
        return self.logits(h), h

    def mtp_draft(self, mtp_state: MTPState, next_tokens: torch.Tensor, hidden: torch.Tensor, pos0: int, k: int,
                  pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftOutput:
        """Draft k tokens. First pass over the n verified rows (pos0..pos0+n-1, the reseed), then a chain
        that feeds back the MTP's own token and post-norm hidden. Chain rows are provisional KV entries that
        the next reseed overwrites. ``pick`` maps logits [B, V] -> tokens [B] (default argmax)."""
        pick = pick or (lambda lg: lg.argmax(-1))
        n = next_tokens.shape[1]
        logits, h = self.mtp_forward(next_tokens, hidden, pos0, mtp_state)
        mtp_state.pos = pos0 + n
        lg, hh = logits[:, -1], h[:, -1:]
        toks, lgs = [], []
        for i in range(k):
            tok = pick(lg)
            toks.append(tok)
            lgs.append(lg)
            if i + 1 < k:
                lg3, hh = self.mtp_forward(tok[:, None], hh, pos0 + n + i, mtp_state)
                lg = lg3[:, -1]
        return DraftOutput(torch.stack(toks, 1), torch.stack(lgs, 1))
