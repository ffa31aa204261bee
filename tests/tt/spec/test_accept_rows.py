"""Per-row sampling settings inside one batched device acceptance (models/qwen36/tt/spec/accept.py,
``DeviceAcceptor(..., stages=SamplerStages)``) on the emulated 1x2 P150a mesh.

Gates:
* row independence: each row of a B=4 acceptor whose users differ (greedy, sampled with top-k/top-p, greedy with
  penalties and logprobs, sampled with min_p, a penalty and logprobs) gives, step after step, exactly what a batch-1
  acceptor with that user's params and seed gives alone: tokens, accepted count, the RNG row (sampled rows), the
  logprobs rows, the token counts after the commit and the draft distributions (bit for bit); RNG tables refill
  mid-run; the traced replay equals the eager run;
* batch 1 with one set of params runs the programs it ran before per-row settings existed (pinned counts);
* a row whose params need a stage the acceptor lacks, and a scalar acceptor's row with other params, are refused.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("ttnn")

from qwen36.speculative.sampling import SamplingParams  # noqa: E402
from qwen36.testing.tt_hooks import acceptor_host_draft_probs, acceptor_host_drafts, acceptor_host_logits  # noqa: E402
from qwen36.tt.runtime.sampler_transform import SamplerStages  # noqa: E402
from qwen36.tt.runtime.trace import TracedStep  # noqa: E402
from qwen36.tt.spec.accept import DeviceAcceptor  # noqa: E402
from qwen36.tt_ops.device import open_mesh  # noqa: E402

K, V = 3, 64
PEN = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
# The users' parameters are exact in fp32 where the batch-1 acceptor takes them as scalars (1/T, 1/repetition,
# log(min_p), top_p, the penalties): the emulator computes a scalar operand in fp64, a per-row operand is its fp32
# rounding, so an inexact value could differ in the last bit between the two forms on the emulator. (A card packs
# a float scalar as fp32 for fp32 operands: both forms see the same number there.)
USERS = [SamplingParams(),
         SamplingParams(temperature=0.8, top_k=10, top_p=0.875, seed=3),
         SamplingParams(logprobs=2, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
         SamplingParams(temperature=0.5, min_p=math.exp(-3.0), frequency_penalty=0.25, logprobs=1, seed=4)]
PROMPT_LEN, HISTORIES = 3, [[1, 2, 3, 7], [5, 5, 9, 11], [1, 2, 3, 7, 7, 9], [4, 8, 15, 16, 23]]


@pytest.fixture(scope="module")
def ctx():
    c = open_mesh("emulated-p150x2", trace_region_size=10_000_000)
    yield c
    c.close()


def _inputs(steps: int, b: int, seed: int):
    """Per step: target logits [B, R, V], drafts [B, K] (every other one the target's argmax, so greedy rows
    accept some), draft logits [B, K, V]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = torch.randn(b, K + 1, V, generator=g) * 2
        drafts = torch.randint(0, V, (b, K), generator=g)
        take = torch.rand(b, K, generator=g) < 0.6
        drafts = torch.where(take, logits[:, :K].argmax(-1), drafts)
        out.append((logits, drafts, torch.randn(b, K, V, generator=g) * 2))
    return out


class _Run:
    """One acceptor with persistent input buffers and one step's device ops (accept, then the count commit)."""

    def __init__(self, ctx, acc: DeviceAcceptor, users: list[SamplingParams], rows: list[int]):
        self.ttnn, self.acc, self.users, self.rows = ctx.ttnn, acc, users, rows
        z = _inputs(1, acc.batch, 0)[0]
        self.bufs = [acc.ttnn.to_device(h, acc.mesh) for h in (acceptor_host_logits(acc, z[0]),
                                                                acceptor_host_drafts(acc, z[1]),
                                                                acceptor_host_draft_probs(acc, z[2]))]
        self.sampled = acc.stages.sampled if acc.stages is not None else not acc.params.greedy
        self.probs = None
        self.start()

    def start(self):
        for row, p in enumerate(self.users):
            self.acc.set_row(row, p)
            self.acc.start_penalties(PROMPT_LEN, HISTORIES[self.rows[row]], row)

    def write(self, logits, drafts, dlogits):
        t, acc = self.ttnn, self.acc
        t.copy_host_to_device_tensor(acceptor_host_logits(acc, logits), self.bufs[0])
        t.copy_host_to_device_tensor(acceptor_host_drafts(acc, drafts), self.bufs[1])
        t.copy_host_to_device_tensor(acceptor_host_draft_probs(acc, dlogits), self.bufs[2])

    def ops(self):
        acc = self.acc
        pd = None
        if self.sampled:
            pd = acc.probs_from_logits(self.bufs[2], acc.draft_penalties() if acc.penalized else None)
        res = acc.accept(self.bufs[0], self.bufs[1], pd)
        if acc.penalized:
            acc.commit_counts()
        self.probs = pd
        return res, pd

    def read(self, pd=None):
        """Per row: (tokens, a, rng_row, logprobs, (seen, counts), draft probs) on the host."""
        acc, out = self.acc, []
        results = acc.read_results()
        pd = self.probs if pd is None else pd
        probs = None if pd is None else self.ttnn.to_torch(self.ttnn.get_device_tensors(pd)[0]).reshape(acc.batch, K, V)
        for row, (p, r) in enumerate(zip(self.users, results)):
            lps = acc.read_logprobs(r.emitted, row) if p.logprobs is not None else None
            counts = [t.tolist() for t in acc.token_counts.read(row)] if p.penalized else None
            out.append((r.tokens, r.num_accepted, None if p.greedy else r.rng_row, lps, counts,
                        None if p.greedy else probs[row].tolist()))
        return out


