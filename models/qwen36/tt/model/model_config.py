"""One place for the TT model's numeric and placement choices: dtypes per tensor group (precision presets),
per-device shapes at tensor-parallel width N, memory configs, program configs and compute kernel configs.

Modules ask ``args.dtype(TensorGroup.X)``; they never name a dtype themselves. Configs come from small
named functions whose docstrings say why the values are what they are.

    args = TTModelArgs.from_config(cfg, num_devices=2, precision=PrecisionSetting.performance())
    args.dtype(TensorGroup.MLP_GATE_UP, ttnn)      # -> ttnn.bfloat4_b
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from ...config import FULL, Qwen36Config
from ...errors import UserError


class TPSplitError(UserError, ValueError):
    """A config that cannot be split over the requested tensor-parallel width; the message names the field."""


class TensorGroup(str, enum.Enum):
    """Groups of tensors that share a precision choice."""

    EMBEDDING = "embedding"  # token embedding table (replicated, gathered by row)
    ATTN_QKV = "attn_qkv"  # fused q|gate|k|v projection (column-parallel)
    ATTN_O = "attn_o"  # o_proj (row-parallel)
    GDN_IN = "gdn_in"  # fused in_proj qkv|z|b|a (column-parallel)
    GDN_OUT = "gdn_out"  # out_proj (row-parallel)
    MLP_GATE_UP = "mlp_gate_up"  # fused gate|up (column-parallel)
    MLP_DOWN = "mlp_down"  # down_proj (row-parallel)
    LM_HEAD = "lm_head"  # vocab-parallel LM head
    NORM = "norm"  # RMSNorm weights, q/k norm, gated-norm weight, RoPE tables, conv taps, GDN decay vectors
    ACTIVATION = "activation"  # hidden states between ops
    GDN_ACTIVATION = "gdn_activation"  # GDN in-proj output, conv + its shift-register state, q/k/v, gated-norm out (ill-conditioned:
    #                                    the per-head norm of a small o amplifies input error; see docs/tt_precision.md)
    RESIDUAL = "residual"  # the residual stream between decoder layers
    GDN_STATE = "gdn_state"  # recurrent state [B, Hv, Dk, Dv] and the g / beta inputs of the recurrence
    GDN_PARTIAL = "gdn_partial"  # out_proj partial sums before the cross-device reduce
    KV_CACHE = "kv_cache"  # paged attention K/V
    LOGITS = "logits"  # LM-head output (argmax / sampling input)
    ROPE = "rope"  # cos/sin tables gathered by position (fp32: bf16 cos/sin at large positions costs ~1e-2)
    MOE_ROUTER = "moe_router"  # MoE router [H, E] and shared-expert gate [H, 1] (replicated; kept out of the
    #                            block-float matrix groups: a rounding that flips a top-k choice is not a small error)
    MOE_ROUTING = "moe_routing"  # router logits, softmax, top-k weights and their renormalisation


_MATRIX_GROUPS = {TensorGroup.ATTN_QKV, TensorGroup.ATTN_O, TensorGroup.GDN_IN, TensorGroup.GDN_OUT,
                  TensorGroup.MLP_GATE_UP, TensorGroup.MLP_DOWN, TensorGroup.LM_HEAD}
_FP32_ONLY = {TensorGroup.GDN_STATE}
_NO_BLOCK_FLOAT_LAYOUT = {TensorGroup.EMBEDDING, TensorGroup.ROPE}  # gathered by row from ROW_MAJOR tables  # bfp8 GDN state diverged within a dozen steps in public reports, so the state stays fp32
_BLOCK_FLOAT = {"bfloat8_b", "bfloat4_b"}
_BF4_ALLOWED = {TensorGroup.MLP_GATE_UP}  # bf4 only where the accuracy gates hold


@dataclass(frozen=True)
class PrecisionSetting:
    """dtype name (``bfloat16``, ``bfloat8_b``, ``bfloat4_b``, ``float32``) per :class:`TensorGroup`."""

    name: str
    dtypes: dict = field(default_factory=dict)
    # the preset the MTP draft head's own weights take (:data:`MTP_HEAD_GROUPS`: its fc and its decoder layer's
    # matrices), None: the same dtypes as the target. The LM head is one weight shared with the target and keeps
    # the target's dtype. Set through :meth:`with_mtp` or a name ``"<preset>+mtp=<preset>"`` (:meth:`named`).
    mtp: str | None = None

    def __post_init__(self) -> None:
        if self.mtp is not None and self.mtp not in PRESET_NAMES:
            raise ValueError(f"precision '{self.name}': MTP head preset {self.mtp!r} is not one of {list(PRESET_NAMES)}")
        missing = [g.value for g in TensorGroup if g not in self.dtypes]
        if missing:
            raise ValueError(f"precision '{self.name}': no dtype for group(s) {missing}")
        for g, d in self.dtypes.items():
            if d not in ("bfloat16", "bfloat8_b", "bfloat4_b", "float32"):
                raise ValueError(f"precision '{self.name}': group '{g.value}' has unknown dtype {d!r}")
            if g in _FP32_ONLY and d != "float32":
                raise ValueError(f"precision '{self.name}': group '{g.value}' must be float32 (got {d})")
            if d in _BLOCK_FLOAT and g not in _MATRIX_GROUPS | {TensorGroup.KV_CACHE}:
                raise ValueError(f"precision '{self.name}': block-float {d} is only for weight matrices/KV, not '{g.value}'")
            if d == "bfloat4_b" and g not in _BF4_ALLOWED:
                raise ValueError(f"precision '{self.name}': bfloat4_b is only allowed for {sorted(x.value for x in _BF4_ALLOWED)}")

    @classmethod
    def accuracy(cls) -> "PrecisionSetting":
        """bf16 weights everywhere (the >= 0.9999 PCC gates), fp32 GDN state/partials, fp32 logits."""
        d = {g: "bfloat16" for g in TensorGroup}
        d.update({TensorGroup.GDN_STATE: "float32", TensorGroup.GDN_PARTIAL: "float32", TensorGroup.LOGITS: "float32",
                  TensorGroup.ROPE: "float32", TensorGroup.MOE_ROUTING: "float32",
                  # bf16 here costs the GDN block PCC 0.99994 -> 0.99986 on the CI checkpoint (decode: a few KB)
                  TensorGroup.GDN_ACTIVATION: "float32"})
        return cls("accuracy", d)

    @classmethod
    def performance(cls, bf4_mlp: bool = False) -> "PrecisionSetting":
        """bf8 projections and LM head, bf16 norms/small vectors/KV, fp32 GDN state, GDN activations and out-proj
        partials (bf16 partials gave PCC ~0.69 in public reports). ``bf4_mlp`` puts MLP gate/up in bfloat4_b:
        allowed only where the accuracy gates hold, and it does not: MLP PCC 0.984 < 0.99 on the CI checkpoint
        (tests/tt/model/test_layers.py), 0.982 on weights with real checkpoints' statistics (tests/tt/model/test_bf4_gate.py),
        so the default preset keeps them in bf8. With ``bf4_mlp`` this is tt_transformers' performance-mode MLP
        (bf4 gate/up, bf8 down)."""
        d = dict(cls.accuracy().dtypes)
        for g in _MATRIX_GROUPS:
            d[g] = "bfloat8_b"
        if bf4_mlp:
            d[TensorGroup.MLP_GATE_UP] = "bfloat4_b"
        return cls("performance-bf4" if bf4_mlp else "performance", d)

    @classmethod
    def named(cls, name: str) -> "PrecisionSetting":
        """A preset, optionally followed by ``+`` modifiers applied left to right, the same names
        :meth:`with_group` and :meth:`with_mtp` give: ``+<group>=<dtype>`` sets one tensor group (target and MTP
        head alike, e.g. ``performance+lm_head=bfloat16``), ``+mtp=<preset>`` the MTP head's own weights
        (``performance+mtp=accuracy``: bf8 target, bf16 MTP layer). ``name(named(x)) == x``."""
        presets = {"accuracy": cls.accuracy, "performance": cls.performance,
                   "performance-bf4": lambda: cls.performance(bf4_mlp=True)}
        base, *mods = name.split("+")
        if base not in presets:
            raise ValueError(f"unknown precision preset {base!r}; choose from {sorted(presets)}")
        s = presets[base]()
        for m in mods:
            key, eq, val = m.partition("=")
            if not eq or not val:
                raise ValueError(f"precision {name!r}: modifier {m!r} is not KEY=VALUE (mtp=<preset> or <group>=<dtype>)")
            if key == "mtp":
                s = s.with_mtp(val)
                continue
            try:
                group = TensorGroup(key)
            except ValueError:
                raise ValueError(f"precision {name!r}: {key!r} is neither 'mtp' nor a tensor group "
                                 f"({', '.join(g.value for g in TensorGroup)})") from None
            s = s.with_group(group, val)
        return s

    def with_group(self, group: TensorGroup, dtype: str) -> "PrecisionSetting":
        d = dict(self.dtypes)
        d[group] = dtype
        return replace(self, name=f"{self.name}+{group.value}={dtype}", dtypes=d)

    def with_mtp(self, preset: str) -> "PrecisionSetting":
        """The MTP head's own weights (:data:`MTP_HEAD_GROUPS`) in ``preset``'s dtypes, the target unchanged."""
        return replace(self, name=f"{self.name}+mtp={preset}", mtp=preset)

    def for_mtp_head(self) -> "PrecisionSetting":
        """The dtypes the MTP head runs with: the target's, with :data:`MTP_HEAD_GROUPS` from the ``mtp`` preset.
        Everything the head shares with the target or hands to it (LM head, embedding, activations, residual rows,
        KV cache format) stays the target's."""
        if self.mtp is None:
            return self
        head = PrecisionSetting.named(self.mtp).dtypes
        d = dict(self.dtypes)
        d.update({g: head[g] for g in MTP_HEAD_GROUPS})
        return PrecisionSetting(f"{self.name}:mtp-head", d)


