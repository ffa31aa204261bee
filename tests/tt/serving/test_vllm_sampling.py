"""Sampling through the vllm-tt adapter (models/qwen36/tt/serving/qwen36_vllm.py) the way the plugin's runner drives it
when the launch samples on device (``--additional-config '{"tt": {"sample_on_device_mode": "all" | "decode_only"}}'``).

The payload is built as tenstorrent/vllm-tt-plugin e3fc849 builds it: ``InputBatch.add_request`` copies a request's
vLLM ``SamplingParams`` into per-row tensors (top_k 0 / -1 / >= V -> V, top_k 1 forces top_p 0, no seed -> -1, no
logprobs -> -2), ``TTModelRunner._sampling_params_for_padded_decode`` pads the rows with
``SamplingInputBatch.DEFAULTS`` and sets ``enable_log_probs = num_logprobs >= 0``, and ``submit_prefill`` /
``TTAsyncDecodeController.submit_decode`` hand the model ``TTSamplingParams`` of ``.tolist()`` lists with the seed
sentinel turned back into None, plus ``prompt_tokens`` / ``output_tokens`` (-1 padded) when a penalty is on;
``finalize_decode`` then calls ``process_decode_output_host(out, is_tokens=True)``. The payload type is the
plugin's own when installed, else our stand-in, whose fields are checked against the plugin's ``TTSamplingParams``
fields as recorded in tests/data/vllm_tt_plugin_sampling_params.json (names, order, defaults and ``frozen``, read
from ``src/vllm_tt_plugin/model_input.py`` at the commit the file names; re-record them to follow a newer plugin).

Exactness: a device-sampled sequence equals ``TTGenerator.generate`` (the engine of ``qwen36 generate --device
emulated-p150x2``) with the same parameters and seed, token for token; greedy equals ``TTGenerator.greedy``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen36.generation.sampling import SamplingParams, SamplingParamsError, TokenHistory, pick_token
from qwen36.tt.serving import vllm_types as vt
from qwen36.tt.serving.qwen36_vllm import DecodeHandle, Qwen36ForCausalLM, sampling_from_plugin
from qwen36.testing.vllm_replay import (BLOCK, MAX_LEN, PROMPT, PluginReplay, batch1_generator, greedy_accept,
                                        load_on_mesh as _load, open_env)

PLUGIN_FIELDS = Path(__file__).resolve().parents[2] / "data" / "vllm_tt_plugin_sampling_params.json"
P = len(PROMPT)
N_NEW = 12
# SamplingInputBatch.DEFAULTS (input_batch.py): the values of the padding rows
PAD_DEFAULTS = dict(temperature=0.0, top_k=1, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=1.0, seed=-1, num_logprobs=-2)


def vllm_request(**kw) -> SimpleNamespace:
    """The fields of a vLLM ``SamplingParams`` the input batch reads (vLLM's defaults)."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, seed=None, logprobs=None)
    base.update(kw)
    return SimpleNamespace(**base)


def runner_payload(req: SimpleNamespace, vocab: int, pad_rows: int = 0, as_lists: bool = True):
    """What the runner passes as ``sampling_params`` for one request in row 0 (+ padding rows)."""
    top_k = req.top_k if 0 < req.top_k < vocab else vocab  # add_request: "consider all tokens"
    top_p = 0.0 if top_k == 1 else req.top_p  # add_request: top_k 1 -> exact argmax on the device sampler
    row = dict(temperature=req.temperature, top_k=top_k, top_p=top_p, presence_penalty=req.presence_penalty,
               frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
               seed=-1 if req.seed is None else req.seed,
               num_logprobs=-2 if req.logprobs is None else (vocab if req.logprobs == -1 else req.logprobs))
    cols = {name: torch.tensor([v] + [PAD_DEFAULTS[name]] * pad_rows,
                               dtype=torch.float32 if isinstance(PAD_DEFAULTS[name], float) else torch.int32)
            for name, v in row.items()}
    cols["enable_log_probs"] = cols["num_logprobs"] >= 0
    if not as_lists:
        return vt.TTSamplingParams(**cols)
    lists = {name: t.tolist() for name, t in cols.items()}
    lists["seed"] = [None if s == -1 else s for s in lists["seed"]]  # SEED_NONE_SENTINEL -> None
    return vt.TTSamplingParams(**lists)


def ours(req: SimpleNamespace) -> SamplingParams:
    """The same request as our CLI would run it (``qwen36 generate --temperature ... --seed ...``)."""
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed or 0,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty)


