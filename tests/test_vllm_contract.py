"""The vllm-tt plugin's call sequence, replayed against models/qwen36/tt/serving/qwen36_vllm.py on the emulated 1x2 mesh
(CI checkpoint, bf16), without vLLM or the plugin installed.

``PluginReplay`` issues the calls the plugin's runner makes (tenstorrent/vllm-tt-plugin e3fc849: worker.py
get_max_tokens_all_users / num_blocks, model_runner.py _allocate_kv_caches / warmup_model / submit_prefill,
async_decode.py submit_decode + finalize_decode; the speculative side as model_runner.py and spec_decode.py build it
at 23f0fcbe: the candidate block, the accept walk over every row, the committed block and positions handed to
``propose_draft_tokens``), with their argument names, kinds, shapes and dtypes: int32
token / position / block-table tensors, vLLM's block pool with block 0 reserved as the null block, tables padded
with 0, padding rows (token 0, position -1), mrope's ``(logits, rope_deltas)`` unpacking and
``rope_deltas_all_users``, ``read_from_device=False`` + ``process_decode_output_host``, and for speculation the
[B, 1+K] verify block with placeholder columns, the host greedy accept walk over ``argmax_ids`` and
``propose_draft_tokens`` after every verify. Any exception the adapter raises for those calls fails the test.

Exactness: token ids equal ``TTGenerator.greedy`` (the engine of ``qwen36 generate --device emulated-p150x2``)
on the same weights and mesh, with no tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen36.tt.runtime.generator import DEFAULT_TRACE_REGION
from qwen36.tt.serving.qwen36_vllm import DecodeHandle, Qwen36ForCausalLM
from qwen36.testing.tt import make_bf16_checkpoint
from qwen36.tt.serving import vllm_types as vt
from qwen36.tt_ops.device import open_mesh

HELPER_TRACE = Path(__file__).parent / "data" / "vllm_tt_plugin_spec_helpers.json"
PROMPT = list(range(5, 45))  # 40 tokens: crosses a 32-token block
P = len(PROMPT)
K = 3
N_NEW = 24
MAX_LEN = 256
BLOCK = 32


def greedy_accept(argmax_ids: torch.Tensor, drafts: torch.Tensor, num_valid: torch.Tensor):
    """The runner's accept walk over a verify's ``argmax_ids`` [B, 1+K] (the plugin's
    ``spec_decode.accept_greedy_drafts``, read at tenstorrent/vllm-tt-plugin 23f0fcbe): row i accepts drafts while
    they equal the column's argmax, up to its ``num_valid`` count; the count is accepted + 1 (the correction or
    bonus), never 0; the committed block is that row's first ``count`` ids, then ``PLACEHOLDER_TOKEN_ID``. Checked
    against the plugin's own function by tests/test_vllm_spec_plugin_dev.py."""
    rows, width = argmax_ids.shape
    committed = torch.full((rows, width), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    counts = torch.ones(rows, dtype=torch.int32)
    for i in range(rows):
        a = 0
        while a < int(num_valid[i]) and int(argmax_ids[i, a]) == int(drafts[i, a]):
            a += 1
        counts[i] = a + 1
        committed[i, : a + 1] = argmax_ids[i, : a + 1].to(torch.int32)
    return committed, counts


def committed_positions(verify_positions: torch.Tensor, width: int) -> torch.Tensor:
    """Positions the runner hands ``propose_draft_tokens`` (model_runner ``_committed_positions`` at 23f0fcbe): the
    committed block starts one past the verify's column 0 and runs on for the whole width, whatever each row
    accepted; padding rows (column 0 at -1) stay -1."""
    first = verify_positions[:, 0].to(torch.int32)
    pos = first.unsqueeze(1) + torch.arange(1, width + 1, dtype=torch.int32).unsqueeze(0)
    return pos.masked_fill((first < 0).unsqueeze(1), -1)


def verify_block(tok: int, pos: int, drafts: list[int], k: int, accepted: int, pad_rows: int = 0):
    """A verify's inputs as the runner builds them for one live request in row 0 (model_runner ``_spec_row_state``
    + ``_spec_candidate_block`` + the decode padding at 23f0fcbe): ``(tokens, positions, drafts, num_valid_drafts,
    accepted_counts)``. Columns past the row's drafts hold ``PLACEHOLDER_TOKEN_ID`` at position -1, padding rows
    token 0 at position -1 with no drafts and a count of 1."""
    nv, b = len(drafts), 1 + pad_rows
    tokens = torch.zeros(b, 1 + k, dtype=torch.int32)
    positions = torch.full((b, 1 + k), -1, dtype=torch.int32)
    tokens[0] = torch.tensor([tok] + drafts + [vt.PLACEHOLDER_TOKEN_ID] * (k - nv), dtype=torch.int32)
    positions[0, : nv + 1] = torch.arange(pos, pos + nv + 1, dtype=torch.int32)
    dt = torch.full((b, k), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    dt[0, :nv] = torch.tensor(drafts, dtype=torch.int32)
    nvd = torch.zeros(b, dtype=torch.int32)
    nvd[0] = nv
    acc = torch.ones(b, dtype=torch.int32)
    acc[0] = accepted
    return tokens, positions, dt, nvd, acc


class BlockPool:
    """vLLM's block pool as the runner sees it: block 0 is the null block, free blocks are handed out from a queue;
    ``freed`` are put at the front (as after another request finished), so tables are never the identity."""

    def __init__(self, num_blocks: int, freed: tuple[int, ...] = ()):
        rest = [b for b in range(1, num_blocks) if b not in freed]
        self.free = list(freed) + rest

    def take(self) -> int:
        return self.free.pop(0)


class PluginReplay:
    """One engine launch: the calls, in the plugin's order, for one request at a time (max_num_seqs = 1)."""

    def __init__(self, ckpt, mesh_device, *, spec_k: int | None, freed=(7, 3, 5), spec_depth: str | None = None,
                 sample_on_device: str | None = None, **model_kwargs):
        hf = json.loads((ckpt / "config.json").read_text())
        # additional_config: vLLM's per-platform dict (VllmConfig.additional_config, --additional-config JSON); the
        # plugin's user options live under its "tt" key (vllm_tt_plugin/config.py get_tt_config)
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BLOCK),
            model_config=SimpleNamespace(hf_config=hf, max_model_len=MAX_LEN),
            speculative_config=SimpleNamespace(num_speculative_tokens=spec_k) if spec_k else None,
            additional_config={"tt": {"spec_depth": spec_depth}} if spec_depth else {})
        self.auto = spec_depth == "auto"
        self.proposed: list[int] = []  # num_valid of each proposal (auto: the controller's depth per step)
        # worker.get_num_available_blocks_tt: the model's token budget plus one block per user
        tokens = Qwen36ForCausalLM.get_max_tokens_all_users(model_name=str(ckpt), num_devices=2, tt_data_parallel=1,
                                                            max_model_len=MAX_LEN, max_num_seqs=1)
        self.num_blocks = (tokens + BLOCK * 1) // BLOCK
        if spec_k:
            plan = Qwen36ForCausalLM.spec_plan(self.vllm_config, 1, spec_k)
            assert isinstance(plan, vt.SpecPlan) and plan.effective_k == spec_k, plan
            assert vt.ACCEPT_MODE_ARGMAX_IDS in plan.accept_modes and plan.drafter_state != "paged"
        # loader.TTModelLoader.load_model
        self.m = Qwen36ForCausalLM.initialize_vllm_model(hf, mesh_device, 1, max_seq_len=MAX_LEN, tt_data_parallel=1,
                                                         optimizations="accuracy", vllm_config=self.vllm_config,
                                                         checkpoint=ckpt, prefill_chunk=64, **model_kwargs)
        self.k = spec_k
        self.max_blocks = min(-(-MAX_LEN // BLOCK), self.num_blocks)  # runner.max_num_blocks_per_req
        # model_runner._allocate_kv_caches: per-layer (shape, dtype, tensor index), kv heads folded by TP
        cfg = self.m.model.args.cfg
        n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
        heads = cfg.num_key_value_heads // min(2, cfg.num_key_value_heads)
        specs = [((self.num_blocks, heads, BLOCK, cfg.head_dim), torch.bfloat16, i) for i in range(n_attn)]
        self.kv = self.m.allocate_kv_cache_per_layer(specs)
        self.pool = BlockPool(self.num_blocks, freed)
        # model_runner.warmup_model: compile pass, then trace pass
        # (the tt option sample_on_device_mode: "all" samples prefill and decode on device, "decode_only" decode)
        self.sample_on_device = sample_on_device
        pre = dict(kv_cache=self.kv, can_sample_on_device=sample_on_device == "all")
        dec = dict(kv_cache=self.kv, max_batch_size=1, num_blocks=self.max_blocks,
                   can_sample_on_device=sample_on_device in ("all", "decode_only"))
        self.m.warmup_model_prefill(enable_trace=False, **pre)
        self.m.warmup_model_decode(enable_trace=False, **dec)
        self.m.already_warmed_up_prefill = False
        self.m.warmup_model_prefill(enable_trace=True, **pre)
        self.m.warmup_model_decode(enable_trace=True, **dec)
        self.blocks: list[int] = []

    # ---- helpers the runner has --------------------------------------------------------------------------
    def table(self, upto: int, rows: int = 1) -> torch.Tensor:
        """Block table [rows, max_blocks] int32 covering positions < upto (new blocks from the pool), 0-padded."""
        while len(self.blocks) * BLOCK < upto:
            self.blocks.append(self.pool.take())
        t = torch.zeros(rows, self.max_blocks, dtype=torch.int32)
        t[0, : len(self.blocks)] = torch.tensor(self.blocks, dtype=torch.int32)
        return t

    def prefill(self, prompt: list[int]) -> int:
        out = self.m.prefill_forward(tokens=torch.tensor([prompt], dtype=torch.int32),
                                     page_table=self.table(len(prompt)), kv_cache=self.kv, enable_trace=False,
                                     prompt_lens=torch.tensor([len(prompt)], dtype=torch.int32),
                                     start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])
        logits, rope_deltas = out  # request_specific_rope: the CI config carries mrope_section
        assert rope_deltas[0].item() == 0
        assert logits.shape == (1, 1, self.m.model.args.cfg.vocab_size) and logits.dtype == torch.float32
        self.first_decode = True
        return int(logits[0, -1].argmax())

    def continue_prefill(self, seq: list[int], sp=None):
        """A decode step the way the synchronous runner sends it: ``prefill_forward`` over the whole sequence so far
        with ``start_pos`` = n - 1 and ``prompt_lens`` = n (its ``_prepare_model_inputs`` counts the last token as
        not yet computed, hence "still prefilling"); returns the prefill's form (logits, or ids with ``sp``)."""
        n = len(seq)
        kw = {} if sp is None else {"sampling_params": sp}
        out, rope_deltas = self.m.prefill_forward(tokens=torch.tensor([seq], dtype=torch.int32),
                                                  page_table=self.table(n), kv_cache=self.kv, enable_trace=True,
                                                  prompt_lens=torch.tensor([n], dtype=torch.int32),
                                                  start_pos=torch.tensor([n - 1], dtype=torch.int32),
                                                  empty_slots=[0], **kw)
        assert rope_deltas[0].item() == 0
        return out

    def _rope(self):
        d = {"rope_deltas_all_users": [0] if self.first_decode else None}
        self.first_decode = False
        return d

    def decode(self, tok: int, pos: int, pad_rows: int = 0) -> int:
        b = 1 + pad_rows
        tokens = torch.zeros(b, 1, dtype=torch.int32)
        tokens[0, 0] = tok
        start = torch.full((b,), -1, dtype=torch.int32)
        start[0] = pos
        out = self.m.decode_forward(tokens=tokens, page_table=self.table(pos + 1, b), kv_cache=self.kv,
                                    start_pos=start, **self._rope(), enable_trace=True, read_from_device=False)
        assert not isinstance(out, torch.Tensor)  # a device-side handle: finalize_decode asks the model to read it
        logits = self.m.process_decode_output_host(out, is_tokens=False)
        assert logits.shape == (b, 1, self.m.model.args.cfg.vocab_size)
        return int(logits[0, -1].argmax())

    def verify(self, tok: int, pos: int, drafts: list[int], accepted: int, pad_rows: int = 0) -> list[int]:
        """One verify step + the host greedy accept walk; returns the committed block (accepted drafts + 1)."""
        k, b = self.k, 1 + pad_rows
        tokens, positions, dt, nvd, acc = verify_block(tok, pos, drafts, k, accepted, pad_rows)
        # the scheduler reserves the block's 1+K tokens plus K+1 lookahead for a model-owned drafter
        out = self.m.decode_forward(tokens=tokens, start_pos=positions, page_table=self.table(pos + 2 * k + 2, b),
                                    kv_cache=self.kv, **self._rope(), enable_trace=True, read_from_device=True,
                                    num_valid_drafts=nvd, accepted_counts=acc, spec_mode="argmax_ids")
        assert isinstance(out, vt.VerifyOutput) and out.spec_mode == "argmax_ids"
        ids = out.argmax_ids
        assert ids.shape == (b, 1 + k) and ids.dtype == torch.int32
        committed, counts = greedy_accept(ids, dt, nvd)  # the runner's accept walk over every row
        self.last = (committed, counts, positions)  # what the runner hands the next propose_draft_tokens
        return committed[0, : int(counts[0])].tolist()

    def propose(self, block: list[int], pos_last: int, pad_rows: int = 0) -> list[int]:
        """``propose_draft_tokens`` as the runner calls it after a verify (commit_spec_acceptance): the committed
        block and counts of the accept walk over every verify row, the positions of ``committed_positions``;
        ``block`` / ``pos_last`` (the last committed token's position) are what the caller expects it to be."""
        k, ac = self.k, len(block)
        committed, counts, vpos = self.last
        assert committed[0, :ac].tolist() == block and int(counts[0]) == ac
        ct, acc = committed, counts
        if pad_rows + 1 > ct.shape[0]:  # padding rows the verify did not have: count 1, placeholder ids
            extra = pad_rows + 1 - ct.shape[0]
            ct = torch.cat([ct, torch.full((extra, 1 + k), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)])
            acc = torch.cat([acc, torch.ones(extra, dtype=torch.int32)])
            vpos = torch.cat([vpos, torch.full((extra, 1 + k), -1, dtype=torch.int32)])
        b = ct.shape[0]
        cp = committed_positions(vpos, 1 + k)
        assert int(cp[0, ac - 1]) == pos_last
        d = self.m.propose_draft_tokens(k, ct, cp, acc, hidden=None)
        assert isinstance(d, vt.DraftOutput)
        assert d.draft_token_ids.shape == (b, k) and d.draft_token_ids.dtype == torch.int32
        nv = int(d.num_valid[0])
        assert d.num_valid.dtype == torch.int32 and d.num_valid.tolist() == [nv] + [0] * (b - 1)
        assert nv == k or (self.auto and 1 <= nv <= k), (nv, k)
        self.proposed.append(nv)
        assert all(int(t) == vt.PLACEHOLDER_TOKEN_ID for t in d.draft_token_ids[0, nv:])
        ids = d.draft_token_ids[0, :nv]
        assert 0 <= int(ids.min()) and int(ids.max()) < self.m.model.args.cfg.vocab_size
        return ids.tolist()

    def release_persistent_capture(self) -> None:
        self.m.release_persistent_capture()

    def finish(self) -> None:
        self.m.release_request(0)  # model_runner._release_model_request(current slot)
        self.pool.free = self.blocks + self.pool.free
        self.blocks = []

    def null_block_untouched(self) -> bool:
        m = self.m.model
        return all(float(m.to_host(t)[0].abs().max()) == 0.0 for kv in self.kv for t in kv)


def open_env(tmp_path_factory, name: str):
    """A CI checkpoint and an emulated mesh with the list of models loaded on it (also used by test_vllm_sampling)."""
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp(name) / "ci", "ci")
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    ctx.models = []  # models sharing this mesh: their traces are released before another model loads weights
    return ck, ctx


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm")
    yield ck, ctx
    ctx.close()


