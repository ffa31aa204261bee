"""The speculative backend on the pure-torch reference model (CPU or CUDA), with all three commit mechanisms.

Live state (:class:`ReferenceLive`): target ModelState (KV + GDN recurrent + conv), MTPState, the pending token
(sampled, not yet consumed by the target) and the reseed rows (verified rows the MTP has not consumed yet).

Mechanisms for GDN recurrent + conv state (KV needs none: rows past the accepted prefix are never attended
and are overwritten by later writes at the same positions):

* ``snapshot``:      verify copies live GDN state (1 copy / GDN layer), advances live through K+1 rows; commit
                     with a < K restores the copy (1 copy / layer) and re-advances the a+1 accepted rows.
* ``shadow_commit``: verify runs on live and keeps the state after every row (slots); commit points live at
                     slot a: zero copies. The reference model never mutates state tensors in place (it
                     reassigns them), so "pointing at a slot" is an assignment, like a ring index on device.
* ``recompute``:     verify runs on a scratch copy (1 copy / layer); commit re-runs the a+1 accepted rows on live.

The reference backend also exposes finer primitives for probes: :attr:`live`, :meth:`snapshot_live`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..config import FULL
from ..reference.gdn import GDNPerToken
from ..reference.model import Qwen36Model
from ..reference.state import GDNState, ModelState, MTPState
from .acceptance import ONE_HOT_DRAFT, greedy_accept, rejection_sample
from .engine import MECHANISMS, Acceptance, MechanismCounters
from .sampling import SamplingParams, pick_token, probs_from_logits, sample

VERIFY_GDN_MODE = "recurrent"  # the token-by-token recurrence, as in single-row decode


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

    def clone(self) -> "ReferenceLive":
        return ReferenceLive(self.state.clone(), self.mtp.clone(), self.pending, self.reseed.clone())


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
    refs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # shadow: pre-verify tensors
    saved: list[GDNState] = field(default_factory=list)  # snapshot: copies of live GDN state
    verify: "ReferenceVerify | None" = None  # the step's verify handle (commit reads rows, hiddens, slots)
    rng_state: torch.Tensor | None = None  # sampler state before the step (abort rewinds it)


class ReferenceBackend:
    """SpecBackend on the torch reference model. ``mechanism`` in MECHANISMS; ``max_len`` sizes the KV caches."""

    def __init__(self, model: Qwen36Model, mechanism: str = "shadow_commit", max_len: int = 2048):
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown commit mechanism {mechanism!r}; choose from {MECHANISMS}")
        if model.mtp is None:
            raise ValueError("speculative decoding needs the MTP head: the checkpoint has no 'mtp.*' tensors")
        self.model = model
        self.mechanism = mechanism
        self.max_len = max_len
        self.label = reference_backend_label(model)
        self.counters = MechanismCounters()
        self.live: ReferenceLive | None = None
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self._txn: _Transaction | None = None
        self._gdn_ids = [i for i, t in enumerate(model.config.layer_types) if t != FULL]

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _gdn(self, state: ModelState | None = None) -> list[GDNState]:
        state = state or self.live.state
        return [state.layers[i] for i in self._gdn_ids]

    def _gdn_bytes(self) -> int:
        return sum(g.nbytes() for g in self._gdn())

    @property
    def gdn_layout(self) -> tuple[int, int]:
        """(number of GDN layers, bytes of all GDN recurrent + conv state) of the live state."""
        return len(self._gdn_ids), self._gdn_bytes()

    def snapshot_live(self) -> ReferenceLive:
        """A deep copy of everything live (probes compare against it)."""
        return self.live.clone()

    def load_live(self, live: ReferenceLive) -> None:
        """Replace the live state (outside a step) with a deep copy of ``live``; the sampler keeps running."""
        if self._txn is not None:
            raise RuntimeError("load_live() inside an open step")
        self.live = live.clone()

    # ---- the contract ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_len {self.max_len}")
        self.params, self.generator = params, params.generator(self.device)
        ids = torch.tensor([list(prompt)], device=self.device)
        state = self.model.new_state(1, self.max_len)
        out = self.model(ids, state)  # the same call as plain greedy decoding's prefill
        first = int(pick_token(out.logits[:, -1], params, self.generator))
        tokens = torch.cat([ids[:, 1:], ids.new_tensor([[first]])], dim=1)  # x_{t+1} for t = 0..n-1
        self.live = ReferenceLive(state, self.model.new_mtp_state(1, self.max_len), first, Reseed(tokens, out.hidden, 0))
        self._txn = None
        return first

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
        sample_drafts = not p.greedy and p.draft == "sample"
        pick = (lambda lg: sample(probs_from_logits(lg, p), self.generator)) if sample_drafts else None
        r = live.reseed
        out = self.model.mtp_draft(live.mtp, r.tokens, r.hidden, r.pos0, k, pick=pick)  # reseed + chain
        self.counters.mtp_forwards += k
        return ReferenceDraft(out.tokens, probs_from_logits(out.logits, p) if sample_drafts else ONE_HOT_DRAFT)

    @torch.no_grad()
    def verify(self, draft: ReferenceDraft) -> ReferenceVerify:
        txn, live, c = self._txn, self.live, self.counters
        if txn is None or txn.verified:
            raise RuntimeError("verify() needs exactly one draft() before it")
        rows = torch.cat([draft.tokens.new_tensor([[live.pending]]), draft.tokens], dim=1)  # [1, K+1]
        n_gdn, k1 = len(self._gdn_ids), rows.shape[1]
        if self.mechanism == "shadow_commit":
            txn.refs = [(g.recurrent, g.conv) for g in self._gdn()]  # references, not copies
            out = self.model(rows, live.state, gdn_mode=VERIFY_GDN_MODE, per_token_states=True)
            c.slot_bytes_written += k1 * self._gdn_bytes()
        elif self.mechanism == "snapshot":
            c.state_bytes_moved += self._gdn_bytes()
            txn.saved = [g.clone() for g in self._gdn()]
            c.state_copies += n_gdn
            out = self.model(rows, live.state, gdn_mode=VERIFY_GDN_MODE)
        else:  # recompute: scratch GDN copies, shared KV (rows >= pos are scratch space anyway)
            c.state_bytes_moved += self._gdn_bytes()
            scratch = ModelState([s.clone() if isinstance(s, GDNState) else s for s in live.state.layers], live.state.pos)
            c.state_copies += n_gdn
            out = self.model(rows, scratch, gdn_mode=VERIFY_GDN_MODE)
        c.target_forwards += 1
        c.recurrence_steps += k1 * n_gdn
        txn.verified = True
        txn.verify = ReferenceVerify(rows, out.logits, out.hidden, out.gdn_per_token)
        return txn.verify

    @torch.no_grad()
    def accept(self, draft: ReferenceDraft, verify: ReferenceVerify) -> Acceptance:
        if self.params.greedy:
            out, n = greedy_accept(draft.tokens, verify.logits)
        else:
            target_probs = probs_from_logits(verify.logits, self.params)
            out, n = rejection_sample(draft.tokens, draft.probs, target_probs, self.generator)
        a = int(n[0])
        return Acceptance(a, out[0, : a + 1].tolist())

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
        if self.mechanism == "shadow_commit":
            self._select_slots(verify.slots, a)
            live.state.pos = n + a + 1
        elif self.mechanism == "snapshot":
            if a < txn.k:  # partial acceptance: restore and re-advance the accepted rows
                self._restore(txn.saved)
                live.state.pos = n
                self._advance(accepted_rows)
        else:  # recompute: live was never touched by the verify
            self._advance(accepted_rows)
        assert live.state.pos == n + a + 1
        toks = accepted_rows.new_tensor([acceptance.tokens])  # x_{t+1} for t = n..n+a
        live.reseed = Reseed(toks, verify.hidden[:, : a + 1], n)
        live.pending = acceptance.tokens[-1]
        c.steps += 1
        self._txn = None

    @torch.no_grad()
    def abort(self) -> None:
        txn, live = self._txn, self.live
        if txn is None:
            raise RuntimeError("abort() outside a step")
        if txn.verified and self.mechanism == "shadow_commit":
            for g, (rec, conv) in zip(self._gdn(), txn.refs):
                g.recurrent, g.conv = rec, conv
        elif txn.verified and self.mechanism == "snapshot":
            self._restore(txn.saved)
        live.state.pos, live.mtp.pos = txn.pos, txn.mtp_pos  # MTP rows >= mtp.pos get rewritten by the reseed
        self.generator.set_state(txn.rng_state)  # the sampler too: an aborted step leaves no trace
        self.counters.aborts += 1
        self._txn = None

    # ---- mechanism pieces -----------------------------------------------------------------------
    def _select_slots(self, slots: dict[int, GDNPerToken], a: int) -> None:
        """shadow_commit: the live state becomes slot a (the state after row a). No copy."""
        for i in self._gdn_ids:
            g = self.live.state.layers[i]
            g.recurrent, g.conv = slots[i].recurrent[:, a], slots[i].conv[:, a]

    def _restore(self, saved: list[GDNState]) -> None:
        for g, s in zip(self._gdn(), saved):
            g.copy_(s)  # live tensors were freshly produced by the verify: no one else holds them
        self.counters.state_copies += len(saved)
        self.counters.state_bytes_moved += sum(s.nbytes() for s in saved)

    def _advance(self, rows: torch.Tensor) -> None:
        """Run ``rows`` [1, T] through the target on live state (re-advance / recompute)."""
        self.model(rows, self.live.state, gdn_mode=VERIFY_GDN_MODE)
        self.counters.target_forwards += 1
        self.counters.recurrence_steps += rows.shape[1] * len(self._gdn_ids)


def expected_step_counters(mechanism: str, k: int, a: int, n_gdn: int, gdn_bytes: int) -> dict[str, int]:
    """Counters of one committed step (draft k, accept a) with n_gdn GDN layers holding gdn_bytes of state."""
    partial = a < k
    copies = {"shadow_commit": 0, "snapshot": n_gdn * (1 + partial), "recompute": n_gdn}[mechanism]
    rerun_rows = {"shadow_commit": 0, "snapshot": (a + 1) * partial, "recompute": a + 1}[mechanism]
    return {
        "steps": 1,
        "aborts": 0,
        "state_copies": copies,
        "state_bytes_moved": copies // max(1, n_gdn) * gdn_bytes,
        "slot_bytes_written": (k + 1) * gdn_bytes if mechanism == "shadow_commit" else 0,
        "recurrence_steps": (k + 1 + rerun_rows) * n_gdn,
        "target_forwards": 1 + (rerun_rows > 0),
        "mtp_forwards": k,
    }
