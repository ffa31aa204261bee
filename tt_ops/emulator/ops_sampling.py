"""Random-number ops on the emulated mesh (used by on-device stochastic acceptance, models/qwen36/tt/speculative/accept.py).

``ttnn.uniform(input, from=0, to=1, seed=0, *, memory_config, compute_kernel_config)`` (ttnn 0.81.1):
the op docstring says it *updates the input tensor in place* with values drawn from U[from, to) and
returns it (BFLOAT16/FLOAT32, TILE). Its golden instead returns a *new* tensor from torch's global RNG and
ignores ``seed``, which is unusable for a deterministic, replicated acceptance step. Emulation here:

* in place: the input buffer is overwritten (through ``write_inplace``, so a trace capture's dry
  evaluation does not change device state) and returned, like the card op; no allocation;
* seeded and deterministic: ``seed != 0`` -> ``torch.Generator().manual_seed(seed)``, values drawn in
  fp32 then rounded to the tensor's dtype; ``seed == 0`` draws from a process-wide generator
  (non-reproducible, like an unseeded card call);
* replicated: every device of the mesh gets the *same* values (each card runs the same program with the
  same seed). Callers that need identical randomness on all devices (replicated acceptance) rely on this.

Not bit-equal to the card RNG (the SFPU PRNG); tests of code that uses it check distributions, never bits.
A uniform recorded inside a trace replays with the seed fixed at capture (same values every replay), which
is also what a card trace does with its captured runtime arguments: draw outside the trace (see accept.py).
"""

from __future__ import annotations

import torch

from .errors import EmulatorError
from .registry import device_op
from .tensor import dtype_name, quantize_via_ttnn, write_inplace

_UNSEEDED = torch.Generator().manual_seed(torch.initial_seed() & 0x7FFFFFFF)


@device_op("ttnn.uniform")
def uniform(input, *args, memory_config=None, compute_kernel_config=None, **kwargs):
    # 'from' is a Python keyword: the real op takes (input, from, to, seed) positionally or via a dict
    low = kwargs.pop("from", args[0] if len(args) > 0 else 0.0)
    high = kwargs.pop("to", args[1] if len(args) > 1 else 1.0)
    seed = kwargs.pop("seed", args[2] if len(args) > 2 else 0)
    if kwargs:
        raise EmulatorError(f"ttnn.uniform: unexpected arguments {sorted(kwargs)}")
    if not float(low) < float(high):
        raise EmulatorError(f"ttnn.uniform: 'from' ({low}) must be less than 'to' ({high})")
    if dtype_name(input.dtype) not in ("FLOAT32", "BFLOAT16"):
        raise EmulatorError(f"ttnn.uniform: input must be FLOAT32 or BFLOAT16, got {dtype_name(input.dtype)}")
    gen = torch.Generator().manual_seed(int(seed)) if int(seed) != 0 else _UNSEEDED
    shape = input.shards[0].shape
    vals = torch.rand(shape, generator=gen, dtype=torch.float32).mul_(float(high) - float(low)).add_(float(low))
    vals = quantize_via_ttnn(vals, input.dtype)
    write_inplace(input, [vals.clone() for _ in range(input.num_shards)])
    return input