def _load(ctx, make):
    for other in ctx.models:
        other.release_persistent_capture()
    m = make()
    ctx.models.append(m)
    return m


@pytest.fixture(scope="module")
def reference(env):
    """TTGenerator.greedy (what ``qwen36 generate --device emulated-p150x2`` runs) on its own identity table."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, MAX_LEN, optimizations="accuracy", checkpoint=ck, block_size=BLOCK, prefill_chunk=64))
    ref = m.gen.greedy(PROMPT, N_NEW + 2 * (K + 1))
    # layer-0 K cache, blocks 0 and 1 of its identity table (positions 0..63)
    m.kv_blocks = m.model.to_host(m.allocate_kv_cache()[0][0])[:2].clone()
    m.close()
    return ref, m.kv_blocks


@pytest.fixture(scope="module")
def plain(env):
    ck, ctx = env
    r = _load(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=None))
    yield r
    r.m.close()


@pytest.fixture(scope="module")
def spec(env):
    ck, ctx = env
    r = _load(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=K))
    yield r
    r.m.close()


K_AUTO = 5  # num_speculative_tokens of the auto launch: the deepest step / the verify block width


@pytest.fixture(scope="module")
def spec_auto(env):
    ck, ctx = env
    # the reference (CPU) step costs: an extra draft costs ~25% of a decode step there, so the controller moves
    # between depths on this CI checkpoint (with the P150a table's +7% per draft it stays at K_AUTO)
    r = _load(ctx, lambda: PluginReplay(ck, ctx.mesh_device, spec_k=K_AUTO, spec_depth="auto",
                                        depth_costs="reference"))
    yield r
    r.m.close()


def test_plain_sequence_equals_greedy(reference, plain):
    r, (reference, ref_kv) = plain, reference
    assert r.m.model_capabilities["supports_async_decode"] is False
    out = [r.prefill(PROMPT)]
    assert r.blocks[:2] == [7, 3]  # vLLM's table, not the identity
    while len(out) < N_NEW:
        out.append(r.decode(out[-1], P + len(out) - 1, pad_rows=1 if len(out) == 5 else 0))
    assert out == reference[:N_NEW]
    assert r.null_block_untouched()
    # the KV rows sit in the blocks vLLM assigned: block 7 holds positions 0..31, block 3 positions 32..62
    kv = r.m.model.to_host(r.kv[0][0])
    assert torch.equal(kv[7], ref_kv[0])
    assert torch.equal(kv[3][:, : P + N_NEW - 1 - BLOCK], ref_kv[1][:, : P + N_NEW - 1 - BLOCK])
    r.finish()
    # a second request reuses freed blocks in another order; start_pos continues, no re-prefill
    r.pool.free = [5, 1, 3, 7] + [b for b in r.pool.free if b not in (5, 1, 3, 7)]
    out2 = [r.prefill(PROMPT)]
    while len(out2) < 8:
        out2.append(r.decode(out2[-1], P + len(out2) - 1))
    assert out2 == reference[:8]
    assert r.blocks[:2] == [5, 1]
    assert r.m.state.pos == P + 7
    r.finish()


def test_plain_decode_as_one_token_prefill_continuation(reference, plain):
    """The plugin's synchronous runner (e3fc849) sends every decode step as a prefill of the sequence so far that
    starts at its last token (checked end to end through vLLM by tests/test_vllm_engine_dev.py): those steps
    equal greedy decoding, and any other prefill past position 0 is refused by name."""
    r, (reference, _) = plain, reference
    seq = list(PROMPT) + [r.prefill(PROMPT)]
    while len(seq) < P + N_NEW:
        logits = r.continue_prefill(seq)
        assert logits.shape == (1, 1, r.m.model.args.cfg.vocab_size) and logits.dtype == torch.float32
        seq.append(int(logits[0, -1].argmax()))
    assert seq[P:] == reference[:N_NEW]
    assert r.m.state.pos == P + N_NEW - 1
    with pytest.raises(NotImplementedError, match="only the one-token continuation"):
        r.continue_prefill(seq[:-2])  # starts before the live sequence's end: a cached prefix
    with pytest.raises(NotImplementedError, match="only the one-token continuation"):
        r.m.prefill_forward(tokens=torch.tensor([seq], dtype=torch.int32), page_table=r.table(len(seq)),
                            kv_cache=r.kv, prompt_lens=torch.tensor([len(seq)], dtype=torch.int32),
                            start_pos=torch.tensor([len(seq) - 2], dtype=torch.int32))  # a two-token chunk
    r.finish()
    with pytest.raises(NotImplementedError, match="only the one-token continuation"):
        r.continue_prefill(seq)  # no live sequence


def test_plain_decode_read_paths(plain):
    r = plain
    tok = r.prefill(PROMPT)
    h = r.m.decode_forward(torch.tensor([[tok]], dtype=torch.int32), r.table(P + 1), r.kv,
                           torch.tensor([P], dtype=torch.int32), read_from_device=False)
    assert isinstance(h, DecodeHandle)
    host, events = r.m.read_decode_output(h, async_read=True)  # the async readback form: (output, events)
    assert events == [] and torch.equal(r.m.process_decode_output_host(host), h.logits)
    r.finish()


@pytest.mark.slow
def test_spec_sequence_equals_greedy(reference, spec):
    r, (reference, _) = spec, reference
    caps = r.m.model_capabilities
    assert caps["supports_spec_decode"] and caps["spec_requirements"] == ("device_propose", "hidden_feed")
    assert caps["spec_hidden_handoff"] == ("on_device",) and caps["output_tokens_per_step"] == 1
    emitted = [r.prefill(PROMPT)]
    pos = P  # position of the pending token (the last committed one)
    # first decode step of a speculating launch: a verify with no drafts (commits one token)
    block = r.verify(emitted[-1], pos, [], 1)
    assert len(block) == 1
    emitted += block
    pos += 1
    seen_a, step = set(), 0
    while len(emitted) < N_NEW:
        drafts = r.propose(block, pos)
        if step == 1:
            drafts = drafts[:2]  # a drafter offering fewer than K: placeholder tail, acceptance capped at 2
        if step == 2:
            v = r.m.model.args.cfg.vocab_size
            drafts = [reference[len(emitted)], (reference[len(emitted) + 1] + 1) % v, reference[len(emitted) + 2]]
        block = r.verify(emitted[-1], pos, drafts, len(block), pad_rows=1 if step == 3 else 0)
        seen_a.add(len(block) - 1)
        if step == 2:
            assert len(block) == 2  # d_1 right, d_2 wrong: one accepted + correction
        emitted += block
        pos += len(block)
        step += 1
    assert emitted[:N_NEW] == reference[:N_NEW]
    assert len(seen_a) >= 2, seen_a
    assert len(r.m.spec_backend.traces) == 2  # verify and commit traces captured and replayed
    assert r.null_block_untouched()
    r.finish()


def test_spec_plan_and_rejects(spec):
    vc = spec.vllm_config
    plan = Qwen36ForCausalLM.spec_plan(vc, 1, 4)
    assert isinstance(plan, vt.SpecPlan) and plan.block_width == 5 and plan.extra_bytes_per_seq > 0
    # the verify occupies 1+K decoder rows for the one request; one cap for every live batch (draft_cap)
    assert plan.lanes_per_request == plan.block_width and plan.draft_cap(1) == 4
    assert plan.supports_narrow_decode is False and plan.accept_modes == ("argmax_ids",)
    rej = Qwen36ForCausalLM.spec_plan(vc, 2, 3)
    assert isinstance(rej, vt.SpecReject) and "max-num-seqs 1" in rej.reason
    rej = Qwen36ForCausalLM.spec_plan(vc, 1, 99)
    assert isinstance(rej, vt.SpecReject) and rej.supported_k == tuple(range(1, 32))
    no_mtp = SimpleNamespace(model_config=SimpleNamespace(
        hf_config={**vc.model_config.hf_config, "mtp_num_hidden_layers": 0}, max_model_len=MAX_LEN))
    assert isinstance(Qwen36ForCausalLM.spec_plan(no_mtp, 1, 3), vt.SpecReject)
    assert isinstance(Qwen36ForCausalLM.spec_plan(SimpleNamespace(), 1, 3), vt.SpecReject)  # never raises


def test_spec_plan_auto_reports_the_deepest_step_and_every_ring(spec):
    """tt.spec_depth auto: effective_k = the deepest depth the controller may pick (the block width the runner
    reserves), capped by the verify's limit; the declared bytes hold one GDN ring per depth."""
    vc = spec.vllm_config
    auto = SimpleNamespace(**{**vars(vc), "additional_config": {"tt": {"spec_depth": "auto"}}})
    plan = Qwen36ForCausalLM.spec_plan(auto, 1, 5)
    fixed = Qwen36ForCausalLM.spec_plan(vc, 1, 5)
    assert isinstance(plan, vt.SpecPlan) and plan.effective_k == 5 and fixed.effective_k == 5
    assert plan.extra_bytes_per_seq > fixed.extra_bytes_per_seq  # rings of depths 1..5, not only 5
    bad = SimpleNamespace(**{**vars(vc), "additional_config": {"tt": {"spec_depth": "sometimes"}}})
    assert isinstance(Qwen36ForCausalLM.spec_plan(bad, 1, 3), vt.SpecReject)
    # the verify's K+1 limit at head_dim 256 (the 27B shape): 11 rows, so K <= 10 even though the acceptor takes 31
    hd256 = SimpleNamespace(model_config=SimpleNamespace(hf_config={**vc.model_config.hf_config, "head_dim": 256},
                                                         max_model_len=MAX_LEN), additional_config={})
    assert isinstance(Qwen36ForCausalLM.spec_plan(hd256, 1, 10), vt.SpecPlan)
    rej = Qwen36ForCausalLM.spec_plan(hd256, 1, 11)
    assert isinstance(rej, vt.SpecReject) and rej.supported_k == tuple(range(1, 11)) and "head_dim 256" in rej.reason


