"""``qwen36 probe gdn-transaction-tp --batch B``: the batched speculative transaction through the TT path
(``tt/batch_spec.py`` TTBatchSpecBackend: one packed B x (K+1) verify, per-user on-device acceptance and commit)
against each user's own single-user oracle.

B users (prompts of different lengths) share one backend whose extra slots stay free (at least one: the slot
count is the smallest above B whose verify rows, slots x (K+1), the decode-path core grid holds) and are
poisoned with NaN (GDN recurrent + conv, the ring blocks of shadow_commit, KV pages) for the whole cell. Per cell
(mechanism x K):
  1. every user joins, then 2 real batched steps at depth K with oracle drafts (the traces are captured);
  2. one step with forced drafts (each user's own greedy continuation with a wrong token at a_b + 1; the plan of
     ``gdn_transaction_batch.user_plan``): user 0 a = 0, user 1 a = K and, at B >= 4, user 2 drafts only K - 1 (its
     last row inert) and accepts all of them, user 3 sits the step out;
  3. abort leg (snapshot / recompute: draft -> verify -> abort; shadow_commit: draft -> abort, its abort after a
     verify being refused by design): every user's committed GDN recurrent, conv and KV rows < n bit-identical;
  4. accept leg: draft -> verify -> accept -> commit (trace replays): emitted tokens and a_b as forced; a user that
     sat out bit-identical to its pre-step state; the free slots still NaN; every stepping user's logits finite;
  5. continuation: the rows past each user's position poisoned with a large finite value, then 4 more batched
     steps with oracle drafts: every user's tokens continue its plain greedy output (rejected rows never read);
  6. oracle: per user, the TT batch-1 plain greedy decode (prefill + one single-row decode per token) of exactly
     the tokens the user consumed; its GDN recurrent, conv and KV rows [0, n) compared with the user's committed
     state (``gdn_transaction_tp.TOLERANCES``).
Host drafts (the batched backend drafts on the host; its label says so); the device is what ran (emulated here).
"""
from __future__ import annotations

import math

import torch

from qwen36.speculative.mechanisms import MECHANISMS

from .gdn_transaction import forced_drafts
from .gdn_transaction_batch import user_plan
from .gdn_transaction_tp import (DRIVE_STEPS, POISON, TOLERANCES, compare, kv_logical, kv_states, per_device,
                                 poison_kv, write_per_device)

CONTINUATION_BATCH_STEPS = 4


def slots_for(b: int, k: int) -> int:
    """The smallest slot count > b whose verify rows the backend accepts (<= 8, or a multiple of 8, up to 32)."""
    t = k + 1
    for s in range(b + 1, 33):
        rows = s * t
        if rows <= 32 and (rows <= 8 or rows % 8 == 0):
            return s
    raise ValueError(f"no slot count above {b} fits B x (K+1 = {t}) verify rows in 32")


class Diverged(RuntimeError):
    """A user's tokens left its plain greedy sequence (the batched run is not lossless)."""

    def __init__(self, message: str, user: int, prompt, got, want):
        super().__init__(message)
        self.user, self.prompt, self.got, self.want = user, list(prompt), list(got), list(want)


def _explain(gen, e: Diverged) -> str:
    """The failure message with the reference model's top-2 margin where the user's tokens first left its plain
    greedy sequence: a near tie (a last-bit difference flipped it) reads differently from a state bug."""
    if gen.ckpt is None:
        return str(e)
    from qwen36.reference.model import Qwen36Model
    from qwen36.speculative.oracle import divergence_note

    ref = Qwen36Model.from_checkpoint(gen.ckpt, dtype=torch.float32, with_mtp=False)
    return f"{e}; {divergence_note(ref, e.prompt, e.got, e.want)}"