PRESET_NAMES = ("accuracy", "performance", "performance-bf4")
# The MTP head's own weight matrices: fc (ATTN_QKV's dtype, tt/model/weights.py load_mtp_weights) and its one full
# attention decoder layer (q|gate|k|v, o, MLP gate/up and down). Not the LM head: the head reads the target's.
MTP_HEAD_GROUPS = frozenset({TensorGroup.ATTN_QKV, TensorGroup.ATTN_O, TensorGroup.MLP_GATE_UP, TensorGroup.MLP_DOWN})


def mtp_head_args(args: "TTModelArgs") -> "TTModelArgs":
    """``args`` with the MTP head's precision (:meth:`PrecisionSetting.for_mtp_head`): what the head's weight
    loader and its layer use, so weights and compute configs agree."""
    if args.precision.mtp is None:
        return args
    return replace(args, precision=args.precision.for_mtp_head())


@dataclass(frozen=True)
class TTModelArgs:
    """Model shapes (from the HF config) plus the device/TP extras. Per-device counts end in ``_d``."""

    cfg: Qwen36Config
    num_devices: int
    precision: PrecisionSetting
    max_seq_len: int = 4096
    block_size: int = 64  # paged-KV page size in tokens (tiles of 32 rows; 64 = tt_transformers default)
    # prefill chunk length; a multiple of block_size (paged_fill_cache writes whole pages). Every chunk re-reads all
    # weights, so longer chunks amortise them: at 27B TP=2 the calibrated 4k TTFT is 1,868 / 1,067 / 991 ms at
    # 256 / 1,024 / 2,048 rows (prefill-cost --chunk; docs/cost_figures.md), where the matmuls turn compute-bound
    prefill_chunk: int = 2048
    batch: int = 1
    # decode matmul layout of the dense MLP and the LM head (tt/model/decode_matmuls.py): "mcast_1d" (DRAM-interleaved
    # weights, 1D multicast matmuls on an explicit small grid, as Tenstorrent's qwen36 decode runs them),
    # "dram_sharded" (weights width-sharded over the DRAM banks, activations width-sharded in L1) or "interleaved"
    # (DRAM-interleaved weights, ttnn's default program configs; A/B figures)
    decode_matmuls: str = "mcast_1d"
    # readers per DRAM bank asked of each DRAM-sharded decode matmul (num_workers_per_dram_bank, ttnn 0.81.1): a
    # matmul takes it where the device op's rule allows its weight's bank shards, else one (decode_readers_per_bank)
    dram_readers: int = 2

    @classmethod
    def from_config(cls, cfg: Qwen36Config, num_devices: int, precision: PrecisionSetting | None = None,
                    **kw) -> "TTModelArgs":
        args = cls(cfg=cfg, num_devices=num_devices, precision=precision or PrecisionSetting.performance(), **kw)
        args.check_split()
        return args

    # ---- TP split -----------------------------------------------------------------------------
    def check_split(self) -> None:
        """Assert every split divides; name the config field that does not."""
        n, c = self.num_devices, self.cfg
        if n < 1:
            raise TPSplitError(f"tensor-parallel width must be >= 1, got {n}")
        def need(value: int, fld: str, what: str) -> None:
            if value % n:
                raise TPSplitError(f"config field '{fld}' = {value} cannot be split over {n} devices ({what})")

        has_attn = FULL in c.layer_types or c.has_mtp
        if has_attn:
            need(c.num_key_value_heads, "num_key_value_heads", "each device owns whole KV heads")
            need(c.num_attention_heads, "num_attention_heads", "each device owns whole query heads")
        need(c.linear_num_key_heads, "linear_num_key_heads", "each device owns whole GDN key-head groups")
        if c.is_moe:
            # every expert (and the shared expert) is tensor-parallel over its intermediate dim (tt/model/moe.py says why)
            need(c.moe_intermediate_size, "moe_intermediate_size", "each expert's gate/up column-parallel, down row-parallel")
            need(c.shared_expert_intermediate_size, "shared_expert_intermediate_size",
                 "shared expert gate/up column-parallel, down row-parallel")
        else:
            need(c.intermediate_size, "intermediate_size", "column-parallel gate/up, row-parallel down")
        need(c.vocab_size, "vocab_size", "vocab-parallel LM head")
        if self.prefill_chunk % self.block_size:
            raise TPSplitError(f"prefill_chunk {self.prefill_chunk} must be a multiple of block_size {self.block_size}")
        if self.block_size % 32:
            raise TPSplitError(f"block_size {self.block_size} must be a multiple of the 32-row tile")
        if not 1 <= self.dram_readers <= 3:
            raise ValueError(f"dram_readers {self.dram_readers}: num_workers_per_dram_bank takes 1, 2 or 3")
        if self.decode_matmuls not in DECODE_MATMUL_LAYOUTS:
            raise ValueError(f"decode_matmuls {self.decode_matmuls!r}: choose from {list(DECODE_MATMUL_LAYOUTS)}")

    @property
    def hq_d(self) -> int:
        return self.cfg.num_attention_heads // self.num_devices

    @property
    def hkv_d(self) -> int:
        return self.cfg.num_key_value_heads // self.num_devices

    @property
    def gdn_hk_d(self) -> int:
        return self.cfg.linear_num_key_heads // self.num_devices

    @property
    def gdn_hv_d(self) -> int:
        return self.cfg.linear_num_value_heads // self.num_devices

    @property
    def gdn_key_dim_d(self) -> int:
        return self.gdn_hk_d * self.cfg.linear_key_head_dim

    @property
    def gdn_value_dim_d(self) -> int:
        return self.gdn_hv_d * self.cfg.linear_value_head_dim

    @property
    def gdn_conv_dim_d(self) -> int:
        return 2 * self.gdn_key_dim_d + self.gdn_value_dim_d

    @property
    def intermediate_d(self) -> int:
        return self.cfg.intermediate_size // self.num_devices

    @property
    def moe_intermediate_d(self) -> int:
        return self.cfg.moe_intermediate_size // self.num_devices

    @property
    def shared_intermediate_d(self) -> int:
        return self.cfg.shared_expert_intermediate_size // self.num_devices

    @property
    def vocab_d(self) -> int:
        return self.cfg.vocab_size // self.num_devices

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_seq * self.batch

    # ---- dtypes ---------------------------------------------------------------------------------
    def dtype(self, group: TensorGroup, ttnn):
        return getattr(ttnn, self.precision.dtypes[group])

    def dtype_name(self, group: TensorGroup) -> str:
        return self.precision.dtypes[group]

    def cache_key(self) -> str:
        """Part of weight-cache file names: changes whenever conversion output would."""
        return f"tp{self.num_devices}"


