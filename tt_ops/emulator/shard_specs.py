"""How an op output gets its shard spec when the caller's sharded ``memory_config`` carries none
(``ttnn.MemoryConfig(ttnn.TensorMemoryLayout.HEIGHT_SHARDED, ttnn.BufferType.L1)``, as many of Tenstorrent's op tests
pass it).

Two levels decide it on cards (tenstorrent/tt-metal, read for facts; the strings are in the installed ttnn 0.81.1):

* **The tensor layer refuses it.** A device buffer cannot be laid out without a shard spec:
  ``TensorLayout::compute_buffer_sharding_args`` (``ttnn/core/tensor/layout/tensor_layout.cpp``) raises "MemoryConfig
  must have Shard Spec specified for sharded memory layout" (in 0.81.1's ``libtt_metal.so``). So an op whose
  ``compute_output_specs`` builds the output's ``TensorSpec`` from the caller's config as it is fails when it creates
  the output: :data:`HANDED_THROUGH` (``rotary_embedding_llama_device_operation.cpp``). The emulator applies that rule
  to every new device tensor (:func:`require_shard_spec`, called by the mesh when it allocates; host-to-device
  transfers included).
* **Some device ops derive a spec first**, each its own way (:class:`SpeclessShard` instances, one per rule):

  - ``experimental.rotary_embedding_hf`` (``rotary_embedding_hf_device_operation.cpp`` ``compute_output_specs``, the
    same in every version read): the input's shard spec when the input is sharded; otherwise the input's tile rows
    split evenly over the largest number of cores of the compute grid that divides them, row-major from core (0, 0),
    ROW_MAJOR orientation (:data:`ROTARY_HF`). Emulated.
  - ``experimental.nlp_create_qkv_heads_decode``: its host wrapper builds the outputs' config itself over the whole
    compute grid (emulated in ``ops_attention``, where the rule is stated).
  - reductions (``reduce_op_device_operation.cpp``): grid and orientation from the input's shard spec, shard shape
    from the output's shape; ``matmul``/``linear``/``sparse_matmul``: from the program config; unary, binary_ng,
    ternary, transpose, repeat, fold, indexed_fill: synthesised over the compute grid (0.81.1 ships
    ``data_movement/common/synthesize_output_shard_spec.cpp``; tt-metal PRs 53900/55243); ``reshape``: from the input's
    shard spec (tt-metal PR 45215). Not emulated: :class:`DerivationNotEmulated` refuses by name.
  - ``clone`` refuses ("Clone: output memory config must have shard spec when sharded"), ``embedding`` too ("Sharded
    memory config must have a shard spec"): :class:`DeviceOpRefuses`, with the device op's message.

An op the emulator has not checked refuses by name too (:data:`UNCHECKED`): a wrong guess would size L1 wrongly and
hide a refusal a card would give. docs/emulator.md "Sharded outputs without a shard spec" has the table.
"""

from __future__ import annotations

import dataclasses

from .errors import EmulatorError, NotEmulatedError
from .tensor import TILE, padded_shape_of
from .ttnn_import import ttnn

TENSOR_LAYER_MESSAGE = "MemoryConfig must have Shard Spec specified for sharded memory layout"


def is_specless_sharded(mc) -> bool:
    return (mc is not None and bool(mc.is_sharded()) and mc.shard_spec is None
            and getattr(mc, "nd_shard_spec", None) is None)


def require_shard_spec(t) -> None:
    """The tensor layer's rule (module doc): a sharded device buffer needs a shard spec."""
    mc = t.memory_config()
    if is_specless_sharded(mc):
        raise EmulatorError(
            f"{TENSOR_LAYER_MESSAGE} (tt-metal TensorLayout::compute_buffer_sharding_args): tensor "
            f"{list(t.logical_shape_list)} {t.dtype.name} {mc.memory_layout.name} in {mc.buffer_type.name} has no "
            "shard_spec; pass one (docs/emulator.md: which ops derive it themselves)")