class _Drafts:
    """The host drafter of every user: the oracle (plain greedy with deliberate misses) or forced drafts."""

    def __init__(self, prompts, plains, vocab):
        self.full = [list(p) + list(pl) for p, pl in zip(prompts, plains)]
        self.prompts, self.vocab = prompts, vocab
        self.forced: dict[int, list[int]] | None = None

    def user(self, hist) -> int:
        for u, p in enumerate(self.prompts):
            if hist[: len(p)] == list(p):
                return u
        raise KeyError("history of no known prompt")

    def cont(self, u: int, hist, n: int) -> list[int]:
        """The plain greedy tokens after ``hist`` (which must be a prefix of the user's greedy sequence)."""
        full = self.full[u]
        if full[: len(hist)] != list(hist):
            n = len(self.prompts[u])
            raise Diverged(f"user {u}: history left the plain greedy sequence (lossless broken)", u,
                           self.prompts[u], list(hist)[n:], full[n:len(hist)])
        return full[len(hist): len(hist) + n]

    def __call__(self, hist, k):
        u = self.user(hist)
        if self.forced is not None:
            return self.forced[u][:k]
        nxt = self.cont(u, hist, k)
        return [(t + 1) % self.vocab if (len(hist) + j) % 3 == 0 else t for j, t in enumerate(nxt)]


def _gdn_host(be, slot):
    return [(r, c) for r, c in be.committed_gdn(slot)]


def kv_host(ttnn, state, row: int, end: int) -> list[torch.Tensor]:
    """Every attention layer's K and V rows [0, end) of page-table row ``row``, heads of all devices: [Hkv, end, D]."""
    table = state.page_table_host[row]
    return [kv_logical(per_device(ttnn, c), table, end) for s in kv_states(state) for c in (s.k, s.v)]


def _state(be, slot: int) -> dict:
    n = be.position(slot)
    return {"n": n, "gdn": _gdn_host(be, slot), "kv": kv_host(be.ttnn, be.decoder.state, slot, n)}


def _equal(x: dict, y: dict) -> bool:
    return (x["n"] == y["n"] and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(x["gdn"], y["gdn"]))
            and all(torch.equal(a, b) for a, b in zip(x["kv"], y["kv"])))


def _poison_free(be, slot: int) -> None:
    ttnn, mesh = be.ttnn, be.mesh
    hv, t, s_all = be.model.args.gdn_hv_d, be.k + 1, be.slots
    for s in be.decoder.state.gdn_states():
        rec = per_device(ttnn, s.recurrent)
        for p in rec:
            p[slot * hv:(slot + 1) * hv] = float("nan")
        write_per_device(ttnn, mesh, s.recurrent, rec)
        conv = per_device(ttnn, s.conv)
        for p in conv:
            p[slot] = float("nan")
        write_per_device(ttnn, mesh, s.conv, conv)
        if be.mechanism.ring:
            ring_t = be.step_state.layer_bufs[id(s)].ring
            ring = per_device(ttnn, ring_t)
            for p in ring:
                for j in range(t):
                    p[(j * s_all + slot) * hv:(j * s_all + slot + 1) * hv] = float("nan")
            write_per_device(ttnn, mesh, ring_t, ring)
    pages = be.decoder.state.page_table_host[slot].long()
    for kv in kv_states(be.decoder.state):
        for c in (kv.k, kv.v):
            parts = per_device(ttnn, c)
            for p in parts:
                p[pages] = float("nan")
            write_per_device(ttnn, mesh, c, parts)


def _free_intact(be, slot: int) -> bool:
    ttnn, hv = be.ttnn, be.model.args.gdn_hv_d
    for s in be.decoder.state.gdn_states():
        if be.mechanism.ring:
            ring = per_device(ttnn, be.step_state.layer_bufs[id(s)].ring)
            t, s_all = be.k + 1, be.slots
            rows = [p[(j * s_all + slot) * hv:(j * s_all + slot + 1) * hv] for p in ring for j in range(t)]
        else:
            rows = [p[slot * hv:(slot + 1) * hv] for p in per_device(ttnn, s.recurrent)]
        rows += [p[slot] for p in per_device(ttnn, s.conv)]
        if not all(bool(r.isnan().all()) for r in rows):
            return False
    return True


def _poison_past(be, slot: int) -> None:
    """KV rows >= the user's position (rejected and inert rows) -> POISON (large, finite: a masked-out row is
    multiplied by probability 0, and 0 * NaN would be NaN)."""
    ttnn, mesh = be.ttnn, be.mesh
    table, end = be.decoder.state.page_table_host[slot], be.position(slot)
    for kv in kv_states(be.decoder.state):
        for c in (kv.k, kv.v):
            write_per_device(ttnn, mesh, c, poison_kv(per_device(ttnn, c), table, end))


