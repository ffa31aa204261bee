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

from qwen36.tt.serving.qwen36_vllm import DecodeHandle, Qwen36ForCausalLM
from qwen36.tt.serving import vllm_types as vt
from support.vllm_replay import (
    BLOCK,
    K,
    MAX_LEN,
    N_NEW,
    P,
    PROMPT,
    PluginReplay,
    committed_positions,
    greedy_accept,
    load_on_mesh as _load,
    open_env,
    reference_greedy,
    verify_block,
)

HELPER_TRACE = Path(__file__).resolve().parents[2] / "data" / "vllm_tt_plugin_spec_helpers.json"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm")
    yield ck, ctx
    ctx.close()


@pytest.fixture(scope="module")
def reference(env):
    """TTGenerator.greedy (what ``qwen36 generate --device emulated-p150x2`` runs) on its own identity table."""
    return reference_greedy(*env)


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
        if len(out) == 5:  # the runner pads a decode to max_num_seqs rows (model_runner.py): 1 here, never 2
            with pytest.raises(ValueError, match=r"decode of 2 rows, this model holds 1 sequence"):
                r.decode(out[-1], P + len(out) - 1, pad_rows=1)
        out.append(r.decode(out[-1], P + len(out) - 1))
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
    assert r.m.server.dec.pos[0] == P + 7  # the sequence's position in its decoder slot
    r.finish()


def test_plain_decode_as_one_token_prefill_continuation(reference, plain):
    """The plugin's synchronous runner (e3fc849) sends every decode step as a prefill of the sequence so far that
    starts at its last token (checked end to end through vLLM by tests/tt/serving/test_vllm_engine_dev.py): those steps
    equal greedy decoding, and any other prefill past position 0 is refused by name."""
    r, (reference, _) = plain, reference
    seq = list(PROMPT) + [r.prefill(PROMPT)]
    while len(seq) < P + N_NEW:
        logits = r.continue_prefill(seq)
        assert logits.shape == (1, 1, r.m.model.args.cfg.vocab_size) and logits.dtype == torch.float32
        seq.append(int(logits[0, -1].argmax()))
    assert seq[P:] == reference[:N_NEW]
    assert r.m.server.dec.pos[0] == P + N_NEW - 1
    with pytest.raises(ValueError, match="no state slot holds"):
        r.continue_prefill(seq[:-2])  # starts before the live sequence's end: no slot holds that prefix
    with pytest.raises(NotImplementedError, match="only the one-token continuation"):
        r.m.prefill_forward(tokens=torch.tensor([seq], dtype=torch.int32), page_table=r.table(len(seq)),
                            kv_cache=r.kv, prompt_lens=torch.tensor([len(seq)], dtype=torch.int32),
                            start_pos=torch.tensor([len(seq) - 2], dtype=torch.int32))  # a two-token chunk
    r.finish()
    with pytest.raises(ValueError, match="no state slot holds"):
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
    # no narrow decode (supports_narrow_decode=False): the runner sends every decode step as a verify, so a plain
    # decode or a one-token prefill continuation is refused by name, and the sequence goes on (nothing moved)
    with pytest.raises(NotImplementedError, match="every decode step is a verify"):
        m.decode_forward(tokens=torch.tensor([[first]], dtype=torch.int32), start_pos=torch.tensor([P], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="supports_narrow_decode=False"):
        r.continue_prefill(list(PROMPT) + [first])
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
    what the plugin's own code returned on the same cases, recorded by tests/tt/serving/test_vllm_spec_plugin_dev.py in
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

    root = Path(__file__).resolve().parents[3] / "vllm_models"
    archs = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        meta = json.loads((folder / "vllm_metadata.json").read_text())
        assert meta.get("arch") and meta.get("main_class"), folder
        module, cls = meta["main_class"].split(":")
        assert getattr(importlib.import_module(module), cls) is Qwen36ForCausalLM
        archs[meta["arch"]] = folder.name
    declared = {PRESETS["ci"].to_hf_dict()["architectures"][0], "Qwen3_5ForConditionalGeneration"}
    declared.add(json.loads((Path(__file__).resolve().parents[3] / "models/qwen36/default_checkpoint/config.json")
                            .read_text())["architectures"][0])
    assert declared <= set(archs), (declared, archs)
