"""The speculative backend on the pure-torch reference model (CPU or CUDA), with all three commit mechanisms.

Live state (:class:`ReferenceLive`): target ModelState (KV + GDN recurrent + conv), MTPState, the pending token
(sampled, not yet consumed by the target) and the reseed rows (verified rows the MTP has not consumed yet).

The GDN recurrent + conv state is routed through each step by the commit mechanism, one object per name
(``reference_mechanisms.py``; the names and why there are three: ``mechanisms.py``). KV needs none: rows past the
accepted prefix are never attended and are overwritten by later writes at the same positions.

The probes read :attr:`ReferenceBackend.live` directly (and copy it with ``live.clone()``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..config import FULL
from ..reference.gdn import GDNPerToken
from ..prefix_cache import PrefixCache
from ..reference.model import Qwen36Model
from ..reference.prefix import prefill as cached_prefill
from ..reference.state import GDNState, ModelState, MTPState
from .acceptance import ONE_HOT_DRAFT, greedy_accept, rejection_sample
from .engine import Acceptance, MechanismCounters
from .mechanisms import DEFAULT_MECHANISM
from .reference_mechanisms import VERIFY_GDN_MODE, ReferenceMechanism, reference_mechanism
from .sampling import (Penalties, SamplingParams, TokenHistory, penalize, pick_token, probs_from_logits, sample,
                       token_logprobs)


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
class ReferenceDraft:
    tokens: torch.Tensor  # [1, K] int64
    probs: torch.Tensor | None  # [1, K, V] fp32 draft distribution; None = one-hot (argmax drafts)

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


@dataclass
class ReferenceVerify:
    rows: torch.Tensor  # [1, K+1] int64: [pending, d_1..d_K]
    logits: torch.Tensor  # [1, K+1, V] fp32
    hidden: torch.Tensor  # [1, K+1, H] post-norm (the MTP's h_t for the reseed)
    slots: dict[int, GDNPerToken] | None = None  # shadow_commit: layer index -> state after every row


@dataclass
class _Transaction:
    """What abort/commit need: positions before the step, and the mechanism's saved state."""

    pos: int
    mtp_pos: int
    k: int = 0
    verified: bool = False
    saved: Any = None  # the mechanism's: snapshot copies, shadow_commit's pre-verify tensors (references)
    verify: "ReferenceVerify | None" = None  # the step's verify handle (commit reads rows, hiddens, slots)
    rng_state: torch.Tensor | None = None  # sampler state before the step (abort rewinds it)


