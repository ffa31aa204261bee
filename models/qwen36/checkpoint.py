"""Checkpoint loading: HF safetensors (single file or sharded with an index), lazy per tensor.

One key mapping lives here. Our canonical names drop the HF wrapper prefix:

    HF (Qwen3_5ForConditionalGeneration)    HF (Qwen3_5ForCausalLM)     canonical
    model.language_model.embed_tokens.w     model.embed_tokens.w        embed_tokens.weight
    model.language_model.layers.N.*         model.layers.N.*            layers.N.*
    model.language_model.norm.weight        model.norm.weight           norm.weight
    lm_head.weight                          lm_head.weight              lm_head.weight
    mtp.*                                   mtp.*                       mtp.*

``model.visual.*`` (vision tower) is recognised and ignored.

Mixture-of-experts checkpoints (``qwen3_5_moe``) store routed experts in one of two layouts, both accepted:

    stacked (transformers 5 modules, what its save_pretrained writes):
        layers.N.mlp.experts.gate_up_proj  [E, 2*I, H]   (per expert: gate rows then up rows)
        layers.N.mlp.experts.down_proj     [E, H, I]
    per expert (the layout transformers' load-time conversion merges; also what quantised exports use):
        layers.N.mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]

The canonical names are the stacked ones. A per-expert checkpoint is validated name by name (a missing expert is
reported as its own tensor) and stacked lazily, one layer's tensor at a time, when the model asks for it. Beside
the experts a MoE layer has the router ``mlp.gate.weight`` [E, H], ``mlp.shared_expert.{gate,up,down}_proj.weight``
and ``mlp.shared_expert_gate.weight`` [1, H]; the MTP layer's MLP is the same MoE block. Tensors are opened one at a time with
``safetensors.safe_open``, so a 55 GB checkpoint is never materialised at once; shapes are checked from
the file headers before anything is read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import FULL, LINEAR, Qwen36Config
from .errors import UserError

HF_PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.visual.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(UserError, ValueError):
    """A checkpoint that does not match its config; the message names every offending tensor."""


def to_canonical(hf_key: str) -> str | None:
    """Map an HF key to our canonical name; ``None`` for keys we deliberately ignore (vision tower)."""
    if hf_key.startswith(IGNORED_PREFIXES):
        return None
    if hf_key.startswith(("mtp.", "lm_head.")):
        return hf_key
    for p in HF_PREFIXES:
        if hf_key.startswith(p):
            return hf_key[len(p):]
    return hf_key  # unknown: reported as unexpected by validate()


def to_hf(canonical: str, wrapped: bool = False) -> str:
    """Canonical name -> HF key (``wrapped`` selects the ConditionalGeneration layout)."""
    if canonical.startswith(("mtp.", "lm_head.")):
        return canonical
    return ("model.language_model." if wrapped else "model.") + canonical


def _attention_shapes(cfg: Qwen36Config, prefix: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        f"{prefix}self_attn.q_proj.weight": (2 * cfg.num_attention_heads * d, h),  # per head [q | gate]
        f"{prefix}self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{prefix}self_attn.q_norm.weight": (d,),
        f"{prefix}self_attn.k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: Qwen36Config, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    p = f"{prefix}linear_attn."
    return {
        f"{p}in_proj_qkv.weight": (cfg.gdn_conv_dim, h),
        f"{p}in_proj_z.weight": (cfg.gdn_value_dim, h),
        f"{p}in_proj_b.weight": (hv, h),
        f"{p}in_proj_a.weight": (hv, h),
        f"{p}conv1d.weight": (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}A_log": (hv,),
        f"{p}dt_bias": (hv,),
        f"{p}norm.weight": (cfg.linear_value_head_dim,),
        f"{p}out_proj.weight": (h, cfg.gdn_value_dim),
    }


def _moe_shapes(cfg: Qwen36Config, prefix: str) -> dict[str, tuple[int, ...]]:
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    p = f"{prefix}mlp."
    return {
        f"{p}gate.weight": (e, h),
        f"{p}experts.gate_up_proj": (e, 2 * i, h),
        f"{p}experts.down_proj": (e, h, i),
        f"{p}shared_expert.gate_proj.weight": (s, h),
        f"{p}shared_expert.up_proj.weight": (s, h),
        f"{p}shared_expert.down_proj.weight": (h, s),
        f"{p}shared_expert_gate.weight": (1, h),
    }


def _decoder_layer_shapes(cfg: Qwen36Config, prefix: str, layer_type: str) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = _attention_shapes(cfg, prefix) if layer_type == FULL else _gdn_shapes(cfg, prefix)
    shapes.update({
        f"{prefix}input_layernorm.weight": (h,),
        f"{prefix}post_attention_layernorm.weight": (h,),
    })
    if cfg.is_moe:
        shapes.update(_moe_shapes(cfg, prefix))
    else:
        shapes.update({
            f"{prefix}mlp.gate_proj.weight": (i, h),
            f"{prefix}mlp.up_proj.weight": (i, h),
            f"{prefix}mlp.down_proj.weight": (h, i),
        })
    return shapes


STACKED_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")
_PER_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def per_expert_names(stacked: str, num_experts: int) -> list[str]:
    """The per-expert tensor names that make up one stacked expert tensor, in stacking order."""
    base, _, leaf = stacked.rpartition(".")
    projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    return [f"{base}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def per_expert_shapes(cfg: Qwen36Config, stacked: str) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {n: ((h, i) if n.endswith("down_proj.weight") else (i, h)) for n in per_expert_names(stacked, cfg.num_experts)}


def unstack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors -> per-expert ones (the other real layout); other tensors pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not name.endswith(STACKED_EXPERT_SUFFIXES):
            out[name] = t
            continue
        base = name.rpartition(".")[0]
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{base}.{e}.up_proj.weight"] = up.clone()
            else:
                out[f"{base}.{e}.down_proj.weight"] = t[e].clone()
    return out


def target_shapes(cfg: Qwen36Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for every tensor of the target model."""
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for n, t in enumerate(cfg.layer_types):
        shapes.update(_decoder_layer_shapes(cfg, f"layers.{n}.", t))
    return shapes


