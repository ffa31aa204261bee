#!/usr/bin/env python3
"""Evaluate a trained checkpoint: held-out loss vs a unigram baseline, and greedy speculative acceptance.

    python scripts/spec_eval.py make-heldout --data DATA_DIR --checkpoint CKPT [--out CKPT/heldout_eval.json]
        held-out prompts + loss windows (token ids from held-out stdlib files) and the training split's
        unigram counts, so that tests and the model card need no corpus.
    python scripts/spec_eval.py eval --checkpoint CKPT [--ks 1,2,3,4,5 --max-new-tokens 64 --out eval.json]
        held-out CE (reference model, fp32) vs unigram CE on the same tokens; greedy acceptance per K through
        the speculative engine (qwen36/speculative/engine.py) AND the one-function greedy loop
        (qwen36/speculative/greedy_loop.py, which shares no code with the engine) that must agree with it step
        for step.

Acceptance figures: ``mean emitted per step`` = accepted drafts + the one correction/bonus token;
``per_position[i]`` = fraction of steps whose first i+1 drafts were all accepted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HELDOUT_FILE = "heldout_eval.json"
PROMPT_LEN = 64
LOSS_WINDOW = 256


# ---------------------------------------------------------------------------------------------------------
# held-out set
# ---------------------------------------------------------------------------------------------------------
def make_heldout(data_dir: Path, out: Path, n_loss_windows: int = 16, min_doc: int = 256) -> dict:
    """Prompts: one per held-out file of >= min_doc tokens, PROMPT_LEN tokens starting at the first line start
    after a third of the file. Loss windows: LOSS_WINDOW-token windows spread evenly over the held-out stream."""
    from tokenizers import Tokenizer

    from qwen36.io_utils import atomic_write_json

    man = json.loads((data_dir / "manifest.json").read_text())
    val = np.fromfile(data_dir / "val.u16", dtype=np.uint16).astype(np.int64)
    train = np.fromfile(data_dir / "train.u16", dtype=np.uint16).astype(np.int64)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    newline_ids = {i for i in range(tok.get_vocab_size()) if tok.decode([i]).endswith("\n")}
    prompts = []
    for rel, start, n in man["docs"]["val"]:
        if n < min_doc:
            continue
        p = start + n // 3
        while p < start + n - PROMPT_LEN - 1 and int(val[p - 1]) not in newline_ids:
            p += 1
        prompts.append({"file": rel, "offset": int(p - start), "ids": val[p:p + PROMPT_LEN].tolist()})
    stride = (len(val) - LOSS_WINDOW) // n_loss_windows
    windows = [val[i * stride:i * stride + LOSS_WINDOW].tolist() for i in range(n_loss_windows)]
    counts = np.bincount(train, minlength=man["tokenizer"]["vocab_size"]).tolist()
    data = {
        "about": "Held-out evaluation data of the embedded default checkpoint: token ids (its tokenizer) from the "
                 "held-out split of the Python stdlib corpus, and the training split's token counts (unigram baseline).",
        "corpus_sha256": man["corpus_sha256"], "python": man["python"],
        "prompt_len": PROMPT_LEN, "prompts": prompts,
        "loss_window": LOSS_WINDOW, "loss_windows": windows,
        "unigram_train_counts": counts, "unigram_smoothing": "add-one",
    }
    atomic_write_json(out, data)
    return data


def load_heldout(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / HELDOUT_FILE).read_text())


def unigram_ce_of(counts: list[int], ids: torch.Tensor) -> float:
    c = torch.tensor(counts, dtype=torch.float64) + 1.0
    logp = (c / c.sum()).log()
    return float(-logp[ids.reshape(-1)].mean())


@torch.no_grad()
def heldout_ce(model, windows: list[list[int]]) -> float:
    """Mean next-token CE (nats/token) over all positions of the windows (each run independently)."""
    tot, n = 0.0, 0
    dev = model.embed_tokens.weight.device
    for w in windows:
        ids = torch.tensor([w], device=dev)
        logits = model(ids[:, :-1]).logits[0]
        tot += float(F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    return tot / n


# ---------------------------------------------------------------------------------------------------------
# acceptance
# ---------------------------------------------------------------------------------------------------------
def summarize(k: int, accepted: list[int]) -> dict:
    steps = len(accepted)
    return {"k": k, "steps": steps, "mean_accepted": sum(accepted) / max(1, steps),
            "mean_emitted": 1 + sum(accepted) / max(1, steps),
            "per_position": [sum(a >= i for a in accepted) / max(1, steps) for i in range(1, k + 1)],
            "conditional": [sum(a >= i for a in accepted) / max(1, sum(a >= i - 1 for a in accepted))
                            for i in range(1, k + 1)]}


def engine_acceptance(model, prompts: list[list[int]], k: int, max_new_tokens: int, mechanism: str = "shadow_commit"):
    """Greedy acceptance through the project's speculative engine. Returns (summary, tokens per prompt, seconds)."""
    from qwen36.speculative.engine import speculative_generate
    from qwen36.speculative.reference_backend import ReferenceBackend

    per_prompt, outs = [], []
    t0 = time.perf_counter()
    for p in prompts:
        backend = ReferenceBackend(model, mechanism, max_len=len(p) + max_new_tokens + k + 2, max_k=k)
        res = speculative_generate(backend, [p], max_new_tokens, [k])[0]
        per_prompt.append(res.stats.accepted)
        outs.append(res.tokens)
    summ = summarize(k, [a for acc in per_prompt for a in acc])
    summ["accepted_per_prompt"] = per_prompt
    return summ, outs, time.perf_counter() - t0


