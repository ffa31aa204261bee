"""The reference lane on a CUDA device (the project's GPU box has torch but no ttnn). Skipped, with a reason, on
machines without CUDA (CI); run on the device tool's H200 to exercise it."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.batch import generate
from qwen36.reference.model import Qwen36Model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")


@needs_cuda
@torch.no_grad()
def test_greedy_generate_on_cuda_matches_cpu(ci_ckpt):
    """Regression: greedy_generate built each decode input on the CPU, so `--device reference-cuda` crashed
    with a device mismatch after the prefill."""
    prompt = torch.tensor([5, 17, 300, 42, 7])
    cpu = generate(Qwen36Model.from_checkpoint(ci_ckpt), [prompt], 16)[0].tokens
    gpu = generate(Qwen36Model.from_checkpoint(ci_ckpt, device="cuda"), [prompt.cuda()], 16)[0].tokens
    assert gpu == cpu


@needs_cuda
@torch.no_grad()
def test_sampling_parameters_on_cuda(ci_ckpt):
    """Plain decoding with penalties and logprobs on CUDA == on CPU (greedy), seeded CUDA sampling reproduces, and
    CUDA speculative greedy with penalties == CUDA plain greedy with penalties (token counts on the GPU)."""
    from qwen36.speculative.engine import speculative_generate
    from qwen36.reference.batch import generate
    from qwen36.speculative.reference_backend import ReferenceBackend
    from qwen36.generation.sampling import SamplingParams

    prompt = [5, 17, 300, 42, 7]
    pen = dict(repetition_penalty=1.3, presence_penalty=-1.5, frequency_penalty=0.7)
    cpu_model = Qwen36Model.from_checkpoint(ci_ckpt)
    gpu_model = Qwen36Model.from_checkpoint(ci_ckpt, device="cuda", require_mtp=True)
    greedy = SamplingParams(logprobs=2, **pen)
    cpu = generate(cpu_model, [prompt], 16, greedy)[0]
    gpu = generate(gpu_model, [prompt], 16, greedy)[0]
    assert gpu.tokens == cpu.tokens
    assert max(abs(a.logprob - b.logprob) for a, b in zip(gpu.logprobs, cpu.logprobs)) < 1e-3
    spec = speculative_generate(ReferenceBackend(gpu_model, "shadow_commit", 64), [prompt], 16, [3], [greedy])[0]
    assert spec.tokens == gpu.tokens
    sampled = SamplingParams(temperature=0.9, top_k=30, min_p=0.02, seed=3, **pen)
    assert generate(gpu_model, [prompt], 12, sampled)[0].tokens == generate(gpu_model, [prompt], 12, sampled)[0].tokens
    a = speculative_generate(ReferenceBackend(gpu_model, "snapshot", 64), [prompt], 12, [2], [sampled])[0].tokens
    assert a == speculative_generate(ReferenceBackend(gpu_model, "snapshot", 64), [prompt], 12, [2], [sampled])[0].tokens
