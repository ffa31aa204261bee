"""Probe verify-tp: packed K+1-row verify vs K+1 sequential single-row decodes on the TT target at TP=N.

For K in {1,3,7} and two page tables (identity = "unpaged" contiguous pages; shuffled = "paged", the sequence's
pages scattered over the cache), from the same post-prefill state:
  * sequential: K+1 eager single-row decode steps (the plain decode path) over rows [x_0..x_K];
  * packed: ONE verify forward over the same rows (recompute mechanism: live GDN untouched, per-row GDN states
    read back from a shadow_commit ring in a second pass).
Gates: logits PCC >= 0.9999 per row and argmax equal per row; max abs error reported. GDN per-token states:
the ring's slot t vs the sequential state after row t (PCC >= 0.99999, max abs reported).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from qwen36.numerics import pcc
from qwen36.probes.records import ProbeReport

NAME = "verify-tp"
HELP = "packed K+1 verify vs K+1 sequential single-row decodes on the TT target (logits PCC, GDN per-token states)"
KS = (1, 3, 7)
LOGITS_PCC = 0.9999
STATE_PCC = 0.99999
PROMPT_LEN = 12


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint (default: a generated bf16 ci one)")
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--precision", default="accuracy")
    p.add_argument("--seed", type=int, default=0)


def shuffle_pages(gen, seed: int) -> None:
    """Scatter the sequence's pages over the cache (host write, outside traces)."""
    st, ttnn = gen.state, gen.ttnn
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(st.page_table_host.numel(), generator=g).to(torch.int32).reshape(st.page_table_host.shape)
    st.page_table_host.copy_(table)
    host = ttnn.from_torch(table, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(gen.mesh))
    ttnn.copy_host_to_device_tensor(host, st.page_table)


def gdn_host(gen, t):
    return [gen.ttnn.to_torch(x).float() for x in gen.ttnn.get_device_tensors(t)]


def run_case(gen, k: int, prompt: list[int], rows: list[int]) -> dict:
    """One K: sequential decode vs packed verify from the same prefill."""
    from qwen36.tt.spec.build import build_spec_backend

    ttnn = gen.ttnn
    gen.use_trace = False
    gen.prefill(prompt)
    seq_logits, seq_states = [], []
    for tok in rows:
        lg, _ = gen.decode_step(tok)
        seq_logits.append(lg.float())
        seq_states.append([gdn_host(gen, s.recurrent) for s in gen.state.gdn_states()])
    seq_logits = torch.stack(seq_logits)
    # packed verify (shadow_commit ring: per-row states land in ring slots 0..K)
    be = build_spec_backend(gen, lambda h, kk: rows[1:kk + 1], mechanism="shadow_commit", use_trace=False)
    be.join(0, prompt)
    be.history[-1] = rows[0]  # verify row 0 = rows[0] (the pending token)
    be.draft({0: k})
    vout = be.verify(None)
    packed = gen.model.to_host(vout.out.logits).float().reshape(k + 1, -1)
    ring_states = []
    for s in gen.state.gdn_states():
        ring_states.append(gdn_host(gen, be.step_state.layer_bufs[id(s)].ring))
    be.release()
    row_pcc = [pcc(packed[j], seq_logits[j]) for j in range(k + 1)]
    max_abs = float((packed - seq_logits).abs().max())
    argmax_eq = bool(torch.equal(packed.argmax(-1), seq_logits.argmax(-1)))
    hv = gen.model.args.gdn_hv_d
    st_pcc, st_abs = 1.0, 0.0
    for li, ring in enumerate(ring_states):
        for d, rd in enumerate(ring):
            for t in range(k + 1):
                a = rd[t * hv:(t + 1) * hv]
                b = seq_states[t][li][d].reshape(a.shape)
                st_pcc = min(st_pcc, pcc(a, b))
                st_abs = max(st_abs, float((a - b).abs().max()))
    ok = min(row_pcc) >= LOGITS_PCC and argmax_eq and st_pcc >= STATE_PCC
    return {"k": k, "logits_pcc_min": min(row_pcc), "logits_pcc_rows": row_pcc, "logits_max_abs": max_abs,
            "argmax_equal": argmax_eq, "gdn_state_pcc_min": st_pcc, "gdn_state_max_abs": st_abs, "pass": ok}


def run_matrix(gen, ks=KS, seed: int = 0) -> list[dict]:
    v = gen.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, v, (PROMPT_LEN,), generator=g).tolist()
    cells = []
    for paged in (False, True):
        if paged:
            shuffle_pages(gen, seed + 1)
        for k in ks:
            rows = torch.randint(0, v, (k + 1,), generator=g).tolist()
            c = run_case(gen, k, prompt, rows)
            c["cell"] = f"K={k} {'paged (shuffled pages)' if paged else 'unpaged (identity pages)'}"
            c["paged"] = paged
            cells.append(c)
    return cells


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator
    from qwen36.testing.tt import make_bf16_checkpoint

    t0 = time.perf_counter()
    ks = tuple(int(x) for x in args.ks.split(","))
    with tempfile.TemporaryDirectory(prefix="qwen36-verify-tp-") as tmp:
        ckpt = args.checkpoint or make_bf16_checkpoint(Path(tmp) / "ci", "ci", seed=args.seed)
        gen = build_generator(ckpt, args.device, precision=args.precision, max_seq_len=256, use_trace=False,
                              progress=False, pages=SMALL_PAGES, cache_dir=None)
        try:
            cells = run_matrix(gen, ks, args.seed)
        finally:
            gen.close()
    return ProbeReport(probe=NAME, backend=gen.label,
                       config={"checkpoint": str(args.checkpoint or "generated ci bf16"), "ks": list(ks),
                               "precision": args.precision, "gates": {"logits_pcc": LOGITS_PCC, "state_pcc": STATE_PCC}},
                       cells=cells, counters={}, gate_complete=set(ks) >= set(KS),
                       notes={"wall_s_measured": round(time.perf_counter() - t0, 2)})
