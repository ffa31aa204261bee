"""The speculative backend on the pure-torch reference model (CPU or CUDA): ``slots`` user slots (one user is
``slots=1``), one packed verify per step, all three commit mechanisms.

State: a batch-``slots`` target ModelState (``reference.batch.SlotDecoder``: slot b is row b of every GDN, conv
and KV tensor, ``pos`` a LongTensor [slots]) and a batch-``slots`` MTPState (``pos`` per slot too); per user the
pending token (sampled, not yet consumed by the target), its MTP reseed rows (verified rows the MTP has not
consumed yet), its sampler (own generator, params, token history). Every forward of a step is packed over all
slots: the MTP reseed ([B, max reseed rows]), each MTP chain step ([B, 1]), the verify ([B, K+1]) and the
re-advance of snapshot / recompute ([B, max accepted rows]); a user's rows past its own count and all rows of
slots outside the step are inert (``reference.batch.packed_forward``). The GDN recurrent + conv state is routed
through each step by the commit mechanism, one object per name (``reference_mechanisms.py``; the names and why
there are three: ``mechanisms.py``). KV needs none: rows past the accepted prefix are never attended and are
overwritten by later writes at the same positions.

The KV caches hold ``max_len + max_k + 1`` rows: ``max_len`` bounds a user's prompt + generated tokens + the
K+1 verify rows; the extra rows are scratch room for inert rows of a user sitting near ``max_len`` (they are
written past its position, never read).

The probes read one user's state with :meth:`ReferenceBackend.live` (a batch-1 copy) and the public ``state`` /
``mtp`` tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..prefix_cache import PrefixCache
from ..reference.batch import SlotDecoder, packed_forward
from ..reference.model import Qwen36Model
from ..reference.state import GDNState, KVCache, ModelState, MTPState
from .acceptance import ONE_HOT_DRAFT, greedy_accept, rejection_sample
from .engine import Acceptance, MechanismCounters
from .mechanisms import DEFAULT_MECHANISM
from .reference_mechanisms import ReferenceMechanism, ReferenceVerify, Transaction, reference_mechanism
from ..generation.sampling import (Penalties, SamplingParams, TokenHistory, TokenLogprobs, penalize, pick_token,
                       probs_from_logits, sample, token_logprobs)


def reference_backend_label(model: Qwen36Model) -> str:
    """Backend label from where the weights actually live (never typed by hand)."""
    dev = model.embed_tokens.weight.device
    if dev.type == "cuda":
        return f"reference (torch CUDA: {torch.cuda.get_device_name(dev)})"
    return f"reference (torch {dev.type.upper()})"


@dataclass
class Reseed:
    """Verified rows not yet in the MTP KV cache: row j is position pos0+j with (x_{t+1}, h_t)."""

    tokens: torch.Tensor  # [1, m] int64: x_{t+1}
    hidden: torch.Tensor  # [1, m, H]: target post-norm h_t
    pos0: int

    def clone(self) -> "Reseed":
        return Reseed(self.tokens.clone(), self.hidden.clone(), self.pos0)


@dataclass
class ReferenceLive:
    state: ModelState
    mtp: MTPState
    pending: int
    reseed: Reseed
    history: TokenHistory  # prompt mask + output counts, pending token included (the penalties read them)

    def clone(self) -> "ReferenceLive":
        return ReferenceLive(self.state.clone(), self.mtp.clone(), self.pending, self.reseed.clone(),
                             self.history.clone())


@dataclass
class _User:
    params: SamplingParams
    generator: torch.Generator
    history: TokenHistory
    pending: int
    reseed: Reseed
    first_logprobs: TokenLogprobs | None

    def penalties_rows(self, tokens: torch.Tensor, rows: int) -> Penalties | None:
        """Penalty contexts [1, rows, V]: row j counts tokens[:j] on top of the history (None: penalties off)."""
        if not self.params.penalized:
            return None
        pen = self.history.rows(tokens.reshape(-1)[: rows - 1])
        return Penalties(pen.seen[None], pen.counts[None])

    def pick(self, chain: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """The next draft from MTP logits [1, V]; draft i's penalties count d_1..d_{i-1} (``chain``)."""
        p = self.params
        if not p.penalized:
            pen = None
        elif not chain:
            pen = self.history.now()
        else:
            rows = self.penalties_rows(torch.cat(chain), len(chain) + 1)
            pen = Penalties(rows.seen[:, -1], rows.counts[:, -1])
        tok = sample(probs_from_logits(logits, p, pen), self.generator) if p.sampled_drafts \
            else penalize(logits, p, pen).argmax(-1)
        chain.append(tok)
        return tok


