"""Preemption, resume and slot reuse through the vLLM adapter, driven the way the plugin's synchronous runner
drives it (e3fc849; the resume path is the plugin's "request resumed from preemption replays prompt+generated"):

- a preempted request's KV blocks are freed and it leaves the batch (the rows condense: the others move to new
  destination slots); it comes back later as a prefill from position 0 of its prompt + every token it generated,
  into whatever slot is free, with new blocks;
- the plugin never says a request finished or was preempted: a new prompt simply names a slot a finished or
  preempted request used last.

Checked exactly (emulator: bit-equal rows; tolerance 1e-4 as in test_vllm_batch): every logits row of every request
equals the row of the same request served alone (batch 1); after the resume, the row equals the batch-1 prefill of
the same tokens (the GDN/conv state rebuilt from scratch, nothing left from before). Under speculation (one
sequence), a resumed request emits exactly what it emits when the same calls follow a fresh load: no draft,
verify or MTP state survives the preemption."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from support.vllm_replay import (
    K,
    LOGITS_TOL,
    PluginReplay,
    batch1_generator,
    load_on_mesh as _load,
    open_env,
    served_model,
)

TRACE = json.loads((Path(__file__).resolve().parents[2] / "data/vllm_tt_plugin_batch_trace.json").read_text())

PROMPTS = [TRACE["prompts"][0][:20], TRACE["prompts"][1], TRACE["prompts"][2][:12], TRACE["prompts"][3]]
MAX_LEN = TRACE["max_model_len"]
BLOCK = 64  # the model's default KV block (the e3fc849 loader passes no vllm_config)
MAX_BLOCKS = MAX_LEN // BLOCK


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_preempt")
    yield ck, ctx
    ctx.close()


@pytest.fixture(scope="module")
def alone(env):
    """fn(tokens, n) -> (greedy tokens, logits rows) of ``tokens`` served alone: batch-1 prefill + decode."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, MAX_LEN, optimizations="accuracy", checkpoint=ck))
    cache = {}
    gen = batch1_generator(ctx, m)

    def run(tokens: list[int], n: int):
        key = (tuple(tokens), n)
        if key not in cache:
            logits = [gen.prefill(tokens).float().reshape(-1).clone()]
            toks = [int(logits[-1].argmax())]
            while len(toks) < n:
                lg, _ = gen.decode_step(toks[-1])
                logits.append(lg.float().reshape(-1).clone())
                toks.append(int(lg.argmax()))
            cache[key] = (toks, logits)
        return cache[key]

    yield run
    m.release_persistent_capture()