# ---- memory configs ---------------------------------------------------------------------------------
def weight_memory_config(ttnn):
    """DRAM interleaved: decode streams every weight once per token; 27B does not fit L1, and interleaving
    spreads the stream over all 8 GDDR6 channels. (The "dram_sharded" decode layout places the MLP and LM head
    otherwise: decode_matmuls.matrix_memory_config.)"""
    return ttnn.DRAM_MEMORY_CONFIG


# decode layouts of the dense MLP's and the LM head's matmuls (tt/model/decode_matmuls.py says what each is and why
# mcast_1d is the default)
DECODE_MATMUL_LAYOUTS = ("mcast_1d", "dram_sharded", "interleaved")
TILE = 32


def activation_memory_config(ttnn):
    """DRAM interleaved activations: correct on every op; L1 sharding is a card-side tuning left for a sweep."""
    return ttnn.DRAM_MEMORY_CONFIG


def state_memory_config(ttnn):
    """GDN/conv state and KV caches live in DRAM (the 27B GDN state alone is 48 layers x 1.5 MiB per device)."""
    return ttnn.DRAM_MEMORY_CONFIG


USER_CORES_PER_ROW = 8  # user cores per core-grid row: 32 users take 8 x 4 cores (the grid is 12+ wide, 10 tall)


