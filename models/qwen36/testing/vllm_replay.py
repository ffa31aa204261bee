"""The vllm-tt plugin's call sequence as a replay harness (no vLLM, no plugin installed): ``PluginReplay`` issues the
calls the plugin's runner makes on the model class (tenstorrent/vllm-tt-plugin e3fc849: worker.py
get_max_tokens_all_users / num_blocks, model_runner.py _allocate_kv_caches / warmup_model / submit_prefill,
async_decode.py submit_decode + finalize_decode; the speculative side as model_runner.py and spec_decode.py build it
at 23f0fcbe), with their argument names, kinds, shapes and dtypes. The serving tests (tests/tt/serving/) drive
it on the emulated 1x2 mesh; what each checks is in their docstrings."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from ..tt.model.state import KVLayerState, allocate_state
from ..tt.runtime.generator import DEFAULT_TRACE_REGION, TTGenerator
from ..tt.serving import vllm_types as vt
from ..tt.serving.qwen36_vllm import Qwen36ForCausalLM
from ..tt_ops.device import open_mesh
from .tt import make_bf16_checkpoint

# The contract scenario: one request, its prompt, the speculative depth and the engine's limits.
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
    against the plugin's own function by tests/tt/serving/test_vllm_spec_plugin_dev.py."""
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
    """A CI checkpoint and an emulated mesh with the list of models loaded on it (released with ctx.close())."""
    ck = make_bf16_checkpoint(tmp_path_factory.mktemp(name) / "ci", "ci")
    ctx = open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION)
    ctx.models = []  # models sharing this mesh: their traces are released before another model loads weights
    return ck, ctx


def load_on_mesh(ctx, make):
    """``make()`` a model on ``ctx``'s mesh after releasing the traces of the models already loaded on it."""
    for other in ctx.models:
        other.release_persistent_capture()
    m = make()
    ctx.models.append(m)
    return m


def batch1_generator(ctx, m) -> TTGenerator:
    """A batch-1 :class:`TTGenerator` with its own one-sequence state on the weights of the loaded model class
    ``m`` (what ``qwen36 generate --device emulated-p150x2`` runs): the tests' reference. A plain launch allocates
    no generator of its own; this one is the test's, registered on ``ctx`` so that its traces are released before
    another model loads (``load_on_mesh``). Allocate it while no trace is live on the mesh."""
    a = m.model.args
    gen = TTGenerator(m.model, allocate_state(a, m.model.ttnn, m.model.mesh), use_trace=True)
    ctx.models.append(SimpleNamespace(release_persistent_capture=gen.release_trace))
    return gen


def reference_greedy(ck, ctx):
    """TTGenerator.greedy (what ``qwen36 generate --device emulated-p150x2`` runs) on its own identity table:
    (the first N_NEW + 2 (K + 1) tokens after PROMPT, layer-0 K cache blocks 0 and 1 = positions 0..63)."""
    hf = json.loads((ck / "config.json").read_text())
    m = load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, MAX_LEN, optimizations="accuracy", checkpoint=ck, block_size=BLOCK, prefill_chunk=64))
    gen = batch1_generator(ctx, m)
    ref = gen.generate([PROMPT], N_NEW + 2 * (K + 1))[0].tokens
    k0 = next(s for s in gen.state.layers if isinstance(s, KVLayerState)).k  # the first full-attention layer's K
    m.kv_blocks = m.model.to_host(k0)[:2].clone()
    gen.release_trace()
    m.close()
    return ref, m.kv_blocks


# Recorded engine runs (tests/data/vllm_tt_plugin_*_trace.json) replayed through the adapter: logits rows vs the
# batch-1 run's (the emulator gives bit-equal rows).
LOGITS_TOL = 1e-4


def served_model(ck, ctx, seqs: int, max_seq_len: int) -> Qwen36ForCausalLM:
    """The model class as the recorded engine runs loaded it, for ``seqs`` sequences."""
    hf = json.loads((ck / "config.json").read_text())
    # loader.TTModelLoader at e3fc849: no vllm_config, so the model keeps its own block size (64, as recorded)
    return load_on_mesh(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, seqs, max_seq_len=max_seq_len, tt_data_parallel=1, checkpoint=ck,
        optimizations="accuracy"))
