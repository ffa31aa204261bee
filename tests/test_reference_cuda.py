"""The reference lane on a CUDA device (the project's GPU box has torch but no ttnn). Skipped, with a reason, on
machines without CUDA (CI); run on the device tool's H200 to exercise it."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.model import Qwen36Model, greedy_generate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")


@needs_cuda
@torch.no_grad()
def test_greedy_generate_on_cuda_matches_cpu(ci_ckpt):
    """Regression: greedy_generate built each decode input on the CPU, so `--device reference-cuda` crashed
    with a device mismatch after the prefill."""
    prompt = torch.tensor([5, 17, 300, 42, 7])
    cpu = greedy_generate(Qwen36Model.from_checkpoint(ci_ckpt), prompt, 16)
    gpu = greedy_generate(Qwen36Model.from_checkpoint(ci_ckpt, device="cuda"), prompt.cuda(), 16)
    assert gpu == cpu