@pytest.mark.slow
def test_spec_auto_depth_sequence_equals_greedy(reference, spec_auto):
    """The runner's speculative loop on an auto launch: each proposal offers the controller's K' <= K drafts
    (num_valid), the next verify carries them with placeholder columns, the model verifies K'+1 rows; output ==
    TTGenerator.greedy."""
    r, (reference, _) = spec_auto, reference
    emitted = [r.prefill(PROMPT)]
    before = dict(r.m.spec_backend.traces.captures)  # the warmup's generations captured too
    pos = P
    block = r.verify(emitted[-1], pos, [], 1)  # first decode step of a speculating launch: no drafts
    emitted += block
    pos += 1
    plans = []
    while len(emitted) < N_NEW:
        drafts = r.propose(block, pos)
        plans.append(r.m.depth_plan()["next_k"])
        block = r.verify(emitted[-1], pos, drafts, len(block))
        emitted += block
        pos += len(block)
    assert emitted[:N_NEW] == reference[:N_NEW]
    assert r.proposed == plans  # what each proposal offered is the depth the plan reported
    # = the controller's choice per step (its first choice went to the first verify, which carries no drafts)
    assert r.proposed == r.m.server.controller.chosen[1:len(r.proposed) + 1]
    assert len(set(r.proposed)) > 1, r.proposed  # the controller moved (the CI MTP drafts are rarely accepted)
    assert r.m.depth_plan()["mode"] == "auto" and max(r.m.depth_plan()["depths"]) == K_AUTO
    caps = {n: c - before.get(n, 0) for n, c in r.m.spec_backend.traces.captures.items()}
    caps = {n: c for n, c in caps.items() if c}
    assert caps and all(c == 1 for c in caps.values()), caps  # this request: each depth's traces captured once
    assert {f"verify:{k}" for k in r.proposed} <= set(caps)
    assert r.null_block_untouched()
    r.finish()
    r.release_persistent_capture()  # the models of this module share one mesh: no trace of ours stays live