def test_rows_with_different_params_equal_each_user_alone_traced_and_eager(ctx):
    ttnn, b, steps = ctx.ttnn, len(USERS), 5
    inputs = _inputs(steps, b, 17)
    batch = _Run(ctx, DeviceAcceptor(ttnn, ctx.mesh_device, K, V, batch=b, rng_rows=3,
                                     stages=SamplerStages.of(USERS, V)).allocate(), USERS, list(range(b)))
    alone = [_Run(ctx, DeviceAcceptor(ttnn, ctx.mesh_device, K, V, p, rng_rows=3).allocate(), [p], [row])
             for row, p in enumerate(USERS)]
    eager = []
    for logits, drafts, dlogits in inputs:
        batch.write(logits, drafts, dlogits)
        batch.ops()
        got = batch.read()
        for row, run in enumerate(alone):
            run.write(logits[row:row + 1], drafts[row:row + 1], dlogits[row:row + 1])
            run.ops()
            assert got[row] == run.read()[0], f"row {row} ({USERS[row].describe()})"
        eager.append(got)
    accepted = {(row, e[row][1]) for e in eager for row in range(b)}
    assert {a for _, a in accepted} >= {0, K} and {row for row, a in accepted if a > 0} == set(range(b)), accepted
    assert all(r[2] is not None for r in eager[-1][1::2])  # sampled rows report their RNG rows (refilled: 3 rows)
    # traced: the same steps again from the same streams and penalty state
    batch.acc.restart_rng()
    batch.start()
    trace = TracedStep(ttnn, ctx.mesh_device, batch.ops)
    _, pd = trace.capture()
    for (logits, drafts, dlogits), want in zip(inputs, eager):
        batch.write(logits, drafts, dlogits)
        trace.replay(blocking=True)
        assert batch.read(pd) == want
    trace.release()


# Programs of one step at B=1 with one set of params (acceptance; sampled: the draft probabilities too; penalties:
# the count commit too), counted per op on the code before per-row settings existed: a batch-1 acceptor without
# stages runs none of the per-row code.
PROGRAMS = {
    "greedy": (SamplingParams(), 35),
    "T0.8": (SamplingParams(temperature=0.8), 73),
    "T0.8+top_k+top_p": (SamplingParams(temperature=0.8, top_k=10, top_p=0.9), 101),
    "T0.8+min_p": (SamplingParams(temperature=0.8, min_p=0.05), 81),
    "greedy+penalties": (SamplingParams(**PEN), 66),
    "T0.8+penalties": (SamplingParams(temperature=0.8, **PEN), 114),
    "greedy+logprobs": (SamplingParams(logprobs=3), 63),
    "T0.8+logprobs": (SamplingParams(temperature=0.8, logprobs=3), 101),
}


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_batch1_programs_per_acceptance_unchanged(ctx, case):
    params, want = PROGRAMS[case]
    acc = DeviceAcceptor(ctx.ttnn, ctx.mesh_device, K, V, params).allocate()
    run = _Run(ctx, acc, [params], [0])
    run.write(*_inputs(1, 1, 5)[0])
    run.ops()  # the first call compiles; count the second
    acc.read_results()
    with ctx.mesh_device.counters.scope(case) as c:
        run.ops()
    assert c.programs == want, dict(c.programs_per_op)


def test_rows_refused_with_named_problem(ctx):
    ttnn, m = ctx.ttnn, ctx.mesh_device
    acc = DeviceAcceptor(ttnn, m, K, V, batch=2, stages=SamplerStages.of([SamplingParams(temperature=0.8)], V))
    acc.allocate()
    with pytest.raises(ValueError, match="needs greedy"):
        acc.set_row(0, SamplingParams())
    with pytest.raises(ValueError, match="needs top_k"):
        acc.set_row(1, SamplingParams(temperature=0.8, top_k=5))
    rows_in_dim2 = ttnn.from_torch(torch.zeros(1, 1, 2, V), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, device=m,
                                   mesh_mapper=ttnn.ReplicateTensorToMesh(m))  # the MTP chain's [1, 1, B, V] rows
    with pytest.raises(ValueError, match="users in dim 1"):
        acc.probs_from_logits(rows_in_dim2)
    scalar = DeviceAcceptor(ttnn, m, K, V, SamplingParams(temperature=0.8), batch=2).allocate()
    scalar.set_row(1, SamplingParams(temperature=0.8, seed=9))  # only the seed differs: fine
    with pytest.raises(ValueError, match="per-row params need"):
        scalar.set_row(0, SamplingParams(temperature=0.5))
