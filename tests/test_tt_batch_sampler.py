"""Batched plain sampling on device (tt/batch_sampler.py) on the emulated P150a x2 mesh: every user of a batch
samples with its own parameters and its own seed, and its tokens equal its batch-1 ``TTGenerator.generate`` run
with the same parameters and seed (the same uniform stream, the same transform per row)."""
from __future__ import annotations

import pytest
import torch

from qwen36.speculative.sampling import SamplingParams
from qwen36.tt.batch import TTBatchDecoder
from qwen36.tt.batch_sampler import BatchDeviceSampler, batched_generate
from test_tt_batch import ckpt, gen, prompt  # noqa: F401 (fixtures)

USERS = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7),
    SamplingParams(),  # greedy, in the same step
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                   seed=11),
    SamplingParams(temperature=1.2, top_k=50, seed=7),  # the same seed as user 0, other params
]


def batch1(gen, prompts, params, n):
    outs = [gen.generate([int(t) for t in p.tolist()], n, sp).tokens for p, sp in zip(prompts, params)]
    gen.release_trace()  # the batch decoder allocates and joins: no generator trace may be live
    return outs


def test_each_user_samples_as_its_batch1_run(gen):
    prompts = [prompt(n, 100 + n) for n in (5, 12, 3, 8)]
    n = 10
    want = batch1(gen, prompts, USERS, n)
    assert want[0] != want[3]  # same seed, other parameters: a different stream of tokens
    dec = TTBatchDecoder(gen.model, 4)
    sampler = BatchDeviceSampler(dec.ttnn, dec.mesh, gen.config.vocab_size, 4).allocate()
    try:
        got = batched_generate(dec, sampler, prompts, USERS, n)
        assert dec.captures == 1
    finally:
        dec.release()
        sampler.release()
    assert got == want


def test_free_rows_and_reused_slot(gen):
    """Two users in an 8-slot decoder (six padded rows), then a second batch on the same decoder and sampler: the
    slots' parameters, penalty rows and streams are reset per user, and the tokens are still the batch-1 ones."""
    prompts = [prompt(6, 201), prompt(9, 202)]
    first = [USERS[2], USERS[0]]
    second = [USERS[0], USERS[2]]
    want1 = batch1(gen, prompts, first, 7)
    want2 = batch1(gen, prompts, second, 5)
    dec = TTBatchDecoder(gen.model, 8)
    sampler = BatchDeviceSampler(dec.ttnn, dec.mesh, gen.config.vocab_size, 8).allocate()
    try:
        assert batched_generate(dec, sampler, prompts, first, 7) == want1
        assert batched_generate(dec, sampler, prompts, second, 5) == want2
        assert dec.captures == 1
    finally:
        dec.release()
        sampler.release()


def test_logprobs_refused(gen):
    dec = TTBatchDecoder(gen.model, 1)
    sampler = BatchDeviceSampler(dec.ttnn, dec.mesh, gen.config.vocab_size, 1).allocate()
    try:
        with pytest.raises(NotImplementedError, match="logprobs"):
            sampler.start(0, SamplingParams(logprobs=2), [1, 2], 3)
    finally:
        dec.release()
        sampler.release()


@pytest.mark.slow
def test_generate_cli_sampled_batch_on_tt(capsys, tmp_path, monkeypatch):
    """`qwen36 generate --device emulated-p150x2` with two prompts and --temperature: `ids[i]` equal each prompt's
    own single-prompt run with the same settings and seed; --logprobs with several prompts is refused in one line."""
    from test_reference_batch import cli
    from test_tt_batch import CLI_TEXTS, batch_cli_equals_alone

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the TT weight cache goes under $HOME
    base = ["generate", "--max-new-tokens", "6", "--device", "emulated-p150x2", "--temperature", "0.8",
            "--top-k", "40", "--presence-penalty", "0.5", "--seed", "5"]
    batch_cli_equals_alone(capsys, base)
    rc, _, err = cli(capsys, *base, "--prompt", CLI_TEXTS[0], "--prompt", CLI_TEXTS[1], "--logprobs", "2")
    assert rc == 2 and "--logprobs" in err


def test_sampling_users_move_between_buckets(gen):
    """The batched sampler inside the bucketed decoder: five users with their own parameters and seeds join and
    leave buckets 1 / 2 / 4 (grow, shrink, grow again); their sampler rows (parameters, penalty rows, uniform
    streams) move with them, and every user's tokens are its batch-1 ``TTGenerator.generate`` tokens."""
    from qwen36.speculative.sampling import TokenHistory, pick_token
    from qwen36.tt.batch_buckets import BucketedBatchDecoder

    prompts = [prompt(n, 300 + n) for n in (4, 9, 6, 12, 3)]
    params = [USERS[0], USERS[2], USERS[1], USERS[3], USERS[2]]
    limits = [4, 11, 3, 12, 6]
    arrivals = [0, 1, 1, 2, 7]
    want = batch1(gen, prompts, params, max(limits))
    dec = BucketedBatchDecoder(gen.model, (1, 2, 4), shrink_after=2, sampling=True)
    out: list[list[int]] = [[] for _ in prompts]
    active: dict[int, int] = {}  # user -> slot
    try:
        step = 0
        while step <= max(arrivals) or active:
            for u in [u for u in range(len(prompts)) if arrivals[u] == step]:
                slot = dec.free_slots()[0]
                ids = prompts[u].tolist()
                logits = dec.join(slot, ids)
                p = params[u]
                tok = int(pick_token(logits.reshape(1, -1), p, p.generator() if not p.greedy else None,
                                     TokenHistory(ids, gen.config.vocab_size).now()))
                dec.start_sampling(slot, p, ids, tok)
                out[u].append(tok)
                active[u] = slot
            if active:
                got = dec.sample_step({s: out[u][-1] for u, s in active.items()})
                for u, s in list(active.items()):
                    out[u].append(got[s])
                    if len(out[u]) >= limits[u]:
                        dec.leave(s)
                        del active[u]
            step += 1
        caps = {b: d.captures for b, d in dec.decs.items()}
    finally:
        dec.close()
    assert dec.moves[:2] == [(1, 2), (2, 4)] and (4, 2) in dec.moves, dec.moves
    assert max(caps.values()) == 1, caps
    for u in range(len(prompts)):
        assert out[u] == want[u][: limits[u]], u
