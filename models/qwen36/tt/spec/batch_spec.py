"""TTBatchSpecBackend: the speculative contract (``speculative.engine.SpecBackend``) with B user slots on the TT
model, over the user slots of a :class:`~.batch.TTBatchDecoder` (B slots: GDN recurrent blocks b*Hv_d.., conv row
b, page-table row b).

One step, K fixed per backend (the verify width; a user drafts k_b <= K):

    host:             the step's row inputs (RoPE rows, physical KV rows, SDPA bounds, row mask, active flags,
                      and the MTP's reseed and chain positions) into persistent buffers
    trace draft:      the device MTP chain (``tt/spec/mtp.py`` ``TTBatchMTPHead``): K drafts (argmax or sampled) for every
                      user, B rows per chain step, written into the verify's token rows and the acceptor's drafts
                      [with a host drafter instead: its drafts written from the host, no draft trace]
    trace verify:     ONE target forward over B x (K+1) rows (user b's rows at b*(K+1)..), on-device acceptance of
                      every user ([1, B, K+1, V] logits -> per-user count + tokens)
    host:             read the acceptor's result (the step's one device->host transfer)
    trace commit:     per user, on device: conv window rows a_b+1.., the commit mechanism's per-user state select,
                      masked re-advance from the user's own rows (``tt/spec/commit.py`` ``commit_gdn_layers``);
                      then the MTP reseed over every stepping user's verified rows (its own positions, its own
                      MTP pages), row a_b of each user kept as the start of its next chain

Rows. User b's rows are ``[pending_b, d_1..d_{k_b}]`` at positions n_b..n_b+k_b. Its rows past k_b, and every
row of a slot not in the step (a free slot, or a user sitting out), are inert:
* GDN: the verify multiplies g and beta by the row mask (g = 0: decay exactly 1, beta = 0: no update), so the
  recurrent state after an inert row is the state before it, bit for bit; the commit selects per user
  (a_b = -1 for a user not in the step: conv rows 0.., nothing re-advanced, ring slot 0 = its unchanged state).
* Attention: an inert row's physical KV row is -1 (``indexed_fused_update_cache`` skips it: no cache write), a
  slot not in the step has bounds -1 (the SDPA skips the group); the inert rows of a stepping user attend up to
  their own (scratch) positions and their outputs are ignored.
* Acceptance: the acceptor's draft past k_b is the id V, which no argmax equals and which has probability 0
  (so a_b <= k_b, and a_b = k_b draws the bonus token from row k_b, as the reference does).
No op mixes users: matmuls, norms and the LM head are row-wise, the conv unfold reads each user's own window, the
recurrence has one batch entry per user, and each SDPA group is one (user, KV head) pair.

Mechanisms (the same ``tt/spec/mechanisms.py`` objects the single-user backend uses, on B-slot shapes):
* snapshot: live recurrent + conv of every slot copied before the verify; the commit re-advances each user's rows
  <= a_b from the copy.
* recompute: the verify runs on a scratch copy; the commit re-advances live the same masked way.
* shadow_commit: the verify runs the ring mode over a [T*B*Hv_d, Dk, Dv] ring (the state after user b's row t in
  block t*B*Hv_d + b*Hv_d + h); the commit points user b's heads at ring slot a_b. The committed state lives in
  the ring, so a join or a leave (which write the decoder's live state) is bracketed by the mechanism's leave
  (ring slots -> live) and enter (live -> ring slot 0): 2 state copies per GDN layer, counted.

Traces: one "draft" (device drafter), one "verify" and one "commit" per backend (i.e. per (bucket, K)); the first
step runs eagerly, the second captures, every later step replays. Joins and leaves run eagerly between replays
inside the decoder's ``corruptible_allocation_scope`` (no retrace).

Drafting: the batched device MTP (``tt/spec/mtp_drafter.py`` ``TTBatchMTPDrafter``), every user's reseed and chain packed
into the same device ops; or a host drafter ``(history, k) -> k ids`` per user (tests and probes; written to
device between replays, the label then says "+ host drafter"). Unlike the single-user backend, the chain runs in
its own trace at draft() rather than at the end of the commit: the next step's per-user depths (which rows of the
chain each user writes) are only known at draft(); the reseed, which needs the accepted counts, stays in the
commit, and nothing is read back between the three traces but the acceptor's result. The MTP KV cache has B
slots of its own pages; a joining user's MTP prefill zeroes and fills only its slot's pages. Device drafts follow
the params as the single-user drafter's do: argmax (greedy, or ``draft="greedy"``: one-hot draft distributions),
or sampled on device (temperature > 0, ``draft="sample"``) from the acceptor's transform of the MTP logits, user b
drawing from its own columns of one uniform row per chain, the draft distributions handed to the stochastic
acceptance (zero past k_b). Sampling: every user has its own uniform stream on the acceptor, seeded with its
own seed when it joins (a user's draws are those of the same user alone at B = 1). With ``stages`` (a
``SamplerStages``: what the traced step may need) each user also has its own params, as per-row device operands
of the one acceptance (greedy and sampled users in one step; tt/spec/accept.py); the device drafter then drafts by
argmax for every user (sampled drafts need ``draft="greedy"`` there: the batched MTP chain's sampled picks take one
set of params). Without ``stages`` every user shares the backend's params apart from the seed. Penalties (each
user's token counts, written at its join, committed in the commit trace) and logprobs (read with the result) are
per user either way; penalised users cannot have sampled device drafts (the MTP chain has no token counts).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch

from ...errors import UserError
from ...speculative.engine import Acceptance, MechanismCounters
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ...speculative.sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs
from .accept import DeviceAcceptor
from ..runtime.sampler import SamplerStages
from ..runtime.batch import TTBatchDecoder
from .commit import abort_after_verify, commit_gdn_layers
from ..runtime.generator import TTGenerator
from ..model.gdn import TILE_ROWS
from .mechanisms import GDNStateBytes, TTMechanism, tt_mechanism
from ..model.model_config import user_core_grid
from ..runtime.trace import StepTraces
from .verify import SpecDeviceState, VerifyOutputs, VerifyPlan


class BatchSpecError(UserError, ValueError):
    """A batched speculative request this backend cannot serve (named in the message)."""


class BatchVerifyPlan(VerifyPlan):
    """The verify plan of B users x T rows: inert rows masked out of the GDN recurrence (g = beta = 0)."""

    @property
    def users(self) -> int:
        return self.step_state.users

    def gdn_recurrence(self, gdn, state, q, k, v, g, beta, window):
        ttnn, mask = self.step_state.ttnn, self.step_state.row_mask  # [B, T, 1]
        return super().gdn_recurrence(gdn, state, q, k, v, ttnn.multiply(g, mask), ttnn.multiply(beta, mask), window)


class BatchSpecDeviceState(SpecDeviceState):
    """The step state of a batched verify over a decoder's B slots: the row inputs are persistent buffers the host
    writes before each verify (see the module doc); the mechanism buffers are B-slot shaped (``hv`` counts the
    ring heads of all users, B*Hv_d, which is what the ring mechanism sizes its ring by)."""

    plan_class = BatchVerifyPlan

    def __init__(self, decoder: TTBatchDecoder, k: int, mechanism: str | TTMechanism):
        self.users = decoder.slots
        super().__init__(decoder.model, decoder.state, k, mechanism)
        per_user = GDNStateBytes.of(self.model.args, len(self.state.gdn_states()))
        self.state_bytes = GDNStateBytes(per_user.recurrent * self.users, per_user.conv * self.users)

    def allocate(self) -> None:
        ttnn, t, kc, b, a = self.ttnn, self.t, self.kc, self.users, self.model.args
        rm, i32 = ttnn.ROW_MAJOR_LAYOUT, torch.int32
        self.hv = b * a.gdn_hv_d
        heads, pages = a.hkv_d, int(self.state.page_table.shape[-1])
        self.tokens = self._dev(torch.zeros(1, b * t, dtype=i32), ttnn.uint32, rm)
        self.rope_idx = self._dev(torch.zeros(1, b * t, dtype=i32), ttnn.uint32, rm)
        self.phys_rows = self._dev(torch.full((1, b * t), -1, dtype=i32), ttnn.int32, rm)
        self.bounds = self._dev(torch.full((b * heads * t,), -1, dtype=i32), ttnn.int32, rm)
        self.head_page_table = self._dev(torch.zeros(b * heads, pages, dtype=i32), ttnn.int32, rm)
        self.drafts = self._dev(torch.zeros(1, b, 1, self.k, dtype=i32), ttnn.uint32, rm)
        self.row_mask = self._dev(torch.zeros(b, t, 1))
        self.active = self._dev(torch.zeros(1, b, 1, 1))
        self.c_zero = self._dev(torch.zeros(1, b, 1, 1))
        self.c_rows = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, t, 1))
        # conv commit: user b's new state row i = window row b*(Kc-1+T) + 1 + i + a_b of the [B*(Kc-1+T), Cd] table
        base = torch.arange(b)[:, None] * (kc - 1 + t) + torch.arange(1, kc)[None, :]
        self.c_conv_rows = self._dev(base.to(torch.float32).reshape(1, b, 1, kc - 1))
        for s in self.state.gdn_states():
            self.layer_bufs[id(s)] = self.mechanism.buffers(self, s)
        for layer in self.model.layers:
            if hasattr(layer.mixer, "prepare_batch_verify"):
                layer.mixer.prepare_batch_verify(b, t)

    def start(self, n: int = 0, pending: int = 0) -> None:
        """The mechanism's start (ring: every slot's live state into ring slot 0). Positions and pending tokens
        are host inputs of each step here, not device state."""
        self.mechanism.start(self)

    def write(self, name: str, host: torch.Tensor) -> None:
        buf = getattr(self, name)
        self.ttnn.copy_host_to_device_tensor(self.host(host, buf), buf)

    def verify_rows(self):
        return self.tokens, self.rope_idx, self.bounds, self.phys_rows, self.head_page_table

    def commit(self, vout: VerifyOutputs) -> None:
        """Device-only per-user commit (traceable) of the verify ``vout``: a_b = count_b for users in the step, -1
        for the others."""
        ttnn, b, acc = self.ttnn, self.users, self.acceptor
        ttnn.copy(ttnn.multiply(acc.count, self.active), acc.count)  # 0 for slots outside the step (ring slot 0)
        a_B111 = ttnn.add(acc.count, ttnn.subtract(self.active, 1.0))
        idx = ttnn.typecast(ttnn.add(self.c_conv_rows, a_B111), ttnn.uint32)  # [1, B, 1, Kc-1]
        idx = ttnn.reshape(ttnn.to_layout(idx, ttnn.ROW_MAJOR_LAYOUT), [1, b * (self.kc - 1)])
        mask = ttnn.le(self.c_rows, ttnn.reshape(a_B111, [b, 1, 1])) if self.mechanism.readvance else None
        commit_gdn_layers(self, vout.plan.records, idx, mask)


@dataclass
class _User:
    params: SamplingParams
    history: list[int]  # prompt + every emitted token; the last one is pending
    first_logprobs: TokenLogprobs | None


@dataclass
class BatchDraft:
    depths: dict[int, int]  # slot -> k_b
    drafts: dict[int, list[int]] | None  # slot -> d_1..d_{k_b} (host drafter); None: the drafts live on device only


def verify_slots(users: int, k: int) -> int:
    """The fewest slots >= ``users`` whose packed verify (slots x (K+1) rows) the decode path can lay out: at most
    ``TILE_ROWS`` rows, and above one row of user cores whole rows of them (``model_config.user_core_grid``). The
    slots past ``users`` stay free (their rows inert). Raises :class:`BatchSpecError` when no slot count fits."""
    for slots in range(max(users, 1), TILE_ROWS // (k + 1) + 1):
        try:
            user_core_grid(slots * (k + 1))
        except ValueError:
            continue
        return slots
    raise BatchSpecError(f"{users} users x (K+1 = {k + 1}) verify rows: the decode-path attention takes at most "
                         f"{TILE_ROWS} rows (one per core, whole rows of 8 cores above 8); use fewer prompts or a "
                         f"smaller --spec-k")


def _is_batch_device_drafter(drafter) -> bool:
    return all(hasattr(drafter, m) for m in ("allocate", "join", "write_inputs", "device_chain", "device_reseed"))


class TTBatchSpecBackend:
    """``SpecBackend`` on the TT model: ``slots`` users, verify width ``k`` (every step runs B x (k+1) rows)."""

    def __init__(self, gen: TTGenerator, slots: int, k: int, mechanism: str | TTMechanism = DEFAULT_MECHANISM,
                 drafter: Callable[[list[int], int], list[int]] | None = None,
                 params: SamplingParams = SamplingParams(), use_trace: bool = True, rng: str = "device",
                 prefix_cache=None, stages: SamplerStages | None = None):
        """``stages``: per-user params (module doc): what the traced step contains, e.g. ``SamplerStages.of`` the
        users' params or ``SamplerStages.every()``; None: every user has ``params`` (apart from the seed).
        ``prefix_cache``: a ``qwen36.prefix_cache.PrefixCache``: joins resume from cached block boundaries
        (tt/runtime/prefix.py; the MTP prefill is redone from the cached hidden rows); new blocks are cached only by joins
        while no step trace is live."""
        self.device_drafter = _is_batch_device_drafter(drafter)
        if drafter is None or (not self.device_drafter and not callable(drafter)):
            raise BatchSpecError("TTBatchSpecBackend needs a drafter: the batched device MTP "
                                 "(tt/spec/mtp_drafter.py TTBatchMTPDrafter) or a host drafter (history, k) -> k ids")
        self._check_drafts(params, stages)
        rows = slots * (k + 1)
        if rows > TILE_ROWS:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) = {rows} verify rows: the decode-path attention "
                                 f"takes at most {TILE_ROWS} rows (one per core); use fewer slots or a smaller K")
        try:
            user_core_grid(rows)
        except ValueError as e:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) verify rows: {e}") from None
        self.gen, self.model = gen, gen.model
        self.ttnn, self.mesh = gen.ttnn, gen.mesh
        self.mechanism = tt_mechanism(mechanism)
        self.slots, self.k, self.drafter, self.use_trace, self.params = slots, k, drafter, use_trace, params
        self.label = f"tt ({gen.label or 'mesh'})" + ("" if self.device_drafter else " + host drafter")
        self.counters = MechanismCounters()
        self.decoder = TTBatchDecoder(self.model, slots, use_trace=use_trace, prefix_cache=prefix_cache)
        a = self.model.args
        self.vocab = a.cfg.vocab_size
        self.stages = stages
        self.acceptor = DeviceAcceptor(self.ttnn, self.mesh, k=k, vocab=self.vocab, sampling_params=params,
                                       batch=slots, rng=rng, ring_heads=a.gdn_hv_d, stages=stages).allocate()
        self.step_state = BatchSpecDeviceState(self.decoder, k, self.mechanism)
        self.step_state.attach_acceptor(self.acceptor)
        st = self.step_state
        heads = a.hkv_d
        pt = self.decoder.state.page_table_host.to(torch.int32)  # [B, pages]
        st.write("head_page_table", (pt[:, None, :] * heads + torch.arange(heads)[None, :, None]).reshape(slots * heads, -1))
        st.start()  # ring: live (zeros) -> ring slot 0, every head pointed at it
        if self.device_drafter:
            drafter.allocate(self.model, slots, k, self.acceptor)  # the B-slot MTP head, before any capture
        self.users: dict[int, _User] = {}
        self._traces = StepTraces(self.ttnn, self.mesh, warmup_steps=1)
        self._phase = "idle"
        self._draft: BatchDraft | None = None
        self._vout: VerifyOutputs | None = None
        self._result = None
        self._n_gdn = len(self.decoder.state.gdn_states())

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _check_drafts(self, params: SamplingParams, stages: SamplerStages | None, slot: int | None = None) -> None:
        """Refuse sampled device drafts the batched MTP chain cannot draw (per-user params, or penalties)."""
        if not (self.device_drafter and params.sampled_drafts):
            return
        who = "" if slot is None else f"slot {slot}: "
        if stages is not None:
            raise BatchSpecError(f"{who}per-user params draft by argmax on the device drafter; pass draft='greedy'")
        if params.penalized:
            raise BatchSpecError(f"{who}penalties with sampled device drafts are not supported in a batch; pass "
                                 "draft='greedy'")

    @property
    def config(self):
        return self.model.args.cfg

    def _scope(self):
        return self.decoder._scratch_scope()

    def _run(self, name: str, fn):
        return self._traces.run(f"{name}/B{self.slots}K{self.k}", fn, traced=self.use_trace)

    def _with_live_state(self, fn) -> None:
        """Run a decoder call that reads/writes the live GDN state of the slots (join, leave): the ring mechanism
        first moves every user's committed ring slot into live, and afterwards live back into ring slot 0."""
        st, ring = self.step_state, self.mechanism.ring
        if ring:
            with self._scope():
                self.mechanism.leave(st)
            self.mechanism.count_switch(self.counters, self._n_gdn, st.state_bytes)
        fn()
        if ring:
            with self._scope():
                self.mechanism.enter(st)

    def _check_idle(self, what: str) -> None:
        if self._phase != "idle":
            raise RuntimeError(f"{what} inside an open step: commit() or abort() first")

    @property
    def captures(self) -> int:
        return sum(self._traces.captures.values())

    def position(self, slot: int) -> int:
        return self.decoder.pos[slot]

    # ---- users --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        self._check_idle("join()")
        if self.stages is None and replace(params, seed=self.params.seed) != self.params:
            raise BatchSpecError(f"slot {slot}: {params.describe()} differ from the backend's {self.params.describe()} "
                                 "(build it with stages=SamplerStages... for per-user params)")
        if self.stages is not None:
            self._check_drafts(params, self.stages, slot)
            missing = self.stages.missing(params, self.vocab)
            if missing:
                raise BatchSpecError(f"slot {slot}: {params.describe()} needs {', '.join(missing)}, which this "
                                     f"backend's stages do not contain")
        logits: list[torch.Tensor] = []
        hidden: list | None = [] if self.device_drafter else None
        insert = len(self._traces) == 0  # a cached block's buffers outlive the join: not while a trace is live
        self._with_live_state(lambda: logits.append(self.decoder.join(slot, prompt, hidden_out=hidden,
                                                                      insert=insert)))
        row = logits[0]
        gen = params.generator(torch.device("cpu"))
        first = int(pick_token(row.reshape(1, -1), params, gen, TokenHistory(list(prompt), self.vocab).now()))
        lp = token_logprobs(row, first, params.logprobs) if params.logprobs is not None else None
        history = list(int(t) for t in prompt) + [first]
        if self.device_drafter:  # the user's MTP prefill: its own MTP pages and its row of the chain start
            with self._scope():
                h = hidden[0] if len(hidden) == 1 else self.ttnn.concat(hidden, dim=2)
                self.drafter.join(slot, history, h)
        self.acceptor.set_row(slot, params)  # its params and its own uniform stream, from its seed
        self.acceptor.start_penalties(len(prompt), history, slot)  # no-op without penalties
        self.users[slot] = _User(params, history, lp)
        return first

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.users[slot].first_logprobs

    def leave(self, slot: int) -> None:
        self._check_idle("leave()")
        if slot not in self.users:
            raise ValueError(f"slot {slot} has no user")
        self._with_live_state(lambda: self.decoder.leave(slot))
        del self.users[slot]

    # ---- the step -----------------------------------------------------------------------------------------------
    def draft(self, depths: Mapping[int, int]) -> BatchDraft:
        self._check_idle("draft()")
        if not depths:
            raise ValueError("draft() needs at least one user")
        max_len = self.model.args.max_seq_len
        for slot, kb in depths.items():
            if slot not in self.users:
                raise ValueError(f"slot {slot} has no user (join it first)")
            if not 1 <= kb <= self.k:
                raise BatchSpecError(f"slot {slot}: draft depth {kb} outside 1..{self.k} (this backend verifies "
                                     f"{self.k + 1} rows per user; build it with a larger k)")
            if self.decoder.pos[slot] + kb + 1 > max_len:
                raise ValueError(f"slot {slot}: KV cache full: position {self.decoder.pos[slot]} + {kb + 1} rows > "
                                 f"max_seq_len {max_len}")
        if self.device_drafter:
            drafts = None
            self._write_rows(depths, None)
            self.drafter.write_inputs(dict(depths), {s: self.decoder.pos[s] for s in depths},
                                      {s: self.users[s].history[-1] for s in depths})
            self.drafter.before_device_draft()
            self._run("draft", lambda: self.drafter.device_chain(self.step_state))
            self.counters.mtp_forwards += self.k  # the packed chain runs K steps whatever each k_b
        else:
            drafts = {s: [int(x) for x in self.drafter(list(self.users[s].history), kb)] for s, kb in depths.items()}
            for s, d in drafts.items():
                if len(d) != depths[s]:
                    raise ValueError(f"slot {s}: the drafter returned {len(d)} drafts, {depths[s]} asked")
            self._write_rows(depths, drafts)
            self.counters.mtp_forwards += max(depths.values())
        self._draft = BatchDraft(dict(depths), drafts)
        self._phase = "drafted"
        return self._draft

    def _write_rows(self, depths: Mapping[int, int], drafts: Mapping[int, list[int]] | None) -> None:
        """The step's row inputs (module doc) into the persistent buffers (between replays). ``drafts`` None: the
        device drafter's chain writes the token rows and the acceptor's drafts on device."""
        st, b, t, k = self.step_state, self.slots, self.k + 1, self.k
        a = self.model.args
        heads, bs, last = a.hkv_d, a.block_size, a.max_seq_len - 1
        pt = self.decoder.state.page_table_host
        tokens = torch.zeros(b, t, dtype=torch.int32)
        rope = torch.zeros(b, t, dtype=torch.int32)
        phys = torch.full((b, t), -1, dtype=torch.int32)
        bounds = torch.full((b, heads, t), -1, dtype=torch.int32)
        acc_drafts = torch.full((1, b, 1, k), self.vocab, dtype=torch.int32)  # id V: never accepted
        mask = torch.zeros(b, t, 1)
        active = torch.zeros(1, b, 1, 1)
        for s, kb in depths.items():
            n = self.decoder.pos[s]
            pos = [min(n + j, last) for j in range(t)]
            if drafts is not None:
                real = [self.users[s].history[-1]] + drafts[s]
                tokens[s, : kb + 1] = torch.tensor(real, dtype=torch.int32)
                acc_drafts[0, s, 0, :kb] = torch.tensor(drafts[s], dtype=torch.int32)
            rope[s] = torch.tensor(pos, dtype=torch.int32)
            for j in range(kb + 1):
                phys[s, j] = int(pt[s, pos[j] // bs]) * bs + pos[j] % bs
            bounds[s] = torch.tensor(pos, dtype=torch.int32)[None, :]
            mask[s, : kb + 1] = 1.0
            active[0, s] = 1.0
        if drafts is not None:
            st.write("tokens", tokens.reshape(1, b * t))
            st.write("drafts", acc_drafts)
        st.write("rope_idx", rope.reshape(1, b * t))
        st.write("phys_rows", phys.reshape(1, b * t))
        st.write("bounds", bounds.reshape(-1))
        st.write("row_mask", mask)
        st.write("active", active)

    def _verify_and_accept(self):
        st = self.step_state
        vout = st.verify()
        logits = self.ttnn.reshape(vout.out.logits, [1, self.slots, self.k + 1, self.vocab])
        # sampled device drafts: their distributions; argmax or host drafts: one-hot (None)
        probs = self.drafter.draft_probs() if self.device_drafter else None
        return vout, self.acceptor.accept(logits, st.drafts, probs)

    def verify(self, draft: BatchDraft) -> VerifyOutputs:
        if self._phase != "drafted" or draft is not self._draft:
            raise RuntimeError("verify() needs exactly one draft() before it (and that draft's handle)")
        self._vout, self._result = self._run("verify", self._verify_and_accept)
        self._phase = "verified"
        c, t = self.counters, self.k + 1
        c.target_forwards += 1
        c.recurrence_steps += self.slots * t * self._n_gdn
        self.mechanism.count_verify(c, t, self._n_gdn, self.step_state.state_bytes)
        return self._vout

    def verify_logits(self) -> torch.Tensor:
        """Host copy of the last verify's logits, fp32 [B, K+1, V] (tests; not part of a step)."""
        if self._vout is None:
            raise RuntimeError("no verify has run")
        return self.model.to_host(self._vout.out.logits).float().reshape(self.slots, self.k + 1, -1)

    def accept(self, draft: BatchDraft, verify) -> dict[int, Acceptance]:
        if self._phase != "verified":
            raise RuntimeError("accept() needs verify() first")
        idle = [s for s in self.users if s not in draft.depths]  # users sitting the step out keep their uniforms
        results = self.acceptor.read_results(self._result, idle_rows=idle)  # the one readback: every slot's result
        out = {}
        for s, kb in draft.depths.items():
            r = results[s]
            if r.num_accepted > kb:
                raise RuntimeError(f"slot {s}: device acceptance a={r.num_accepted} past the user's {kb} drafts")
            lps = self.acceptor.read_logprobs(r.emitted, s) if self.users[s].params.logprobs is not None else None
            out[s] = Acceptance(r.num_accepted, r.emitted, lps)
        self._phase = "accepted"
        return out

    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        if self._phase != "accepted":
            raise RuntimeError("commit() needs accept() first")
        depths = self._draft.depths
        if set(acceptances) != set(depths):
            raise ValueError(f"commit() needs the acceptance of every user of the step: got slots "
                             f"{sorted(acceptances)}, the step has {sorted(depths)}")
        self._run("commit", self._commit_device)
        c = self.counters
        # the re-advance runs every slot's K+1 rows (B*(K+1) recurrence rows per GDN layer)
        self.mechanism.count_commit(c, self.slots * (self.k + 1), self._n_gdn, self.step_state.state_bytes)
        c.steps += 1
        for s, acc in acceptances.items():
            self.decoder.pos[s] += acc.num_accepted + 1
            self.users[s].history += list(acc.tokens)
        self._traces.step_done()
        self._draft, self._phase = None, "idle"

    def _commit_device(self) -> None:
        """The commit trace: per-user state commit, then (device drafter) the MTP reseed over the verified rows."""
        self.step_state.commit(self._vout)  # also zeroes the count of slots outside the step
        if self.acceptor.penalized:
            self.acceptor.commit_counts(self.step_state.active)  # the users' token counts are part of the commit
        if self.device_drafter:
            self.drafter.device_reseed(self.step_state, self._vout)

    def abort(self) -> None:
        if self._phase == "idle":
            raise RuntimeError("abort() outside a step")
        if self._phase in ("verified", "accepted"):
            with self._scope():
                abort_after_verify(self.step_state)  # shadow_commit refuses here (see mechanisms.ShadowCommit)
                # a step with sampled rows advanced the RNG counters on device (accept() gave the idle users' back)
                self.acceptor.step_back_rng(None if self._phase == "verified" else list(self._draft.depths))
        if self.device_drafter:
            self.drafter.step_back()  # the chain's uniform row (sampled drafts; no-op otherwise)
        self.counters.aborts += 1
        self._draft, self._phase = None, "idle"

    # ---- state views (tests and probes) -------------------------------------------------------------------------
    def committed_gdn(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of user ``slot``'s committed GDN state per GDN layer: (recurrent [Hv, Dk, Dv] per device
        concatenated over the mesh, conv [K-1, Cd] likewise). Ring: read through the ring index. Between steps."""
        self._check_idle("committed_gdn()")
        ttnn, a = self.ttnn, self.model.args
        hv = a.gdn_hv_d
        out = []
        idx = None
        if self.mechanism.ring:
            idx = [ttnn.to_torch(x).reshape(-1).to(torch.int64) for x in ttnn.get_device_tensors(self.acceptor.block_idx)]
        for s in self.decoder.state.gdn_states():
            if self.mechanism.ring:
                ring = self.step_state.layer_bufs[id(s)].ring
                recs = [ttnn.to_torch(x)[i[slot * hv:(slot + 1) * hv]] for x, i in zip(ttnn.get_device_tensors(ring), idx)]
            else:
                recs = [ttnn.to_torch(x)[slot * hv:(slot + 1) * hv] for x in ttnn.get_device_tensors(s.recurrent)]
            convs = [ttnn.to_torch(x)[slot, 0] for x in ttnn.get_device_tensors(s.conv)]
            out.append((torch.cat([r.float() for r in recs], 0), torch.cat([c.float() for c in convs], -1)))
        return out

    def release(self) -> None:
        self._traces.release()
        self.decoder.release()

    close = release


__all__ = ["TTBatchSpecBackend", "BatchSpecDeviceState", "BatchVerifyPlan", "BatchSpecError"]