class Runner:
    """The synchronous runner's calls for several requests on one batched model: each step is one
    ``prefill_forward`` whose rows are new prompts / resumes (start 0) or one-token continuations, with the
    destination slot of each row in ``empty_slots`` and each request's own blocks in its row of the table."""

    def __init__(self, m: Qwen36ForCausalLM, num_blocks: int):
        self.m = m
        self.kv = m.allocate_kv_cache_per_layer([((num_blocks, 1, BLOCK, m.model.args.cfg.head_dim),
                                                  torch.bfloat16, 0)])
        m.warmup_model_prefill(kv_cache=self.kv, enable_trace=False)
        m.warmup_model_decode(kv_cache=self.kv, enable_trace=True, max_batch_size=m.batch.dec.slots)
        self.free_blocks = list(range(1, num_blocks))[::-1]  # handed out from the end: never the identity
        self.seq: dict[str, list[int]] = {}  # request -> prompt + emitted tokens
        self.start: dict[str, int] = {}  # request -> tokens already fed (0: needs a prefill)
        self.blocks: dict[str, list[int]] = {}
        self.rows: dict[str, list] = {}  # request -> logits row of every emitted token

    def add(self, name: str, prompt: list[int]) -> None:
        self.seq[name], self.start[name], self.blocks[name], self.rows[name] = list(prompt), 0, [], []

    def preempt(self, name: str) -> None:
        """The scheduler frees the request's KV blocks; it resumes later from position 0."""
        self.free_blocks += self.blocks[name]
        self.blocks[name], self.start[name] = [], 0

    def finish(self, name: str) -> None:
        self.free_blocks += self.blocks.pop(name)
        del self.start[name]

    def step(self, plan: list[tuple[str, int]]) -> None:
        """One call: ``plan`` = [(request, destination slot)] in row order."""
        width = max(len(self.seq[r]) for r, _ in plan)
        n = len(plan)
        tokens = torch.zeros(n, width, dtype=torch.int32)
        table = torch.zeros(n, MAX_BLOCKS, dtype=torch.int32)
        lens, starts = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        for i, (r, _) in enumerate(plan):
            s = self.seq[r]
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
            while len(self.blocks[r]) * BLOCK < len(s):
                self.blocks[r].append(self.free_blocks.pop())
            table[i, : len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
            lens[i] = len(s)
            starts[i] = 0 if self.start[r] == 0 else len(s) - 1
        out = self.m.prefill_forward(tokens, table, self.kv, lens, start_pos=starts,
                                     empty_slots=[slot for _, slot in plan])
        logits = out[0] if isinstance(out, tuple) else out
        for i, (r, _) in enumerate(plan):
            row = logits[i, -1].clone()
            self.rows[r].append(row)
            self.seq[r].append(int(row.argmax()))
            self.start[r] = len(self.seq[r]) - 1


def _close(got: list, want: list) -> float:
    assert len(got) == len(want)
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


@pytest.mark.slow
def test_preempted_request_resumes_into_another_slot_and_slots_reused(env, alone):
    ck, ctx = env
    m = served_model(ck, ctx, 4, TRACE["max_model_len"])
    run = Runner(m, num_blocks=24)
    a, b, c, d = PROMPTS
    run.add("A", a)
    run.add("B", b)
    run.step([("A", 0), ("B", 1)])  # both prompts in one call
    for _ in range(3):
        run.step([("A", 0), ("B", 1)])
    # A is preempted: the batch condenses, B's row 0 now names slot 0 (its state moves there); C's prompt takes
    # slot 1, which held A last (and then B's state before the move)
    run.preempt("A")
    run.add("C", c)
    run.step([("B", 0)])
    run.step([("C", 1)])
    for _ in range(2):
        run.step([("B", 0), ("C", 1)])
    # A resumes: a prefill of its prompt + the 4 tokens it generated, into slot 2 with new blocks
    cut = len(run.seq["A"])
    run.step([("A", 2)])
    for _ in range(3):
        run.step([("B", 0), ("C", 1), ("A", 2)])
    # B finishes; D takes B's slot 0 without any signal; A and C condense to rows 0 and 1 (slots 1 and 2 -> 0, 1)
    run.finish("B")
    run.add("D", d)
    run.step([("C", 0), ("A", 1)])
    run.step([("D", 2)])
    for _ in range(3):
        run.step([("C", 0), ("A", 1), ("D", 2)])
    caps = [cnt for dec in m.batch.dec.decs.values() for cnt in dec.traces.captures.values()]
    assert caps and max(caps) == 1, caps  # moves, resumes and reuse never re-captured a step
    m.release_persistent_capture()  # the batch-1 references below allocate on the same mesh

    worst = 0.0
    for name, prompt in zip("BCD", (b, c, d)):
        n = len(run.rows[name])
        toks, rows = alone(prompt, n)
        assert run.seq[name][len(prompt):] == toks, name  # tokens equal the request served alone
        worst = max(worst, _close(run.rows[name], rows))  # and every logits row
    # A before its preemption: its batch-1 run; after: the batch-1 run of its prompt + generated tokens
    before = cut - len(a)
    toks, rows = alone(a, before)
    assert run.seq["A"][len(a): cut] == toks
    worst = max(worst, _close(run.rows["A"][:before], rows))
    after = len(run.rows["A"]) - before
    toks, rows = alone(run.seq["A"][:cut], after)
    assert run.seq["A"][cut:] == toks
    worst = max(worst, _close(run.rows["A"][before:], rows))
    assert worst <= LOGITS_TOL, worst
    # against A never preempted: the resume prefill's row is a prefill row, not a decode row (rounding differs),
    # yet the tokens are the same on this checkpoint
    toks, rows = alone(a, len(run.rows["A"]))
    assert run.seq["A"][len(a):] == toks
    rel = max(float((g - w).norm() / w.norm()) for g, w in zip(run.rows["A"], rows))
    pcc = min(float(torch.corrcoef(torch.stack([g, w]))[0, 1]) for g, w in zip(run.rows["A"], rows))
    kl = max(float(((g.log_softmax(-1) - w.log_softmax(-1)) * (g.softmax(-1) - w.softmax(-1))).sum())
             for g, w in zip(run.rows["A"], rows))  # symmetric KL of the sampling distributions
    print(f"A resumed vs never preempted: max abs {_close(run.rows['A'], rows):.4f}, worst rel L2 {rel:.2e}, "
          f"worst PCC {pcc:.6f}, worst symmetric KL {kl:.2e}")
    assert rel < 5e-2 and pcc > 0.999 and kl < 2e-3, (rel, pcc, kl)


@pytest.mark.slow
def test_speculative_resume_keeps_no_draft_or_verify_state(env, alone):
    """One sequence with K drafts: a request preempted after three verify steps resumes with a prefill of prompt +
    generated tokens, a draftless verify, then propose/verify. The same resumed calls on a freshly loaded model
    return the same ids, drafts and blocks, and the tokens equal greedy decoding (speculation is lossless)."""
    ck, ctx = env
    prompt = PROMPTS[0]

    def spec_run(r: PluginReplay, seq: list[int], steps: int):
        """prefill(seq), the first draftless verify, then ``steps`` propose/verify rounds; returns
        (emitted, drafts offered per step, prefill logits)."""
        out = r.m.prefill_forward(tokens=torch.tensor([seq], dtype=torch.int32), page_table=r.table(len(seq)),
                                  kv_cache=r.kv, prompt_lens=torch.tensor([len(seq)], dtype=torch.int32),
                                  start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])
        logits = (out[0] if isinstance(out, tuple) else out)[0, -1].clone()
        emitted, pos, r.first_decode = [int(logits.argmax())], len(seq), True
        block = r.verify(emitted[-1], pos, [], 1)
        emitted += block
        pos += 1
        offered = []
        for _ in range(steps):
            drafts = r.propose(block, pos)
            offered.append(drafts)
            block = r.verify(emitted[-1], pos, drafts, len(block))
            emitted += block
            pos += len(block)
        return emitted, offered, logits

    reference, _ = alone(prompt, 2 + 2 * 3 * (K + 1))  # at most 2 + 3 (K + 1) tokens per run
    r = _load(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=K))
    first, _, _ = spec_run(r, prompt, 3)
    # preempted: blocks freed (the next table takes new ones), and it comes back with everything it generated
    r.finish()
    resumed_seq = prompt + first
    again, offered, logits = spec_run(r, resumed_seq, 3)
    emitted = first + again
    assert len(emitted) >= 8 and emitted == reference[: len(emitted)]
    r.finish()
    r.release_persistent_capture()

    fresh = _load(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=K))
    again2, offered2, logits2 = spec_run(fresh, resumed_seq, 3)
    assert again2 == again and offered2 == offered
    assert torch.equal(logits2, logits)  # the resume prefill's row, bit for bit
    fresh.finish()
    fresh.release_persistent_capture()