def mtp_shapes(cfg: Qwen36Config) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors: fc, two pre-fc norms, final norm and one full-attention decoder layer (15 for a dense
    config; its MLP is the MoE block for a MoE config)."""
    h = cfg.hidden_size
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    shapes.update(_decoder_layer_shapes(cfg, "mtp.layers.0.", FULL))
    return shapes


@dataclass
class CheckpointReader:
    """Lazy view of a checkpoint directory: canonical name -> (file, HF key)."""

    path: Path
    config: Qwen36Config
    locations: dict[str, tuple[Path, str]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    _stacks: set[str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path) -> "CheckpointReader":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory not found")
        cfg = Qwen36Config.from_file(path)
        reader = cls(path=path, config=cfg)
        index = path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from e
            missing_files = sorted({f for f in weight_map.values() if not (path / f).exists()})
            if missing_files:
                raise CheckpointError(f"{index}: shard file(s) listed in the index are missing: {missing_files}")
            files = {k: path / f for k, f in weight_map.items()}
        elif (path / SINGLE_FILE).exists():
            with safe_open(path / SINGLE_FILE, framework="pt") as f:
                files = {k: path / SINGLE_FILE for k in f.keys()}
        else:
            raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        for hf_key, file in files.items():
            canon = to_canonical(hf_key)
            if canon is None:
                reader.ignored.append(hf_key)
            elif canon in reader.locations:
                raise CheckpointError(f"{path}: tensor '{canon}' appears twice (as '{reader.locations[canon][1]}' and '{hf_key}')")
            else:
                reader.locations[canon] = (file, hf_key)
        return reader

    @property
    def has_mtp(self) -> bool:
        return any(k.startswith("mtp.") for k in self.locations)

    def _per_expert_stacks(self) -> set[str]:
        """Stacked expert names this checkpoint provides in the per-expert layout (computed once)."""
        if self._stacks is not None:
            return self._stacks
        out = set()
        for k in self.locations:
            m = _PER_EXPERT_RE.match(k)
            if m:
                out.add(f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}")
        self._stacks = out
        return out

    @property
    def names(self) -> list[str]:
        """Canonical tensor names the model can ask for: stored names, with per-expert tensors replaced by
        the stacked names they assemble into."""
        stacks = self._per_expert_stacks()
        return [k for k in self.locations if not _PER_EXPERT_RE.match(k)] + sorted(stacks - set(self.locations))

    def shape_of(self, name: str) -> tuple[int, ...]:
        if name not in self.locations and name.endswith(STACKED_EXPERT_SUFFIXES):
            parts = [self.shape_of(n) for n in per_expert_names(name, self.config.num_experts)]
            per = 2 if name.endswith("gate_up_proj") else 1
            return (len(parts) // per, parts[0][0] * per, parts[0][1])
        file, key = self.locations[name]
        with safe_open(file, framework="pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def validate(self, *, require_mtp: bool = False) -> None:
        """Check every expected tensor is present with the right shape; report all problems at once."""
        cfg = self.config
        expected = target_shapes(cfg)
        has_mtp_tensors = self.has_mtp
        if require_mtp and not has_mtp_tensors:
            raise CheckpointError(
                f"{self.path}: speculative decoding needs the MTP head, but the checkpoint has no 'mtp.*' tensors "
                f"(expected {len(mtp_shapes(cfg))} tensors such as 'mtp.fc.weight'). Run without speculation or use a "
                "checkpoint that ships the MTP weights.")
        if has_mtp_tensors or require_mtp:
            expected.update(mtp_shapes(cfg))
        problems: list[str] = []
        if cfg.is_moe:
            # a stacked expert tensor may come as per-expert tensors instead: expect those, name by name
            per_expert = self._per_expert_stacks()
            both = sorted(n for n in per_expert if n in self.locations)
            if both:
                problems.append(f"expert tensor(s) stored both stacked and per expert: {both}")
            for stacked in sorted(per_expert - set(both)):
                if stacked in expected:
                    del expected[stacked]
                    expected.update(per_expert_shapes(cfg, stacked))
        missing = sorted(k for k in expected if k not in self.locations)
        if missing:
            problems.append(f"missing tensor(s): {missing}")
        allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        unexpected = sorted(k for k in self.locations if k not in expected and k not in allowed_extra)
        if unexpected:
            problems.append(f"unexpected tensor(s): {unexpected}")
        by_file: dict[Path, list[str]] = {}
        for k in expected:
            if k in self.locations:
                by_file.setdefault(self.locations[k][0], []).append(k)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for k in names:
                    got = tuple(f.get_slice(self.locations[k][1]).get_shape())
                    if got != tuple(expected[k]):
                        problems.append(f"tensor '{k}' has shape {list(got)}, expected {list(expected[k])}")
        if problems:
            raise CheckpointError(f"{self.path}: checkpoint does not match config.json: " + "; ".join(problems))

    def _assemble_stacked(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """Stack per-expert tensors into [E, 2I, H] (gate rows then up rows per expert) or [E, H, I]."""
        parts = [self.get(n, dtype) for n in per_expert_names(name, self.config.num_experts)]
        if name.endswith("gate_up_proj"):
            return torch.stack([torch.cat(parts[j:j + 2], dim=0) for j in range(0, len(parts), 2)])
        return torch.stack(parts)

    def _is_assembled(self, name: str) -> bool:
        return name not in self.locations and name.endswith(STACKED_EXPERT_SUFFIXES) and \
            name in self._per_expert_stacks()

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._is_assembled(name):
            return self._assemble_stacked(name, dtype)
        if name not in self.locations:
            raise CheckpointError(f"{self.path}: tensor '{name}' not in checkpoint")
        file, key = self.locations[name]
        with safe_open(file, framework="pt") as f:
            t = f.get_tensor(key)
        return t if dtype is None else t.to(dtype)

    def iter_tensors(self, names: list[str] | None = None, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, opening each file once."""
        names = sorted(self.names) if names is None else names
        assembled = [n for n in names if self._is_assembled(n)]
        for n in assembled:  # one stacked tensor alive at a time
            yield n, self._assemble_stacked(n, dtype)
        names = [n for n in names if n not in assembled]
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.locations:
                raise CheckpointError(f"{self.path}: tensor '{n}' not in checkpoint")
            by_file.setdefault(self.locations[n][0], []).append(n)
        for file, ns in by_file.items():
            with safe_open(file, framework="pt") as f:
                for n in ns:
                    t = f.get_tensor(self.locations[n][1])
                    yield n, (t if dtype is None else t.to(dtype))


_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def load_checkpoint(path: str | Path, *, require_mtp: bool = False) -> CheckpointReader:
    """Open and fully validate a checkpoint (headers only; no tensor data is read)."""
    reader = CheckpointReader.open(path)
    reader.validate(require_mtp=require_mtp)
    return reader
