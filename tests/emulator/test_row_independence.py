"""A row's matmul result must not depend on how many rows share the call.

On a card every row of a 32-row tile goes through the same FPU sequence, so a 1-row decode and a (K+1)-row verify
give a shared row the same bits. torch's CPU fp32 matmul does not: below ``numerics.MIN_ROWS`` rows it takes
another kernel that rounds differently. Before the emulator padded small row counts, a speculative run on the
emulated mesh (K+1-row verify) and plain greedy (1-row decode) could pick different tokens at near ties."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.tt_ops.device import open_mesh  # noqa: E402
from qwen36.tt_ops.emulator import numerics  # noqa: E402

ROWS = [1, 2, 3, 4, 5, 7, 31, 32, 33, 100]


@pytest.mark.parametrize("k", [32, 256, 1024])
def test_matmul_rows_row_invariant(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(max(ROWS), k, generator=g)
    w = torch.randn(k, 96, generator=g)
    first = {m: numerics.matmul_rows(x[:m], w)[0] for m in ROWS}
    for m in ROWS:
        assert torch.equal(first[m], first[1]), f"row 0 differs between 1 and {m} rows at K={k}"
    wb = torch.randn(3, k, 40, generator=g)  # batched weights (attention scores / probabilities @ V)
    xb = torch.randn(3, max(ROWS), k, generator=g)
    firstb = {m: numerics.matmul_rows(xb[:, :m], wb)[:, 0] for m in ROWS}
    for m in ROWS:
        assert torch.equal(firstb[m], firstb[1]), f"batched row 0 differs between 1 and {m} rows at K={k}"
    # the padding changes nothing but the kernel: values are the fp64 product (rule N8) to fp64 rounding
    torch.testing.assert_close(numerics.matmul_rows(x[:2], w), x[:2].double() @ w.double(), rtol=1e-12, atol=1e-12)


def test_emulated_matmul_row_invariant():
    """Through the emulated ttnn.matmul (strict numerics; fp32 activations, bf16 weights, HiFi4 with an fp32 Dst,
    where the last bits survive to the output)."""
    with open_mesh("emulated-p150", trace_region_size=100_000) as c:
        ttnn, mesh = c.ttnn, c.mesh_device
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, 1, 32, 512, generator=g)
        w = ttnn.from_torch(torch.randn(512, 256, generator=g), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=mesh)
        ckc = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                               fp32_dest_acc_en=True, packer_l1_acc=False)
        rows = {}
        for m in (1, 2, 4, 8):
            xt = ttnn.from_torch(x[:, :, :m], dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=mesh)
            rows[m] = ttnn.to_torch(ttnn.matmul(xt, w, dtype=ttnn.float32, compute_kernel_config=ckc))[0, 0, 0]
        for m in rows:
            assert torch.equal(rows[m], rows[1]), f"row 0 differs between a 1-row and a {m}-row matmul"


@pytest.mark.slow
def test_tt_speculative_equals_tt_plain_greedy_at_a_near_tie():
    """Held-out depth prompt #15 (code-repetitive): at its 6th new token the fp32 reference's top two logits are
    0.016 apart; with the old row-count-dependent matmul the TT speculative run took the runner-up there while TT
    plain greedy took the argmax."""
    from qwen36.commands.common import DEFAULT_CHECKPOINT
    from qwen36.commands.speculative_generate import config_of, depth_policy, load_backend
    from qwen36.speculative.engine import speculative_generate

    torch.set_num_threads(1)
    ids = json.loads((files("qwen36.speculative") / "depth_prompts.json").read_text())["prompts"][15]["ids"]
    policy = lambda: depth_policy("auto", "emulated-p150x2", config_of(DEFAULT_CHECKPOINT))  # noqa: E731
    be = load_backend(DEFAULT_CHECKPOINT, "emulated-p150x2", None, "shadow_commit", len(ids) + 24, policy())
    try:
        spec = speculative_generate(be, [ids], 8, [policy()])[0].tokens
        be.release()
        plain = be.gen.generate([ids], 8)[0].tokens
    finally:
        be.close()
    assert spec == plain