def gdn_host_batch1(ttnn, state) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch-1 state's GDN layers as (recurrent [Hv, Dk, Dv], conv [K-1, Cd]) over all devices, the layout of
    ``TTBatchSpecBackend.committed_gdn``."""
    return [(torch.cat([p.float() for p in per_device(ttnn, s.recurrent)], 0),
             torch.cat([p.float()[0, 0] for p in per_device(ttnn, s.conv)], -1)) for s in state.gdn_states()]


def _oracle(gen, tokens: list[int], prompt_len: int) -> dict:
    """TT batch-1 plain greedy decode of ``tokens`` (prefill of the prompt, then one single-row decode per token)."""
    ttnn = gen.ttnn
    gen.prefill(torch.tensor(tokens[:prompt_len]))
    for tok in tokens[prompt_len:]:
        gen.decode_step(tok)
    st = gen.state
    out = {"n": len(tokens), "gdn": gdn_host_batch1(ttnn, st), "kv": kv_host(ttnn, st, 0, len(tokens))}
    gen.release_trace()
    return out


def run_tp_batch_cell(gen, mechanism: str, k: int, b: int, prompts, plains) -> dict:
    from qwen36.tt.batch_spec import TTBatchSpecBackend

    vocab = gen.config.vocab_size
    plan = user_plan(b, k)
    slots = slots_for(b, k)
    drafts = _Drafts(prompts, plains, vocab)
    be = TTBatchSpecBackend(gen, slots, k, mechanism, drafter=drafts)
    failed: list[str] = []
    users: list[dict] = []
    try:
        for s, p in enumerate(prompts):
            be.join(s, p)
        for _ in range(DRIVE_STEPS):
            d = be.draft({s: k for s in range(b)})
            be.commit(be.accept(d, be.verify(d)))
        free = list(range(b, slots))
        for s in free:
            _poison_free(be, s)
        pre = {s: _state(be, s) for s in range(b)}
        stepping = {s: kb for s, (kb, _) in enumerate(plan) if kb is not None}
        cont = {s: drafts.cont(s, be.users[s].history, kb + 1) for s, kb in stepping.items()}
        drafts.forced = {s: forced_drafts(cont[s], kb, plan[s][1], vocab) for s, kb in stepping.items()}

        # abort leg
        d = be.draft(stepping)
        if not be.mechanism.ring:
            be.verify(d)
        be.abort()
        abort = {f"user{s}": _equal(_state(be, s), pre[s]) for s in range(b)}
        failed += [f"abort:{u}" for u, ok in abort.items() if not ok]

        # accept leg
        before = be.counters.as_dict()
        d = be.draft(stepping)
        v = be.verify(d)
        finite = bool(be.verify_logits()[list(stepping)].isfinite().all())
        accepted = be.accept(d, v)
        be.commit(accepted)
        counters = {key: x - before[key] for key, x in be.counters.as_dict().items()}
        drafts.forced = None
        if not finite:
            failed.append("nonfinite_logits")
        if not all(_free_intact(be, s) for s in free):
            failed.append("free_slot")
        post = {s: _state(be, s) for s in range(b)}
        for s, (kb, a) in enumerate(plan):
            if kb is None:
                ok = _equal(post[s], pre[s])
                users.append({"user": s, "k": None, "untouched": ok, "pass": ok})
                if not ok:
                    failed.append(f"user{s}:touched")
                continue
            acc = accepted[s]
            tokens_ok = acc.num_accepted == a and acc.tokens == cont[s][: a + 1]
            pos_ok = post[s]["n"] == pre[s]["n"] + a + 1
            users.append({"user": s, "k": kb, "a": a, "accepted": acc.num_accepted, "tokens_ok": tokens_ok,
                          "pos_ok": pos_ok, "prompt_len": len(prompts[s])})
            failed += [f"user{s}:{name}" for name, ok in (("tokens", tokens_ok), ("pos", pos_ok)) if not ok]

        # continuation: rejected / inert rows poisoned, then more batched steps must stay on the greedy path
        for s in range(b):
            _poison_past(be, s)
        cont_ok = True
        try:
            for _ in range(CONTINUATION_BATCH_STEPS):
                d = be.draft({s: k for s in range(b)})
                be.commit(be.accept(d, be.verify(d)))
                for s in range(b):
                    drafts.cont(s, be.users[s].history, 0)  # raises when a user left its greedy sequence
        except Diverged as e:
            cont_ok = False
            failed.append(f"continuation:{_explain(gen, e)}")
        consumed = {s: list(be.users[s].history[:-1]) for s in range(b)}
        final = {s: _state(be, s) for s in range(b)}
        captures = be.captures
    finally:
        be.close()
    if captures != 2:
        failed.append(f"captures:{captures}")
    # oracle per user (after the backend's traces are released: the batch-1 decode allocates)
    for u in users:
        s = u["user"]
        orc = _oracle(gen, consumed[s], len(prompts[s]))
        got = final[s]
        u["oracle_n_ok"] = got["n"] == orc["n"]
        u["gdn_recurrent"] = compare([g[0] for g in got["gdn"]], [g[0] for g in orc["gdn"]], "gdn_recurrent")
        u["conv"] = compare([g[1] for g in got["gdn"]], [g[1] for g in orc["gdn"]], "conv")
        u["target_kv"] = compare(got["kv"], orc["kv"], "target_kv")
        for name in ("gdn_recurrent", "conv", "target_kv"):
            if not u[name]["pass"]:
                failed.append(f"user{s}:{name}")
        if not u["oracle_n_ok"]:
            failed.append(f"user{s}:oracle_n")
        u["pass"] = not any(f.startswith(f"user{s}:") for f in failed)
    return {"cell": f"B={b} K={k} {mechanism}", "batch": b, "slots": slots, "k": k, "mechanism": mechanism,
            "plan": [{"k": kb, "a": a} for kb, a in plan], "users": users, "abort": abort,
            "continuation_ok": cont_ok, "counters": counters, "captures": captures, "failed": failed,
            "pass": not failed}


def run_tp_batch_matrix(gen, *, batch: int, ks, mechanisms=MECHANISMS, seed: int = 0, prompt_len: int = 12):
    """Every (mechanism, K) cell for B = ``batch`` users -> (cells, counters summed per mechanism)."""
    if batch < 2:
        raise ValueError(f"the batched probe needs B >= 2 users, got {batch}")
    g = torch.Generator().manual_seed(seed)
    v = gen.config.vocab_size
    prompts = [torch.randint(0, v, (prompt_len + 3 * i,), generator=g).tolist() for i in range(batch)]
    n_plain = (DRIVE_STEPS + 2 + CONTINUATION_BATCH_STEPS) * (max(ks) + 1) + 2
    plains = []
    for p in prompts:
        plains.append(gen.greedy(p, n_plain))
        gen.release_trace()
    cells, totals = [], {m: {} for m in mechanisms}
    for k in ks:
        for mech in mechanisms:
            try:
                cell = run_tp_batch_cell(gen, mech, k, batch, prompts, plains)
            except Diverged as e:  # before the forced step: nothing else of the cell is meaningful
                cell = {"cell": f"B={batch} K={k} {mech}", "batch": batch, "k": k, "mechanism": mech, "users": [],
                        "counters": {}, "failed": [f"lossless:{_explain(gen, e)}"], "pass": False}
            cells.append(cell)
            for key, x in cell["counters"].items():
                totals[mech][key] = totals[mech].get(key, 0) + x
    return cells, totals


def worst(cells) -> dict:
    out = {}
    for name in ("gdn_recurrent", "conv", "target_kv"):
        vals = [u[name] for c in cells for u in c["users"] if name in u]
        out[name] = {"max_abs": max((x["max_abs"] for x in vals), default=0.0),
                     "pcc": min((x["pcc"] for x in vals), default=1.0)}
        if any(math.isnan(x["max_abs"]) for x in vals):
            out[name]["max_abs"] = float("nan")
    return out


__all__ = ["run_tp_batch_matrix", "run_tp_batch_cell", "slots_for", "TOLERANCES", "POISON"]
