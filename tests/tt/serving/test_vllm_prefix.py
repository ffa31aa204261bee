"""Prefix-cache hits and prompt chunks through the vLLM adapter (``vllm_prefix.py``, ``tt/runtime/resume.py``), called
as the plugin calls it: a hit is a ``prefill_forward`` row with ``start_pos`` = the cached tokens (whole vLLM blocks),
``prompt_lens`` = the prompt's length and the cached blocks at the front of its block-table row; a chunk of a long
prompt is the same with ``prompt_lens`` = the chunk's end (docs/serving_contract.md, "Prefix caching").

Every returned row of a warm or chunked request is compared with the same request prefilled from position 0 (the
cold run) with ``torch.equal``, and so is every decode row after it; the pages vLLM lists as cached are never written
(every paged KV write is recorded); pages a decode step wrote are not trusted and are rewritten with the prefill's
rows; a checkpoint that was evicted costs recomputation only."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from support.vllm_replay import load_on_mesh, open_env
from qwen36.tt.serving import vllm_types as vt
from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
from qwen36.tt.serving.vllm_prefix import PrefixConfig

GRID = 128  # the model's prefill chunk in these tests (the engine's default is 256)
BLOCKS = 48  # vLLM's pool (block 0 its null block); the model appends GRID / 64 scratch pages


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_prefix")
    yield ck, ctx
    ctx.close()


@pytest.fixture(scope="module")
def model(env):
    """One launch for the tests of this file (each starts from an empty checkpoint store and ledger)."""
    m, kv = served(env)
    yield m, kv
    m.release_persistent_capture()


def fresh(model):
    m, kv = model
    m.batch.prefix.clear()
    return m, kv


def served(env, seqs=4, checkpoints=4):
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, seqs, max_seq_len=512, optimizations="accuracy", checkpoint=ck, prefill_chunk=GRID,
        prefix=PrefixConfig(checkpoints)))
    cfg = m.model.args.cfg
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    kv = m.allocate_kv_cache_per_layer([((BLOCKS, 1, 64, cfg.head_dim), torch.bfloat16, i) for i in range(n_attn)])
    m.warmup_model_prefill(kv_cache=kv, enable_trace=False)
    m.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=seqs)
    return m, kv


class Engine:
    """The plugin's side of the calls: block tables, rows, the synchronous runner's one-token decode steps."""

    def __init__(self, m, kv):
        self.m, self.kv = m, kv
        self.writes: list[int] = []  # every page a paged KV fill wrote (real pages of vLLM's pool)

    def call(self, rows, starts, ends, tables, slots, width=8):
        w = max(ends)
        toks = torch.zeros(len(rows), w, dtype=torch.int32)
        for i, r in enumerate(rows):
            toks[i, : min(len(r), w)] = torch.tensor(r[:w], dtype=torch.int32)
        pt = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            pt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        out = self.m.prefill_forward(toks, pt, self.kv, np.array(ends), start_pos=np.array(starts), empty_slots=slots)
        return (out[0] if isinstance(out, tuple) else out)[:, -1]

    def decode(self, seqs, tables, slots, steps):
        """``steps`` greedy decode steps of every sequence in ``seqs`` (lists, extended in place); the rows."""
        got = []
        for _ in range(steps):
            n = [len(s) for s in seqs]
            out = self.call(seqs, [k - 1 for k in n], n, tables, slots)
            assert all(r["kind"] == "decode" for r in self.m.batch.prefix.served)
            got.append(out.clone())
            for s, row in zip(seqs, out):
                s.append(int(row.argmax()))
        return got


@pytest.fixture
def fill_log(monkeypatch, env):
    """Pages written by ``paged_fill_cache`` (the prefill's KV writes and a join's zeroing), one list per call: the
    emulator's op is wrapped where its dispatcher calls it."""
    proxy = env[1].ttnn.experimental.paged_fill_cache
    log: list[list[int]] = []
    real = proxy.impl

    def spy(*args, **kwargs):
        table = kwargs["page_table"] if "page_table" in kwargs else args[2]
        log.append([int(p) for p in table.shards[0].reshape(-1)])
        return real(*args, **kwargs)

    monkeypatch.setattr(proxy, "impl", spy)
    return log