# ---- the payload type and its conversion (no mesh) ---------------------------------------------------------
def _plugin_fields() -> list[tuple[str, object]]:
    rec = json.loads(PLUGIN_FIELDS.read_text())
    assert rec["class"] == "TTSamplingParams" and rec["dataclass_frozen"] is True
    return [(f["name"], f.get("default", dataclasses.MISSING)) for f in rec["fields"]]


def test_payload_type_matches_the_plugins():
    """The stand-in (or the installed plugin's class) has the plugin's TTSamplingParams fields, order, defaults."""
    ours_ = [(f.name, f.default) for f in dataclasses.fields(vt.TTSamplingParams)]
    assert ours_ == _plugin_fields()
    assert dataclasses.fields(vt.TTSamplingParams)[0].name == "temperature"
    with pytest.raises(dataclasses.FrozenInstanceError):
        vt.TTSamplingParams(temperature=[0.0], top_k=[1], top_p=[1.0]).temperature = [1.0]


V = 1000


@pytest.mark.parametrize("as_lists", [True, False])
def test_conversion_reads_the_runners_encodings(as_lists):
    req = vllm_request(temperature=0.7, top_k=0, top_p=0.9, presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.2, seed=11)
    p = sampling_from_plugin(runner_payload(req, V, pad_rows=2, as_lists=as_lists), V, fresh_seed=99)
    assert (p.top_k, p.seed) == (0, 11)  # top_k "off" came as V; the request's own seed wins
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.25) and p.repetition_penalty == pytest.approx(1.2)
    assert p.min_p == 0.0 and p.logprobs is None
    # top_k -1 and >= V are "off" too; top_k 1 arrives with top_p 0 and means argmax of the kept token
    for k in (-1, V, V + 5):
        assert sampling_from_plugin(runner_payload(vllm_request(top_k=k), V), V, 0).top_k == 0
    one = sampling_from_plugin(runner_payload(vllm_request(top_k=1, top_p=0.5), V, as_lists=as_lists), V, 0)
    assert (one.top_k, one.top_p) == (1, 1.0)
    # no seed: the per-request seed the adapter drew (None in the lists, the sentinel -1 in the tensors)
    assert sampling_from_plugin(runner_payload(vllm_request(seed=None), V, as_lists=as_lists), V, 1234).seed == 1234
    # greedy stays greedy; below vLLM's epsilon a temperature means greedy (vLLM's sampling_type), copied verbatim
    g = sampling_from_plugin(runner_payload(vllm_request(temperature=0.0), V), V, 1234)
    assert g.greedy and not g.penalized and g.seed == 0  # nothing is drawn: one greedy params value per request
    assert sampling_from_plugin(runner_payload(vllm_request(temperature=5e-6), V), V, 0).greedy
    assert not sampling_from_plugin(runner_payload(vllm_request(temperature=2e-5), V), V, 0).greedy


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a finite number"),
])
def test_conversion_refuses_bad_values_in_one_line(field, value, msg):
    sp = runner_payload(vllm_request(temperature=0.8, top_k=5), V)
    bad = dataclasses.replace(sp, **{field: [value]})
    with pytest.raises(SamplingParamsError) as e:
        sampling_from_plugin(bad, V, 0)
    text = str(e.value)
    assert text.startswith("vllm-tt sampling_params row 0: ") and msg in text and "\n" not in text


def test_conversion_refuses_device_logprobs():
    for n in (0, 5):
        with pytest.raises(NotImplementedError, match="logprobs on device"):
            sampling_from_plugin(runner_payload(vllm_request(logprobs=n), V), V, 0)


