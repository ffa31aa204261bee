"""Batch > 1 on the reference (the oracle): plain greedy decoding of B users in one batch-B state with per-row
positions (the speculative engine at B >= 1: tests/speculative/test_engine.py), and the masked-inert packed forward
of the speculative verify (``packed_forward``). Every user's batched
output must be its own batch-1 output; logits are compared too (max abs), since equal tokens alone would hide a
small leak between users."""
from __future__ import annotations

import pytest
import torch

from qwen36.reference.batch import SlotDecoder, generate, packed_forward
from qwen36.reference.model import Qwen36Model
from qwen36.testing.cli import run_cli_streams as cli

# fp32 on CPU: a [B, H] matmul may round differently from the [1, H] one, so batched logits equal the batch-1
# logits to float rounding, not bit for bit (observed max abs ~1e-6 on these checkpoints).
LOGITS_ATOL = 1e-4


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (1, 4, 7, ...), so users sit at different positions every step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1 + 3 * i,), generator=g).tolist() for i in range(n)]


@torch.no_grad()
def batch1_greedy(model, prompt, n, eos=()):
    """Independent batch-1 oracle: one int position, the scalar-position attention path. -> (tokens, logits)."""
    state = model.new_state(1, len(prompt) + n + 1)
    out = model(torch.tensor([prompt]), state)
    toks, lgs = [], []
    while True:
        lg = out.logits[0, -1]
        tok = int(lg.argmax())
        toks.append(tok)
        lgs.append(lg)
        if tok in eos or len(toks) >= n:
            return toks, torch.stack(lgs)
        out = model(torch.tensor([[tok]]), state)


@pytest.fixture(scope="module")
def ci_model(ci_ckpt):
    return Qwen36Model.from_checkpoint(ci_ckpt)


@pytest.mark.parametrize("b", [2, 4, 8])
def test_batched_greedy_equals_each_users_batch1_greedy(ci_model, b):
    prompts = prompts_of(b, ci_model.config.vocab_size, seed=b)
    n = 12
    batch1 = [batch1_greedy(ci_model, p, n) for p in prompts]
    # an EOS that one user emits mid-run: that user stops early, the others go on
    eos = (batch1[1][0][5],)
    batch1 = [batch1_greedy(ci_model, p, n, eos) for p in prompts]
    assert len({len(t) for t, _ in batch1}) > 1, "users should finish at different times"
    got = [r.tokens for r in generate(ci_model, prompts, n, eos_ids=eos)]
    assert got == [t for t, _ in batch1]


def test_slot_decoder_logits_match_batch1_with_users_joining_and_leaving(ci_model):
    """Two slots, three users: A and B decode together, A leaves, C joins A's old slot mid-run. Every logits
    row of every user equals its own batch-1 logits; nothing of A survives in the slot C reuses."""
    vocab = ci_model.config.vocab_size
    a, b, c = prompts_of(3, vocab, seed=7)
    n = 8
    ref = {name: batch1_greedy(ci_model, p, n) for name, p in zip("abc", (a, b, c))}
    dec = SlotDecoder(ci_model, slots=2, max_len=32)
    got = {name: [] for name in "abc"}
    slot_of = {"a": 0}
    nxt = torch.zeros(2, dtype=torch.long)

    def record(name, lg):
        got[name].append(lg)
        nxt[slot_of[name]] = int(lg.argmax())

    record("a", dec.join(0, a))
    for step in range(n - 1):
        if step == 2:
            slot_of["b"] = 1
            record("b", dec.join(1, b))
        if step == 4:  # A stops early (its first 5 tokens), C takes slot 0 at once
            dec.leave(0)
            slot_of["c"] = 0
            del slot_of["a"]
            record("c", dec.join(0, c))
        lg = dec.step(nxt)
        for name, s in list(slot_of.items()):
            record(name, lg[s])
    for name in "abc":
        mine = torch.stack(got[name])
        want = ref[name][1][: len(mine)]
        assert mine.argmax(-1).tolist() == ref[name][0][: len(mine)]
        err = (mine - want).abs().max().item()
        assert err <= LOGITS_ATOL, f"user {name}: max abs logits error {err:.3g} vs its batch-1 run"
    assert len(got["a"]) == 5 and len(got["c"]) == 4 and len(got["b"]) == 6


