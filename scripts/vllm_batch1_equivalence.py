#!/usr/bin/env python
"""At one sequence, the vLLM adapter's two servers fed the same plugin calls: the one-sequence server
(``OneSequenceServer``: prefill and decode on ``TTGenerator``, what a ``max_num_seqs`` 1 launch uses) and the batch
server at B = 1 (``_BatchServer``: ``BucketedBatchDecoder`` with bucket 1, what 2..32 use). Emulated 1x2 mesh, CI
checkpoint, the call sequence of tests/tt/serving/test_vllm_contract.py's ``PluginReplay`` (vLLM's block table, two-phase
warmup): a prefill, decode steps as ``decode_forward``, then a second request whose steps arrive as one-token
prefill continuations (the synchronous runner's form). Prints whether the tokens and every returned logits row are
bitwise equal (and the max abs difference), and the batch decoder's captures.

    .venv/bin/python scripts/vllm_batch1_equivalence.py [--steps 24]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="tokens per request (prefill's + decode steps)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from test_vllm_contract import P, PROMPT, PluginReplay, open_env

    from qwen36.tt.serving.vllm_batch import _BatchServer

    class Dirs:  # what open_env needs of pytest's tmp_path_factory
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))

    ck, ctx = open_env(Dirs(), "batch1")
    res = {}
    for variant in ("one-sequence server", "batch server B=1"):
        r = PluginReplay(ck, ctx.mesh_device, spec_k=None)
        if variant.startswith("batch"):
            r.m.release_persistent_capture()  # no trace may be live while the batch decoder allocates
            srv = _BatchServer(r.m, 1)
            srv.on_kv_pool(r.m.num_blocks)
            r.m.server = r.m.batch = srv
            r.m.already_warmed_up_prefill = False
            r.m.warmup_model_prefill(kv_cache=r.kv, enable_trace=False)
            r.m.warmup_model_decode(kv_cache=r.kv, enable_trace=False, max_batch_size=1)
            r.m.warmup_model_decode(kv_cache=r.kv, enable_trace=True, max_batch_size=1)
        rows = []
        out = r.m.prefill_forward(tokens=torch.tensor([PROMPT], dtype=torch.int32), page_table=r.table(P),
                                  kv_cache=r.kv, prompt_lens=torch.tensor([P], dtype=torch.int32),
                                  start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])[0]
        rows.append(out[0, -1].clone())
        toks = [int(out[0, -1].argmax())]
        while len(toks) < args.steps:
            pos = P + len(toks) - 1
            o = r.m.decode_forward(tokens=torch.tensor([[toks[-1]]], dtype=torch.int32), page_table=r.table(pos + 1),
                                   kv_cache=r.kv, start_pos=torch.tensor([pos], dtype=torch.int32), enable_trace=True)
            rows.append(o[0, -1].clone())
            toks.append(int(o[0, -1].argmax()))
        r.finish()
        seq = list(PROMPT) + [r.prefill(PROMPT)]
        while len(seq) < P + args.steps:
            lg = r.continue_prefill(seq)
            rows.append(lg[0, -1].clone())
            seq.append(int(lg[0, -1].argmax()))
        r.finish()
        res[variant] = (toks, seq[P:], torch.stack(rows))
        if variant.startswith("batch"):
            print("batch decoder captures:", {n: c for d in srv.dec.decs.values() for n, c in d.traces.captures.items()})
        r.m.release_persistent_capture()
    (a_dec, a_cont, a), (b_dec, b_cont, b) = res.values()
    d = (a - b).abs()
    print(f"backend: emulated-p150x2 (ttnn goldens on CPU, no hardware), CI checkpoint, {a.shape[0]} logits rows")
    print(f"tokens equal: decode_forward {a_dec == b_dec}, continuations {a_cont == b_cont}; logits bitwise equal: "
          f"{torch.equal(a, b)} (max abs {float(d.max()):.3g}, rows differing {int((d.amax(-1) > 0).sum())})")
    ctx.close()
    return 0 if torch.equal(a, b) and a_dec == b_dec and a_cont == b_cont else 1


if __name__ == "__main__":
    sys.exit(main())