# ---- the adapter on the emulated mesh, driven like the runner ------------------------------------------------
class SamplingReplay(PluginReplay):
    """PluginReplay plus the device-sampling forms of prefill and decode (tokens back instead of logits)."""

    def prefill_tokens(self, prompt: list[int], sp) -> int:
        out = self.m.prefill_forward(tokens=torch.tensor([prompt], dtype=torch.int32),
                                     page_table=self.table(len(prompt)), kv_cache=self.kv, enable_trace=False,
                                     prompt_lens=torch.tensor([len(prompt)], dtype=torch.int32),
                                     start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0],
                                     sampling_params=sp)
        toks, rope_deltas = out  # request_specific_rope: the runner unpacks (tt_out, rope_deltas)
        assert rope_deltas[0].item() == 0
        assert toks.dtype == torch.int32 and toks.reshape(-1).shape == (1,)  # _take(tt_out).reshape(sz)
        self.first_decode = True
        return int(toks.reshape(-1)[0])

    def decode_tokens(self, tok: int, pos: int, sp, history: tuple[list[int], list[int]] | None = None,
                      pad_rows: int = 0) -> int:
        b = 1 + pad_rows
        tokens = torch.zeros(b, 1, dtype=torch.int32)
        tokens[0, 0] = tok
        start = torch.full((b,), -1, dtype=torch.int32)
        start[0] = pos
        kw = dict(reset_batch=False)
        if history is not None:  # make_prompt_token_ids_tensor / make_output_token_ids_tensor: [B, L], -1 padded
            prompt, output = history
            pt = torch.full((b, len(prompt)), -1, dtype=torch.int32)
            pt[0] = torch.tensor(prompt, dtype=torch.int32)
            ot = torch.full((b, len(output)), -1, dtype=torch.int32)
            ot[0] = torch.tensor(output, dtype=torch.int32)
            kw.update(prompt_tokens=pt, output_tokens=ot)
        out = self.m.decode_forward(tokens=tokens, page_table=self.table(pos + 1, b), kv_cache=self.kv,
                                    start_pos=start, **self._rope(), enable_trace=True, read_from_device=False,
                                    sampling_params=sp, **kw)
        assert isinstance(out, DecodeHandle)
        toks = self.m.process_decode_output_host(out, is_tokens=True)
        assert toks.dtype == torch.int32 and toks.shape == (b, 1)
        return int(toks.reshape(b)[0])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ck, ctx = open_env(tmp_path_factory, "vllm_sampling")
    yield ck, ctx
    ctx.close()


STOCHASTIC = vllm_request(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.4, frequency_penalty=0.3,
                          repetition_penalty=1.3, seed=7)
GREEDY_PENALIZED = vllm_request(temperature=0.0, presence_penalty=-2.0, frequency_penalty=0.5, repetition_penalty=0.7)


@pytest.fixture(scope="module")
def reference(env):
    """TTGenerator.generate / greedy on the same weights and mesh (what ``qwen36 generate`` runs)."""
    ck, ctx = env
    hf = json.loads((ck / "config.json").read_text())
    m = _load(ctx, lambda: Qwen36ForCausalLM.initialize_vllm_model(
        hf, ctx.mesh_device, 1, MAX_LEN, optimizations="accuracy", checkpoint=ck, block_size=BLOCK, prefill_chunk=64))
    gen = batch1_generator(ctx, m)
    out = {"greedy": gen.generate([PROMPT], N_NEW)[0].tokens,
           "stochastic": gen.generate([PROMPT], N_NEW, ours(STOCHASTIC))[0].tokens,
           "seed8": gen.generate([PROMPT], N_NEW, ours(vllm_request(**{**vars(STOCHASTIC), "seed": 8})))[0].tokens,
           "greedy_penalized": gen.generate([PROMPT], 2 * N_NEW, ours(GREEDY_PENALIZED))[0].tokens}
    gen.release_trace()
    m.close()
    return out


@pytest.fixture(scope="module")
def on_device(env):
    ck, ctx = env
    r = _load(ctx, lambda: SamplingReplay(ck, ctx.mesh_device, spec_k=None, sample_on_device="all"))
    yield r
    r.m.close()


def _run_all_mode(r, req, n: int, history: bool) -> list[int]:
    vocab = r.m.model.args.cfg.vocab_size
    out = [r.prefill_tokens(PROMPT, runner_payload(req, vocab))]
    while len(out) < n:
        h = (PROMPT, list(out)) if history else None
        out.append(r.decode_tokens(out[-1], P + len(out) - 1, runner_payload(req, vocab), history=h))
    r.finish()
    return out


@pytest.mark.slow
def test_device_sampling_equals_generate(reference, on_device):
    """sample_on_device_mode "all": a seeded stochastic request with top-k, top-p and all three penalties equals
    TTGenerator.generate with the same parameters and seed; another seed gives that seed's sequence; greedy
    (temperature 0) equals TTGenerator.greedy; the same seed again replays."""
    r = on_device
    assert r.m.model_capabilities["supports_sample_on_device"] is True
    got = _run_all_mode(r, STOCHASTIC, N_NEW, history=True)
    assert got == reference["stochastic"]
    assert reference["stochastic"] != reference["greedy"]  # the draw matters on this checkpoint
    assert _run_all_mode(r, vllm_request(**{**vars(STOCHASTIC), "seed": 8}), N_NEW, history=True) == reference["seed8"]
    assert _run_all_mode(r, vllm_request(temperature=0.0), N_NEW, history=False) == reference["greedy"]
    assert _run_all_mode(r, STOCHASTIC, N_NEW, history=True) == reference["stochastic"]
    assert r.null_block_untouched()