def user_core_grid(users: int) -> tuple[int, int]:
    """(x, y) extent of the one-core-per-user grids below: one row up to 8 users (user b on core (b, row)), else
    rows of 8 (user b on core (b % 8, b // 8)); more than 8 users must fill whole rows."""
    if users <= USER_CORES_PER_ROW:
        return users, 1
    if users % USER_CORES_PER_ROW:
        raise ValueError(f"{users} decode rows: above {USER_CORES_PER_ROW} the per-user core grid needs a multiple of "
                         f"{USER_CORES_PER_ROW} (pad the batch to its bucket)")
    return USER_CORES_PER_ROW, users // USER_CORES_PER_ROW


def kv_update_input_memory_config(ttnn, batch: int, head_dim: int, core_row: int = 0):
    """L1 height-sharded, one [32, head_dim] shard (KV heads padded to a tile) per user core, cores
    (0..batch-1, core_row) (above 8 users, :func:`user_core_grid` rows starting at core row ``core_row`` x its height):
    the layout ``paged_update_cache`` requires for its decode input ("input_tensor is height sharded on B cores").
    ``paged_fused_update_cache`` needs K and V on disjoint cores: V uses ``core_row=1``."""
    w, h = user_core_grid(batch)
    first = core_row * h
    cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, first), ttnn.CoreCoord(w - 1, first + h - 1))})
    return ttnn.create_sharded_memory_config(
        shape=(32, head_dim), core_grid=cores, strategy=ttnn.ShardStrategy.HEIGHT,
        orientation=ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True)