def prompt(n, seed, vocab=512):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hits_equal_cold_and_never_write_cached_pages(model, fill_log):
    m, kv = fresh(model)
    e = Engine(m, kv)
    p = prompt(400, 1)
    cold_table = [1, 2, 3, 4, 5, 6, 7]
    cold = e.call([p], [0], [400], [cold_table], [0])
    assert m.batch.prefix.served[0] == {"row": 0, "kind": "prefill", "cached": 0, "ran_from": 0, "restored": False,
                                        "repaired": 0}
    seq0 = p + [int(cold[0].argmax())]
    cold_rows = e.decode([seq0], [cold_table], [0], 3)
    # hits on the grid (256), off it (320, 384: rows from 256 rerun), and at 128, whose boundary keeps no checkpoint
    # (the policy keeps the prompt's last two, 256 and 384): rerun from position 0
    for hit, slot, ran_from in ((256, 1, 256), (320, 2, 256), (384, 3, 384), (128, 1, 0)):
        n_cached = hit // 64
        table = cold_table[:n_cached] + [8 + 7 * slot + j for j in range(7 - n_cached)]
        fill_log.clear()
        warm = e.call([p], [hit], [400], [table], [slot])
        got = m.batch.prefix.served[0]
        assert (got["kind"], got["cached"], got["ran_from"], got["restored"]) == ("prefill", hit, ran_from,
                                                                                   ran_from > 0), got
        assert torch.equal(warm[0], cold[0]), hit
        written = {pg for call in fill_log for pg in call}
        assert not written & set(cold_table[:n_cached]), (hit, written)  # cached pages: read, never written
        seq = p + [int(warm[0].argmax())]
        rows = e.decode([seq], [table], [slot], 3)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(rows, cold_rows)), hit
    s = m.batch.prefix.stats
    assert (s.hits, s.misses, s.restores) == (4, 1, 3) and s.hit_tokens == 256 + 320 + 384 + 128
    assert s.recomputed_tokens == 0 + 64 + 0 + 128
    assert float(m.model.to_host(kv[0][0])[0].abs().max()) == 0.0  # vLLM's null block stays zero


def test_pages_written_by_decode_steps_are_rewritten(model, fill_log):
    """A sequence decodes past a page boundary; a second request repeats its prompt and output (vLLM caches the
    decode-written pages like any other) and hits them: the adapter does not trust those rows (the recurrent form's
    bits), reruns from the grid boundary below them and rewrites the pages; the result equals a cold prefill of the
    same tokens. Its writer still holds a slot (the plugin never says it finished): counted as an unsafe repair. A
    resumed request (its own prompt and output) rewrites its pages without that warning."""
    m, kv = fresh(model)
    e = Engine(m, kv)
    p = prompt(70, 4)
    t0 = [1, 2, 3]
    seq = p + [int(e.call([p], [0], [70], [t0], [0])[0].argmax())]
    e.decode([seq], [t0], [0], 60)  # rows 70..129 written by decode steps: page 1 wholly, page 2 partly
    cold_tokens = seq + [7]  # its prompt, its output and one more token: not its resume
    cold = e.call([cold_tokens], [0], [132], [[5, 6, 7]], [1])
    fill_log.clear()
    warm = e.call([cold_tokens], [128], [132], [t0], [2])  # vLLM: pages 0 and 1 cached
    got = m.batch.prefix.served[0]
    assert (got["ran_from"], got["repaired"]) == (0, 1) and torch.equal(warm[0], cold[0])
    written = {pg for call in fill_log for pg in call}
    assert 2 in written and 1 not in written  # the decode page rewritten; page 0 (prompt rows) only read
    assert m.batch.prefix.stats.unsafe_repairs == 1
    # a resume: a sequence preempted and re-prefilled with everything it emitted rewrites its own decode pages
    # without that warning (its slot's sequence is this request)
    seq2 = prompt(70, 5)
    t3 = [9, 10, 11]
    seq2 += [int(e.call([seq2], [0], [70], [t3], [3])[0].argmax())]
    e.decode([seq2], [t3], [3], 59)
    before = m.batch.prefix.stats.unsafe_repairs
    resumed = e.call([seq2], [128], [len(seq2)], [t3], [0])
    assert m.batch.prefix.served[0]["repaired"] == 1 and m.batch.prefix.stats.unsafe_repairs == before
    assert torch.equal(resumed[0], e.call([seq2], [0], [len(seq2)], [[13, 14, 15]], [1])[0])


