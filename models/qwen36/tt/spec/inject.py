"""Forced tokens through the TT speculative step (a thinking budget's stop-thinking phrase, ``generation/thinking.py``):
the B-slot layout's ``TTSpecBackend.inject`` (host rows).

Each round is one step of the backend's own draft-less traces: the forced users' next up-to-K forced tokens are
written as their drafts (k_b = the chunk's length, 0 when only the pending token is left to verify), the verify
replays, the host overwrites those users' results with "every forced row accepted, the next forced token pending"
(:meth:`DeviceAcceptor.force_rows`; the other rows written back unchanged), and the commit replays: the per-user state
commit and the MTP reseed take the forced rows, so the next step's chain drafts on from the forced tokens. The last
round's next token is picked on the host from the verify row after the last forced token, with the user's params
and host stream (the one its join's token came from), as the one-user layout does. Users not forced sit the rounds
out (inert rows, their uniform rows given back), so their own steps are those of a run without the others' budgets.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ...speculative.engine import Acceptance
from ...generation.sampling import TokenHistory, pick_token
from .host_rows import BatchDraft


def inject_slots(be, forced: Mapping[int, Sequence[int]]) -> dict[int, Acceptance]:
    """The forced tokens of every user in ``forced`` (slot -> tokens) on ``be`` (a B-slot ``TTSpecBackend``),
    packed into shared rounds (module doc).
    Returns slot -> the forced tokens + the pick after them; ``be.inject_logits`` = slot -> that pick's row (fp32 [V])."""
    be._check_idle("inject()")
    toks: dict[int, list[int]] = {}
    for s, f in forced.items():
        if s not in be.users:
            raise ValueError(f"inject(): slot {s} has no user")
        toks[s] = [int(t) for t in f]
        if not toks[s]:
            raise ValueError(f"inject(): slot {s}: at least one forced token is needed")
    k, max_len = be.k, be.model.args.max_seq_len
    done: dict[int, list[int]] = {s: [] for s in toks}
    at = {s: 0 for s in toks}  # the next forced token of each user
    out: dict[int, Acceptance] = {}
    be.inject_logits = {}
    while len(out) < len(toks):
        chunks = {s: toks[s][at[s]: at[s] + min(k, len(toks[s]) - at[s])] for s in toks if s not in out}
        depths = {s: len(c) for s, c in chunks.items()}
        for s, c in depths.items():
            if be.decoder.pos[s] + c + 1 > max_len:
                raise ValueError(f"slot {s}: KV cache full: position {be.decoder.pos[s]} + {c + 1} rows > "
                                 f"max_seq_len {max_len}")
        be._write_rows(depths, chunks)
        if be.device_drafter:  # the reseed rows' positions (the chain does not run: the drafts are the forced tokens)
            be.drafter.write_inputs(depths, {s: be.decoder.pos[s] for s in depths},
                                    {s: be.users[s].history[-1] for s in depths})
        be._draft, be._phase = BatchDraft(depths, chunks), "drafted"
        be._verify_slots(be._draft)
        idle = [s for s in be.users if s not in depths]
        results = be.acceptor.read_results(be._result, idle_rows=idle)  # the step's RNG bookkeeping, as accept()
        final = {s for s, c in depths.items() if at[s] + c >= len(toks[s])}
        logits = be.verify_logits() if final else None
        rows, acc = {}, {}
        for s, chunk in chunks.items():
            c = len(chunk)
            if s in final:
                u = be.users[s]
                row = logits[s, c]
                be.inject_logits[s] = row
                history = TokenHistory(u.history[: u.prompt_len], be.vocab)
                history.add(u.history[u.prompt_len:] + chunk)
                nxt = int(pick_token(row.reshape(1, -1), u.params, u.host_gen, history.now()))
            else:
                nxt = toks[s][at[s] + c]
            rows[s] = (chunk + [nxt], c)
            acc[s] = Acceptance(c, chunk + [nxt])
        be.acceptor.force_rows(rows, results)
        be._phase = "accepted"
        be._commit_slots(acc, forced=True)
        for s, a in acc.items():
            done[s] += a.tokens
            if s in final:
                out[s] = Acceptance(len(toks[s]), done[s])
            else:
                at[s] += a.num_accepted + 1
    return out
