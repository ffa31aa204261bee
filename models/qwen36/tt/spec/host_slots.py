"""The B-slot step layout of :class:`~.spec_backend.TTSpecBackend` (host rows; docs/tt_spec.md, "The step (B slots)"):
B users over a :class:`~..runtime.batch.TTBatchDecoder` of its own, the host writing every user's row inputs before
each step, the packed device MTP chain in a draft trace of its own (three trace replays a step); at one slot it is
the batched step at B = 1. The row inputs, users and draft handle: tt/spec/host_rows.py.

Forced tokens (:meth:`HostRows.inject`, a thinking budget's stop-thinking phrase, ``generation/thinking.py``): each
round is one step of the layout's own draft-less traces: the forced users' next up-to-K forced tokens are written as
their drafts (k_b = the chunk's length, 0 when only the pending token is left to verify), the verify replays, the host
overwrites those users' results with "every forced row accepted, the next forced token pending"
(:meth:`DeviceAcceptor.force_rows`; the other rows written back unchanged), and the commit replays: the per-user state
commit and the MTP reseed take the forced rows, so the next step's chain drafts on from the forced tokens. The last
round's next token is picked on the host from the verify row after the last forced token, with the user's params
and host stream (the one its join's token came from), as the one-user layout does. Users not forced sit the rounds
out (inert rows, their uniform rows given back), so their own steps are those of a run without the others' budgets.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import torch

from ...generation.sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs
from ...speculative.engine import Acceptance
from ..model.gdn import TILE_ROWS
from ..model.model_config import user_core_grid
from ..runtime.batch import TTBatchDecoder
from ..runtime.generator import TTGenerator
from ..runtime.sampler_transform import SamplerStages
from .accept import DeviceAcceptor
from .commit import abort_after_verify, commit
from .host_rows import (BatchDraft, BatchSpecError, HostRowsState, SlotUser, check_drafts, is_packed_device_drafter,
                        write_host_rows)
from .layout import StepLayout
from .mechanisms import TTMechanism
from .verify import VerifyOutputs


class HostRows(StepLayout):
    """B user slots over the layout's own batch decoder, the row inputs written by the host (module doc): every
    step verifies ``k`` drafts per user (B x (k+1) rows), with the backend's ``params``, or each user its own with
    ``stages``."""

    def __init__(self, gen: TTGenerator, slots: int, k: int | None, mechanism: TTMechanism, drafter,
                 params: SamplingParams, use_trace: bool, rng: str, prefix_cache,
                 stages: SamplerStages | None, pool_blocks: int = 0) -> None:
        """B slots over a decoder of their own (module doc); the checks come before the generator is touched."""
        if not isinstance(k, int) or k < 1:
            raise BatchSpecError(f"{slots} slots (host rows) need the verify width k >= 1, got {k!r}")
        if hasattr(drafter, "for_slots"):  # the device MTP drafter: its B-slot form, one per layout
            drafter = drafter.for_slots()
        device_drafter = is_packed_device_drafter(drafter)
        if drafter is None or (not device_drafter and not callable(drafter)):
            raise BatchSpecError("B slots (host rows) need a drafter: the device MTP "
                                 "(tt/spec/mtp_drafter.py TTMTPDrafter) or a host drafter (history, k) -> k ids")
        check_drafts(device_drafter, params, stages)
        n_rows = slots * (k + 1)
        if n_rows > TILE_ROWS:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) = {n_rows} verify rows: the decode-path attention "
                                 f"takes at most {TILE_ROWS} rows (one per core); use fewer slots or a smaller K")
        try:
            user_core_grid(n_rows)
        except ValueError as e:
            raise BatchSpecError(f"{slots} slots x (K+1 = {k + 1}) verify rows: {e}") from None
        super().__init__(gen, mechanism, drafter, use_trace, device_drafter)
        self.slots, self.k, self.params = slots, k, params
        self.depths = None  # one verify width; each user's k_b chosen at draft()
        self.decoder = TTBatchDecoder(self.model, slots, use_trace=use_trace, prefix_cache=prefix_cache,
                                      pool_blocks=pool_blocks)
        self.state = self.decoder.state
        a = self.model.args
        self.vocab = a.cfg.vocab_size
        self.stages = stages
        self.acceptor = DeviceAcceptor(self.ttnn, self.mesh, k=k, vocab=self.vocab, sampling_params=params,
                                       batch=slots, rng=rng, ring_heads=a.gdn_hv_d, stages=stages).allocate()
        # host rows at every slot count, B = 1 included
        self.step_state = HostRowsState(self.model, self.decoder.state, k, self.mechanism, users=slots)
        self.step_state.attach_acceptor(self.acceptor)
        st = self.step_state
        heads = a.hkv_d
        pt = self.decoder.state.page_table_host.to(torch.int32)  # [B, pages]
        st.write("head_page_table", (pt[:, None, :] * heads + torch.arange(heads)[None, :, None]).reshape(slots * heads, -1))
        st.start()  # ring: live (zeros) -> ring slot 0, every head pointed at it
        if self.device_drafter:
            drafter.allocate(self.step_state)  # the packed B-slot MTP head, before any capture
        self.users: dict[int, SlotUser] = {}
        self._draft: BatchDraft | None = None
        self._results = None  # the last step's host results (accept()), for a commit that cuts a user's rows
        self._n_gdn = len(self.decoder.state.gdn_states())

    @property
    def verify_width(self) -> int:
        return self.k

    def release(self) -> None:
        self._traces.release()
        self.decoder.release()

    def position(self, slot: int) -> int:
        """The user's position (the host's mirror): tokens in its KV cache, its pending token not yet among them."""
        return self.decoder.pos[slot]

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.users[slot].first_logprobs

    def release_prefix(self) -> None:
        """Nothing to drop here: each user's cached prefix blocks are held by the decoder until it leaves."""

    def plan_next_depths(self, depths: Mapping[int, int]) -> None:
        """Each user's depth is chosen at draft() (one verify width for the step); only checked here."""
        if self._phase != "accepted":
            raise RuntimeError("plan_next_depths() goes between accept() and commit()")
        for slot, kb in depths.items():
            if slot not in self.users or not 1 <= kb <= self.k:
                raise BatchSpecError(f"slot {slot}: next depth {kb} for no user or outside 1..{self.k}")

    def draft_ids(self, slot: int) -> list[int]:
        """Host copy of user ``slot``'s drafts of the open step (between draft() and verify())."""
        if self._phase != "drafted":
            raise RuntimeError("draft_ids() goes between draft() and verify()")
        k = self._draft.depths[slot]
        if self.device_drafter:
            ids, _ = self.drafter.read_drafts()
            return [int(t) for t in ids[slot, :k]]
        return list(self._draft.drafts[slot])

    def cap_drafts(self, drafts: Mapping[int, Sequence[int]]) -> None:
        raise ValueError("cap_drafts() needs a backend built with capped_accept=True (the one-user layout)")

    def _run(self, name: str, fn):
        """A trace per (slots, K): eager on the first step after setup, captured on the second, replayed afterwards."""
        return self._traced(f"{name}/B{self.slots}K{self.k}", fn)

    def abort(self) -> None:
        if self._phase == "idle":
            raise RuntimeError("abort() outside a step")
        if self._phase in ("verified", "accepted"):
            with self._scope():
                abort_after_verify(self.step_state)
                # a step with sampled rows advanced the RNG counters on device (accept() gave the idle users'
                # back): every row before accept(), the step's rows after it
                self.acceptor.step_back_rng(None if self._phase == "verified" else list(self._draft.depths))
        if self.device_drafter:
            self.drafter.step_back()  # the chain's uniform row (sampled drafts; no-op otherwise)
        self._draft = None
        self.counters.aborts += 1
        self._phase = "idle"

    # ---- the step (docs/tt_spec.md, "The step (B slots)") -------------------------------------------------------------------
    def _scope(self):
        return self.decoder.scratch_scope()

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
    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
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

    def leave(self, slot: int) -> None:
        self._check_idle("leave()")
        if slot not in self.users:
            raise ValueError(f"slot {slot} has no user")
        self._with_live_state(lambda: self.decoder.leave(slot))
        del self.users[slot]

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
        write_host_rows(self.step_state, self.model.args, self.decoder.state.page_table_host, self.decoder.pos,
                        self.users, self.slots, self.k, self.vocab, depths, drafts)

    def _verify_and_accept(self):
        st = self.step_state
        vout = st.verify()
        logits = self.ttnn.reshape(vout.out.logits, [1, self.slots, self.k + 1, self.vocab])
        # sampled device drafts: their distributions; argmax or host drafts: one-hot (None)
        probs = self.drafter.draft_probs(self.acceptor) if self.device_drafter else None
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

    def accept(self, draft: BatchDraft, verify=None) -> dict[int, Acceptance]:
        if self._phase != "verified":
            raise RuntimeError("accept() needs verify() first")
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

    def commit(self, acceptances: Mapping[int, Acceptance], forced: bool = False) -> None:
        """``forced``: an inject round (:meth:`inject`), whose results were already forced; it does not count as
        a completed step for the trace policy (the draft trace has not run in it: the first real step stays eager)."""
        if self._phase != "accepted":
            raise RuntimeError("commit() needs accept() first")
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
        self._run("commit", self._commit_device)
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

    def _commit_device(self) -> None:
        """The commit trace of B slots: per-user state commit, then (device drafter) the MTP reseed over the verified rows."""
        commit(self.step_state, self._vout)  # also zeroes the count of slots outside the step
        if self.acceptor.penalized:
            self.acceptor.commit_counts(self.step_state.active)  # the users' token counts are part of the commit
        if self.device_drafter:
            self.drafter.device_reseed(self.step_state, self._vout)

    @torch.no_grad()
    def inject(self, forced: Mapping[int, Sequence[int]],
               depths: Mapping[int, int] | None = None) -> dict[int, Acceptance]:
        """The forced tokens of every user in ``forced`` (slot -> tokens), packed into shared rounds (module doc; the
        rounds run at the verify width k, ``depths`` is not needed).
        Returns slot -> the forced tokens + the pick after them; ``self.inject_logits`` = slot -> that pick's row (fp32 [V])."""
        self._check_idle("inject()")
        toks: dict[int, list[int]] = {}
        for s, f in forced.items():
            if s not in self.users:
                raise ValueError(f"inject(): slot {s} has no user")
            toks[s] = [int(t) for t in f]
            if not toks[s]:
                raise ValueError(f"inject(): slot {s}: at least one forced token is needed")
        k, max_len = self.k, self.model.args.max_seq_len
        done: dict[int, list[int]] = {s: [] for s in toks}
        at = {s: 0 for s in toks}  # the next forced token of each user
        out: dict[int, Acceptance] = {}
        self.inject_logits = {}
        while len(out) < len(toks):
            chunks = {s: toks[s][at[s]: at[s] + min(k, len(toks[s]) - at[s])] for s in toks if s not in out}
            depths = {s: len(c) for s, c in chunks.items()}
            for s, c in depths.items():
                if self.decoder.pos[s] + c + 1 > max_len:
                    raise ValueError(f"slot {s}: KV cache full: position {self.decoder.pos[s]} + {c + 1} rows > "
                                     f"max_seq_len {max_len}")
            self._write_rows(depths, chunks)
            if self.device_drafter:  # the reseed rows' positions (the chain does not run: the drafts are the forced tokens)
                self.drafter.write_inputs(depths, {s: self.decoder.pos[s] for s in depths},
                                        {s: self.users[s].history[-1] for s in depths})
            self._draft, self._phase = BatchDraft(depths, chunks), "drafted"
            self.verify(self._draft)
            idle = [s for s in self.users if s not in depths]
            results = self.acceptor.read_results(self._result, idle_rows=idle)  # the step's RNG bookkeeping, as accept()
            final = {s for s, c in depths.items() if at[s] + c >= len(toks[s])}
            logits = self.verify_logits() if final else None
            rows, acc = {}, {}
            for s, chunk in chunks.items():
                c = len(chunk)
                if s in final:
                    u = self.users[s]
                    row = logits[s, c]
                    self.inject_logits[s] = row
                    history = TokenHistory(u.history[: u.prompt_len], self.vocab)
                    history.add(u.history[u.prompt_len:] + chunk)
                    nxt = int(pick_token(row.reshape(1, -1), u.params, u.host_gen, history.now()))
                else:
                    nxt = toks[s][at[s] + c]
                rows[s] = (chunk + [nxt], c)
                acc[s] = Acceptance(c, chunk + [nxt])
            self.acceptor.force_rows(rows, results)
            self._phase = "accepted"
            self.commit(acc, forced=True)
            for s, a in acc.items():
                done[s] += a.tokens
                if s in final:
                    out[s] = Acceptance(len(toks[s]), done[s])
                else:
                    at[s] += a.num_accepted + 1
        return out