def test_poisoned_inactive_slot_never_changes_active_users(ci_model):
    """Fill a free slot's whole state (GDN recurrent + conv, KV, far beyond anyone's position) with NaN: the
    active users' logits stay those of a run with a clean free slot, and the slot stays inert."""
    vocab = ci_model.config.vocab_size
    a, b = prompts_of(2, vocab, seed=3)

    def run(poison: bool):
        dec = SlotDecoder(ci_model, slots=3, max_len=24)
        if poison:
            for s in dec.state.layers:
                if hasattr(s, "recurrent"):
                    s.recurrent[2].fill_(float("nan"))
                    s.conv[2].fill_(float("nan"))
                else:
                    s.k[2].fill_(float("nan"))
                    s.v[2].fill_(float("nan"))
            dec.state.pos[2] = 20  # and an odd position: its inert rows must not move the others' masks
        lgs = [torch.stack([dec.join(0, a), dec.join(1, b)])]
        nxt = torch.tensor([int(lgs[0][0].argmax()), int(lgs[0][1].argmax()), 0])
        for _ in range(6):
            lg = dec.step(nxt)[:2]
            lgs.append(lg)
            nxt[:2] = lg.argmax(-1)
        return torch.stack(lgs), dec

    clean, _ = run(False)
    poisoned, dec = run(True)
    assert torch.isfinite(poisoned).all()
    # not bit-equal by construction: the poisoned slot's position widens every row's key window (with zero
    # weight), which may regroup float sums; a leak of the poison would be NaN or O(1), not rounding
    err = (clean - poisoned).abs().max().item()
    assert err <= LOGITS_ATOL, f"max abs logits change {err:.3g} from a poisoned free slot"
    assert dec.positions()[2] == 20  # the inactive slot never advanced
    # and a user joining the poisoned slot decodes exactly as it would alone
    dec.leave(1)
    assert torch.equal(dec.join(2, b), batch1_greedy(ci_model, b, 1)[1][0])  # the same batch-1 prefill


def test_slot_decoder_rejects_misuse(ci_model):
    dec = SlotDecoder(ci_model, slots=2, max_len=8)
    with pytest.raises(ValueError, match="no active slot"):
        dec.step(torch.zeros(2, dtype=torch.long))
    dec.join(0, [1, 2])
    with pytest.raises(ValueError, match="slot 0 is in use"):
        dec.join(0, [3])
    with pytest.raises(ValueError, match="does not fit max_len"):
        dec.join(1, list(range(8)))
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        dec.leave(1)


def test_generate_cli_several_prompts(capsys, tmp_path):
    """`generate` with several prompts decodes them as one batch: `ids[i]` / `prompt[i]` / `text[i]` per user,
    each equal to that prompt's own single-prompt run (whose output keeps the plain `ids:` / `text:` lines);
    --prompts-file gives the same batch; speculative adds per-user acceptance statistics."""
    texts = ["def add(a, b):\n", "import os\nimport sys\n", "x = ["]
    base = ["generate", "--max-new-tokens", "6", "--device", "reference"]
    alone = []
    for t in texts:
        rc, out, _ = cli(capsys, *base, "--prompt", t)
        assert rc == 0
        assert out.startswith("ids: ") and "\nprompt: " in out and "\ntext: " in out and "[0]" not in out
        alone.append(out.splitlines()[0].removeprefix("ids: "))
    argv = [a for t in texts for a in ("--prompt", t)]
    rc, out, err = cli(capsys, *base, *argv)
    assert rc == 0
    lines = out.splitlines()
    assert [l for l in lines if l.startswith("ids[")] == [f"ids[{i}]: {a}" for i, a in enumerate(alone)]
    assert sum(l.startswith("text[") for l in lines) == 3 and "batch 3" in err
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f"{__import__('json').dumps(t)}\n" for t in texts))
    rc, out2, _ = cli(capsys, *base, "--prompts-file", str(path))
    assert rc == 0 and out2 == out

    rc, spec, _ = cli(capsys, *base, *argv, "--spec-k", "2", "--commit", "shadow_commit")
    assert rc == 0
    lines = spec.splitlines()
    assert [l for l in lines if l.startswith("ids[")] == [f"ids[{i}]: {a}" for i, a in enumerate(alone)]
    assert [l for l in lines if l.startswith("user ")] == ["user 0:", "user 1:", "user 2:"]
    assert sum("mean accepted/step" in l for l in lines) == 3 and "users: 3" in spec


