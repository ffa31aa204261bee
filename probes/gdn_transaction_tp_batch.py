"""The batched matrix of probe gdn-transaction-tp (``--batch B``): B users in one B-slot ``TTSpecBackend`` (host
rows) driven through per-user forced plans (every mechanism x K), each user's committed GDN / conv / KV / MTP state
and continuation checked against its own TT batch-1 plain decode (probes/gdn_transaction_tp.py runs it)."""
from __future__ import annotations

import torch

from qwen36.speculative.mechanisms import MECHANISMS

from .gdn_transaction_tp_checks import (compare, free_slot_intact, gdn_host_batch1, kv_host, poison_free_slot,
                                        poison_past_rows, slot_state, states_equal)
from .transaction_plan import forced_drafts, user_plan

DRIVE_STEPS = 2


# ---- the batched transaction (--batch B) ------------------------------------------------------------------
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
    from qwen36.tt.spec.build import build_spec_backend

    vocab = gen.config.vocab_size
    plan = user_plan(b, k)
    slots = slots_for(b, k)
    drafts = _Drafts(prompts, plains, vocab)
    be = build_spec_backend(gen, drafts, users=slots, depth=k, mechanism=mechanism)
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
            poison_free_slot(be, s)
        pre = {s: slot_state(be, s) for s in range(b)}
        stepping = {s: kb for s, (kb, _) in enumerate(plan) if kb is not None}
        cont = {s: drafts.cont(s, be.users[s].history, kb + 1) for s, kb in stepping.items()}
        drafts.forced = {s: forced_drafts(cont[s], kb, plan[s][1], vocab) for s, kb in stepping.items()}

        # abort leg
        d = be.draft(stepping)
        if not be.mechanism.ring:
            be.verify(d)
        be.abort()
        abort = {f"user{s}": states_equal(slot_state(be, s), pre[s]) for s in range(b)}
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
        if not all(free_slot_intact(be, s) for s in free):
            failed.append("free_slot")
        post = {s: slot_state(be, s) for s in range(b)}
        for s, (kb, a) in enumerate(plan):
            if kb is None:
                ok = states_equal(post[s], pre[s])
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
            poison_past_rows(be, s)
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
        final = {s: slot_state(be, s) for s in range(b)}
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
        plains.append(gen.generate([p], n_plain)[0].tokens)
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