def test_chunked_prompt_equals_one_prefill(model):
    """A 450-token prompt in chunks ending at 200, 330 and 450 (vLLM's token budget cuts anywhere): each chunk
    continues the slot's sequence (``start_pos`` = tokens computed); the last chunk's row and every decode row after
    it equal the prompt prefilled in one call."""
    m, kv = fresh(model)
    e = Engine(m, kv)
    p = prompt(450, 6)
    table = [1, 2, 3, 4, 5, 6, 7, 8]
    cold = e.call([p], [0], [450], [[9, 10, 11, 12, 13, 14, 15, 16]], [0])
    seq_c = p + [int(cold[0].argmax())]
    rows_c = e.decode([seq_c], [[9, 10, 11, 12, 13, 14, 15, 16]], [0], 3)
    last = None
    for a, b in ((0, 200), (200, 330), (330, 450)):
        last = e.call([p], [a], [b], [table], [1])
        assert m.batch.prefix.served[0]["kind"] == "prefill"
    assert torch.equal(last[0], cold[0])
    seq = p + [int(last[0].argmax())]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(e.decode([seq], [table], [1], 3), rows_c))


def test_one_token_rows(model):
    """A one-token row past position 0 is a decode step when the call decodes only (the synchronous runner's form),
    and the last token of a prompt when the call also prefills (the plugin's steps are all-prefill or all-decode):
    a prompt whose last chunk is one token, next to a new prompt, equals its one-call prefill."""
    m, kv = fresh(model)
    e = Engine(m, kv)
    p, q = prompt(257, 7), prompt(70, 8)
    ta, tb = [1, 2, 3, 4, 5], [6, 7]
    cold = e.call([p], [0], [257], [[8, 9, 10, 11, 12]], [2])
    e.call([p], [0], [256], [ta], [0])  # a chunk ending one token short
    out = e.call([p, q], [256, 0], [257, 70], [ta, tb], [0, 1])
    assert [r["kind"] for r in m.batch.prefix.served] == ["prefill", "prefill"]
    assert torch.equal(out[0], cold[0])


def test_evicted_checkpoint_recomputes_exactly(env):
    """One checkpoint slot: a later prompt's checkpoint evicts the first prompt's; a hit on the first prompt then
    restores nothing and reruns from position 0, still bit-identical."""
    m, kv = served(env, checkpoints=1)
    e = Engine(m, kv)
    p, q = prompt(300, 2), prompt(300, 3)
    cold = e.call([p], [0], [300], [[1, 2, 3, 4, 5]], [0])
    e.call([q], [0], [300], [[6, 7, 8, 9, 10]], [1])
    assert m.batch.prefix.stats.evictions >= 1
    warm = e.call([p], [256], [300], [[1, 2, 3, 4, 11]], [2])
    got = m.batch.prefix.served[0]
    assert (got["ran_from"], got["restored"]) == (0, False)
    assert torch.equal(warm[0], cold[0]) and m.batch.prefix.stats.misses == 1
    m.release_persistent_capture()


