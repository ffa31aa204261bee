"""Plain decoding on the TT model: the ``generation.plain.DecodeBackend`` over a :class:`.batch.TTBatchDecoder`'s
slots, driven by ``generation.plain.plain_generate`` like the reference's.

How a step's tokens are picked is one object chosen at construction:

* :class:`DevicePicks`: inside the traced step by a :class:`.sampler.DeviceSampler` (one row per slot, each its
  user's params, penalties and seeded stream), so a step reads back only token ids (and logprobs when asked); a
  user's first token is picked on the host from the prompt's last row by the same transform, and a forced token
  (thinking budget) rewrites the user's penalty rows from its history;
* :class:`LogitsRows`: every step's logits rows are read back and picked on the host
  (``generation.plain.HostPicks``: each user's params, generator and penalties), the rows kept when asked.

    backend = TTDecoder(TTBatchDecoder(model, 8), DevicePicks(sampler))
    results = plain_generate(backend, prompts, 64, params, eos_ids)
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ...generation.plain import HostPicks, Pick
from ...generation.sampling import SamplingParams, TokenHistory, pick_token, token_logprobs
from .batch import FREE, TTBatchDecoder
from .sampler import DeviceSampler


def sampled_step(dec: TTBatchDecoder, sampler: DeviceSampler, tokens: dict[int, int],
                 traced: bool | None = None) -> list[tuple]:
    """One decode forward over ``dec``'s slots followed by the device pick (row r of ``sampler`` picks for slot r),
    as one traced step (its own trace name, captured once like the greedy step); returns every slot's (token,
    logprobs or None) (rows of slots not in ``tokens`` are meaningless)."""
    m = dec.model
    if sampler.rows != dec.slots:
        raise ValueError(f"sampler has {sampler.rows} rows, the decoder {dec.slots} slots")
    for s in tokens:
        if not 0 <= s < dec.slots:
            raise ValueError(f"slot {s} out of range (decoder has {dec.slots} slots)")
        if dec.pos[s] == FREE:
            raise ValueError(f"slot {s} has no user (join it first)")
        if dec.pos[s] >= m.args.max_seq_len:
            raise ValueError(f"slot {s}: position {dec.pos[s]} reached max_seq_len {m.args.max_seq_len}")
    toks = [int(tokens.get(s, 0)) for s in range(dec.slots)]
    pos = [dec.pos[s] if s in tokens else -1 for s in range(dec.slots)]
    m.copy_host_to_device(m.prepare_decode_inputs_host(toks, pos), dec.inputs)
    sampler.before_step()
    dec.traces.run(f"decode+sample/B{dec.slots}", lambda: sampler.pick(m.decode_forward(dec.inputs, dec.state).logits),
                   traced=dec.use_trace if traced is None else traced)
    dec.traces.step_done()
    out = sampler.read()
    for s in tokens:
        dec.pos[s] += 1
    return out


class LogitsRows:
    """Host picks from every step's read-back logits rows (the decoder's full-logits step)."""

    def __init__(self, vocab: int, keep_logits: bool = False):
        self.host = HostPicks(vocab, "cpu", keep_logits)

    def start(self, slot: int, prompt: Sequence[int], params: SamplingParams, logits: torch.Tensor,
              forced: int | None) -> Pick:
        return self.host.start(slot, prompt, params, logits, forced)

    def step(self, dec: TTBatchDecoder, tokens: Mapping[int, int], forced: Mapping[int, int]) -> dict[int, Pick]:
        logits, _ = dec.step(dict(tokens))
        return {s: self.host.next(s, logits[s], forced.get(s)) for s in tokens}

    def stop(self, slot: int) -> None:
        self.host.stop(slot)


class DevicePicks:
    """Picks on device by ``sampler`` (row r for slot r; allocated by its owner before the first step, outside any
    capture); the first token of a user on the host from its prompt's last row."""

    def __init__(self, sampler: DeviceSampler | None):
        self.sampler = sampler
        self.seq: dict[int, tuple[int, list[int]]] = {}  # slot -> (prompt length, prompt + emitted tokens)

    def start(self, slot: int, prompt: Sequence[int], params: SamplingParams, logits: torch.Tensor,
              forced: int | None) -> Pick:
        ids = [int(t) for t in torch.as_tensor(prompt).reshape(-1).tolist()]
        lp = None
        if forced is None:  # a forced first token (budget 0) starts the row's history instead
            gen = params.generator() if not params.greedy else None
            tok = int(pick_token(logits.reshape(1, -1), params, gen, TokenHistory(ids, self.sampler.vocab).now()))
            lp = token_logprobs(logits, tok, params.logprobs) if params.logprobs is not None else None
        else:
            tok = int(forced)
        self.sampler.start(slot, params, ids, tok)
        self.seq[slot] = (len(ids), ids + [tok])
        return Pick(tok, lp)

    def step(self, dec: TTBatchDecoder, tokens: Mapping[int, int], forced: Mapping[int, int]) -> dict[int, Pick]:
        picked = sampled_step(dec, self.sampler, {s: tokens[s] for s in sorted(tokens)})
        out = {}
        for s in sorted(tokens):
            n, seq = self.seq[s]
            tok, lp = picked[s]
            if s in forced:
                tok, lp = int(forced[s]), None
                if self.sampler.stages.penalized:  # the device counted its own pick: rewrite from the history
                    self.sampler.resync(s, n, seq + [tok])
            seq.append(tok)
            out[s] = Pick(tok, lp)
        return out

    def stop(self, slot: int) -> None:
        self.seq.pop(slot, None)


class TTDecoder:
    """``generation.plain.DecodeBackend`` over ``decoder``'s slots with ``picks`` (module doc). A user joins a free
    slot by the decoder's join (its prefill alone in the slot, through the decoder's prefix cache) and leaves it
    reset."""

    def __init__(self, decoder: TTBatchDecoder, picks: LogitsRows | DevicePicks, label: str = ""):
        self.decoder, self.picks = decoder, picks
        self.slots = decoder.slots
        self.label = label or "tt"

    def free_slots(self) -> list[int]:
        return self.decoder.free_slots()

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams, forced: int | None = None) -> Pick:
        logits = self.decoder.join(slot, prompt)
        pick = self.picks.start(slot, prompt, params, logits, forced)
        pick.prefill = self.decoder.prefills.get(slot)
        return pick

    def step(self, tokens: Mapping[int, int], forced: Mapping[int, int]) -> dict[int, Pick]:
        return self.picks.step(self.decoder, tokens, forced)

    def leave(self, slot: int) -> None:
        self.decoder.leave(slot)
        self.picks.stop(slot)
