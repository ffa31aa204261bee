#!/usr/bin/env python
"""A plain ``max_num_seqs`` 1 launch of the vLLM adapter fed the plugin's one-sequence call sequences, its outputs
saved, or compared with those another checkout of this repository saved (``--against``): the check that moving
one sequence from the one-sequence server (``TTGenerator``) onto the batch server at B = 1
(``BucketedBatchDecoder``, bucket 1) changed no number. Emulated 1x2 mesh, CI checkpoint, the calls of
tests/tt/serving/test_vllm_contract.py's ``PluginReplay`` (vLLM's block table, two-phase warmup):
1. a prefill, then decode steps as ``decode_forward`` (``read_from_device=False``);
2. a second request whose decode steps arrive as one-token prefill continuations (the synchronous runner's form);
3. on a launch sampling on device (``sample_on_device_mode`` "all"): a seeded request with top-k, top-p and every
   penalty, ids back from the prefill, from continuations and from ``decode_forward`` with ``sampling_params``.
Prints which server ran, the trace captures of each phase, and (with ``--against``) whether every logits row is
bitwise equal (max abs difference) and the token ids equal.

    .venv/bin/python scripts/vllm_batch1_equivalence.py --save after.pt [--against before.pt] [--steps 24]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class Dirs:  # what open_env needs of pytest's tmp_path_factory
    def mktemp(self, name):
        return Path(tempfile.mkdtemp(prefix=name))


def count_captures():
    """Count every trace capture (``TracedStep.capture``: the generator's and the batch decoder's) by name."""
    from qwen36.tt.runtime import trace

    counts: Counter[str] = Counter()
    orig = trace.TracedStep.capture

    def capture(self, *a, **kw):
        counts[getattr(self, "name", "?")] += 1
        return orig(self, *a, **kw)

    trace.TracedStep.capture = capture
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="tokens per request (prefill's + decode steps)")
    ap.add_argument("--save", type=Path, required=True, help="write this checkout's outputs here (torch.save)")
    ap.add_argument("--against", type=Path, help="outputs another checkout saved: compare bitwise")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from test_vllm_contract import P, PROMPT, PluginReplay, open_env
    from test_vllm_sampling import STOCHASTIC, SamplingReplay, runner_payload

    counts = count_captures()
    ck, ctx = open_env(Dirs(), "batch1")
    res, caps = {}, {}
    r = PluginReplay(ck, ctx.mesh_device, spec_k=None)
    server = type(r.m.server).__name__
    caps["warmup"], rows = dict(counts), []
    counts.clear()
    out = r.m.prefill_forward(tokens=torch.tensor([PROMPT], dtype=torch.int32), page_table=r.table(P), kv_cache=r.kv,
                              prompt_lens=torch.tensor([P], dtype=torch.int32),
                              start_pos=torch.tensor([0], dtype=torch.int32), empty_slots=[0])[0]
    rows.append(out[0, -1].clone())
    toks = [int(out[0, -1].argmax())]
    r.first_decode = True
    while len(toks) < args.steps:
        pos = P + len(toks) - 1
        h = r.m.decode_forward(tokens=torch.tensor([[toks[-1]]], dtype=torch.int32), page_table=r.table(pos + 1),
                               kv_cache=r.kv, start_pos=torch.tensor([pos], dtype=torch.int32), **r._rope(),
                               enable_trace=True, read_from_device=False)
        o = r.m.process_decode_output_host(h, is_tokens=False)
        rows.append(o[0, -1].clone())
        toks.append(int(o[0, -1].argmax()))
    r.finish()
    caps["request 1 (decode_forward)"] = dict(counts)
    counts.clear()
    seq = list(PROMPT) + [r.prefill(PROMPT)]
    while len(seq) < P + args.steps:
        lg = r.continue_prefill(seq)
        rows.append(lg[0, -1].clone())
        seq.append(int(lg[0, -1].argmax()))
    r.finish()
    caps["request 2 (continuations)"] = dict(counts)
    res["logits"], res["decode_tokens"], res["continuation_tokens"] = torch.stack(rows), toks, seq[P:]
    r.m.release_persistent_capture()

    s = SamplingReplay(ck, ctx.mesh_device, spec_k=None, sample_on_device="all")
    counts.clear()
    vocab = s.m.model.args.cfg.vocab_size
    sp = runner_payload(STOCHASTIC, vocab)
    sampled = [s.prefill_tokens(PROMPT, sp)]
    half = args.steps // 2
    while len(sampled) < args.steps:  # half as continuations, half as decode_forward with the runner's history
        if len(sampled) < half:
            sampled.append(int(s.continue_prefill(list(PROMPT) + sampled, sp).reshape(-1)[0]))
        else:
            sampled.append(s.decode_tokens(sampled[-1], P + len(sampled) - 1, sp, history=(PROMPT, list(sampled))))
    s.finish()
    caps["request 3 (device-sampled)"] = dict(counts)
    res["sampled_tokens"] = sampled
    s.m.release_persistent_capture()
    ctx.close()

    res["server"], res["captures"] = server, caps
    torch.save(res, args.save)
    print(f"backend: emulated-p150x2 (ttnn goldens on CPU, no hardware), CI checkpoint; server: {server}")
    for phase, c in caps.items():
        print(f"  trace captures, {phase}: {c}")
    print(f"{res['logits'].shape[0]} logits rows, {len(sampled)} device-sampled ids -> {args.save}")
    if args.against is None:
        return 0
    ref = torch.load(args.against)
    d = (res["logits"] - ref["logits"]).abs()
    same = {k: res[k] == ref[k] for k in ("decode_tokens", "continuation_tokens", "sampled_tokens")}
    bitwise = torch.equal(res["logits"], ref["logits"])
    print(f"against {args.against} (server {ref['server']}): logits bitwise equal {bitwise} (max abs "
          f"{float(d.max()):.3g}, rows differing {int((d.amax(-1) > 0).sum())} of {d.shape[0]}); tokens equal {same}")
    return 0 if bitwise and all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
