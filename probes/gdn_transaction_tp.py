"""Probe gdn-transaction-tp: the speculative transaction driven through the TT path at TP=N.

Same matrix as ``gdn-transaction`` (the reference probe), through ``TTSpecBackend`` (traced verify+accept = trace A,
traced MTP reseed/draft + commit = trace B) on the mesh: every mechanism in ``mechanisms.MECHANISMS`` x
K in {1,2,3,7} x a in [0, K]. One cell:

  1. prefill + 2 real speculative steps with the device MTP drafter (step 1 eager, step 2 captures both traces;
     every later step of the cell replays them);
  2. drafts forced from the TT plain greedy continuation with a wrong token at position a+1 (written into the
     MTP's draft buffer between replays), so the greedy acceptance length is exactly a;
  3. abort leg: draft -> verify -> abort (shadow_commit: draft -> abort, see below); the live state must equal
     the pre-step state bit for bit: committed GDN recurrent (shadow_commit: the ring slot the device ring index
     points at), conv, target KV rows < n, MTP KV rows < n, device n, pending token, ring index;
  4. accept leg after the abort: draft -> verify -> accept -> commit (trace replays); emitted tokens, counters;
  5. oracle = TT single-row decode replay: the pre-step state (host copy) is written back into the target state
     and the rows [pending, t_1..t_a] run through the plain 1-row decode forward (eager); committed GDN recurrent,
     conv and target KV rows [0, n+a+1) are compared with it. MTP KV oracle: the pre-step MTP KV written back,
     then the MTP reseed run eagerly from the *decode* hiddens of those rows and the emitted tokens (rows > a:
     placeholders, as in the real path); MTP KV rows [0, n+a+1) compared;
  6. continuation: 16 single-row greedy decode steps from the committed state (target KV rows >= n+a+1 poisoned
     with a large finite value (POISON) first: rejected rows must never be read) vs 16 from the oracle state
     (teacher-forced with its tokens): logits within tolerance, argmax equal except at near ties.
Counters are checked against TT's own closed form (``TTMechanism.expected_step_counters``, tt/spec/mechanisms.py): the
device shapes are fixed, so the cost does not depend on a (snapshot always restores; snapshot/recompute re-advance
all K+1 rows masked).

shadow_commit abort after verify is refused by design (the ring verify overwrites, in place, the slot it started
from; undoing it would need the copy the mechanism exists to avoid): its cells test abort *before* verify and
record the after-verify leg as "refused by design"; one extra cell checks the refusal is raised.

Tolerances: the oracle runs the same TT kernels on the same weights; the differences are multi-row vs single-row
arithmetic only (see TOLERANCES for the measured figures and their source); abort is bitwise. Continuation rows
are teacher-forced with the oracle's tokens; an argmax that differs must be a near tie (top-2 margin within twice
the row's logit difference), else the cell fails.

``--batch B`` (B >= 2): the batched transaction through ``tt/spec/spec_backend.py`` TTSpecBackend with B slots (one packed
B x (K+1) verify, per-user on-device acceptance and commit), each user against its own single-user oracle
(``run_tp_batch_cell``). B users (prompts of different lengths) share one backend whose extra slots stay free
(at least one: the slot count is the smallest above B whose verify rows, slots x (K+1), the decode-path core grid holds) and are
poisoned with NaN (GDN recurrent + conv, the ring blocks of shadow_commit, KV pages) for the whole cell. Per cell
(mechanism x K):
  1. every user joins, then 2 real batched steps at depth K with oracle drafts (the traces are captured);
  2. one step with forced drafts (each user's own greedy continuation with a wrong token at a_b + 1; the plan of
     ``transaction_plan.user_plan``): user 0 a = 0, user 1 a = K and, at B >= 4, user 2 drafts only K - 1 (its
     last row inert) and accepts all of them, user 3 sits the step out;
  3. abort leg (snapshot / recompute: draft -> verify -> abort; shadow_commit: draft -> abort, its abort after a
     verify being refused by design): every user's committed GDN recurrent, conv and KV rows < n bit-identical;
  4. accept leg: draft -> verify -> accept -> commit (trace replays): emitted tokens and a_b as forced; a user that
     sat out bit-identical to its pre-step state; the free slots still NaN; every stepping user's logits finite;
  5. continuation: the rows past each user's position poisoned with a large finite value, then 4 more batched
     steps with oracle drafts: every user's tokens continue its plain greedy output (rejected rows never read);
  6. oracle: per user, the TT batch-1 plain greedy decode (prefill + one single-row decode per token) of exactly
     the tokens the user consumed; its GDN recurrent, conv and KV rows [0, n) compared with the user's committed
     state (``TOLERANCES``).
Host drafts (the batched backend drafts on the host; its label says so); the device is what ran (emulated here).

Pieces: ``transaction_plan`` (forced drafts, the batch's per-user plan; shared with gdn-transaction),
``gdn_transaction_tp_checks`` (device state to host, poisoning, comparisons, TOLERANCES); this module drives the
cells.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

from qwen36.errors import UserError
from qwen36.probes.records import ProbeReport
from qwen36.speculative.mechanisms import MECHANISMS

from .gdn_transaction_tp_checks import (TOLERANCES, argmax_flips, compare, kv_logical, kv_states, per_device, poison_kv,
                                        worst, write_per_device)
from .transaction_plan import BATCH_KS
from .gdn_transaction_tp_batch import CONTINUATION_BATCH_STEPS, DRIVE_STEPS, run_tp_batch_matrix

NAME = "gdn-transaction-tp"
HELP = ("speculative transaction through the TT path at TP=N: 3 mechanisms x K x acceptance length vs TT "
        "single-row decode replay (GDN, conv, KV, MTP KV, 16-step continuation)")
KS = (1, 2, 3, 7)
CONTINUATION_STEPS = 16
PROMPT_LEN = 12
MAX_SEQ_LEN = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full", action="store_true",
                   help="real 27B per-device shapes at TP=2: GDN 8 key / 24 value heads per device, 128x128 fp32 "
                        "state; attention 2 KV heads per device, head_dim 256; 3 GDN + 1 attention layer, hidden 256")
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint with mtp.* (default: generated bf16)")
    p.add_argument("--ks", default=",".join(map(str, KS)), help="draft depths, comma-separated (gate: 1,2,3,7)")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--accepts", default=None,
                   help="acceptance lengths to run per K (comma-separated; default every a in [0, K])")
    p.add_argument("--precision", default="accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1,
                   help="B >= 2: the batched transaction (B users in one packed B x (K+1) verify on the TT path, each "
                        "against its own batch-1 TT oracle; run_tp_batch_cell); default K in {2, 3}")


def full_config():
    """The 27b-ratios preset: real 27B per-device GDN shapes at TP=2 (16 key / 48 value heads = 8 / 24 per device,
    Dk = Dv = 128, fp32 state) and the 27B attention layout (24 query / 4 KV heads = 12 / 2 per device,
    head_dim 256), on 4 layers (3 GDN + 1 attention), hidden 256, vocab 1024."""
    from qwen36.tiny import PRESETS

    return PRESETS["27b-ratios"]


class Probe:
    """Holds the generator, the device MTP drafter and the cell logic."""

    def __init__(self, gen, reader, plain: list[int], prompt: list[int], backend_factory=None):
        from qwen36.tt.spec.mtp_drafter import TTMTPDrafter
        from qwen36.tt.spec.spec_backend import TTSpecBackend

        self.gen, self.ttnn, self.mesh, self.model = gen, gen.ttnn, gen.mesh, gen.model
        self.plain, self.prompt = plain, prompt
        self.drafter = TTMTPDrafter(reader)
        self.factory = backend_factory or TTSpecBackend
        from qwen36.tt.spec.mechanisms import GDNStateBytes

        self.n_gdn = len(gen.state.gdn_states())
        self.state_bytes = GDNStateBytes.of(self.model.args, self.n_gdn)
        self._draft_inputs: dict[int, object] = {}

    # ---- snapshots --------------------------------------------------------------------------------------
    def committed_rec(self, be, s) -> list[torch.Tensor]:
        """The committed recurrent state of GDN layer ``s`` per device. Ring mechanisms (shadow_commit): gathered
        from the ring at the device ring index (block idx[h] for head h), i.e. what the next verify will start from."""
        ttnn = self.ttnn
        if not be.mechanism.ring or be.step_state is None:
            return per_device(ttnn, s.recurrent)
        ring = per_device(ttnn, be.step_state.layer_bufs[id(s)].ring)
        idx = per_device(ttnn, be.acceptor.block_idx)
        return [r[i.reshape(-1).long()] for r, i in zip(ring, idx)]  # [Hv, Dk, Dv], like s.recurrent

    def snapshot(self, be) -> dict:
        from qwen36.testing.tt import device_position, read_scalar

        ttnn, st = self.ttnn, self.gen.state
        gdn = st.gdn_states()
        kv = kv_states(st)
        head = self.drafter.head
        snap = {"rec": [self.committed_rec(be, s) for s in gdn], "conv": [per_device(ttnn, s.conv) for s in gdn],
                "kv": [(per_device(ttnn, s.k), per_device(ttnn, s.v)) for s in kv],
                "mtp_kv": (per_device(ttnn, head.kv.k), per_device(ttnn, head.kv.v)),
                "n": device_position(be), "pending": int(read_scalar(be.step_state, be.step_state.pending)),
                "block_idx": per_device(ttnn, be.acceptor.block_idx) if be.mechanism.ring else None}
        return snap

    def restore_target(self, snap: dict, poison_from: int | None = None) -> None:
        """Write a snapshot's committed target state into the plain decode buffers (s.recurrent, conv, KV)."""
        ttnn, mesh, st = self.ttnn, self.mesh, self.gen.state
        gdn = st.gdn_states()
        kv = kv_states(st)
        for s, rec, conv in zip(gdn, snap["rec"], snap["conv"]):
            write_per_device(ttnn, mesh, s.recurrent, rec)
            write_per_device(ttnn, mesh, s.conv, conv)
        table = st.page_table_host[0]
        for s, (k, v) in zip(kv, snap["kv"]):
            if poison_from is not None:
                k, v = poison_kv(k, table, poison_from), poison_kv(v, table, poison_from)
            write_per_device(ttnn, mesh, s.k, k)
            write_per_device(ttnn, mesh, s.v, v)

    def restore_mtp(self, snap: dict) -> None:
        head = self.drafter.head
        write_per_device(self.ttnn, self.mesh, head.kv.k, snap["mtp_kv"][0])
        write_per_device(self.ttnn, self.mesh, head.kv.v, snap["mtp_kv"][1])

    def views(self, snap: dict, end_kv: int, end_mtp: int) -> dict[str, list[torch.Tensor]]:
        table = self.gen.state.page_table_host[0]
        mtp_table = self.drafter.head.page_table_host[0]
        return {"gdn_recurrent": [torch.cat(r, 1).float() for r in snap["rec"]],
                "conv": [torch.cat(c, 3).float() for c in snap["conv"]],
                "target_kv": [kv_logical(p, table, end_kv) for kv in snap["kv"] for p in kv],
                "mtp_kv": [kv_logical(p, mtp_table, end_mtp) for p in snap["mtp_kv"]]}

    # ---- oracle -----------------------------------------------------------------------------------------
    def decode_rows(self, tokens: list[int], pos: int):
        """Plain single-row decode (eager) of ``tokens`` from ``pos`` -> (logits [T, V] host, device hiddens)."""
        m, gen = self.model, self.gen
        logits, hidden = [], []
        for i, tok in enumerate(tokens):
            m.copy_host_to_device(m.prepare_decode_inputs_host([int(tok)], pos + i), gen.inputs)
            out = m.decode_forward(gen.inputs, gen.state)
            lg, _ = m.process_output_decode(out)
            logits.append(lg[-1])
            hidden.append(out.hidden)
        return torch.stack(logits), hidden

    def mtp_reseed_oracle(self, k: int, emitted: list[int], hidden: list, n: int, a: int) -> None:
        """MTP reseed of rows n..n+a from the decode hiddens (eager; the real path uses the verify's hiddens)."""
        ttnn, head = self.ttnn, self.drafter.head
        if k not in self._draft_inputs:
            self._draft_inputs[k] = head.allocate_draft_inputs()
        inp = self._draft_inputs[k]
        hsz = self.model.args.cfg.hidden_size
        toks = list(emitted) + [-1] * (k - a)
        host = head.host_draft_inputs(toks, torch.zeros(k + 1, hsz), n, a)
        del host["hidden"]
        head.copy_host_to_device(host, inp)
        rows = list(hidden)
        if a < k:
            rows.append(ttnn.multiply(ttnn.slice(inp.hidden, [0, 0, 0, 0], [1, 1, k - a, hsz]), 0.0))
        h = rows[0] if len(rows) == 1 else ttnn.concat([ttnn.typecast(r, inp.hidden.dtype) if r.dtype != inp.hidden.dtype
                                                         else r for r in rows], dim=2)
        head.draft(inp.tokens, h, inp.pos, inp.select)

    # ---- one cell -----------------------------------------------------------------------------------------
    def forced(self, be, k: int, a: int) -> tuple[list[int], list[int]]:
        i = len(be.history) - len(self.prompt)
        cont = self.plain[i:i + k + 1]
        d = list(cont[:k])
        if a < k:
            d[a] = (cont[a] + 1) % self.model.args.cfg.vocab_size
        return cont, d

    def run_cell(self, mech: str, k: int, a: int) -> dict:
        ttnn = self.ttnn
        be = self.factory(self.gen, mech, drafter=self.drafter, use_trace=True)
        self.label = be.label  # derived from the MeshContext the generator opened
        failed: list[str] = []
        be.join(0, self.prompt)
        for _ in range(DRIVE_STEPS):
            from qwen36.speculative.engine import speculative_step

            speculative_step(be, {0: k})
        drive_ok = be.history[len(self.prompt):] == self.plain[:len(be.history) - len(self.prompt)]
        if not drive_ok:
            failed.append("drive_lossless")
        pre = self.snapshot(be)
        n = pre["n"]
        if n != be.n or pre["pending"] != be.history[-1]:
            failed.append("pre_position")
        cont, drafts = self.forced(be, k, a)

        # abort leg
        be.draft({0: k})
        if be.mechanism.ring:  # the ring verify overwrites the slot it started from: abort after it is refused
            abort_mode = "before verify (after verify: refused by design, see refusal cell)"
        else:
            be.step_state.write_drafts(drafts)
            be.verify(None)
            abort_mode = "after verify"
        be.abort()
        post_abort = self.snapshot(be)
        pv, av = self.views(pre, n, n), self.views(post_abort, n, n)
        abort = {name: all(torch.equal(x, y) for x, y in zip(pv[name], av[name])) for name in pv}
        abort["pos"] = post_abort["n"] == n
        abort["pending"] = post_abort["pending"] == pre["pending"]
        if be.mechanism.ring:
            abort["ring_idx"] = all(torch.equal(x, y) for x, y in zip(pre["block_idx"], post_abort["block_idx"]))
        failed += [f"abort:{name}" for name, ok in abort.items() if not ok]

        # accept leg (after the abort)
        before = be.counters.as_dict()
        be.draft({0: k})
        be.step_state.write_drafts(drafts)
        v = be.verify(None)
        acc = be.accept(None, v)[0]
        be.commit({0: acc})
        counters = {key: val - before[key] for key, val in be.counters.as_dict().items()}
        expected = be.mechanism.expected_step_counters(k, acc.num_accepted, self.n_gdn, self.state_bytes)
        if counters != expected:
            failed.append("counters")
        tokens_ok = acc.num_accepted == a and acc.tokens == cont[:a + 1]
        if not tokens_ok:
            failed.append("tokens")
        end = n + acc.num_accepted + 1
        post = self.snapshot(be)
        pos_ok = post["n"] == end and post["pending"] == acc.tokens[-1]
        if not pos_ok:
            failed.append("pos")
        traces = len(be.traces)
        be.release()  # the oracle below allocates (eager forwards): no trace may be live

        # oracle: single-row decode replay from the pre-step state
        self.restore_target(pre)
        rows = [pre["pending"]] + acc.tokens[:-1]
        orc_logits, orc_hidden = self.decode_rows(rows, n)
        orc_tokens = orc_logits.argmax(-1).tolist()
        oracle_tokens_ok = orc_tokens == cont[:a + 1]
        if not oracle_tokens_ok:
            failed.append("oracle_tokens")
        self.restore_mtp(pre)
        self.mtp_reseed_oracle(k, acc.tokens, orc_hidden, n, acc.num_accepted)
        orc = {"rec": [per_device(ttnn, s.recurrent) for s in self.gen.state.gdn_states()],
               "conv": [per_device(ttnn, s.conv) for s in self.gen.state.gdn_states()],
               "kv": [(per_device(ttnn, s.k), per_device(ttnn, s.v)) for s in kv_states(self.gen.state)],
               "mtp_kv": (per_device(ttnn, self.drafter.head.kv.k), per_device(ttnn, self.drafter.head.kv.v))}
        ov, cv = self.views(orc, end, end), self.views(post, end, end)
        results = {name: compare(cv[name], ov[name], name) for name in ov}

        # continuation: oracle state first (it is live now), then the committed state with rejected rows poisoned,
        # teacher-forced with the oracle's tokens (so one near-tie flip cannot turn 15 later rows into noise)
        lg_or, toks_or = self.greedy_decode(orc_tokens[-1], end)
        self.restore_target(post, poison_from=end)
        lg_be, _ = self.greedy_decode(acc.tokens[-1], end, forced=toks_or)
        results["continuation_logits"] = compare([lg_be], [lg_or], "continuation_logits")
        flips = argmax_flips(lg_be, lg_or)
        cont_tokens_ok = all(f["near_tie"] for f in flips)
        if not cont_tokens_ok:
            failed.append("continuation_tokens")
        failed += [name for name, r in results.items() if not r["pass"]]
        be.close()
        return {"cell": f"K={k} a={a} {mech}", "k": k, "a": a, "mechanism": mech, "accepted": acc.num_accepted,
                "abort_mode": abort_mode, "abort": abort, "tokens_ok": tokens_ok, "pos_ok": pos_ok,
                "drive_lossless": drive_ok, "traces_replayed": traces, **results,
                "continuation_argmax_flips": flips, "continuation_tokens_ok": cont_tokens_ok, "counters": counters, "counters_expected": expected,
                "failed": failed, "pass": not failed}

    def greedy_decode(self, first: int, pos: int, forced: list[int] | None = None):
        """CONTINUATION_STEPS single-row decodes from ``first`` at ``pos``: greedy, or feeding ``forced`` tokens."""
        tok, logits = first, []
        for i in range(CONTINUATION_STEPS):
            lg, _ = self.decode_rows([tok], pos + i)
            logits.append(lg[0])
            tok = int(lg[0].argmax()) if forced is None else forced[i]
        lg = torch.stack(logits)
        return lg, lg.argmax(-1).tolist()

    def refusal_cell(self, mech: str) -> dict:
        """A ring mechanism (shadow_commit): abort after verify must be refused (ring slots overwritten in place)."""
        from qwen36.tt.spec.build import build_spec_backend

        be = build_spec_backend(self.gen, self.drafter, mechanism=mech, use_trace=False)
        self.label = be.label
        be.join(0, self.prompt)
        be.verify(be.draft({0: 1}))
        msg = ""
        try:
            be.abort()
            refused = False
        except RuntimeError as e:
            refused, msg = mech in str(e), str(e)
        be.close()
        return {"cell": f"{mech} abort-after-verify", "mechanism": mech,
                "result": "refused by design" if refused else "NOT refused", "reason": msg, "failed": [] if refused
                else ["not_refused"], "pass": refused}