def test_lifecycle_hooks_and_refusals(spec):
    r, m = spec, spec.m
    m.note_state_slots_moved({0: 0})
    with pytest.raises(NotImplementedError, match="max-num-seqs 1"):
        m.note_state_slots_moved({0: 1})
    first = r.prefill(PROMPT)
    # a second live request in the block (position >= 0 on row 1) fails fast naming the limit
    with pytest.raises(NotImplementedError, match="max-num-seqs 1"):
        m.decode_forward(tokens=torch.tensor([[first] + [-1] * K, [9] + [-1] * K], dtype=torch.int32),
                         start_pos=torch.tensor([[P] + [-1] * K, [3] + [-1] * K], dtype=torch.int32),
                         num_valid_drafts=torch.tensor([0, 0], dtype=torch.int32),
                         accepted_counts=torch.tensor([1, 1], dtype=torch.int32), spec_mode="argmax_ids")
    with pytest.raises(NotImplementedError, match="max-num-seqs 1"):
        m.prefill_forward(torch.tensor([PROMPT, PROMPT]), None, r.kv, torch.tensor([P, P]))
    with pytest.raises(NotImplementedError, match="slot_remap"):
        m.decode_forward(tokens=torch.tensor([[first]]), start_pos=torch.tensor([P]), slot_remap=torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="max-num-seqs <= 32"):  # past the largest decode bucket
        Qwen36ForCausalLM.initialize_vllm_model({}, None, max_batch_size=33, max_seq_len=256)
    with pytest.raises(ValueError, match="block_size"):
        m.allocate_kv_cache((8, 1, 64, m.model.args.cfg.head_dim), torch.bfloat16, 1)
    block = r.verify(first, P, [], 1)
    committed, counts, vpos = r.last
    cp = committed_positions(vpos, 1 + K)
    # accepted_counts naming a slot the device did not commit is refused, not silently rolled back
    with pytest.raises(ValueError, match="accepted_counts"):
        m.propose_draft_tokens(K, committed, cp, counts + 1)
    # the contract's domain for the side tensors (spec_decode.check_spec_side_tensors), each violation on its own:
    # int32 only, one entry per row, [1, 1+K] on every row (a padding row too), and a uniform 1+K wide block
    for bad, what in ((counts.to(torch.int64), "int32"), (torch.ones(2, dtype=torch.int32), r"must be \[1\]"),
                      (torch.zeros(1, dtype=torch.int32), r"\[1, 4\]")):
        with pytest.raises(ValueError, match=what):
            m.propose_draft_tokens(K, committed, cp, bad)
    with pytest.raises(ValueError, match=r"\[B, 1\+K\]"):
        m.propose_draft_tokens(K, committed[:, :K], cp[:, :K], counts)
    with pytest.raises(ValueError, match=r"\[B, 1\+K\]"):
        m.propose_draft_tokens(K, committed[:0], cp[:0], counts[:0])
    tok = torch.tensor([[block[0]] + [vt.PLACEHOLDER_TOKEN_ID] * K, [0] * (K + 1)], dtype=torch.int32)
    pos = torch.tensor([[P + 1] + [-1] * K, [-1] * (K + 1)], dtype=torch.int32)
    side = dict(num_valid_drafts=torch.zeros(2, dtype=torch.int32), accepted_counts=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"accepted_counts entries must lie in \[1, 4\]"):  # padding row at 0
        m.decode_forward(tokens=tok, start_pos=pos, spec_mode="argmax_ids",
                         **{**side, "accepted_counts": torch.tensor([1, 0], dtype=torch.int32)})
    with pytest.raises(ValueError, match="num_valid_drafts must be int32"):
        m.decode_forward(tokens=tok, start_pos=pos, spec_mode="argmax_ids",
                         **{**side, "num_valid_drafts": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="at least one row"):
        m.decode_forward(tokens=tok[:0], start_pos=pos[:0], spec_mode="argmax_ids",
                         num_valid_drafts=torch.zeros(0, dtype=torch.int32),
                         accepted_counts=torch.zeros(0, dtype=torch.int32))
    with pytest.raises(TypeError, match="together with spec_mode"):  # side tensors without the mode: no plain decode
        m.decode_forward(tokens=tok[:, :1], start_pos=pos[:, 0], **side)
    # the same step, well formed, still runs after every refusal above (they changed no state)
    assert len(r.verify(block[0], P + 1, [], 1)) == 1
    r.finish()
    assert m.server.mode is None
    with pytest.raises(RuntimeError, match="prefill_forward first"):
        m.decode_forward(tokens=torch.tensor([[first]]), start_pos=torch.tensor([P]))


def test_replay_builds_what_the_plugin_helpers_built():
    """The speculative inputs this replay builds (``verify_block``, ``committed_positions``, ``greedy_accept``) equal
    what the plugin's own code returned on the same cases, recorded by tests/test_vllm_spec_plugin_dev.py in
    tests/data/vllm_tt_plugin_spec_helpers.json (its ``source`` says which code ran)."""
    rec = json.loads(HELPER_TRACE.read_text())
    assert "23f0fcbe" in rec["source"]
    cases = rec["cases"]
    assert len(cases["blocks"]) >= 5
    for c in cases["blocks"]:
        kept = c["drafts"][: c["draft_cap"]]  # the runner cuts a row's drafts to the plan's cap
        tokens, positions, dt, nvd, acc = verify_block(c["tok"], c["pos"], kept, c["k"], c["accepted"])
        assert tokens.tolist() == c["tokens"] and positions.tolist() == c["positions"], c
        assert dt.tolist() == c["draft_token_ids"] and nvd.tolist() == c["num_valid_drafts"], c
        assert acc.tolist() == c["accepted_counts"], c
    cp = cases["committed_positions"]
    got = committed_positions(torch.tensor(cp["verify_positions"], dtype=torch.int32), cp["width"])
    assert got.tolist() == cp["out"]
    for w in cases["accept_walks"]:
        committed, counts = greedy_accept(*(torch.tensor(w[n], dtype=torch.int32)
                                            for n in ("argmax_ids", "draft_token_ids", "num_valid_drafts")))
        assert committed.tolist() == w["committed"] and counts.tolist() == w["counts"]
    assert sorted({n for w in cases["accept_walks"] for n in w["counts"]}) == [1, 2, 3, 4]  # every stop column


def test_model_bundles_resolve_like_the_plugin_registry():
    """vllm_models/ is what EXTRA_MODELS_DIR points at: each folder's vllm_metadata.json carries ``arch`` and
    ``main_class`` ("module:Class"), the plugin registers ``"TT" + arch`` -> main_class. Every architecture name
    this project's checkpoints declare has a bundle, and main_class imports to the adapter."""
    import importlib
    from pathlib import Path

    from qwen36.tiny import PRESETS

    root = Path(__file__).resolve().parents[1] / "vllm_models"
    archs = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        meta = json.loads((folder / "vllm_metadata.json").read_text())
        assert meta.get("arch") and meta.get("main_class"), folder
        module, cls = meta["main_class"].split(":")
        assert getattr(importlib.import_module(module), cls) is Qwen36ForCausalLM
        archs[meta["arch"]] = folder.name
    declared = {PRESETS["ci"].to_hf_dict()["architectures"][0], "Qwen3_5ForConditionalGeneration"}
    declared.add(json.loads((Path(__file__).resolve().parents[1] / "models/qwen36/default_checkpoint/config.json")
                            .read_text())["architectures"][0])
    assert declared <= set(archs), (declared, archs)
