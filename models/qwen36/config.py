"""Qwen3.6 model configuration: parse an HF ``config.json`` and validate it.

Qwen3.6 checkpoints declare ``model_type: qwen3_5`` (multimodal wrapper with a nested ``text_config``)
or ``qwen3_5_text`` (flat). The mixture-of-experts sibling (Qwen3.6-35B-A3B) declares ``qwen3_5_moe`` /
``qwen3_5_moe_text``: the same hybrid GDN/attention stack whose every MLP is a routed-expert block (softmax
router, top-k, renormalised weights) plus one shared expert behind a sigmoid gate. All land in one typed
:class:`Qwen36Config` (``num_experts > 0`` marks MoE). Every inconsistency raises :class:`ConfigError` naming
the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import UserError

LINEAR = "linear_attention"  # Gated DeltaNet layer
FULL = "full_attention"  # gated softmax attention layer
DENSE_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # nested text_config
# MoE fields of transformers' Qwen3_5MoeTextConfig; a dense config.json carries none of them
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "router_aux_loss_coef")


class ConfigError(UserError, ValueError):
    """A config.json that cannot describe a Qwen3.6 model; the message names the field."""


@dataclass(frozen=True)
class Qwen36Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # misc
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    hidden_act: str = "silu"
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # mixture of experts (0 experts = dense SwiGLU MLPs, intermediate_size used)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001  # training-only load-balancing loss weight; inference ignores it
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv: concatenated [q | k | v]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    # ---- construction ---------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field '{fld}': {msg}")

        if self.is_moe:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size"):
                v = getattr(self, name)
                need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                     f"must be a positive integer, got {v!r}")
            need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
            need(isinstance(self.intermediate_size, int) and self.intermediate_size >= 0, "intermediate_size",
                 f"must be a non-negative integer (unused by a MoE model), got {self.intermediate_size!r}")
        else:
            need(isinstance(self.num_experts, int) and self.num_experts == 0, "num_experts",
                 f"must be a non-negative integer, got {self.num_experts!r}")
            need(isinstance(self.intermediate_size, int) and not isinstance(self.intermediate_size, bool)
                 and self.intermediate_size > 0, "intermediate_size",
                 f"must be a positive integer, got {self.intermediate_size!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive integer, got {v!r}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        need(not bad, "layer_types", f"unknown layer type(s) {bad}; expected '{LINEAR}' or '{FULL}'")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"{self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
             f"{self.linear_num_value_heads} is not a multiple of linear_num_key_heads={self.linear_num_key_heads}")
        need(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor",
             f"must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "partial_rotary_factor",
             f"head_dim * partial_rotary_factor = {self.head_dim * self.partial_rotary_factor} must be a positive even integer")
        need(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        need(not self.attention_bias, "attention_bias", "attention biases are not supported (Qwen3.6 has none)")
        need(self.mtp_num_hidden_layers in (0, 1), "mtp_num_hidden_layers",
             f"only 0 or 1 MTP layers are supported, got {self.mtp_num_hidden_layers}")
        for e in self.eos_token_id:
            need(0 <= e < self.vocab_size, "eos_token_id", f"{e} is outside the vocabulary (size {self.vocab_size})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen36Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config field 'model_type': {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        text = raw
        moe = model_type in MOE_MODEL_TYPES
        if model_type in WRAPPER_MODEL_TYPES:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config field 'text_config': model_type {model_type!r} needs a nested text_config object")
            text = dict(text)
            # tie_word_embeddings / eos may live on the outer config
            for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
                if k not in text and k in raw:
                    text[k] = raw[k]

        def get(name: str, default: Any = ...) -> Any:
            if name in text:
                return text[name]
            if default is ...:
                raise ConfigError(f"config field '{name}': missing")
            return default

        if not moe:
            stray = [k for k in MOE_FIELDS[:4] if k in text]
            if stray:
                raise ConfigError(f"config field '{stray[0]}': a dense {model_type!r} config has no experts; "
                                  "a mixture-of-experts checkpoint declares model_type 'qwen3_5_moe' or 'qwen3_5_moe_text'")
        else:
            # transformers' Qwen3_5Moe modeling always renormalises the top-k weights and makes every layer
            # sparse; a config asking otherwise describes a different model, so it is refused, not ignored
            if text.get("norm_topk_prob", True) is not True:
                raise ConfigError("config field 'norm_topk_prob': Qwen3.6 MoE always renormalises the top-k router "
                                  f"weights; got {text['norm_topk_prob']!r}")
            if text.get("mlp_only_layers"):
                raise ConfigError("config field 'mlp_only_layers': every Qwen3.6 MoE layer is sparse; dense-MLP "
                                  f"layers {text['mlp_only_layers']!r} are not supported")
            if text.get("decoder_sparse_step", 1) != 1:
                raise ConfigError("config field 'decoder_sparse_step': every Qwen3.6 MoE layer is sparse; "
                                  f"got {text['decoder_sparse_step']!r}")

        n_layers = get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"config field 'full_attention_interval': must be a positive integer, got {interval!r}")
            if not isinstance(n_layers, int):
                raise ConfigError(f"config field 'num_hidden_layers': must be an integer, got {n_layers!r}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"config field 'layer_types': must be a list, got {type(layer_types).__name__}")

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field 'rope_parameters': must be an object, got {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type': {rope_type!r} is not supported (only 'default')")
        if rope.get("mrope_section") is not None and not rope.get("mrope_interleaved", True):
            raise ConfigError("config field 'rope_parameters.mrope_interleaved': only interleaved mRoPE is supported")
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

        eos = get("eos_token_id", None)
        eos_t: tuple[int, ...] = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        head_dim = text.get("head_dim") or (get("hidden_size") // get("num_attention_heads"))
        known = {f.name for f in fields(cls)} | {"layer_types", "rope_parameters", "rope_scaling", "model_type",
                                                 "full_attention_interval", "text_config"}
        moe_kw = {}
        if moe:
            moe_kw = dict(num_experts=get("num_experts", 256), num_experts_per_tok=get("num_experts_per_tok", 8),
                          moe_intermediate_size=get("moe_intermediate_size", 512),
                          shared_expert_intermediate_size=get("shared_expert_intermediate_size", 512),
                          router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)))
        try:
            return cls(
                vocab_size=get("vocab_size"),
                hidden_size=get("hidden_size"),
                intermediate_size=get("intermediate_size", 0) if moe else get("intermediate_size"),
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=get("num_attention_heads"),
                num_key_value_heads=get("num_key_value_heads"),
                head_dim=head_dim,
                partial_rotary_factor=float(prf),
                rope_theta=float(rope_theta),
                linear_num_key_heads=get("linear_num_key_heads", 16),
                linear_num_value_heads=get("linear_num_value_heads", 32),
                linear_key_head_dim=get("linear_key_head_dim", 128),
                linear_value_head_dim=get("linear_value_head_dim", 128),
                linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                max_position_embeddings=get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                mtp_num_hidden_layers=get("mtp_num_hidden_layers", 0),
                hidden_act=get("hidden_act", "silu"),
                attention_bias=bool(get("attention_bias", False)),
                eos_token_id=eos_t,
                bos_token_id=get("bos_token_id", None),
                pad_token_id=get("pad_token_id", None),
                extra={k: v for k, v in text.items() if k not in known},
                **moe_kw,
            )
        except TypeError as e:  # e.g. a string where a number belongs
            raise ConfigError(f"config has a field of the wrong type: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen36Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: config.json not found")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A flat ``qwen3_5_text`` (``qwen3_5_moe_text`` for MoE) config.json that transformers' Qwen3_5TextConfig
        (Qwen3_5MoeTextConfig) also accepts."""
        drop = {"extra", "partial_rotary_factor", "rope_theta"}
        drop |= {"intermediate_size"} if self.is_moe else set(MOE_FIELDS)
        d = {k: v for k, v in asdict(self).items() if k not in drop}
        d["layer_types"] = list(self.layer_types)
        eos = list(self.eos_token_id)
        d["eos_token_id"] = None if not eos else (eos[0] if len(eos) == 1 else eos)
        d["model_type"] = "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text"
        d["architectures"] = ["Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"]
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        }
        d["torch_dtype"] = "bfloat16"
        return d