class ReferenceBackend:
    """SpecBackend on the torch reference model. ``mechanism``: a name in ``mechanisms.MECHANISMS`` (or a built
    ReferenceMechanism); ``max_len`` sizes the KV caches."""

    def __init__(self, model: Qwen36Model, mechanism: str | ReferenceMechanism = DEFAULT_MECHANISM,
                 max_len: int = 2048, prefix_cache: PrefixCache | None = None):
        mech = reference_mechanism(mechanism)
        if model.mtp is None:
            raise ValueError("speculative decoding needs the MTP head: the checkpoint has no 'mtp.*' tensors")
        if prefix_cache is not None and not prefix_cache.with_mtp:
            raise ValueError("speculative decoding needs a prefix cache that keeps the MTP rows (with_mtp=True)")
        self.prefix_cache = prefix_cache
        self.last_prefill = None  # the last prefill's PrefillResult (tokens reused / computed, the lease)
        self.model = model
        self.mechanism = mech
        self.max_len = max_len
        self.label = reference_backend_label(model)
        self.counters = MechanismCounters()
        self.live: ReferenceLive | None = None
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.first_logprobs = None
        self._txn: _Transaction | None = None
        self.gdn_ids = [i for i, t in enumerate(model.config.layer_types) if t != FULL]

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def gdn(self) -> list[GDNState]:
        """The live GDN layer states."""
        return [self.live.state.layers[i] for i in self.gdn_ids]

    def gdn_bytes(self) -> int:
        return sum(g.nbytes() for g in self.gdn())

    @property
    def gdn_layout(self) -> tuple[int, int]:
        """(number of GDN layers, bytes of all GDN recurrent + conv state) of the live state."""
        return len(self.gdn_ids), self.gdn_bytes()

    # ---- the contract ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_len {self.max_len}")
        self.release()
        t0 = time.perf_counter()
        self.params, self.generator = params, params.generator(self.device)
        state = self.model.new_state(1, self.max_len)
        mtp = self.model.new_mtp_state(1, self.max_len)
        # without a cache: one forward, the same call as plain greedy decoding's prefill
        res = self.last_prefill = cached_prefill(self.model, state, prompt, self.prefix_cache, mtp)
        history = TokenHistory(prompt, self.model.config.vocab_size, self.device)
        first = int(pick_token(res.logits, params, self.generator, history.now()))
        self.first_logprobs = (token_logprobs(res.logits[0], first, params.logprobs)
                               if params.logprobs is not None else None)
        history.add([first])
        self.prefill_s = time.perf_counter() - t0  # time to first token (prefill + pick), measured here
        tokens = res.reseed_tokens(prompt, first, self.device)  # x_{t+1} for t = reseed_pos0..n-1
        mtp.pos = res.reseed_pos0
        self.live = ReferenceLive(state, mtp, first, Reseed(tokens, res.reseed_hidden, res.reseed_pos0), history)
        self._txn = None
        return first

    def release(self) -> None:
        """The request is over: drop its references to cached blocks (they become evictable)."""
        if self.last_prefill is not None and self.last_prefill.lease is not None:
            self.last_prefill.lease.release()

    @torch.no_grad()
    def draft(self, k: int) -> ReferenceDraft:
        if self.live is None:
            raise RuntimeError("draft() before prefill()")
        if self._txn is not None:
            raise RuntimeError("draft() inside an open step: commit() or abort() first")
        if k < 1:
            raise ValueError(f"draft depth k must be >= 1, got {k}")
        if self.live.state.pos + k + 1 > self.max_len:
            raise ValueError(f"KV cache full: position {self.live.state.pos} + {k + 1} rows > max_len {self.max_len}")
        live, p = self.live, self.params
        self._txn = _Transaction(live.state.pos, live.mtp.pos, k, rng_state=self.generator.get_state())
        chain: list[torch.Tensor] = []  # the drafts picked so far: draft i's penalties count d_1..d_{i-1}

        def pick(lg: torch.Tensor) -> torch.Tensor:
            pen = self._chain_penalties(chain)
            tok = (sample(probs_from_logits(lg, p, pen), self.generator) if p.sampled_drafts
                   else penalize(lg, p, pen).argmax(-1))
            chain.append(tok)
            return tok

        r = live.reseed
        out = self.model.mtp_draft(live.mtp, r.tokens, r.hidden, r.pos0, k, pick=pick)  # reseed + chain
        self.counters.mtp_forwards += k
        if not p.sampled_drafts:
            return ReferenceDraft(out.tokens, ONE_HOT_DRAFT)
        pen = self._row_penalties(out.tokens, rows=k)
        return ReferenceDraft(out.tokens, probs_from_logits(out.logits, p, pen))

    def _chain_penalties(self, chain: list[torch.Tensor]) -> Penalties | None:
        if not self.params.penalized:
            return None
        if not chain:
            return self.live.history.now()
        pen = self._row_penalties(torch.cat(chain), rows=len(chain) + 1)
        return Penalties(pen.seen[:, -1], pen.counts[:, -1])  # [1, V], like the chain's logits

    def _row_penalties(self, tokens: torch.Tensor, rows: int) -> Penalties | None:
        """Penalty contexts [1, rows, V]: row j counts tokens[:j] on top of the history (None when penalties are
        off)."""
        if not self.params.penalized:
            return None
        pen = self.live.history.rows(tokens.reshape(-1)[: rows - 1])
        return Penalties(pen.seen[None], pen.counts[None])

    @torch.no_grad()
    def verify(self, draft: ReferenceDraft) -> ReferenceVerify:
        txn, live, c = self._txn, self.live, self.counters
        if txn is None or txn.verified:
            raise RuntimeError("verify() needs exactly one draft() before it")
        rows = torch.cat([draft.tokens.new_tensor([[live.pending]]), draft.tokens], dim=1)  # [1, K+1]
        out = self.mechanism.verify(self, txn, rows)
        c.target_forwards += 1
        c.recurrence_steps += rows.shape[1] * len(self.gdn_ids)
        txn.verified = True
        txn.verify = ReferenceVerify(rows, out.logits, out.hidden, out.gdn_per_token)
        return txn.verify

    @torch.no_grad()
    def accept(self, draft: ReferenceDraft, verify: ReferenceVerify) -> Acceptance:
        p = self.params
        # verify row j is used only when d_1..d_j were accepted: its penalties count them (plain decoding's context)
        pen = self._row_penalties(draft.tokens, rows=draft.k + 1)
        if p.greedy:
            out, n = greedy_accept(draft.tokens, penalize(verify.logits, p, pen))
        else:
            target_probs = probs_from_logits(verify.logits, p, pen)
            out, n = rejection_sample(draft.tokens, draft.probs, target_probs, self.generator)
        a = int(n[0])
        tokens = out[0, : a + 1].tolist()
        lps = None
        if p.logprobs is not None:
            lps = [token_logprobs(verify.logits[0, j], t, p.logprobs) for j, t in enumerate(tokens)]
        return Acceptance(a, tokens, lps)

    @torch.no_grad()
    def commit(self, acceptance: Acceptance) -> None:
        """Publish the state after row a = num_accepted; the MTP reseeds rows n..n+a at the next draft."""
        txn, live, c = self._txn, self.live, self.counters
        if txn is None or not txn.verified:
            raise RuntimeError("commit() needs draft() and verify() first")
        verify = txn.verify
        a, n = acceptance.num_accepted, txn.pos
        if not 0 <= a <= txn.k:
            raise ValueError(f"num_accepted {a} outside [0, {txn.k}]")
        accepted_rows = verify.rows[:, : a + 1]
        self.mechanism.commit(self, txn, a, accepted_rows)
        assert live.state.pos == n + a + 1
        toks = accepted_rows.new_tensor([acceptance.tokens])  # x_{t+1} for t = n..n+a
        live.reseed = Reseed(toks, verify.hidden[:, : a + 1], n)
        live.pending = acceptance.tokens[-1]
        self.live.history.add(acceptance.tokens)  # part of the commit: an aborted step adds nothing
        c.steps += 1
        self._txn = None

    @torch.no_grad()
    def inject(self, forced: Sequence[int]) -> Acceptance:
        """Commit ``forced`` tokens after the pending one like a prefill continuation (the thinking budget's
        stop-thinking phrase): one target forward over [pending, forced...] through the commit mechanism with every
        row kept, the next token picked from its last row (the request's sampler and penalties), the MTP re-seeded
        from its rows at the next draft. Returns the emitted tokens (forced + the picked one) as an Acceptance."""
        if self._txn is not None:
            raise RuntimeError("inject() inside an open step: commit() or abort() first")
        live, m = self.live, len(forced)
        if m < 1:
            raise ValueError("inject() needs at least one token")
        if live.state.pos + m + 1 > self.max_len:
            raise ValueError(f"KV cache full: position {live.state.pos} + {m + 1} rows > max_len {self.max_len}")
        before = live.reseed  # rows the MTP has not consumed yet: the forced rows follow them
        self._txn = _Transaction(live.state.pos, live.mtp.pos, m, rng_state=self.generator.get_state())
        tokens = torch.tensor([list(forced)], device=self.device)
        verify = self.verify(ReferenceDraft(tokens, ONE_HOT_DRAFT))
        pen = self._row_penalties(tokens, rows=m + 1)
        last = verify.logits[:, m]
        nxt = int(pick_token(last, self.params, self.generator,
                             None if pen is None else Penalties(pen.seen[:, m], pen.counts[:, m])))
        acceptance = Acceptance(m, list(forced) + [nxt])
        self.commit(acceptance)
        r = live.reseed
        live.reseed = Reseed(torch.cat([before.tokens, r.tokens], 1), torch.cat([before.hidden, r.hidden], 1),
                             before.pos0)
        return acceptance

    @torch.no_grad()
    def abort(self) -> None:
        txn, live = self._txn, self.live
        if txn is None:
            raise RuntimeError("abort() outside a step")
        if txn.verified:
            self.mechanism.abort(self, txn)
        live.state.pos, live.mtp.pos = txn.pos, txn.mtp_pos  # MTP rows >= mtp.pos get rewritten by the reseed
        self.generator.set_state(txn.rng_state)  # the sampler too: an aborted step leaves no trace
        self.counters.aborts += 1
        self._txn = None

    # ---- shared by the mechanisms -------------------------------------------------------------------
    def advance(self, rows: torch.Tensor) -> None:
        """Run ``rows`` [1, T] through the target on live state (re-advance / recompute)."""
        self.model(rows, self.live.state, gdn_mode=VERIFY_GDN_MODE)
        self.counters.target_forwards += 1
        self.counters.recurrence_steps += rows.shape[1] * len(self.gdn_ids)