def run_matrix(probe: Probe, ks=KS, mechs=MECHANISMS, accepts=None) -> tuple[list[dict], dict]:
    cells, totals = [], {m: {} for m in mechs}
    for k in ks:
        for a in range(k + 1):
            if accepts is not None and a not in accepts:
                continue
            for m in mechs:
                c = probe.run_cell(m, k, a)
                cells.append(c)
                for key, v in c["counters"].items():
                    totals[m][key] = totals[m].get(key, 0) + v
    from qwen36.tt.spec.mechanisms import TT_MECHANISMS

    cells += [probe.refusal_cell(m) for m in mechs if TT_MECHANISMS[m].ring]
    return cells, totals


def open_probe(ckpt: Path, device: str, precision: str, seed: int, backend_factory=None):
    from qwen36.checkpoint import load_checkpoint
    from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator

    gen = build_generator(ckpt, device, precision=precision, max_seq_len=MAX_SEQ_LEN, use_trace=True, progress=False,
                          pages=SMALL_PAGES, cache_dir=None, require_mtp=True)
    v = gen.config.vocab_size
    prompt = torch.randint(0, v, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    # the forcing oracle: TT plain greedy continuation (single-row decode), long enough for every cell
    plain = gen.generate([prompt], (DRIVE_STEPS + 2) * (max(KS) + 1) + 2)[0].tokens
    gen.release_trace()
    return Probe(gen, load_checkpoint(ckpt, require_mtp=True), plain, prompt, backend_factory)


def matrix_args(args: argparse.Namespace, batch: int) -> tuple[tuple[int, ...], tuple[str, ...], set[int] | None]:
    """(ks, mechanisms, accepts) of the command line, refused by name where they cannot run: ``--ks`` defaults to
    ``BATCH_KS`` for B users (the batched cells force their own per-user plan, so no ``--accepts``)."""
    ks_arg = ",".join(map(str, BATCH_KS)) if batch > 1 and args.ks == ",".join(map(str, KS)) else args.ks
    ks = tuple(int(x) for x in ks_arg.split(","))
    mechs = tuple(args.mechanisms.split(","))
    if any(k < 1 for k in ks) or any(m not in MECHANISMS for m in mechs):
        raise UserError(f"--ks must be positive and --mechanisms in {MECHANISMS}; got {ks_arg!r} {args.mechanisms!r}")
    if batch > 1 and args.accepts is not None:
        raise UserError("--accepts is for the single-user matrix; the batched cells force their own per-user plan")
    if args.device.startswith("reference"):
        ref = "qwen36 probe gdn-transaction" + (" --batch B" if batch > 1 else "")
        raise UserError(f"probe {NAME} runs the TT path (--device emulated-p150x2 or p150x2); "
                        f"for the reference backend use `{ref}`")
    return ks, mechs, None if args.accepts is None else {int(x) for x in args.accepts.split(",")}


def run(args: argparse.Namespace) -> ProbeReport:
    """The matrix for one user (``run_matrix``) or, with ``--batch B``, for B users in one packed verify
    (``run_tp_batch_matrix``: mechanisms x K, default K in ``BATCH_KS``), on one checkpoint built or given."""
    from qwen36.testing.tt import make_bf16_checkpoint
    from qwen36.tt.runtime.generator import SMALL_PAGES, build_generator

    batch = getattr(args, "batch", 1)
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    ks, mechs, accepts = matrix_args(args, batch)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qwen36-gdn-tp-") as tmp:
        if args.checkpoint is not None:
            ckpt, source = args.checkpoint, str(args.checkpoint)
        else:
            ckpt = make_bf16_checkpoint(Path(tmp) / "ckpt", full_config() if args.full else "ci", seed=args.seed)
            source = f"generated bf16 {'full (27B per-device GDN shapes)' if args.full else 'ci'} (seed {args.seed})"
        if batch == 1:
            probe = open_probe(ckpt, args.device, args.precision, args.seed)
            gen = probe.gen
        else:
            gen = build_generator(ckpt, args.device, precision=args.precision, max_seq_len=MAX_SEQ_LEN,
                                  use_trace=True, progress=False, pages=SMALL_PAGES, cache_dir=None)
            label = f"tt ({gen.label or 'mesh'}) + host drafter"
        try:
            if batch == 1:
                cells, totals = run_matrix(probe, ks, mechs, accepts)
                label = probe.label  # the backend's own label, set by the cells
            else:
                cells, totals = run_tp_batch_matrix(gen, batch=batch, ks=ks, mechanisms=mechs, seed=args.seed,
                                                    prompt_len=PROMPT_LEN)
            a = gen.model.args
        finally:
            gen.close()
    measured = {"wall_s_measured": round(time.perf_counter() - t0, 2),
                "peak_rss_mib_measured": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    config = {"checkpoint": source, "full": bool(args.full)}
    if batch > 1:
        return ProbeReport(
            probe=NAME, backend=label,
            config={**config, "batch": batch, "ks": list(ks), "mechanisms": list(mechs), "precision": args.precision,
                    "seed": args.seed, "prompt_len": PROMPT_LEN, "drive_steps": DRIVE_STEPS,
                    "continuation_batch_steps": CONTINUATION_BATCH_STEPS,
                    "oracle": "per user: TT batch-1 plain greedy decode (prefill + single-row decode) of its tokens",
                    "drafts": "host (oracle / forced); the batched backend has no device MTP drafter",
                    "tolerances": TOLERANCES, "tp": a.num_devices},
            cells=cells, counters=totals,
            gate_complete=set(ks) >= set(BATCH_KS) and set(mechs) >= set(MECHANISMS) and batch in (2, 4),
            notes={**measured, "worst_measured": worst(cells)})
    cfg = a.cfg
    worst_abs = {name: max((c[name]["max_abs"] for c in cells if name in c), default=0.0) for name in TOLERANCES}
    worst_pcc = {name: min((c[name]["pcc"] for c in cells if name in c), default=1.0) for name in TOLERANCES}
    full_grid = accepts is None and set(ks) >= set(KS) and set(mechs) >= set(MECHANISMS)
    return ProbeReport(
        probe=NAME, backend=label,
        config={**config, "ks": list(ks), "mechanisms": list(mechs),
                "accepts": sorted(accepts) if accepts else "all", "precision": args.precision, "seed": args.seed,
                "prompt_len": PROMPT_LEN, "drive_steps": DRIVE_STEPS, "continuation_steps": CONTINUATION_STEPS,
                "oracle": "TT single-row decode replay from the pre-step state (+ MTP reseed from decode hiddens)",
                "tolerances": TOLERANCES, "tp": a.num_devices,
                "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                          "gdn_heads_per_device": [cfg.linear_num_key_heads // a.num_devices, a.gdn_hv_d],
                          "gdn_head_dims": [cfg.linear_key_head_dim, cfg.linear_value_head_dim],
                          "kv_heads_per_device": a.hkv_d, "head_dim": cfg.head_dim}},
        cells=cells, counters=totals, gate_complete=full_grid,
        notes={**measured, "worst_max_abs_measured": worst_abs, "worst_pcc_measured": worst_pcc,
               "counters_formula": "TTMechanism.expected_step_counters (fixed device shapes; independent of a)"})
