"""Pick the backend a command runs on, explicitly. ``reference`` is the pure-torch model (CPU, or CUDA when
``--device reference-cuda``); ``emulated-p150*`` / ``p150*`` run the TTNN model through tt_ops.device.
There is no fallback between them: an unavailable backend is an error."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import REFERENCE_DEVICES, TT_DEVICES, check_device  # noqa: F401  (re-exported for the commands)
from ..errors import UserError


def reference_label(device: str) -> str:
    if device == "reference-cuda":
        return f"reference (torch CUDA: {torch.cuda.get_device_name()})"
    return "reference (torch CPU)"


@dataclass
class ReferenceTarget:
    model: "object"
    label: str

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def teacher_forced_logits(self, ids: torch.Tensor) -> torch.Tensor:
        dev = self.model.embed_tokens.weight.device
        state = self.model.new_state(1, ids.numel() + 1)
        return self.model(ids.view(1, -1).to(dev), state).logits[0].cpu()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens, params=None, eos_ids: tuple[int, ...] = (), *,
                 thinking=None, keep_logits: bool = False, prefix_cache=None):
        """Plain decoding of ``prompts`` (one slot each; ``reference.batch.generate``) -> one PlainResult per user,
        the same contract as ``TTGenerator.generate``."""
        from ..reference.batch import generate

        return generate(self.model, prompts, max_new_tokens, params, eos_ids, thinking=thinking,
                        keep_logits=keep_logits, prefix_cache=prefix_cache)


def load_target(ckpt: Path, device: str, dtype: torch.dtype, *, require_mtp: bool = False,
                precision: str | None = None):
    """The target model on the requested backend; ``precision``: the TT precision preset (None: the TT loader's
    default; not used by the reference)."""
    check_device(device)
    if device in REFERENCE_DEVICES:
        from ..reference.model import Qwen36Model

        if device == "reference-cuda" and not torch.cuda.is_available():
            raise UserError("--device reference-cuda but torch sees no CUDA device; use --device reference")
        dev = "cuda" if device == "reference-cuda" else "cpu"
        model = Qwen36Model.from_checkpoint(ckpt, dtype=dtype, device=dev, require_mtp=require_mtp)
        return ReferenceTarget(model, reference_label(device))
    from ..tt.runtime.generator import build_generator  # TT model (emulated mesh or cards)

    kw = {} if precision is None else {"precision": precision}
    return build_generator(ckpt, device, dtype=dtype, require_mtp=require_mtp, **kw)