@pytest.mark.slow
def test_device_sampling_through_prefill_continuations(reference, on_device):
    """The synchronous runner's form of the decode steps (one-token prefill continuations carrying
    sampling_params, ids back in the prefill's form) samples on device too and equals TTGenerator.generate."""
    r = on_device
    vocab = r.m.model.args.cfg.vocab_size
    sp = runner_payload(STOCHASTIC, vocab)
    seq = list(PROMPT) + [r.prefill_tokens(PROMPT, sp)]
    while len(seq) < P + N_NEW:
        toks = r.continue_prefill(seq, sp)
        assert toks.dtype == torch.int32 and toks.reshape(-1).shape == (1,)
        seq.append(int(toks.reshape(-1)[0]))
    assert seq[P:] == reference["stochastic"]
    r.finish()


@pytest.mark.slow
def test_decode_only_mode_continues_the_hosts_first_token(reference, on_device):
    """sample_on_device_mode "decode_only": the prefill returns logits (vLLM samples the first token on the host),
    then every decode carries sampling_params; with the first token the host would pick, the sequence equals
    TTGenerator.generate."""
    r = on_device
    vocab = r.m.model.args.cfg.vocab_size
    params = ours(STOCHASTIC)
    out = r.m.prefill_forward(tokens=torch.tensor([PROMPT], dtype=torch.int32), page_table=r.table(P),
                              kv_cache=r.kv, prompt_lens=torch.tensor([P], dtype=torch.int32),
                              start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])[0]
    r.first_decode = True
    first = int(pick_token(out.reshape(1, -1), params, params.generator(), TokenHistory(PROMPT, vocab).now()))
    toks = [first]
    while len(toks) < N_NEW:
        toks.append(r.decode_tokens(toks[-1], P + len(toks) - 1, runner_payload(STOCHASTIC, vocab),
                                    history=(PROMPT, list(toks))))
    assert toks == reference["stochastic"]
    r.finish()


@pytest.mark.slow
def test_device_sampling_refusals(on_device):
    r = on_device
    vocab = r.m.model.args.cfg.vocab_size
    sp = runner_payload(STOCHASTIC, vocab)
    # a bad value: one line naming it
    bad = dataclasses.replace(sp, top_p=[1.5])
    with pytest.raises(SamplingParamsError, match=r"^vllm-tt sampling_params row 0: top_p must be in \(0, 1\]"):
        r.prefill_tokens(PROMPT, bad)
    r.finish()
    first = r.prefill_tokens(PROMPT, sp)
    # the runner's history must be the sequence the device penalty state holds
    with pytest.raises(ValueError, match="token history"):
        r.decode_tokens(first, P, sp, history=(PROMPT[1:], [first]))
    second = r.decode_tokens(first, P, sp, history=(PROMPT, [first]))
    # params cannot change within a sequence; the input must be the id the device returned; is_tokens must match
    with pytest.raises(ValueError, match="changed within one sequence"):
        r.decode_tokens(second, P + 1, runner_payload(vllm_request(**{**vars(STOCHASTIC), "seed": 9}), vocab))
    with pytest.raises(ValueError, match="token this model sampled last"):
        r.decode_tokens((second + 1) % vocab, P + 1, sp)
    h = r.m.decode_forward(torch.tensor([[second]], dtype=torch.int32), r.table(P + 2), r.kv,
                           torch.tensor([P + 1], dtype=torch.int32), read_from_device=False, sampling_params=sp)
    with pytest.raises(ValueError, match="is_tokens=False"):
        r.m.process_decode_output_host(h, is_tokens=False)
    host, events = r.m.read_decode_output(h, async_read=True)  # the async readback form hands the ids over
    assert events == [] and torch.equal(host, h.tokens)
    with pytest.raises(NotImplementedError, match="logprobs on device"):
        r.decode_tokens(int(h.tokens[0, 0]), P + 2, runner_payload(vllm_request(logprobs=2), vocab))
    r.finish()