@dataclass
class ReferenceDraft:
    depths: dict[int, int]  # slot -> k_b
    tokens: dict[int, torch.Tensor]  # slot -> [1, k_b] int64
    probs: dict[int, torch.Tensor | None]  # slot -> [1, k_b, V] draft distribution, None = one-hot

    @property
    def k(self) -> int:
        return max(self.depths.values())


class ReferenceBackend:
    """``engine.SpecBackend`` on the torch reference model. ``mechanism``: a name in ``mechanisms.MECHANISMS`` (or a
    built ReferenceMechanism); ``slots`` users at once; ``max_len`` bounds each user's prompt + generated tokens +
    K+1 verify rows; ``max_k`` the largest draft depth a step may use."""

    def __init__(self, model: Qwen36Model, mechanism: str | ReferenceMechanism = DEFAULT_MECHANISM,
                 max_len: int = 2048, *, slots: int = 1, max_k: int = 8, prefix_cache: PrefixCache | None = None):
        if model.mtp is None:
            raise ValueError("speculative decoding needs the MTP head: the checkpoint has no 'mtp.*' tensors")
        if prefix_cache is not None and not prefix_cache.with_mtp:
            raise ValueError("speculative decoding needs a prefix cache that keeps the MTP rows (with_mtp=True)")
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.mechanism = reference_mechanism(mechanism)
        self.model, self.slots, self.max_len, self.max_k = model, slots, max_len, max_k
        self.label = reference_backend_label(model)
        self.counters = MechanismCounters()
        self.dec = SlotDecoder(model, slots, max_len + max_k + 1, prefix_cache)
        self.mtp = model.new_mtp_state(slots, max_len + max_k + 1)
        self.mtp.pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.users: dict[int, _User] = {}
        self.gdn_ids = [i for i, s in enumerate(self.state.layers) if isinstance(s, GDNState)]
        self._txn: Transaction | None = None
        self.last_prefill = None  # the last join's PrefillResult (tokens reused / computed, the lease)
        self.prefill_s: float | None = None  # the last join's prefill + first pick, wall time (measured)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def state(self) -> ModelState:
        return self.dec.state

    @property
    def occupied(self) -> torch.Tensor:
        return self.dec.active

    def gdn(self) -> list[GDNState]:
        return [self.state.layers[i] for i in self.gdn_ids]

    def gdn_bytes(self) -> int:
        return sum(g.nbytes() for g in self.gdn())

    @property
    def gdn_layout(self) -> tuple[int, int]:
        """(number of GDN layers, bytes of one slot's GDN recurrent + conv state)."""
        return len(self.gdn_ids), self.gdn_bytes() // self.slots

    def advance(self, rows: torch.Tensor, n_valid: torch.Tensor) -> None:
        """Run each slot's first n_valid[b] ``rows`` through the target on live state (re-advance / recompute)."""
        packed_forward(self.model, self.state, rows, n_valid, self.occupied)
        self.counters.target_forwards += 1
        self.counters.recurrence_steps += rows.numel() * len(self.gdn_ids)

    def _slot(self, slot: int) -> _User:
        if slot not in self.users:
            raise ValueError(f"slot {slot} holds no user")
        return self.users[slot]

    # ---- the contract ---------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        if self._txn is not None:
            raise RuntimeError("join() inside an open step: commit() or abort() first")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_len {self.max_len}")
        t0 = time.perf_counter()
        if 0 <= slot < self.slots and slot not in self.users:
            self.mtp.kv.k[slot].zero_()  # a packed MTP forward reads rows up to the longest user's: no garbage here
            self.mtp.kv.v[slot].zero_()
        view = MTPState(KVCache(self.mtp.kv.k[slot:slot + 1], self.mtp.kv.v[slot:slot + 1]), 0)
        # checks the slot and the prompt; writes this slot only (cached blocks: also its MTP rows, through the view)
        res = self.last_prefill = self.dec.prefill(slot, prompt, view)
        self.mtp.pos[slot] = res.reseed_pos0
        gen = params.generator(self.device)
        history = TokenHistory(prompt, self.model.config.vocab_size, self.device)
        first = int(pick_token(res.logits, params, gen, history.now()))
        lp = token_logprobs(res.logits[0], first, params.logprobs) if params.logprobs is not None else None
        history.add([first])
        self.prefill_s = time.perf_counter() - t0  # time to first token (prefill + pick), measured here
        tokens = res.reseed_tokens(prompt, first, self.device)  # x_{t+1} for t = reseed_pos0..n-1
        self.users[slot] = _User(params, gen, history, first, Reseed(tokens, res.reseed_hidden, res.reseed_pos0), lp)
        return first

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        return self._slot(slot).first_logprobs

    def leave(self, slot: int) -> None:
        if self._txn is not None:
            raise RuntimeError("leave() inside an open step: commit() or abort() first")
        self._slot(slot)
        self.dec.leave(slot)
        self.mtp.pos[slot] = 0
        del self.users[slot]

    def live(self, slot: int) -> ReferenceLive:
        """A batch-1 copy of one user's live state (what the single-user backend would hold): the probes compare
        it with the single-user oracle."""
        u = self._slot(slot)
        layers = [KVCache(s.k[slot:slot + 1].clone(), s.v[slot:slot + 1].clone()) if isinstance(s, KVCache)
                  else GDNState(s.recurrent[slot:slot + 1].clone(), s.conv[slot:slot + 1].clone())
                  for s in self.state.layers]
        kv = self.mtp.kv
        mtp = MTPState(KVCache(kv.k[slot:slot + 1].clone(), kv.v[slot:slot + 1].clone()), int(self.mtp.pos[slot]))
        return ReferenceLive(ModelState(layers, int(self.state.pos[slot])), mtp, u.pending, u.reseed.clone(),
                             u.history.clone())

    def restore(self, slot: int, live: ReferenceLive) -> None:
        """Outside a step: make the user in ``slot`` hold a copy of ``live`` (a :meth:`live` copy taken earlier,
        from this backend; the sampler keeps running). Tests repeat one step from the same state this way."""
        if self._txn is not None:
            raise RuntimeError("restore() inside an open step: commit() or abort() first")
        u, idx = self._slot(slot), torch.tensor([slot], device=self.device)
        for s, v in zip(self.state.layers, live.state.layers):
            if isinstance(s, KVCache):
                s.k[slot:slot + 1], s.v[slot:slot + 1] = v.k, v.v
            else:
                s.recurrent = s.recurrent.index_copy(0, idx, v.recurrent.to(s.recurrent.dtype))
                s.conv = s.conv.index_copy(0, idx, v.conv.to(s.conv.dtype))
        self.state.pos = self.state.pos.index_fill(0, idx, live.state.pos)
        self.mtp.kv.k[slot:slot + 1], self.mtp.kv.v[slot:slot + 1] = live.mtp.kv.k, live.mtp.kv.v
        self.mtp.pos[slot] = live.mtp.pos
        u.pending, u.reseed, u.history = live.pending, live.reseed.clone(), live.history.clone()

    @torch.no_grad()
    def draft(self, depths: Mapping[int, int]) -> ReferenceDraft:
        if self._txn is not None:
            raise RuntimeError("draft() inside an open step: commit() or abort() first")
        depths = dict(depths)
        if not depths:
            raise ValueError("draft() with no user in the step")
        for slot, k in depths.items():
            self._slot(slot)
            if not 1 <= k <= self.max_k:
                raise ValueError(f"slot {slot}: draft depth must be in [1, {self.max_k}], got {k}")
            if int(self.state.pos[slot]) + k + 1 > self.max_len:
                raise ValueError(f"slot {slot}: KV cache full: position {int(self.state.pos[slot])} + {k + 1} rows "
                                 f"> max_len {self.max_len}")
        b, dev, big_k = self.slots, self.device, max(depths.values())
        part = torch.zeros(b, dtype=torch.bool, device=dev)
        kvec = torch.zeros(b, dtype=torch.long, device=dev)
        for slot, k in depths.items():
            part[slot], kvec[slot] = True, k
        txn = Transaction(depths, self.state.pos.clone(), self.mtp.pos.clone(),
                        {s: self.users[s].generator.get_state() for s in depths}, big_k, part, kvec)
        self._txn = txn

        # MTP reseed, packed: user b's verified rows at its own positions, the rest inert (scratch rows)
        m = torch.zeros(b, dtype=torch.long, device=dev)
        for slot in depths:
            m[slot] = self.users[slot].reseed.tokens.shape[1]
        width = max(1, int(m.max()))
        hdim = self.model.config.hidden_size
        toks = torch.zeros(b, width, dtype=torch.long, device=dev)
        hid = torch.zeros(b, width, hdim, dtype=self.model.embed_tokens.weight.dtype, device=dev)
        for slot in depths:
            r = self.users[slot].reseed
            if r.pos0 != int(self.mtp.pos[slot]):
                raise AssertionError(f"slot {slot}: reseed rows start at {r.pos0}, MTP position {int(self.mtp.pos[slot])}")
            toks[slot, : r.tokens.shape[1]] = r.tokens[0]
            hid[slot, : r.tokens.shape[1]] = r.hidden[0].to(hid.dtype)
        base = torch.where(self.occupied, self.mtp.pos, 0)
        logits, h = self.model.mtp_forward(toks, hid, base, self.mtp)
        self.mtp.pos = torch.where(part, base + m, self.mtp.pos)
        rows = torch.arange(b, device=dev)
        last = (m - 1).clamp(min=0)
        lg, hh = logits[rows, last], h[rows, last][:, None]
        chain_base = torch.where(self.occupied, self.mtp.pos, 0)  # participants: right after their reseed rows
        chains: dict[int, list[torch.Tensor]] = {s: [] for s in depths}
        lgs: dict[int, list[torch.Tensor]] = {s: [] for s in depths}
        for i in range(big_k):
            tok = torch.zeros(b, dtype=torch.long, device=dev)
            for slot, k in depths.items():
                if i < k:
                    lgs[slot].append(lg[slot:slot + 1])
                    tok[slot] = self.users[slot].pick(chains[slot], lg[slot:slot + 1])[0]
            if i + 1 < big_k:
                lg3, hh = self.model.mtp_forward(tok[:, None], hh, chain_base + i, self.mtp)
                lg = lg3[:, -1]
        self.counters.mtp_forwards += big_k
        tokens, probs = {}, {}
        for slot, k in depths.items():
            u = self.users[slot]
            tokens[slot] = torch.stack(chains[slot], 1)  # [1, k]
            probs[slot] = (probs_from_logits(torch.stack(lgs[slot], 1), u.params, u.penalties_rows(tokens[slot], k))
                           if u.params.sampled_drafts else ONE_HOT_DRAFT)
        return ReferenceDraft(depths, tokens, probs)

    @torch.no_grad()
    def verify(self, draft: ReferenceDraft) -> ReferenceVerify:
        txn = self._txn
        if txn is None or txn.verified:
            raise RuntimeError("verify() needs exactly one draft() before it")
        if draft.depths != txn.depths:
            raise ValueError("verify() of a draft from another step")
        rows = torch.zeros(self.slots, txn.k + 1, dtype=torch.long, device=self.device)
        for slot, k in txn.depths.items():
            rows[slot, 0] = self.users[slot].pending
            rows[slot, 1: k + 1] = draft.tokens[slot][0]
        n_valid = torch.where(txn.part, txn.kvec + 1, 0)
        out = self.mechanism.verify(self, txn, rows, n_valid)
        self.counters.target_forwards += 1
        self.counters.recurrence_steps += rows.numel() * len(self.gdn_ids)
        txn.verified = True
        txn.verify = ReferenceVerify(rows, n_valid, out.logits, out.hidden, out.gdn_per_token)
        return txn.verify

    @torch.no_grad()
    def accept(self, draft: ReferenceDraft, verify: ReferenceVerify) -> dict[int, Acceptance]:
        out: dict[int, Acceptance] = {}
        for slot, k in draft.depths.items():
            u, d = self.users[slot], draft.tokens[slot]
            p, logits = u.params, verify.logits[slot:slot + 1, : k + 1]
            pen = u.penalties_rows(d, k + 1)  # row j is used only when d_1..d_j were accepted
            if p.greedy:
                toks, n = greedy_accept(d, penalize(logits, p, pen))
            else:
                toks, n = rejection_sample(d, draft.probs[slot], probs_from_logits(logits, p, pen), u.generator)
            a = int(n[0])
            emitted = toks[0, : a + 1].tolist()
            lps = ([token_logprobs(logits[0, j], t, p.logprobs) for j, t in enumerate(emitted)]
                   if p.logprobs is not None else None)
            out[slot] = Acceptance(a, emitted, lps)
        return out

    @torch.no_grad()
    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        txn = self._txn
        if txn is None or not txn.verified:
            raise RuntimeError("commit() needs draft() and verify() first")
        if set(acceptances) != set(txn.depths):
            raise ValueError(f"commit() needs one acceptance per user of the step: {sorted(txn.depths)}, "
                             f"got {sorted(acceptances)}")
        a = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        for slot, acc in acceptances.items():
            if not 0 <= acc.num_accepted <= txn.depths[slot]:
                raise ValueError(f"slot {slot}: num_accepted {acc.num_accepted} outside [0, {txn.depths[slot]}]")
            a[slot] = acc.num_accepted
        self.mechanism.commit(self, txn, a)
        expected = torch.where(txn.part, txn.pos + a + 1, txn.pos)
        if not torch.equal(self.state.pos, expected):
            raise AssertionError(f"positions after commit {self.state.pos.tolist()}, expected {expected.tolist()}")
        for slot, acc in acceptances.items():
            u, n = self.users[slot], int(txn.pos[slot])
            toks = torch.tensor([acc.tokens], device=self.device)  # x_{t+1} for t = n..n+a
            u.reseed = Reseed(toks, txn.verify.hidden[slot:slot + 1, : acc.num_accepted + 1], n)
            u.pending = acc.tokens[-1]
            u.history.add(acc.tokens)
        self.counters.steps += 1
        self._txn = None

    @torch.no_grad()
    def inject(self, forced: Mapping[int, Sequence[int]],
               depths: Mapping[int, int] | None = None) -> dict[int, Acceptance]:
        """Per user in ``forced``: commit its forced tokens after its pending one like a prefill continuation (the
        thinking budget's phrase): ONE packed forward over [pending, forced...] of every such user (the others inert)
        through the commit mechanism with every row kept, the next token picked from each user's last real row with
        its own sampler and penalties, the MTP re-seeded from those rows at the next draft (after the rows it had not
        consumed yet). Returns slot -> Acceptance (forced + the picked token). ``depths`` is not needed here (one
        packed forward of any width)."""
        if self._txn is not None:
            raise RuntimeError("inject() inside an open step: commit() or abort() first")
        forced = {slot: list(toks) for slot, toks in forced.items()}
        if not forced or any(len(t) < 1 for t in forced.values()):
            raise ValueError("inject() needs at least one forced token per user")
        cache_rows = self.state.kv_caches()[0].max_len if self.state.kv_caches() else None
        b, dev, big = self.slots, self.device, max(len(t) for t in forced.values())
        for slot in forced:
            self._slot(slot)
        if cache_rows is not None and int(torch.where(self.occupied, self.state.pos, 0).max()) + big + 1 > cache_rows:
            raise ValueError(f"KV cache full: {big + 1} forced rows past a user's position exceed the {cache_rows} "
                             "cache rows (raise max_len)")
        part = torch.zeros(b, dtype=torch.bool, device=dev)
        kvec = torch.zeros(b, dtype=torch.long, device=dev)
        for slot, toks in forced.items():
            part[slot], kvec[slot] = True, len(toks)
        before = {slot: self.users[slot].reseed for slot in forced}
        depths = {s: len(t) for s, t in forced.items()}
        self._txn = Transaction(depths, self.state.pos.clone(), self.mtp.pos.clone(),
                              {s: self.users[s].generator.get_state() for s in forced}, big, part, kvec)
        tokens = {slot: torch.tensor([toks], device=dev) for slot, toks in forced.items()}
        verify = self.verify(ReferenceDraft(depths, tokens, {s: ONE_HOT_DRAFT for s in forced}))
        out: dict[int, Acceptance] = {}
        for slot, toks in forced.items():
            u, m = self.users[slot], len(toks)
            pen = u.penalties_rows(tokens[slot], m + 1)
            last = verify.logits[slot:slot + 1, m]
            nxt = int(pick_token(last, u.params, u.generator,
                                 None if pen is None else Penalties(pen.seen[:, m], pen.counts[:, m])))
            out[slot] = Acceptance(m, toks + [nxt])
        self.commit(out)
        for slot, old in before.items():
            r = self.users[slot].reseed
            self.users[slot].reseed = Reseed(torch.cat([old.tokens, r.tokens], 1), torch.cat([old.hidden, r.hidden], 1),
                                             old.pos0)
        return out

    @torch.no_grad()
    def abort(self) -> None:
        txn = self._txn
        if txn is None:
            raise RuntimeError("abort() outside a step")
        if txn.verified:
            self.mechanism.abort(self, txn)
        self.state.pos, self.mtp.pos = txn.pos, txn.mtp_pos  # MTP rows >= pos are rewritten by the next reseed
        for slot, rng in txn.rng.items():
            self.users[slot].generator.set_state(rng)
        self.counters.aborts += 1
        self._txn = None