def rope_decode_memory_config(ttnn, rows: int, heads: int, head_dim: int):
    """L1 height-sharded, one [heads padded to 32, head_dim] shard per row core: ``rotary_embedding_hf`` in decode
    mode requires a height-sharded input (its device validation); for the K heads (<= 32) this is exactly
    :func:`kv_update_input_memory_config`, so the rotated K goes into ``paged_update_cache`` without a reshard."""
    grid_x, grid_y = user_core_grid(rows)
    return ttnn.create_sharded_memory_config(
        shape=(-(-heads // 32) * 32, head_dim), core_grid=ttnn.CoreGrid(y=grid_y, x=grid_x),
        strategy=ttnn.ShardStrategy.HEIGHT, orientation=ttnn.ShardOrientation.ROW_MAJOR,
        use_height_and_width_as_shard_shape=True)


# ---- program configs ----------------------------------------------------------------------------------
def matmul_program_config(ttnn, rows: int, k: int, n: int):
    """``None``: let ttnn pick its default multicast matmul for [rows, k] x [k, n] (prefill, and decode matmuls of
    the groups outside DRAM_SHARDED_GROUPS; those use :func:`decode_matmul_plan`). No card sweep exists yet."""
    return None


# q / k chunk sizes the chunked prefill SDPA may take, largest first. The op requires the chunk's start to be a
# multiple of both (its docstring: q_chunk_size, and k_chunk_size as a workaround for tt-metal issue 35225); a prefill
# starts on a KV page (block_size, >= 32 rows), a prefix-cache resume too, so 32 always divides it.
SDPA_PREFILL_CHUNKS = (256, 128, 64, 32)


def sdpa_prefill_chunk_size(chunk_start: int, rows: int) -> int:
    """The q and k chunk size of a prefill chunk of ``rows`` rows at ``chunk_start``: the largest of
    :data:`SDPA_PREFILL_CHUNKS` that divides the start (any size divides 0) and is at most the rows rounded up to a
    tile. One size for q and k keeps the rule simple: both must divide the start."""
    rows_pad = -(-rows // TILE) * TILE
    for c in SDPA_PREFILL_CHUNKS:
        if chunk_start % c == 0 and c <= rows_pad:
            return c
    raise ValueError(f"prefill chunk start {chunk_start} is not a multiple of {SDPA_PREFILL_CHUNKS[-1]} (a KV page "
                     "starts every block_size rows, itself a multiple of the 32-row tile)")


def sdpa_prefill_program_config(ttnn, mesh, chunk_start: int, rows: int):
    """Program config of the chunked prefill SDPA (``transformer.chunked_scaled_dot_product_attention``) for a chunk
    of ``rows`` rows at ``chunk_start``: the device's compute grid and :func:`sdpa_prefill_chunk_size` for q and k,
    exact exponentials. The op's default (no config) leaves the chunk sizes to the device op; naming them makes the
    start rule checkable and holds at any position up to the model's 262,144. Sizes are to tune on cards."""
    size = sdpa_prefill_chunk_size(chunk_start, rows)
    return ttnn.SDPAProgramConfig(compute_with_storage_grid_size=mesh.compute_with_storage_grid_size(),
                                  q_chunk_size=size, k_chunk_size=size, exp_approx_mode=False)


def sdpa_decode_program_config(ttnn):
    """``None``: paged decode SDPA defaults (k_chunk_size 32 when paged). Tune on cards."""
    return None


# ---- compute kernel configs ---------------------------------------------------------------------------
def compute_config_fp32_state(ttnn):
    """HiFi4 + fp32 dest accumulation: the GDN recurrence, its norms and the fp32 out-proj partials (the state
    lives in fp32; lower fidelity or bf16 dest accumulation compounds over every decoded token)."""
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=True)


def compute_config_matmul(ttnn, weight_dtype_name: str):
    """Fidelity by weight format (tt_transformers convention): bf16 -> HiFi4, bfloat8_b -> HiFi2, bfloat4_b -> LoFi.
    fp32 dest accumulation on: K is up to 17408 at 27B. (The emulator models both: docs/emulator_ops.md N1-N3.)"""
    fid = {"bfloat16": ttnn.MathFidelity.HiFi4, "float32": ttnn.MathFidelity.HiFi4,
           "bfloat8_b": ttnn.MathFidelity.HiFi2, "bfloat4_b": ttnn.MathFidelity.LoFi}[weight_dtype_name]
    return ttnn.WormholeComputeKernelConfig(math_fidelity=fid, math_approx_mode=False, fp32_dest_acc_en=True,
                                            packer_l1_acc=True)


def compute_config_norm(ttnn):
    """RMSNorm / softmax-like reductions: HiFi4 with fp32 accumulation (cheap: small tensors)."""
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=False)


def compute_config_exact_select(ttnn):
    """0/+-1 matmuls that only move values (selection or sign-permutation matrices): HiFi4, because LoFi/HiFi2
    feed only 1+6 mantissa bits of in0 to the multiplier and would drop the last bit of every bf16 value moved (SrcA/SrcB fidelity
    phases, docs/emulator_ops.md rule N2); fp32 dest so nothing is rounded before the output dtype."""
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=False)


def compute_config_exact_count(ttnn):
    """Acceptance and sampling reductions (tt/speculative/accept.py, tt/runtime/sampler.py): sums of 0/1 masks that become token ids
    and accepted counts, and of probabilities. HiFi4 with fp32 dest accumulation keeps integer sums exact below
    2**24 (a bf16 dest would round ids above 256); no L1 packer accumulation, these are single-tile reductions."""
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=True, packer_l1_acc=False)