class SpeclessShard:
    """One device op family's rule for a sharded output ``memory_config`` without a shard spec."""

    def resolve(self, op: str, mc, input_tensor):
        """The memory config the output gets (``mc`` carries no shard spec)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class HandedThrough(SpeclessShard):
    """The device op builds its output from the caller's config as it is: the tensor layer refuses it when the output
    is created (:func:`require_shard_spec`)."""

    def resolve(self, op, mc, input_tensor):
        return mc


@dataclasses.dataclass(frozen=True)
class InputSpecOrEvenRows(SpeclessShard):
    """``rotary_embedding_hf``'s ``compute_output_specs``: the input's shard spec, else the input's tile rows over the
    largest core count of the compute grid that divides them (``num_cores_to_corerangeset(n, grid, row_wise=True)``),
    shard ``[ceil(rows / n) * 32, padded width]``, ROW_MAJOR."""

    def resolve(self, op, mc, input_tensor):
        spec = input_tensor.memory_config().shard_spec if input_tensor.memory_config().is_sharded() else None
        if spec is None:
            padded = padded_shape_of(input_tensor.logical_shape_list, input_tensor.layout)
            width = padded[-1]
            blocks = _volume(padded) // width // TILE
            grid = input_tensor.mesh.compute_with_storage_grid_size()
            cores = next(i for i in range(grid.x * grid.y, 0, -1) if blocks % i == 0)
            spec = ttnn.ShardSpec(ttnn.num_cores_to_corerangeset(cores, grid, True),
                                  [-(-blocks // cores) * TILE, width], ttnn.ShardOrientation.ROW_MAJOR)
        return ttnn.MemoryConfig(mc.memory_layout, mc.buffer_type, spec)


@dataclasses.dataclass(frozen=True)
class DeviceOpRefuses(SpeclessShard):
    """The device op's validation refuses a sharded output config without a spec, with this message."""

    message: str

    def resolve(self, op, mc, input_tensor):
        raise EmulatorError(f"{op}: {self.message} (the device op's validation)")


@dataclasses.dataclass(frozen=True)
class DerivationNotEmulated(SpeclessShard):
    """The device op derives the output's shard spec (``derivation``); the emulator does not model that derivation."""

    derivation: str

    def resolve(self, op, mc, input_tensor):
        raise NotEmulatedError(
            f"{op}: a sharded memory_config without a shard_spec: on cards the device op derives the output's shard "
            f"spec ({self.derivation}); the emulator does not model that derivation: pass a memory_config with a "
            "shard_spec")


HANDED_THROUGH = HandedThrough()
ROTARY_HF = InputSpecOrEvenRows()
UNCHECKED = DerivationNotEmulated("how was not checked for this op: 0.81.1's eltwise and data-movement ops synthesise "
                                  "one over the compute grid, others hand the config to the tensor layer, which "
                                  "refuses it")
_PROGRAM_CONFIG = DerivationNotEmulated("from the program config, or the one the op picks")

RULES: dict[str, SpeclessShard] = {
    "ttnn.experimental.rotary_embedding_hf": ROTARY_HF,
    "ttnn.experimental.rotary_embedding_llama": HANDED_THROUGH,
    "ttnn.matmul": _PROGRAM_CONFIG,
    "ttnn.linear": _PROGRAM_CONFIG,
    "ttnn.sparse_matmul": _PROGRAM_CONFIG,
    "ttnn.sum": DerivationNotEmulated("grid and orientation from the input's shard spec, shard shape from the output"),
    "ttnn.mean": DerivationNotEmulated("grid and orientation from the input's shard spec, shard shape from the output"),
    "ttnn.typecast": DerivationNotEmulated("synthesised over the compute grid, as for every unary op"),
    "ttnn.reshape": DerivationNotEmulated("from the input's shard spec"),
    "ttnn.clone": DeviceOpRefuses("Clone: output memory config must have shard spec when sharded"),
    "ttnn.embedding": DeviceOpRefuses("Sharded memory config must have a shard spec"),
}


def output_memory_config(op: str, mc, input_tensor):
    """The memory config an output of ``op`` gets from the caller's ``mc`` (``None``: the op's default, unchanged);
    every emulated op and the golden path call it before creating an output from a caller's config."""
    if not is_specless_sharded(mc):
        return mc
    return RULES.get(op, UNCHECKED).resolve(op, mc, input_tensor)


def _volume(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
