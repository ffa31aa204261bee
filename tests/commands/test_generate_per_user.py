"""Per-user sampling settings through `qwen36 generate --prompts-file` (commands/generate.py ``user_requests``):
each JSONL line may carry its own temperature/top-k/top-p/min-p/penalties/seed/logprobs/max_tokens, and the users
decode as one batch (speculative: one B-slot backend, each user its own params; plain: one batch).

Checks: a bad line is a one-line error naming line and field; a speculative batch of greedy and sampled users on the
reference (default checkpoint, trained MTP: drafts are accepted) gives each user its own batch-1 run (tokens, and the
raw logprobs, top-20 per token, within float rounding) and the greedy users their plain batch-1 output; a sampled
user's first two tokens in a mixed batch follow its own target law p(x1) p(x2 | x1) (chi-square). The TT path (the
B-slot TTSpecBackend with per-user stages, plain TTBatchDecoder + DeviceSampler) runs the same users on the
emulated mesh (slow).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qwen36 import DEFAULT_CHECKPOINT
from qwen36.cli import build_parser
from qwen36.commands.generate import user_requests
from qwen36.commands.speculative_generate import load_backend
from qwen36.speculative.engine import speculative_generate
from qwen36.generation.sampling import SamplingParams, probs_from_logits
from qwen36.testing.cli import assert_one_line_error, run_cli, run_cli_streams as cli
from qwen36.testing.stats import P_VALUE_MIN, chi2_p, rank_cell

# fp32 on CPU: a packed B-row verify may round differently from the one-row one (tests/reference/test_slot_decoder.py)
LOGPROB_ATOL = 1e-4
PROMPTS = [[1734, 4064, 17, 279, 1076], [4064, 17, 279, 1076, 4064, 17, 279], [17, 279, 1076]]
# greedy with logprobs; sampled (top-k, its own seed and budget); greedy with a repetition penalty
LINES = [{"ids": PROMPTS[0], "logprobs": 20},
         {"ids": PROMPTS[1], "temperature": 1.2, "top_k": 8, "seed": 5, "logprobs": 20, "max_tokens": 5},
         {"ids": PROMPTS[2], "repetition_penalty": 1.3, "max_tokens": 7}]
N_NEW = 6


def write_lines(path, lines) -> str:
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return str(path)


def requests(tmp_path, lines, *argv, speculative=True):
    args = build_parser().parse_args(["generate", "--prompts-file", write_lines(tmp_path / "u.jsonl", lines),
                                      "--max-new-tokens", str(N_NEW), *argv])
    return user_requests(args, DEFAULT_CHECKPOINT, speculative)


def run_reference(users, k=2):
    """What run_speculative_generate does on the reference: one backend of len(prompts) slots, per-user params."""
    max_len = max(map(len, users.prompts)) + max(users.max_tokens) + k + 2
    be = load_backend(DEFAULT_CHECKPOINT, "reference", torch.float32, "shadow_commit", max_len, k,
                      users=len(users.prompts), params=users.params[0], per_user=users.params)
    return speculative_generate(be, users.prompts, users.max_tokens, [k] * len(users.prompts), users.params,
                                eos_ids=be.model.config.eos_token_id)


def logprob_gap(a, b) -> float:
    """Max abs between two runs' raw logprobs (the emitted token's and the top-n), same tokens and ids."""
    assert [(x.token, [t for t, _ in x.top]) for x in a] == [(y.token, [t for t, _ in y.top]) for y in b]
    return max(abs(v - w) for x, y in zip(a, b) for v, w in zip([x.logprob, *(v for _, v in x.top)],
                                                                  [y.logprob, *(v for _, v in y.top)]))


def test_prompts_file_lines_set_each_users_params(tmp_path):
    users = requests(tmp_path, [*LINES, {"ids": [3], "seed": 9}], "--temperature", "0.5", "--top-p", "0.9",
                     "--seed", "40")
    assert users.per_user and users.prompts == [*PROMPTS, [3]] and users.max_tokens == [N_NEW, 5, 7, N_NEW]
    assert users.params[0] == SamplingParams(0.5, top_p=0.9, seed=40, logprobs=20)  # the command line's, seed + i
    assert users.params[1] == SamplingParams(1.2, top_k=8, top_p=0.9, seed=5, logprobs=20)
    assert users.params[2] == SamplingParams(0.5, top_p=0.9, seed=42, repetition_penalty=1.3)
    assert users.params[3].seed == 9
    plain = requests(tmp_path, [{"ids": [1]}, {"ids": [2]}], "--seed", "3", speculative=False)
    assert not plain.per_user and [p.seed for p in plain.params] == [3, 3]  # plain: every user --seed, as before


@pytest.mark.parametrize("line, fragment", [
    ({"ids": [1], "topk": 3}, "line 2: unknown field 'topk'"),
    ({"ids": [1], "temperature": -1}, "line 2: temperature must be >= 0"),
    ({"ids": [1], "top_p": "0.5"}, "line 2: top_p must be a finite number"),
    ({"ids": [1], "seed": 1.5}, "line 2: seed must be an integer"),
    ({"ids": [1], "max_tokens": 0}, "line 2: max_tokens must be a positive integer"),
    ({"ids": [1], "prompt": "x"}, 'line 2: give exactly one of "prompt"'),
    ({"ids": [1, -2]}, 'line 2: "ids" must be a non-empty list of non-negative integers'),
    ({"prompt": "x"}, "mixes text prompts and \"ids\" lines"),
])
def test_prompts_file_bad_line_is_one_line_error(capsys, tmp_path, line, fragment):
    path = write_lines(tmp_path / "bad.jsonl", [{"ids": [1]}, line])
    assert_one_line_error(*run_cli(capsys, "generate", "--prompts-file", path), fragment)


def test_tt_per_user_sampled_drafts_refused_before_loading(capsys, tmp_path):
    """The packed device MTP chain drafts by argmax for per-user params: sampled drafts are refused up front."""
    path = write_lines(tmp_path / "u.jsonl", LINES)
    assert_one_line_error(*run_cli(capsys, "generate", "--prompts-file", path, "--spec-k", "2", "--device",
                                   "emulated-p150x2"), "user 1", "pass --draft greedy")


def test_reference_plain_batch_takes_each_users_settings(capsys, tmp_path):
    """The reference's plain batch (the one plain driver) takes every user's budget and sampling settings: each
    user's printed tokens equal its own run alone (a greedy user with logprobs, a seeded sampled one, a penalised
    one)."""
    lines = [{"ids": PROMPTS[0], "max_tokens": 3}, {"ids": PROMPTS[2]}]
    rc, out, _ = cli(capsys, "generate", "--prompts-file", write_lines(tmp_path / "u.jsonl", lines),
                     "--max-new-tokens", str(N_NEW))
    assert rc == 0
    from qwen36.reference.model import Qwen36Model
    from qwen36.reference.batch import generate

    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT)
    eos = model.config.eos_token_id
    alone = [generate(model, [p], n, SamplingParams(), eos)[0].tokens for p, n in ((PROMPTS[0], 3), (PROMPTS[2], N_NEW))]
    ids = [[int(t) for t in l.split(": ")[1].split(",")] for l in out.splitlines() if l.startswith("ids[")]
    assert ids == alone and len(alone[0]) == 3
    users = requests(tmp_path, LINES, speculative=False)
    rc, out, _ = cli(capsys, "generate", "--prompts-file", write_lines(tmp_path / "s.jsonl", LINES),
                     "--max-new-tokens", str(N_NEW))
    assert rc == 0
    ids = [[int(t) for t in l.split(": ")[1].split(",")] for l in out.splitlines() if l.startswith("ids[")]
    want = [generate(model, [p], n, sp, eos)[0].tokens for p, n, sp in zip(PROMPTS, users.max_tokens, users.params)]
    assert ids == want


def test_reference_speculative_mixed_batch_equals_each_user_alone(capsys, tmp_path):
    """Greedy and sampled users with their own settings in one B = 3 speculative batch: each user's tokens,
    accepted counts and logprobs equal its own batch-1 run (same seed); the greedy users' tokens and logprobs equal
    their plain batch-1 output; and the command line prints the same per-user lines."""
    users = requests(tmp_path, LINES, "--spec-k", "2")
    got = run_reference(users)
    greedy_plain = {}
    from qwen36.reference.model import Qwen36Model
    from qwen36.reference.batch import generate

    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT)
    for u, line in enumerate(LINES):
        alone = requests(tmp_path, [{**line, "seed": users.params[u].seed}], "--spec-k", "2")  # the same stream
        want = run_reference(alone)[0]
        assert alone.params[0] == users.params[u]
        assert got[u].tokens == want.tokens and len(got[u].tokens) == users.max_tokens[u], f"user {u}"
        assert got[u].stats.accepted == want.stats.accepted, f"user {u}"
        if users.params[u].logprobs is not None:
            assert logprob_gap(got[u].logprobs, want.logprobs) <= LOGPROB_ATOL, f"user {u}"
        if users.params[u].greedy:
            plain = generate(model, [PROMPTS[u]], users.max_tokens[u], users.params[u], model.config.eos_token_id)[0]
            assert got[u].tokens == plain.tokens, f"user {u}"
            greedy_plain[u] = plain
    assert logprob_gap(got[0].logprobs, greedy_plain[0].logprobs) <= LOGPROB_ATOL
    assert any(a > 0 for r in got for a in r.stats.accepted)  # drafts were accepted
    assert got[1].tokens != generate(model, [PROMPTS[1]], 5, SamplingParams(), ())[0].tokens  # user 1 sampled

    # the command line prints these users' tokens
    write_lines(tmp_path / "u.jsonl", LINES)
    rc, out, _ = cli(capsys, "generate", "--prompts-file", str(tmp_path / "u.jsonl"), "--spec-k", "2",
                     "--max-new-tokens", str(N_NEW))
    assert rc == 0
    lines = out.splitlines()
    assert [l for l in lines if l.startswith("ids[")] == [f"ids[{u}]: {','.join(map(str, r.tokens))}"
                                                          for u, r in enumerate(got)]


@pytest.mark.slow
def test_reference_sampled_user_in_mixed_batch_follows_its_law(tmp_path):
    """A sampled user (T = 1, top-k 4, stochastic MTP drafts) beside a greedy user in one speculative batch: each
    of its N emitted tokens, binned by its rank under its own law given the history before it (the target's
    teacher-forced logits through that user's transform), fits the summed per-step rank probabilities (chi-square;
    the sequence's law is the product of these conditionals, and the tokens come out of join, acceptance, residual
    resampling and bonus picks alike). The greedy user equals its own batch-1 run."""
    n, k, top_k = 150, 2, 4
    lines = [{"ids": PROMPTS[0], "max_tokens": 8}, {"ids": PROMPTS[1], "temperature": 1.0, "top_k": top_k, "seed": 7,
                                                    "max_tokens": n}]
    users = requests(tmp_path, lines, "--spec-k", str(k))
    got = run_reference(users, k)
    greedy_alone = run_reference(requests(tmp_path, lines[:1], "--spec-k", str(k)), k)[0]
    assert got[0].tokens == greedy_alone.tokens
    toks, params = got[1].tokens, users.params[1]
    assert len(toks) == n and any(a > 0 for a in got[1].stats.accepted)
    from qwen36.reference.model import Qwen36Model

    model = Qwen36Model.from_checkpoint(DEFAULT_CHECKPOINT)
    seq = PROMPTS[1] + toks
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]), model.new_state(1, len(seq))).logits[0, len(PROMPTS[1]) - 1:]

    def fit(law: SamplingParams) -> tuple[float, list, list]:
        probs = probs_from_logits(logits.double(), law)  # [n, V]: each step's law given the tokens before it
        observed = torch.zeros(top_k + 1, dtype=torch.float64)
        expected = torch.zeros(top_k + 1, dtype=torch.float64)
        for row, tok in zip(probs, toks):
            observed[rank_cell(row, tok, top_k)] += 1
            expected[:top_k] += row.sort(descending=True).values[:top_k]
        return chi2_p(observed, expected), observed.tolist(), expected.tolist()

    p, obs, exp = fit(params)
    assert p > P_VALUE_MIN, (p, obs, exp)
    # negative control: the same tokens against a colder law (what a sampler reading another user's temperature
    # would draw from) are rejected
    p_cold, obs, exp = fit(dataclasses.replace(params, temperature=0.5))
    assert p_cold < P_VALUE_MIN, (p_cold, obs, exp)
    print(f"chi-square p {p:.3f}; colder law p {p_cold:.1e}")


# ---- TT (emulated P150a x2 mesh): the same users through the TT backends the command loads --------------------------
TT_LINES = [{"ids": PROMPTS[0], "logprobs": 2, "max_tokens": 4},
            {"ids": PROMPTS[1], "temperature": 1.2, "top_k": 8, "seed": 5, "logprobs": 2, "max_tokens": 3}]


@pytest.mark.slow
def test_tt_speculative_mixed_batch_equals_each_user_alone(tmp_path):
    """A greedy and a sampled user (argmax device drafts) in one B-slot TTSpecBackend with per-user stages, loaded
    as the command loads it: each user's tokens, accepted counts and raw logprobs equal the same user run alone on
    the one-user layout (what `generate` runs for one prompt), exactly."""
    k = 1
    users = requests(tmp_path, TT_LINES, "--spec-k", str(k), "--draft", "greedy")
    max_len = max(map(len, users.prompts)) + max(users.max_tokens) + k + 2

    def run(us, b):
        be = load_backend(DEFAULT_CHECKPOINT, "emulated-p150x2", None, "snapshot", max_len, k, users=b,
                          params=us.params[0], per_user=us.params, precision="performance")
        try:
            assert b == 1 or be.stages is not None  # per-user params: the acceptor holds every user's stages
            return speculative_generate(be, us.prompts, us.max_tokens, [k] * len(us.prompts), us.params,
                                        eos_ids=be.config.eos_token_id)
        finally:
            be.close()

    got = run(users, 2)
    for u, line in enumerate(TT_LINES):
        want = run(requests(tmp_path, [{**line, "seed": users.params[u].seed}], "--spec-k", str(k), "--draft",
                            "greedy"), 1)[0]
        assert got[u].tokens == want.tokens and len(want.tokens) == users.max_tokens[u], f"user {u}"
        assert got[u].stats.accepted == want.stats.accepted, f"user {u}"
        assert logprob_gap(got[u].logprobs, want.logprobs) == 0.0, f"user {u}"


@pytest.mark.slow
def test_tt_plain_mixed_batch_equals_each_user_alone(tmp_path):
    """The same users decoded plain as one TT batch (``TTGenerator.generate``: TTBatchDecoder + a DeviceSampler with
    their stages): each user's tokens and raw logprobs equal its batch-1 ``generate``, exactly."""
    from qwen36.testing.tt import small_tt_generator

    users = requests(tmp_path, TT_LINES, speculative=False)
    gen = small_tt_generator(DEFAULT_CHECKPOINT, prefill_chunk=64)
    try:
        eos = gen.config.eos_token_id
        got = gen.generate(users.prompts, users.max_tokens, users.params, eos)
        for u in range(len(TT_LINES)):
            want = gen.generate([users.prompts[u]], users.max_tokens[u], users.params[u], eos)[0]
            assert got[u].tokens == want.tokens and len(got[u].tokens) == users.max_tokens[u], f"user {u}"
            assert logprob_gap(got[u].logprobs, want.logprobs) == 0.0, f"user {u}"
    finally:
        gen.close()
