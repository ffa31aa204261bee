"""Greedy MTP speculative decoding in one function: the loop the rest of this package generalises.

Batch 1, greedy, on the pure-torch reference model (qwen36.reference.model.Qwen36Model), with the simplest
commit: copy the state before the verify and restore it when a draft is rejected (the engine's ``snapshot``
mechanism). ``qwen36.speculative.engine.speculative_generate`` / ``SpecBatch.step`` run the same step over any
backend (reference or TT), with stochastic acceptance and the ``shadow_commit`` / ``recompute`` mechanisms;
for greedy decoding both give the same tokens and the same accepted counts (tests/speculative/test_greedy_loop.py).

One step, with ``pending`` the target's latest token (emitted, not yet fed to the target):
1. draft:  the MTP head proposes k tokens d1..dk that follow ``pending``;
2. verify: ONE target forward over the k+1 rows [pending, d1..dk] gives the target's own choice after each row;
3. accept: the drafts that match those choices, up to the first mismatch (a of them), plus the target's choice
   after the last accepted row (a correction, or a bonus token when all k match): a + 1 new tokens per forward;
4. commit: the target state must end after the accepted rows. Attention KV rows past them are never read and
   get overwritten, but the Gated-DeltaNet recurrent state has no rows to drop: it is restored and the accepted
   rows are run again.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy_speculative_generate(model, prompt: list[int], max_new_tokens: int, k: int,
                                eos_ids: tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    """New tokens (at most ``max_new_tokens``, ending at the first EOS) and the accepted-draft count per step."""
    if k < 1:
        raise ValueError(f"draft depth k must be >= 1, got {k}")
    max_len = len(prompt) + max_new_tokens + k + 2
    state, mtp_state = model.new_state(1, max_len), model.new_mtp_state(1, max_len)
    ids = torch.tensor([prompt], device=model.embed_tokens.weight.device)
    out = model(ids, state)  # prefill
    pending = int(out.logits[0, -1].argmax())
    # The MTP head predicts token t+2 from (the target's hidden at t, token t+1). Its first pass covers the prompt
    # rows; after each step it covers the rows just accepted.
    mtp_tokens, mtp_hidden, mtp_pos = torch.cat([ids[:, 1:], ids.new_tensor([[pending]])], dim=1), out.hidden, 0
    tokens, accepted = [pending], []
    while len(tokens) < max_new_tokens and not any(t in eos_ids for t in tokens):
        drafts = model.mtp_draft(mtp_state, mtp_tokens, mtp_hidden, mtp_pos, k).tokens[0].tolist()
        rows = ids.new_tensor([[pending] + drafts])  # positions n .. n+k
        n, saved = state.pos, state.clone()
        verify = model(rows, state)
        choice = verify.logits[0].argmax(-1).tolist()  # the target's token after each row
        a = 0
        while a < k and drafts[a] == choice[a]:
            a += 1
        new = drafts[:a] + [choice[a]]
        if a < k:  # rows a+1..k went into the GDN state: restore it and advance over the accepted rows only
            state = saved
            model(rows[:, : a + 1], state)
        mtp_tokens, mtp_hidden, mtp_pos = ids.new_tensor([new]), verify.hidden[:, : a + 1], n
        pending = new[-1]
        tokens += new
        accepted.append(a)
    for i, t in enumerate(tokens):  # EOS inside an accepted block ends the output there
        if t in eos_ids:
            tokens = tokens[: i + 1]
            break
    return tokens[:max_new_tokens], accepted