def test_a_slot_left_out_of_a_decode_step_is_not_continued(model):
    """Regression (the prefix-caching soak, seed 3): a request preempted after 128 tokens lost its state when the
    next decode step padded its slot (a padded row's GDN state is rewritten); vLLM resumed it with 128 of its 129
    tokens cached, a one-token row whose prefix the slot still listed. Served as that slot's decode step it returned
    garbage (max abs 4.3); it is a prefill from the cached prefix, equal to the cold prefill."""
    m, kv = fresh(model)
    e = Engine(m, kv)
    p, q = prompt(100, 9), prompt(80, 10)
    t0, t1 = [1, 2], [3, 4]
    seq = p + [int(e.call([p], [0], [100], [t0], [0])[0].argmax())]
    e.decode([seq], [t0], [0], 28)  # slot 0 holds 128 tokens
    other = q + [int(e.call([q], [0], [80], [t1], [1])[0].argmax())]
    e.decode([other], [t1], [1], 2)  # slot 0 is a padded row of these steps
    cold = e.call([seq[:129]], [0], [129], [[5, 6, 7]], [2])
    resumed = e.call([seq[:129]], [128], [129], [[1, 2, 8]], [0])
    assert m.batch.prefix.served[0]["kind"] == "prefill" and torch.equal(resumed[0], cold[0])


def test_spec_plan_refuses_prefix_caching(env):
    ck, _ = env
    hf = json.loads((ck / "config.json").read_text())

    class Cfg:
        model_config = type("M", (), {"hf_config": hf, "max_model_len": 256})()
        cache_config = type("C", (), {"enable_prefix_caching": True, "block_size": 64})()
        additional_config = {}

    rej = Qwen36ForCausalLM.spec_plan(Cfg(), 1, 2)
    assert isinstance(rej, vt.SpecReject) and "--no-enable-prefix-caching" in rej.reason
    Cfg.cache_config.enable_prefix_caching = False
    assert isinstance(Qwen36ForCausalLM.spec_plan(Cfg(), 1, 2), vt.SpecPlan)


def test_prefix_config_from_the_launch():
    assert PrefixConfig.from_tt_options({}, False, 8) == PrefixConfig.off() and not PrefixConfig.off().enabled
    assert PrefixConfig.from_tt_options({}, True, 8).checkpoints == 18
    assert PrefixConfig.from_tt_options({}, True, 1).checkpoints == 4
    c = PrefixConfig.from_tt_options({"prefix_checkpoints": 3, "prefix_checkpoint_every": 1024}, True, 8)
    assert (c.checkpoints, c.policy.every) == (3, 1024)
    with pytest.raises(ValueError, match="prefix_checkpoints"):
        PrefixConfig.from_tt_options({"prefix_checkpoints": -1}, True, 8)


def test_served_prefill_chunk_is_the_checkpoint_grid_unless_the_launch_says():
    """The served model prefills in 256-row chunks (its prefix checkpoints' grid) whatever the model's own default,
    unless the launch's additional_config names another; a bad value is refused by name."""
    from types import SimpleNamespace

    from qwen36.tt.model.model_config import TTModelArgs
    from qwen36.tt.serving.vllm_args import SERVED_PREFILL_CHUNK, prefill_chunk_option

    assert prefill_chunk_option(None) == SERVED_PREFILL_CHUNK == 256
    assert TTModelArgs.__dataclass_fields__["prefill_chunk"].default != SERVED_PREFILL_CHUNK
    assert prefill_chunk_option(SimpleNamespace(additional_config={"tt": {"prefill_chunk": 2048}})) == 2048
    with pytest.raises(ValueError, match="tt.prefill_chunk"):
        prefill_chunk_option(SimpleNamespace(additional_config={"tt": {"prefill_chunk": "big"}}))
