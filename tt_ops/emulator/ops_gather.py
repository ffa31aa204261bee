"""``ttnn.embedding``: the golden gather, accepting the weight shapes ttnn accepts.

ttnn's embedding reads the hidden size from the weight's last dimension and the vocabulary from its
second-to-last, so a ``[1, 1, V, D]`` weight (the tile-friendly 4-D form tt_transformers uses) works like a
``[V, D]`` one; the golden (``torch.nn.functional.embedding``) needs a 2-D weight, so the emulator hands it
a ``[V, D]`` view of the same values. Everything else (output dtype/layout, accounting) is the generic
golden path's.
"""

from __future__ import annotations

from .errors import EmulatorError
from .goldens import golden_impl
from .registry import device_op
from .tensor import EmuTensor
from .ttnn_import import ttnn


@device_op("ttnn.embedding")
def embedding(input_tensor, weight, **kwargs):
    shape = weight.logical_shape_list
    if len(shape) != 2:
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 1:
            raise EmulatorError(f"ttnn.embedding: weight must be [V, D] or [1, 1, V, D], got {shape}")
        weight = EmuTensor([s.reshape(shape[2], shape[3]) for s in weight.shards], weight.dtype, weight.layout,
                           mesh=weight.mesh, on_device=weight.on_device, memory_config=weight.memory_config())
    return golden_impl("ttnn.embedding", ttnn.embedding)(input_tensor, weight, **kwargs)
