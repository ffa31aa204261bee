"""scripts/train_tiny.py: corpus selection rules, the training-time MTP chain (== inference drafting), and a CPU
smoke run at tiny size (loss goes down, bit-identical given the seed, output loads through the normal loader)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.scripts import load_script

tt = load_script("train_tiny")

from qwen36.checkpoint import load_checkpoint  # noqa: E402
from qwen36.reference.model import Qwen36Model  # noqa: E402


def test_corpus_listing_is_sorted_and_excludes_tests_and_generated_files():
    root = tt.stdlib_root()
    rels = tt.list_corpus(root)
    assert rels == sorted(rels) and len(rels) > 100
    for r in rels:
        parts = r.split("/")
        assert not set(parts[:-1]) & tt.EXCLUDED_DIRS, r
        assert not parts[-1].startswith("test_") and not parts[-1].startswith("_sysconfigdata"), r
    assert "argparse.py" in rels
    # the held-out rule depends on the path only
    val = [r for r in rels if tt.is_val(r)]
    assert 0.02 < len(val) / len(rels) < 0.10
    assert tt.is_val("ast.py") and not tt.is_val("argparse.py")


def test_chain_mask_matches_inference_chain():
    m = tt.chain_mask(5, 3, "cpu")  # depth-3 rows: depth-1 keys <= p-2, depth-2 key p-1, itself
    p = 4
    assert m[p, :5].tolist() == [True, True, True, False, False]
    assert m[p, 5:10].tolist() == [False, False, False, True, False]
    assert m[p, 10:].tolist() == [False, False, False, False, True]


@torch.no_grad()
def test_training_chain_equals_inference_drafting_with_forced_tokens():
    """Row p of depth d in mtp_chain_forward == mtp_draft's d-th draft logits for anchor p-d+1 when the chain is
    fed the ground-truth tokens: the MTP is trained on exactly what it does at inference."""
    torch.manual_seed(0)
    cfg = tt.PRESETS["smoke"]
    model = Qwen36Model(cfg, with_mtp=True)
    tt.init_weights(model, cfg, 0)
    for p in model.parameters():  # larger weights: attention patterns far from uniform
        if p.ndim == 2:
            p.mul_(10)
    model.eval()
    t = 12
    x = torch.randint(0, cfg.vocab_size, (1, t + 3), generator=torch.Generator().manual_seed(1))
    out = model(x[:, :t])
    depth1 = model.mtp_forward(x[:, 1:t + 1], out.hidden, 0)[0]
    logits = [model.logits(h) for h in tt.mtp_chain_forward(model, out.hidden, x[:, 1:t + 1], 3)]
    assert (depth1 - logits[0]).abs().max() <= 1e-4
    for a in (0, 4, 9):
        forced = iter([x[0, a + 2], x[0, a + 3], x[0, a + 4]])
        draft = model.mtp_draft(model.new_mtp_state(1, 32), x[:, 1:a + 2], out.hidden[:, :a + 1], 0, 3,
                                pick=lambda lg: next(forced).view(1))
        for d in range(3):
            err = (draft.logits[0, d] - logits[d][0, a + d]).abs().max()
            assert err <= 1e-4, (a, d + 1, float(err))


def _smoke(tmp: Path, data: Path, name: str) -> list[dict]:
    out = tmp / name
    tt.main(["train", "--data", str(data), "--out", str(out), "--preset", "smoke", "--device", "cpu",
             "--steps", "6", "--batch", "4", "--seq", "32", "--threads", "1", "--lr", "1e-2", "--warmup", "1",
             "--eval-every", "3", "--log-every", "1", "--val-windows", "4", "--seed", "3"])
    return [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("smoke-data")
    tt.main(["prepare", "--data", str(d), "--max-files", "8", "--vocab-size", "320"])
    return d


def test_prepare_is_deterministic(smoke_data, tmp_path):
    man = json.loads((smoke_data / "manifest.json").read_text())
    assert man["n_files"] == 8 and man["n_files_split"]["val"] >= 1
    tt.main(["prepare", "--data", str(tmp_path / "again"), "--max-files", "8", "--vocab-size", "320"])
    for f in ("tokenizer.json", "train.u16", "val.u16"):
        assert (smoke_data / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


@pytest.mark.slow  # two training runs
def test_smoke_training_decreases_loss_is_deterministic_and_loads(smoke_data, tmp_path):
    old = torch.get_num_threads()
    try:
        log1 = _smoke(tmp_path, smoke_data, "a")
        log2 = _smoke(tmp_path, smoke_data, "b")
    finally:
        torch.set_num_threads(old)
    train1 = [r for r in log1 if r["event"] == "train"]
    train2 = [r for r in log2 if r["event"] == "train"]
    assert [r["loss"] for r in train1] == [r["loss"] for r in train2], "same seed, same losses (CPU)"
    assert train1[-1]["main_ce"] < train1[0]["main_ce"] - 0.3, [r["main_ce"] for r in train1]
    assert train1[-1]["loss"] < train1[0]["loss"]
    ckpt = tmp_path / "a"
    reader = load_checkpoint(ckpt, require_mtp=True)
    assert reader.config.eos_token_id == (0,)
    model = Qwen36Model.from_reader(reader)
    assert model.mtp is not None
    assert (ckpt / "tokenizer.json").exists() and (ckpt / "train_summary.json").exists()