def test_generate_cli_batch_errors(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"prompt": 1}\n')
    rc, _, err = cli(capsys, "generate", "--prompts-file", str(bad))
    assert rc == 2 and 'line 2: "prompt" must be a string, got int' in err
    bad.write_text('"ok"\n[1]\n')
    rc, _, err = cli(capsys, "generate", "--prompts-file", str(bad))
    assert rc == 2 and "line 2: expected a JSON string or object, got list" in err
    bad.write_text('"ok"\nnot json\n')
    rc, _, err = cli(capsys, "generate", "--prompts-file", str(bad))
    assert rc == 2 and "line 2: not a JSON string or object" in err
    rc, _, err = cli(capsys, "generate", "--prompts-file", str(tmp_path / "missing"))
    assert rc == 2 and "cannot read" in err
    rc, _, err = cli(capsys, "generate", "--ids", "1,2", "--ids", "3", "--device", "emulated-p150x2",
                     "--spec-k", "auto")
    assert rc == 2 and "--spec-k auto with several prompts" in err and "pass an integer --spec-k" in err


def test_batched_greedy_fp64_model(ci_ckpt):
    """Regression: an fp64 model's GDN state comes back fp64 from a prefill; publishing it into the (fp32-born)
    batch state must widen the batch state, not fail."""
    model = Qwen36Model.from_checkpoint(ci_ckpt, dtype=torch.float64)
    prompts = prompts_of(2, model.config.vocab_size, seed=1)
    assert [r.tokens for r in generate(model, prompts, 4)] == [batch1_greedy(model, p, 4)[0] for p in prompts]


# ---- the masked-inert packed forward -------------------------------------------------------------------
@torch.no_grad()
def test_packed_forward_inert_rows_leave_no_trace(ci_model):
    """Three users at different positions, 4 rows each, of which 4 / 2 / 0 are real: each user's logits of its
    real rows, GDN recurrent + conv state, KV rows and position equal a batch-1 forward of its real rows only;
    the user with none keeps its state exactly; a NaN-poisoned free slot leaks nowhere."""
    m, g = ci_model, torch.Generator().manual_seed(3)
    v = m.config.vocab_size
    dec = SlotDecoder(m, 4, 40)
    prompts = [torch.randint(0, v, (n,), generator=g).tolist() for n in (3, 9, 5)]
    for s, p in enumerate(prompts):
        dec.join(s, p)
    for st in dec.state.gdn_states():  # slot 3 is free and poisoned
        st.recurrent = st.recurrent.index_fill(0, torch.tensor([3]), float("nan"))
    for c in dec.state.kv_caches():
        c.k[3], c.v[3] = float("nan"), float("nan")
    rows = torch.randint(0, v, (4, 4), generator=g)
    n_valid = torch.tensor([4, 2, 0, 0])
    before = dec.state.clone()
    out = packed_forward(m, dec.state, rows, n_valid, dec.active)
    for s, p in enumerate(prompts):
        ref = m.new_state(1, 40)
        m(torch.tensor([p]), ref)
        ref_out = m(rows[s:s + 1, : int(n_valid[s])], ref, gdn_mode="recurrent") if n_valid[s] else None
        if ref_out is not None:
            assert (out.logits[s, : int(n_valid[s])] - ref_out.logits[0]).abs().max() < LOGITS_ATOL
        for x, y in zip(dec.state.gdn_states(), ref.gdn_states()):
            assert (x.recurrent[s] - y.recurrent[0]).abs().max() < LOGITS_ATOL
            assert (x.conv[s] - y.conv[0]).abs().max() < LOGITS_ATOL
        end = ref.pos
        for x, y in zip(dec.state.kv_caches(), ref.kv_caches()):
            assert (x.k[s, :, :end] - y.k[0, :, :end]).abs().max() < LOGITS_ATOL
        assert int(dec.state.pos[s]) == end
    for x, y in zip(dec.state.gdn_states(), before.gdn_states()):  # user 2 (no real rows): bit for bit
        assert torch.equal(x.recurrent[2], y.recurrent[2]) and torch.equal(x.conv[2], y.conv[2])
        assert x.recurrent[3].isnan().all()  # the free slot: put back, not advanced
    assert dec.state.pos.tolist()[2:] == before.pos.tolist()[2:]
    assert out.logits[:3].isfinite().all()
    with pytest.raises(ValueError, match="free slot"):
        packed_forward(m, dec.state, rows, torch.tensor([1, 1, 1, 1]), dec.active)