@pytest.mark.slow
def test_host_and_device_sampling_alternate_within_a_sequence(reference, on_device):
    """The runner picks host or device sampling per step (``check_perform_device_sampling``): a request with
    ``min_tokens`` keeps vLLM's MinTokensLogitsProcessor active, hence host sampling, until it has emitted
    ``min_tokens`` tokens, then samples on device. Alternating steps (logits, then ids) of a greedy request with all
    three penalties, the host steps picked from the logits with the same penalties, equal TTGenerator.generate: the
    device penalty state is rebuilt from the sequence's tokens at each switch."""
    r = on_device
    vocab = r.m.model.args.cfg.vocab_size
    params, sp = ours(GREEDY_PENALIZED), runner_payload(GREEDY_PENALIZED, vocab)
    lg = r.m.prefill_forward(tokens=torch.tensor([PROMPT], dtype=torch.int32), page_table=r.table(P), kv_cache=r.kv,
                             prompt_lens=torch.tensor([P], dtype=torch.int32),
                             start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])[0]
    r.first_decode = True

    def host_pick(logits, toks):
        hist = TokenHistory(PROMPT, vocab)
        hist.add(toks)
        return int(pick_token(logits.reshape(1, -1), params, None, hist.now()))

    toks = [host_pick(lg, [])]
    while len(toks) < 2 * N_NEW:
        pos = P + len(toks) - 1
        if len(toks) % 6 in (1, 2, 3):  # three host steps, three device steps, ...
            out = r.m.decode_forward(tokens=torch.tensor([[toks[-1]]], dtype=torch.int32), page_table=r.table(pos + 1),
                                     kv_cache=r.kv, start_pos=torch.tensor([pos], dtype=torch.int32), **r._rope())
            toks.append(host_pick(out[0, -1], toks))
        else:
            toks.append(r.decode_tokens(toks[-1], pos, sp, history=(PROMPT, list(toks))))
    assert toks == reference["greedy_penalized"]
    assert reference["greedy_penalized"][:N_NEW] != reference["greedy"]  # the penalties matter on this checkpoint
    r.finish()


@pytest.fixture(scope="module")
def spec_on_device(env):
    ck, ctx = env
    r = _load(ctx, lambda: SamplingReplay(ck, ctx.mesh_device, spec_k=3, sample_on_device="all"))
    yield r
    r.m.close()


@pytest.mark.slow
def test_speculative_launch_serves_greedy_payloads_only(reference, spec_on_device):
    """Under speculation the plugin admits greedy requests only: with the launch sampling on device, a greedy
    payload is served (prefill returns the argmax, the verify steps equal greedy decoding) and a stochastic or
    penalised one is refused in one line."""
    r = spec_on_device
    vocab = r.m.model.args.cfg.vocab_size
    greedy = runner_payload(vllm_request(temperature=0.0), vocab)
    emitted = [r.prefill_tokens(PROMPT, greedy)]
    assert emitted[0] == reference["greedy"][0]
    k, pos, drafts, accepted = r.k, P, [], 1
    while len(emitted) < N_NEW:
        tokens = torch.zeros(1, 1 + k, dtype=torch.int32)
        positions = torch.full((1, 1 + k), -1, dtype=torch.int32)
        nv = len(drafts)
        tokens[0] = torch.tensor([emitted[-1]] + drafts + [vt.PLACEHOLDER_TOKEN_ID] * (k - nv), dtype=torch.int32)
        positions[0, : nv + 1] = torch.arange(pos, pos + nv + 1, dtype=torch.int32)
        v = r.m.decode_forward(tokens=tokens, start_pos=positions, page_table=r.table(pos + 2 * k + 2),
                               kv_cache=r.kv, **r._rope(), enable_trace=True, read_from_device=True,
                               num_valid_drafts=torch.tensor([nv], dtype=torch.int32),
                               accepted_counts=torch.tensor([accepted], dtype=torch.int32), spec_mode="argmax_ids",
                               sampling_params=greedy, reset_batch=False)
        dt = torch.full((1, k), vt.PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        dt[0, :nv] = torch.tensor(drafts, dtype=torch.int32)
        committed, counts = greedy_accept(v.argmax_ids, dt, torch.tensor([nv], dtype=torch.int32))
        r.last = (committed, counts, positions)  # the runner's next propose_draft_tokens reads these
        a = int(counts[0]) - 1
        block = committed[0, : a + 1].tolist()
        emitted += block
        pos += a + 1
        accepted = a + 1
        drafts = r.propose(block, pos, pad_rows=0)
    assert emitted[:N_NEW] == reference["greedy"]
    r.finish()
    for req, what in ((STOCHASTIC, "stochastic"), (vllm_request(temperature=0.0, repetition_penalty=1.2), "greedy")):
        with pytest.raises(NotImplementedError, match="greedy requests without penalties only") as e:
            r.prefill_tokens(PROMPT, runner_payload(req, vocab))
        assert what in str(e.value) and "\n" not in str(e.value)
        r.finish()