def test_small_kv_pool_warms_up_and_serves(env, alone):
    """A KV pool smaller than the decoder's default page tables (the soak's setting that makes vLLM preempt): the
    rows no request has set yet, in every bucket, name blocks inside the pool, so the warmup steps (all rows
    padded) read inside it; a request then serves exactly as alone. Regression: the warmup decode read block ids
    past a 7-block pool."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 4, max_seq_len=128, tt_data_parallel=1, checkpoint=ck, optimizations="accuracy"))
    kv = m.allocate_kv_cache_per_layer([((7, 1, BLOCK, m.model.args.cfg.head_dim), torch.bfloat16, 0)])
    m.warmup_model_prefill(kv_cache=kv, enable_trace=False)
    m.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=4)
    for d in m.batch.dec.decs.values():
        assert int(d.state.page_table_host.max()) < 7
    prompt = PROMPTS[1]
    table = torch.zeros(1, 2, dtype=torch.int32)
    table[0, 0] = 5
    out = m.prefill_forward(torch.tensor([prompt], dtype=torch.int32), table, kv, np.array([len(prompt)]),
                            start_pos=np.array([0]), empty_slots=[2])
    row = (out[0] if isinstance(out, tuple) else out)[0, -1].clone()
    m.release_persistent_capture()
    toks, rows = alone(prompt, 1)
    assert int(row.argmax()) == toks[0] and float((row - rows[0]).abs().max()) <= LOGITS_TOL


def test_stale_block_in_a_new_rows_tail_is_not_zeroed(env, alone):
    """The runner does not clear a block-table row's tail when a new request takes the row: a short prompt's row
    can still name, past its own blocks, a block a live request owns (seen in the soak: a 44-token prompt's row
    [5, 2] while block 2 held positions 64.. of another request). The prefill zeroes its row's pages before
    writing, so the tail must not reach the pool: the live request decodes exactly as alone. Regression: its
    logits moved by ~0.1 and its sampled tokens changed."""
    ck, ctx = env
    m = served_model(ck, ctx, 4, TRACE["max_model_len"])
    run = Runner(m, num_blocks=8)
    long_prompt = (PROMPTS[0] * 4)[:70]  # positions 0..69: two blocks
    run.add("A", long_prompt)
    run.step([("A", 0)])
    run.step([("A", 0)])
    assert len(run.blocks["A"]) == 2
    run.add("B", PROMPTS[1])
    run.blocks["B"] = [run.free_blocks.pop(), run.blocks["A"][1]]  # B's tail still names A's second block
    run.step([("B", 1)])
    for _ in range(3):
        run.step([("A", 0), ("B", 1)])
    m.release_persistent_capture()
    for name, prompt in (("A", long_prompt), ("B", PROMPTS[1])):
        toks, rows = alone(prompt, len(run.rows[name]))
        assert run.seq[name][len(prompt):] == toks, name
        assert _close(run.rows[name], rows) <= LOGITS_TOL, name
