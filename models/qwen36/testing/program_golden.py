"""The program golden of the TT speculative step, two views (emulated P150a x2; counters of what the emulated step
runs, not times):

* gate-0b (``probes/gate_0b.py``) on the ci preset at one user (``measure``: the one-user step composed from its
  entry points) and at four users (``measure(batch=4)``: the packed B-slot step), K = 1, 2, 3; per phase (decode,
  verify, accept, draft and its parts, commit per K and per mechanism, the per-layer parts) the program count per
  op, collectives and bytes read per device;
* the step as ``TTSpecBackend`` runs it (:func:`backend_steps`, the shipped checkpoint): the 4th step (replayed) of
  one user (device rows: shadow_commit K = 2, snapshot K = 3, sampled K = 2) and of the B-slot layout (host rows:
  B = 1 K = 2, B = 2 K = 3); programs per op, trace replays, collectives, bytes read, host transfer calls, trace
  captures and the step's tokens.

The golden in ``tests/data/`` is compared exactly by ``tests/tt/spec/test_program_golden.py``: a change to the
programs of the speculative step (a refactor that should be invisible, or a deliberate change) shows up there op by
op. Regenerate it only for a deliberate, reviewed change, with the command in its ``command`` field:

    .venv/bin/python -m qwen36.testing.program_golden --write tests/data/tt_spec_program_golden.json
"""
from __future__ import annotations

import argparse
import json

PRESET, DEVICE, PRECISION, CONTEXT, VOCAB, KS, COMMIT_K, SEED = "ci", "emulated-p150x2", "performance", 4096, 4096, \
    (1, 2, 3), 3, 0
BATCHES = (1, 4)
COMMAND = "python -m qwen36.testing.program_golden --write tests/data/tt_spec_program_golden.json"


def _phases(node, path: str, out: dict) -> None:
    """Collect every phase figure (a dict carrying the counters ``_figures`` added) under its path in the record."""
    if isinstance(node, dict):
        if "_counts" in node:
            out[path] = node["_counts"]
            return
        for k, v in node.items():
            _phases(v, f"{path}/{k}" if path else str(k), out)


def gate0b_programs(batch: int) -> dict:
    """{phase path: {"programs": {op: n}, "collectives": n, "collective_bytes": n, "bytes_read": {dtype: n}}} of
    gate-0b at ``batch`` users (``measure``: device rows at 1, host rows above), plus ``ks_refused`` at B > 1."""
    from qwen36.probes import gate_0b

    orig = gate_0b.phase_figures

    def figures(cost, cm, emulated):
        out = orig(cost, cm, emulated)
        c = cost.counts("phase")
        out["_counts"] = {"programs": dict(sorted(c.programs_per_op.items())), "collectives": c.collectives,
                          "collective_bytes": c.collective_bytes, "bytes_read": dict(sorted(c.bytes_read.items()))}
        return out

    cfg, base = gate_0b.build_config(PRESET, VOCAB)
    gate_0b.phase_figures = figures
    try:
        fig = gate_0b.measure(DEVICE, cfg, PRECISION, CONTEXT, list(KS), COMMIT_K, SEED, base.vocab_size,
                              real_cfg=base, batch=batch)
    finally:
        gate_0b.phase_figures = orig
    out: dict = {}
    _phases(fig, "", out)
    if batch > 1:
        out["ks_refused"] = fig["ks_refused"]
    return out


BACKEND_CKPT = "models/qwen36/default_checkpoint"
BACKEND_PROMPTS = ([1734, 4064, 17, 279, 1076, 4064, 17, 279], [17, 279, 1076, 5, 99, 1734, 201])
# (name, slots, rows, mechanism, K, temperature)
BACKEND_CASES = (("one user shadow_commit K2", 1, "device", "shadow_commit", 2, 0.0),
                 ("one user snapshot K3", 1, "device", "snapshot", 3, 0.0),
                 ("one user shadow_commit K2 sampled", 1, "device", "shadow_commit", 2, 0.8),
                 ("slots B1 shadow_commit K2", 1, "host", "shadow_commit", 2, 0.0),
                 ("slots B2 shadow_commit K3", 2, "host", "shadow_commit", 3, 0.0))


def backend_steps(gen=None, names=None) -> dict:
    """{case: counters of the 4th (replayed) step of ``TTSpecBackend``} for :data:`BACKEND_CASES` (``names``: a
    subset), every stepping user drafting K with the device MTP. ``gen``: a generator of :data:`BACKEND_CKPT` (the
    accuracy-preset ``small_tt_generator``; built here when None)."""
    from collections import Counter

    from ..checkpoint import load_checkpoint
    from ..generation.sampling import SamplingParams
    from ..tt.spec.mtp_drafter import TTMTPDrafter
    from ..tt.spec.spec_backend import TTSpecBackend
    from ..tt_ops.emulator import namespace
    from .tt import small_tt_generator

    own = gen is None
    if own:
        gen = small_tt_generator(BACKEND_CKPT, prefill_chunk=64, require_mtp=True)
    reader = load_checkpoint(BACKEND_CKPT, require_mtp=True)
    calls: Counter = Counter()
    host_call = namespace.HostFunction.__call__

    def counted(fn, *a, **kw):
        calls[fn.name] += 1
        return host_call(fn, *a, **kw)

    out = {}
    namespace.HostFunction.__call__ = counted
    try:
        for name, slots, rows, mech, k, temp in BACKEND_CASES:
            if names is not None and name not in names:
                continue
            params = SamplingParams(temperature=temp, top_k=20, seed=1) if temp else SamplingParams()
            if rows == "device":
                be = TTSpecBackend(gen, mech, drafter=TTMTPDrafter(reader))
            else:
                be = TTSpecBackend(gen, mech, drafter=TTMTPDrafter(reader), slots=slots, k=k, params=params,
                                   rows="host")
            try:
                for s in range(slots):
                    be.join(s, BACKEND_PROMPTS[s], params)

                def step():
                    d = be.draft({s: k for s in range(slots)})
                    v = be.verify(d)
                    acc = be.accept(d, v)
                    be.commit(acc)
                    return {str(s): [int(t) for t in a.tokens] for s, a in acc.items()}

                for _ in range(3):  # eager, captured, replayed
                    step()
                calls.clear()
                with gen.ctx.counters.scope("step") as c:
                    tokens = step()
                out[name] = {"programs": dict(sorted(c.programs_per_op.items())), "trace_replays": c.trace_replays,
                             "collectives": c.collectives, "bytes_read": dict(sorted(c.bytes_read.items())),
                             "host_calls": {n: v for n, v in sorted(calls.items())
                                            if "copy_host" in n or "to_torch" in n or "trace" in n},
                             "captures": be.captures, "tokens": tokens}
            finally:
                be.close()
                if rows == "device":
                    gen.reset()
    finally:
        namespace.HostFunction.__call__ = host_call
        if own:
            gen.close()
    return out


def golden() -> dict:
    return {"command": COMMAND,
            "what": f"gate-0b {PRESET} preset on {DEVICE} ({PRECISION}, context {CONTEXT}, vocab {VOCAB}, ks "
                    f"{','.join(map(str, KS))}, commit_k {COMMIT_K}, seed {SEED}): emulator counters per phase; "
                    f"backend_steps: the 4th (replayed) step of TTSpecBackend per case ({BACKEND_CKPT})",
            "batches": {str(b): gate0b_programs(b) for b in BATCHES},
            "backend_steps": backend_steps()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", required=True, help="the golden JSON to (over)write")
    args = p.parse_args()
    from qwen36.io_utils import atomic_write_text

    atomic_write_text(args.write, json.dumps(golden(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