@torch.no_grad()
def full_split_ce(model, data_dir: Path, window: int = 512) -> dict:
    """CE over the whole held-out split in non-overlapping windows (each predicts its window-1 next tokens)."""
    val = np.fromfile(Path(data_dir) / "val.u16", dtype=np.uint16).astype(np.int64)
    train = np.fromfile(Path(data_dir) / "train.u16", dtype=np.uint16).astype(np.int64)
    n = len(val) // window
    windows = [val[i * window:(i + 1) * window].tolist() for i in range(n)]
    ce = heldout_ce(model, windows)
    targets = torch.tensor([w[1:] for w in windows])
    counts = np.bincount(train, minlength=model.config.vocab_size).tolist()
    return {"window": window, "n_windows": n, "n_tokens": int(targets.numel()), "ce": ce,
            "unigram_ce": unigram_ce_of(counts, targets)}


def evaluate(ckpt: Path, ks: list[int], max_new_tokens: int, n_prompts: int | None, cross_check_k: int = 3,
             data_dir: Path | None = None) -> dict:
    from qwen36.reference.batch import generate
    from qwen36.reference.model import Qwen36Model
    from qwen36.speculative.greedy_loop import greedy_speculative_generate

    torch.manual_seed(0)
    model = Qwen36Model.from_checkpoint(ckpt, require_mtp=True)
    ho = load_heldout(ckpt)
    prompts = [p["ids"] for p in ho["prompts"]][:n_prompts]
    ce = heldout_ce(model, ho["loss_windows"])
    targets = torch.tensor([w[1:] for w in ho["loss_windows"]])
    uni = unigram_ce_of(ho["unigram_train_counts"], targets)
    res = {"checkpoint": str(ckpt), "backend": "reference (torch CPU, fp32)",
           "heldout_ce": ce, "unigram_ce": uni, "n_loss_tokens": int(targets.numel()),
           "n_prompts": len(prompts), "prompt_len": ho["prompt_len"], "max_new_tokens": max_new_tokens,
           "acceptance": {}}
    if data_dir is not None:
        res["full_heldout_split"] = full_split_ce(model, data_dir)
        print(json.dumps(res["full_heldout_split"]), flush=True)
    for k in ks:
        summ, outs, secs = engine_acceptance(model, prompts, k, max_new_tokens)
        summ["seconds"] = round(secs, 2)
        res["acceptance"][str(k)] = summ
        print(json.dumps({"k": k, **summ}), flush=True)
        if k == cross_check_k:
            mine = [greedy_speculative_generate(model, p, max_new_tokens, k) for p in prompts]
            acc_mine = [a for _, acc in mine for a in acc]
            res["cross_check"] = {"k": k, "minimal_loop": summarize(k, acc_mine),
                                  "tokens_equal_engine": all(m[0] == o for m, o in zip(mine, outs)),
                                  "accepted_equal_engine": [m[1] for m in mine] == summ["accepted_per_prompt"]}
            greedy = [generate(model, [p], max_new_tokens)[0].tokens for p in prompts]
            res["cross_check"]["tokens_equal_plain_greedy"] = sum(g == o for g, o in zip(greedy, outs))
            print(json.dumps(res["cross_check"]), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-heldout")
    m.add_argument("--data", required=True, type=Path)
    m.add_argument("--checkpoint", required=True, type=Path)
    m.add_argument("--threads", type=int, default=1)
    e = sub.add_parser("eval")
    e.add_argument("--checkpoint", required=True, type=Path)
    e.add_argument("--ks", default="1,2,3,4,5")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--n-prompts", type=int, default=None)
    e.add_argument("--out", type=Path, default=None)
    e.add_argument("--data", type=Path, default=None, help="prepared data dir: also score the whole held-out split")
    e.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for batch-1 decode of tiny models)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cmd == "make-heldout":
        d = make_heldout(args.data, args.checkpoint / HELDOUT_FILE)
        print(f"{len(d['prompts'])} prompts, {len(d['loss_windows'])} loss windows -> {args.checkpoint / HELDOUT_FILE}")
    else:
        res = evaluate(args.checkpoint, [int(x) for x in args.ks.split(",")], args.max_new_tokens, args.n_prompts,
                       data_dir=args.data)
        print(json.dumps({k: v for k, v in res.items() if k != "acceptance"}, indent=1))
        if args.out:
            from qwen36.io_utils import atomic_write_json

            atomic_write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
