"""The B-slot layout of :class:`~.spec_backend.TTSpecBackend` (host rows; docs/tt_spec.md, "The step (B slots)"):
its construction over a :class:`~..runtime.batch.TTBatchDecoder` of its own and its halves of the engine's protocol
(join, leave, draft, verify, accept, commit) as a mixin of that class, which dispatches to them when
``rows == "host"``. The row inputs, users and draft handle: tt/spec/host_rows.py; forced tokens: tt/spec/inject.py."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import torch

from ...speculative.engine import Acceptance, MechanismCounters
from ...generation.sampling import SamplingParams, TokenHistory, pick_token, token_logprobs
from ..model.gdn import TILE_ROWS
from ..model.model_config import user_core_grid
from ..runtime.batch import TTBatchDecoder
from ..runtime.generator import TTGenerator
from ..runtime.sampler_transform import SamplerStages
from ..runtime.trace import StepTraces
from .accept import DeviceAcceptor
from .commit import commit
from .host_rows import (BatchDraft, BatchSpecError, SlotUser, check_drafts, is_packed_device_drafter,
                        write_host_rows)
from .mechanisms import tt_mechanism
from .verify import SpecDeviceState, VerifyOutputs


class HostRowSlots:
    """B user slots over the backend's own batch decoder (host rows): the methods ``TTSpecBackend`` runs when
    ``rows == "host"``."""

    def _init_host_rows(self, gen: TTGenerator, slots: int, k: int | None, mechanism, drafter,
                        params: SamplingParams, use_trace: bool, rng: str, prefix_cache,
                        stages: SamplerStages | None, pool_blocks: int = 0) -> None:
        """B slots over a decoder of their own (module doc); the checks come before the generator is touched."""
        if not isinstance(k, int) or k < 1:
            raise BatchSpecError(f"{slots} slots (host rows) need the verify width k >= 1, got {k!r}")
        self.device_drafter = is_packed_device_drafter(drafter)
        if drafter is None or (not self.device_drafter and not callable(drafter)):
            raise BatchSpecError("B slots (host rows) need a drafter: the device MTP "
                                 "(tt/spec/mtp_drafter.py TTMTPDrafter) or a host drafter (history, k) -> k ids")
        check_drafts(self.device_drafter, params, stages)
        n_rows = slots * (k + 1)
        if n_rows > TILE_ROWS:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) = {n_rows} verify rows: the decode-path attention "
                                 f"takes at most {TILE_ROWS} rows (one per core); use fewer slots or a smaller K")
        try:
            user_core_grid(n_rows)
        except ValueError as e:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) verify rows: {e}") from None
        self.gen, self.model = gen, gen.model
        self.ttnn, self.mesh = gen.ttnn, gen.mesh
        self.mechanism = tt_mechanism(mechanism)
        self.slots, self.k, self.drafter, self.use_trace, self.params = slots, k, drafter, use_trace, params
        self.depths, self._k, self._next_k = None, k, None  # one verify width; each user's k_b chosen at draft()
        self.label = f"tt ({gen.label or 'mesh'})" + ("" if self.device_drafter else " + host drafter")
        self.counters = MechanismCounters()
        self.decoder = TTBatchDecoder(self.model, slots, use_trace=use_trace, prefix_cache=prefix_cache,
                                      pool_blocks=pool_blocks)
        self.state = self.decoder.state
        a = self.model.args
        self.vocab = a.cfg.vocab_size
        self.stages = stages
        self.acceptor = DeviceAcceptor(self.ttnn, self.mesh, k=k, vocab=self.vocab, sampling_params=params,
                                       batch=slots, rng=rng, ring_heads=a.gdn_hv_d, stages=stages).allocate()
        # host rows at every slot count, B = 1 included
        self.step_state = SpecDeviceState(self.model, self.decoder.state, k, self.mechanism, users=slots, rows="host")
        self.step_state.attach_acceptor(self.acceptor)
        st = self.step_state
        heads = a.hkv_d
        pt = self.decoder.state.page_table_host.to(torch.int32)  # [B, pages]
        st.write("head_page_table", (pt[:, None, :] * heads + torch.arange(heads)[None, :, None]).reshape(slots * heads, -1))
        st.start()  # ring: live (zeros) -> ring slot 0, every head pointed at it
        if self.device_drafter:
            drafter.allocate(self.step_state)  # the packed B-slot MTP head, before any capture
        self.users: dict[int, SlotUser] = {}
        self._traces = StepTraces(self.ttnn, self.mesh, warmup_steps=1)
        self._phase = "idle"
        self._draft: BatchDraft | None = None
        self._vout: VerifyOutputs | None = None
        self._result = None
        self._results = None  # the last step's host results (accept()), for a commit that cuts a user's rows
        self._n_gdn = len(self.decoder.state.gdn_states())

    # ---- the step (docs/tt_spec.md, "The step (B slots)") -------------------------------------------------------------------
    def _scope(self):
        return self.decoder._scratch_scope()

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

    @torch.no_grad()
    def _join_slot(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        self._check_idle("join()")
        if self.stages is None and replace(params, seed=self.params.seed) != self.params:
            raise BatchSpecError(f"slot {slot}: {params.describe()} differ from the backend's {self.params.describe()} "
                                 "(build it with stages=SamplerStages... for per-user params)")
        if self.stages is not None:
            check_drafts(self.device_drafter, params, self.stages, slot)
            missing = self.stages.missing(params, self.vocab)
            if missing:
                raise BatchSpecError(f"slot {slot}: {params.describe()} needs {', '.join(missing)}, which this "
                                     f"backend's stages do not contain")
        logits: list[torch.Tensor] = []
        hidden: list | None = [] if self.device_drafter else None
        # a cached block's buffers outlive the join: into the decoder's pool (allocated before any capture), or
        # without one only while no step trace is live
        insert = self.decoder.pool is not None or len(self._traces) == 0
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
        self.users[slot] = SlotUser(params, history, lp, len(prompt), gen)
        return first

    def _leave_slot(self, slot: int) -> None:
        self._check_idle("leave()")
        if slot not in self.users:
            raise ValueError(f"slot {slot} has no user")
        self._with_live_state(lambda: self.decoder.leave(slot))
        del self.users[slot]

    def _draft_slots(self, depths: Mapping[int, int]) -> BatchDraft:
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
        write_host_rows(self.step_state, self.model.args, self.decoder.state.page_table_host, self.decoder.pos,
                        self.users, self.slots, self.k, self.vocab, depths, drafts)

    def _verify_and_accept_slots(self):
        st = self.step_state
        vout = st.verify()
        logits = self.ttnn.reshape(vout.out.logits, [1, self.slots, self.k + 1, self.vocab])
        # sampled device drafts: their distributions; argmax or host drafts: one-hot (None)
        probs = self.drafter.draft_probs(self.acceptor) if self.device_drafter else None
        return vout, self.acceptor.accept(logits, st.drafts, probs)

    def _verify_slots(self, draft: BatchDraft) -> VerifyOutputs:
        if self._phase != "drafted" or draft is not self._draft:
            raise RuntimeError("verify() needs exactly one draft() before it (and that draft's handle)")
        self._vout, self._result = self._run("verify", self._verify_and_accept_slots)
        self._phase = "verified"
        c, t = self.counters, self.k + 1
        c.target_forwards += 1
        c.recurrence_steps += self.slots * t * self._n_gdn
        self.mechanism.count_verify(c, t, self._n_gdn, self.step_state.state_bytes)
        return self._vout

    def _accept_slots(self, draft: BatchDraft) -> dict[int, Acceptance]:
        idle = [s for s in self.users if s not in draft.depths]  # users sitting the step out keep their uniforms
        results = self.acceptor.read_results(self._result, idle_rows=idle)  # the one readback: every slot's result
        self._results = results
        out = {}
        for s, kb in draft.depths.items():
            r = results[s]
            if r.num_accepted > kb:
                raise RuntimeError(f"slot {s}: device acceptance a={r.num_accepted} past the user's {kb} drafts")
            lps = self.acceptor.read_logprobs(r.emitted, s) if self.users[s].params.logprobs is not None else None
            out[s] = Acceptance(r.num_accepted, r.emitted, lps)
        self._phase = "accepted"
        return out

    def _commit_slots(self, acceptances: Mapping[int, Acceptance], forced: bool = False) -> None:
        """``forced``: an inject round (tt/spec/inject.py), whose results were already forced; it does not count as
        a completed step for the trace policy (the draft trace has not run in it: the first real step stays eager)."""
        depths = self._draft.depths
        if set(acceptances) != set(depths):
            raise ValueError(f"commit() needs the acceptance of every user of the step: got slots "
                             f"{sorted(acceptances)}, the step has {sorted(depths)}")
        if not forced:
            # a user kept fewer rows (the thinking budget cuts a step after its last thinking token): its commit
            # takes that acceptance instead of the device's, the last kept token pending
            cut = {}
            for s, acc in acceptances.items():
                a_dev = self._results[s].num_accepted
                if acc.num_accepted != a_dev:
                    kept = self._results[s].tokens[: acc.num_accepted + 1]
                    if not 0 <= acc.num_accepted < a_dev or list(acc.tokens) != kept:
                        raise ValueError(f"commit(): slot {s}: a={acc.num_accepted} is not a cut of the step's a={a_dev}")
                    cut[s] = (list(acc.tokens), acc.num_accepted)
            if cut:
                self.acceptor.force_rows(cut, self._results)
        self._run("commit", self._commit_slots_device)
        c = self.counters
        # the re-advance runs every slot's K+1 rows (B*(K+1) recurrence rows per GDN layer)
        self.mechanism.count_commit(c, self.slots * (self.k + 1), self._n_gdn, self.step_state.state_bytes)
        c.steps += 1
        for s, acc in acceptances.items():
            self.decoder.pos[s] += acc.num_accepted + 1
            self.users[s].history += list(acc.tokens)
        if not forced:
            self._traces.step_done()
        self._draft, self._phase = None, "idle"

    def _commit_slots_device(self) -> None:
        """The commit trace of B slots: per-user state commit, then (device drafter) the MTP reseed over the verified rows."""
        commit(self.step_state, self._vout)  # also zeroes the count of slots outside the step
        if self.acceptor.penalized:
            self.acceptor.commit_counts(self.step_state.active)  # the users' token counts are part of the commit
        if self.device_drafter:
            self.drafter.device_reseed(self.step_state, self._vout)
