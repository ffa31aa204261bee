"""The one-user step layout of :class:`~.spec_backend.TTSpecBackend` (device rows; docs/tt_spec.md, "The step (one
user)"): position and pending token are device state, the verify derives its row inputs from them, and the commit
advances them and makes the next step's drafts inside the commit trace (two trace replays a step, no host writes).
Per-step draft depths (``depths=``, ``--spec-k auto``): one buffer set per depth over the one device state
(tt/spec/depth_sets.py; docs/depth.md). ``capped_accept``: a caller's drafts, acceptance capped at their count
(the vLLM verify)."""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ...generation.sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs
from ...speculative.engine import Acceptance
from ..runtime.generator import TTGenerator
from ..runtime.prefix import prefill as tt_prefix_prefill
from .accept import DeviceAcceptor
from .commit import abort_after_verify, commit
from .depth_sets import DepthBuffers, allocate_depth_set
from .layout import StepLayout
from .mechanisms import TTMechanism
from .verify import SpecDeviceState, VerifyOutputs, check_verify_shape


class DeviceRows(StepLayout):
    """One user in slot 0, the row inputs derived on device (module doc). K is picked at the first draft of a
    generation (one depth per generation), or per step among ``depths``."""

    slots = 1

    def __init__(self, gen: TTGenerator, mechanism: TTMechanism, drafter: Any, use_trace: bool, rng: str,
                 depths: Sequence[int] | None, prefix_cache, capped_accept: bool):
        super().__init__(gen, mechanism, drafter, use_trace, device_drafter=hasattr(drafter, "device_draft"))
        self.state = gen.state
        self.prefix_cache = prefix_cache  # qwen36.prefix_cache.PrefixCache (tt/runtime/prefix.py; the MTP prefill is redone)
        self.last_prefill = None  # tt/runtime/prefix.py TTPrefillResult of the last prompt (tokens reused, its lease)
        self.rng = rng
        self.params = SamplingParams()
        self.stages = None  # per-user params are the B-slot layout's (one user takes its params at join())
        self._first_logprobs: TokenLogprobs | None = None  # the join token's, when the params ask for logprobs
        self.step_state: SpecDeviceState | None = None
        self.acceptor: DeviceAcceptor | None = None
        self.history: list[int] = []
        self.n = 0  # host mirror of the device position (bookkeeping / max_len checks only)
        self._k = None
        self._host_gen: torch.Generator | None = None
        self.depths: tuple[int, ...] | None = None
        if depths is not None:
            self.depths = tuple(sorted(set(int(d) for d in depths)))
            if not self.depths:
                raise ValueError("depths must name at least one draft depth")
            for d in self.depths:
                check_verify_shape(self.model.args, d)
        self._by_k: dict[int, DepthBuffers] = {}
        self.capped_accept = capped_accept
        self._accept_bufs: dict = {}  # capped_accept: K -> the acceptor's copy of the drafts (cap_drafts)
        self._verify_ids: torch.Tensor | None = None  # capped_accept: the last step's target argmax ids
        self._capped = False  # capped_accept: cap_drafts() ran for the open step
        self._next_k: int | None = None  # depth of the drafts now on device (made by the last commit)
        self._planned_k: int | None = None  # plan_next_depths() of the open step

    @property
    def depth(self) -> int | None:
        """K of the open (or last) step; None before the first draft of a generation."""
        return self._k

    @property
    def next_depth(self) -> int | None:
        """K of the drafts already on device for the next step (made inside the last commit); None before it."""
        return self._next_k

    @property
    def verify_width(self) -> int | None:
        return self._k

    def release(self) -> None:
        self._traces.release()

    def position(self, slot: int) -> int:
        """The user's position (the host's mirror): tokens in its KV cache, its pending token not yet among them."""
        self._check_slot(slot)
        return self.n

    def _setup(self, k: int) -> None:
        """Allocate the step's buffers for draft depth k (outside any trace)."""
        self.release()
        v = self.model.args.cfg.vocab_size
        acc = DeviceAcceptor(self.ttnn, self.mesh, k=k, vocab=v, sampling_params=self.params,
                             rng=self.rng, ring_heads=self.model.args.gdn_hv_d).allocate()
        step_state = SpecDeviceState(self.model, self.state, k, self.mechanism)
        step_state.attach_acceptor(acc)
        if self.device_drafter:
            self.drafter.allocate(step_state)
        self.acceptor, self.step_state, self._k = acc, step_state, k
        acc.start_penalties(self._prompt_len, self.history)  # token counts so far (no-op without penalties)
        step_state.start(self.n, self.history[-1])
        if self.device_drafter:
            self.drafter.start(step_state, self.history, self._prompt_hidden)
        if self.capped_accept:
            self._alloc_accept_drafts([k])

    def _alloc_accept_drafts(self, ks) -> None:
        ttnn = self.ttnn
        self._accept_bufs = {k: ttnn.from_torch(torch.zeros(1, 1, 1, k, dtype=torch.int32), dtype=ttnn.uint32,
                                                layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                                                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
                             for k in ks}

    def _setup_depths(self, k_first: int) -> None:
        """Allocate every depth's buffers over one shared device state, compile them, start at k_first."""
        self.release()
        if self.capped_accept:
            self._alloc_accept_drafts(self.depths)
            self.release()
        self._by_k = allocate_depth_set(self.ttnn, self.mesh, self.model, self.state, self.mechanism, self.params,
                                        self.rng, self.depths)
        if self.device_drafter:
            self.drafter.allocate_depths([b.step_state for b in self._by_k.values()])
        first = self._by_k[k_first].step_state
        first.start(self.n, self.history[-1])  # n first: the compile pass writes only at positions >= n
        if self.use_trace:
            self._compile_depths()
            first.start(self.n, self.history[-1])
        # the shared token counts so far (after the compile pass, whose commits added to them; no-op without penalties)
        first.acceptor.start_penalties(self._prompt_len, self.history)
        if self.device_drafter:
            self.drafter.start(first, self.history, self._prompt_hidden)
        self._traces.warmup_steps = 0  # compiled: each name is captured on its first use

    def _compile_depths(self) -> None:
        """Run every depth's device programs once, eagerly (traces record compiled programs; once one is live no
        eager op may allocate). The live GDN recurrent + conv state is saved before and restored after; what else
        it writes is scratch the real steps rewrite before reading (KV / MTP KV rows at positions >= n, per-depth
        rings, acceptor outputs, drafts), and the RNG streams restart."""
        ttnn = self.ttnn
        saved = [(s, ttnn.clone(s.recurrent), ttnn.clone(s.conv)) for s in self.state.gdn_states()]
        for d, b in self._by_k.items():
            st = b.step_state
            self.acceptor, self.step_state, self._k = b.acceptor, st, d
            self.mechanism.enter(st)
            if self.device_drafter:
                self.drafter.use(d)
                self.drafter.before_device_draft()
                self.drafter.device_chain(st)
            self._vout, self._result = self._verify_and_accept()
            self._commit_reseed()
            self.mechanism.leave(st)
            for s, rec, conv in saved:  # the commit moved live state; back to the prefill's
                ttnn.copy(rec, s.recurrent)
                ttnn.copy(conv, s.conv)
        for _, rec, conv in saved:
            ttnn.deallocate(rec)
            ttnn.deallocate(conv)
        shared = next(iter(self._by_k.values()))
        if not self.params.greedy:
            shared.acceptor.uniforms.restart()
        if self.device_drafter:
            self.drafter.restart_rng()
        self._vout = self._result = None

    # ---- the contract --------------------------------------------------------------------------------
    @staticmethod
    def _check_slot(slot: int) -> None:
        if slot != 0:
            raise ValueError(f"slot {slot}: this backend holds one user, in slot 0")

    _check_user_slot = _check_slot

    def _only(self, per_slot: Mapping[int, Any], what: str) -> Any:
        if set(per_slot) != {0}:
            raise ValueError(f"{what}: this backend holds one user, in slot 0; got slots {sorted(per_slot)}")
        return per_slot[0]

    @torch.no_grad()
    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        self._check_slot(slot)
        if self.history:
            raise ValueError("slot 0 is in use: leave() it first")
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if self.capped_accept and not params.greedy:
            raise NotImplementedError(f"capped_accept verifies greedily; {params.describe()} requested")
        self.release()
        self.release_prefix()
        t0 = time.perf_counter()
        self.params = params
        self._host_gen = params.generator(torch.device("cpu"))
        self.gen.reset()  # releases the plain-decode trace, zeroes state
        hs: list = [] if self.device_drafter else None
        # without a cache: one prefill_forward over the prompt; with one: resume at the longest cached boundary
        res = self.last_prefill = tt_prefix_prefill(self.model, self.state, list(prompt), self.prefix_cache,
                                                    hidden_out=hs)
        logits = res.logits
        self.prefill_logits = logits  # host fp32 [V]: the last prompt row (the vllm-tt contract returns it)
        first = int(pick_token(logits.reshape(1, -1), params, self._host_gen,
                               TokenHistory(prompt, self.config.vocab_size).now()))
        self._prompt_len = len(prompt)
        self._first_logprobs = token_logprobs(logits, first, params.logprobs) if params.logprobs is not None else None
        self._prompt_hidden = None
        if hs:
            self._prompt_hidden = hs[0] if len(hs) == 1 else self.ttnn.concat(hs, dim=2)
        self.n = len(prompt)
        self.history = list(prompt) + [first]
        self.prefill_s = time.perf_counter() - t0  # time to first token, measured
        self.step_state, self.acceptor, self._k = None, None, None
        self._by_k, self._next_k, self._planned_k = {}, None, None
        self._phase = "idle"
        return first

    def first_logprobs(self, slot: int) -> TokenLogprobs | None:
        self._check_slot(slot)
        return self._first_logprobs

    def leave(self, slot: int) -> None:
        """The user is done: slot 0 is free for the next join (device state is reset by that join's prefill; the
        traces stay captured until then); its cached prefix blocks become evictable."""
        self._check_slot(slot)
        if not self.history:
            raise ValueError("slot 0 holds no user")
        if self._phase != "idle":
            raise RuntimeError("leave() inside an open step: commit() or abort() first")
        self.history = []
        self.release_prefix()

    def draft(self, depths: Mapping[int, int]):
        k = self._only(depths, "draft()")
        if not self.history:
            raise RuntimeError("draft() before join()")
        if self._phase != "idle":
            raise RuntimeError("draft() inside an open step: commit() or abort() first")
        if self.n + k + 1 > self.model.args.max_seq_len:
            raise ValueError(f"KV cache full: position {self.n} + {k + 1} rows > max_seq_len {self.model.args.max_seq_len}")
        if self.depths is not None:
            self._select_depth(k)
        else:
            if self._k is not None and k != self._k:
                # the next step's drafts were made inside the last commit trace at depth self._k, and the ring
                # slots, acceptor and draft buffers are per-K: without ``depths`` there is one K per generation
                raise ValueError(f"draft depth changed from {self._k} to {k} within one generation; this backend "
                                 "keeps one K per generation (prefill again, or build it with depths=...)")
            if k != self._k:
                self._setup(k)
        if not self.device_drafter:
            self.step_state.write_drafts([int(t) for t in self.drafter(list(self.history), k)])
        self._phase = "drafted"
        self._capped = False
        self.counters.mtp_forwards += k
        return self.step_state.drafts

    def _select_depth(self, k: int) -> None:
        if k not in self.depths:
            raise ValueError(f"draft depth {k} is not one of this backend's depths {list(self.depths)}")
        if self._k is None:
            self._setup_depths(k)
        elif k != self._next_k:
            raise ValueError(f"the drafts on device were made at depth {self._next_k} inside the last commit; "
                             f"to draft at depth {k}, call plan_next_depths({{0: {k}}}) between accept() and commit()")
        b = self._by_k[k]
        self.acceptor, self.step_state, self._k, self._next_k = b.acceptor, b.step_state, k, k
        if self.device_drafter:
            self.drafter.use(k)

    def plan_next_depths(self, depths: Mapping[int, int]) -> None:
        """The depth of the next step, decided on the host after accept() (from the accepted count it read) and
        before commit(), which drafts the next step on device at that depth. ``{}``: the user is done (the commit
        keeps the step's depth)."""
        if self._phase != "accepted":
            raise RuntimeError("plan_next_depths() goes between accept() and commit()")
        if not depths:
            self._planned_k = None
            return
        k = self._only(depths, "plan_next_depths()")
        if self.depths is None:
            if k != self._k:
                raise ValueError(f"draft depth changed from {self._k} to {k} within one generation; this backend "
                                 "keeps one K per generation (build it with depths=... to switch)")
        elif k not in self.depths:
            raise ValueError(f"draft depth {k} is not one of this backend's depths {list(self.depths)}")
        self._planned_k = k

    def cap_drafts(self, drafts: Mapping[int, Sequence[int]]) -> None:
        """Between draft() and verify() (``capped_accept``): the step of user ``slot`` verifies the caller's
        ``drafts[slot]`` (n <= K ids; the rows past n hold token 0, their outputs unread) and its greedy acceptance
        stops at n."""
        if not self.capped_accept:
            raise ValueError("cap_drafts() needs a backend built with capped_accept=True")
        if self._phase != "drafted":
            raise RuntimeError("cap_drafts() goes between draft() and verify()")
        ids = [int(t) for t in self._only(drafts, "cap_drafts()")]
        k = self._k
        if len(ids) > k:
            raise ValueError(f"cap_drafts(): {len(ids)} drafts for a step of depth {k}")
        self.step_state.write_drafts(ids + [0] * (k - len(ids)))
        buf = self._accept_bufs[k]
        x = torch.tensor(ids + [self.config.vocab_size] * (k - len(ids)), dtype=torch.int32).reshape(1, 1, 1, k)
        self.ttnn.copy_host_to_device_tensor(self.step_state.host(x, buf), buf)
        self._capped = True

    def draft_ids(self, slot: int) -> list[int]:
        """Host copy of user ``slot``'s drafts of the open step (between draft() and verify()): the device MTP's
        (made inside the last commit, or by this draft()), or the host drafter's."""
        if self._phase != "drafted":
            raise RuntimeError("draft_ids() goes between draft() and verify()")
        self._check_slot(slot)
        k = self._k
        if self.device_drafter:
            ids, _ = self.drafter.read_drafts()
            return [int(t) for t in ids[0, :k]]
        row = self.model.to_host(self.step_state.drafts).reshape(self.slots, -1)[slot]
        return [int(t) for t in row[:k]]

    def verify_ids(self, slot: int) -> torch.Tensor:
        """The last step's target argmax id of every verified row of user ``slot``, int64 [K+1] (``capped_accept``:
        read at accept(), before the commit's traces replay over the verify's outputs)."""
        if self._verify_ids is None:
            raise RuntimeError("verify_ids() needs a capped_accept backend and an accepted step")
        self._check_slot(slot)
        return self._verify_ids

    def _name(self, what: str, k: int) -> str:
        return what if self.depths is None else f"{what}:{k}"

    def _run(self, name: str, fn: Callable[[], Any]):
        """Eager on the first step after setup, captured on the second, replayed afterwards."""
        return self._traced(name, fn)

    def _verify_and_accept(self):
        vout = self.step_state.verify()
        if self.params.greedy:
            drafts = self._accept_bufs[self._k] if self.capped_accept else self.step_state.drafts
            res = self.acceptor.greedy(vout.out.logits, drafts)
        else:
            probs = self.drafter.draft_probs(self.acceptor) if self.device_drafter else None
            res = self.acceptor.stochastic(vout.out.logits, self.step_state.drafts, probs)
        return vout, res

    def verify(self, draft) -> VerifyOutputs:
        if self._phase != "drafted":
            raise RuntimeError("verify() needs exactly one draft() before it")
        if self.capped_accept and not self._capped:
            raise RuntimeError("a capped_accept backend verifies the caller's drafts: cap_drafts() between draft() "
                               "and verify()")
        self._vout, self._result = self._run(self._name("verify", self._k), self._verify_and_accept)
        self._phase = "verified"
        c, n_gdn, t = self.counters, len(self.state.gdn_states()), self._k + 1
        c.target_forwards += 1
        c.recurrence_steps += t * n_gdn
        self.mechanism.count_verify(c, t, n_gdn, self.step_state.state_bytes)
        return self._vout

    def accept(self, draft, verify) -> dict[int, Acceptance]:
        if self._phase != "verified":
            raise RuntimeError("accept() needs verify() first")
        if self.capped_accept:  # the caller returns the target's choice at every row (vLLM's argmax_ids)
            self._verify_ids = self.model.to_host(self._vout.out.tokens).reshape(-1).to(torch.int64)[: self._k + 1]
        r = self.acceptor.read_results(self._result)[0]  # the one readback: tokens + count
        toks, a = r.tokens, r.num_accepted
        lps = self.acceptor.read_logprobs(toks[: a + 1]) if self.params.logprobs is not None else None  # (+ asked)
        self._phase = "accepted"
        self._accepted = (a, r.rng_row)
        return {0: Acceptance(a, toks[: a + 1], lps)}

    def _commit_device(self):
        if self.device_drafter:  # reads n before the commit advances it
            self.drafter.device_draft(self.step_state, self._vout)
        commit(self.step_state, self._vout, self._result)
        if self.params.penalized:
            self.acceptor.commit_counts()  # the token counts are part of the state transaction
        return None

    def _commit_reseed(self):
        """Multi-depth commit: the MTP reseed of this step's rows (reads n before the commit advances it), then the
        commit; the chain runs in its own trace at the next step's depth."""
        if self.device_drafter:
            self.drafter.device_reseed(self.step_state, self._vout)
        commit(self.step_state, self._vout, self._result)
        if self.params.penalized:
            self.acceptor.commit_counts()  # into the counts every depth shares, before the next step's chain reads them
        return None

    def commit(self, acceptances: Mapping[int, Acceptance]) -> None:
        if self._phase != "accepted":
            raise RuntimeError("commit() needs accept() first")
        acceptance = self._only(acceptances, "commit()")
        a_dev, rng_row = self._accepted
        if acceptance.num_accepted != a_dev:
            # the caller kept fewer rows (the thinking budget cuts a step after its last thinking token): the
            # commit takes that acceptance instead of the device's, the last kept token pending
            if not 0 <= acceptance.num_accepted < a_dev:
                raise ValueError(f"commit(): a={acceptance.num_accepted} is not a cut of the step's a={a_dev}")
            self.acceptor.force_result(list(acceptance.tokens), acceptance.num_accepted, rng_row)
        if self.device_drafter:
            self.drafter.before_device_draft()  # outside capture: sampled-draft RNG table refill when used up
        a, c, n_gdn = acceptance.num_accepted, self.counters, len(self.state.gdn_states())
        if self.depths is None:
            self._run("commit", self._commit_device)
        else:
            k, k2 = self._k, self._planned_k or self._k
            self._run(f"commit:{k}", self._commit_reseed)
            if k2 != k and self.mechanism.ring:
                st, st2 = self.step_state, self._by_k[k2].step_state
                self._run(f"leave:{k}", lambda: self.mechanism.leave(st))
                self._run(f"enter:{k2}", lambda: self.mechanism.enter(st2))
                self.mechanism.count_switch(c, n_gdn, self.step_state.state_bytes)
            if self.device_drafter:
                self.drafter.use(k2)
                st2 = self._by_k[k2].step_state
                self._run(f"chain:{k2}", lambda: self.drafter.device_chain(st2))
            self._next_k, self._planned_k = k2, None
        self.mechanism.count_commit(c, self._k + 1, n_gdn, self.step_state.state_bytes)
        c.steps += 1
        self.n += a + 1
        self.history += acceptance.tokens
        self._traces.step_done()
        self._phase = "idle"

    @torch.no_grad()
    def inject(self, forced: Mapping[int, Sequence[int]],
               depths: Mapping[int, int] | None = None) -> dict[int, Acceptance]:
        """The thinking budget's forced tokens (``generation/thinking.py``), one user: committed after the pending
        token like a prefill continuation, through the step's own traces. Each round writes up to K forced tokens as
        the drafts, replays the verify, then forces the acceptance (:meth:`DeviceAcceptor.force_result`: every
        forced row accepted, the next forced token pending) and replays the commit, which re-seeds the MTP from
        those rows and drafts on from them; the last round's next token is picked on the host from its verify row
        (the row after the last forced token) with the user's params. Returns the forced tokens + that pick."""
        if self.capped_accept:
            raise NotImplementedError("inject() (forced tokens) on a capped_accept backend: its acceptor reads the "
                                      "caller's drafts")
        toks = [int(t) for t in self._only(forced, "inject()")]
        if not toks:
            raise ValueError("inject() needs at least one forced token")
        self._check_idle("inject()")
        nxt_k = None if not depths or depths.get(0) is None else int(depths[0])
        if self._k is None:  # before the first step (a budget reached at the prompt's first token): set up at the
            # depth the first step will draft at, as its draft() would
            if nxt_k is None:
                raise ValueError("inject() before the first step needs the next draft depth (depths={0: K})")
            if self.n + nxt_k + 1 > self.model.args.max_seq_len:
                raise ValueError(f"KV cache full: position {self.n} + {nxt_k + 1} rows > max_seq_len "
                                 f"{self.model.args.max_seq_len}")
            if self.depths is None:
                self._setup(nxt_k)
        if self.depths is not None:
            # per-step depths: the rounds run at the depth the last commit prepared (its drafts are overwritten by
            # the forced tokens), the last round's chain at the user's next depth (as plan_next_depths would)
            if nxt_k is not None and nxt_k not in self.depths:
                raise ValueError(f"draft depth {nxt_k} is not one of this backend's depths {list(self.depths)}")
            self._select_depth(self._next_k if self._k is not None else nxt_k)
        k, m, out, i = self._k, len(toks), [], 0
        while True:
            c = min(k, m - i)
            chunk = toks[i:i + c]
            if self.n + k + 1 > self.model.args.max_seq_len:
                raise ValueError(f"KV cache full: position {self.n} + {k + 1} rows > max_seq_len "
                                 f"{self.model.args.max_seq_len}")
            self.step_state.write_drafts(chunk + [chunk[-1] if chunk else toks[-1]] * (k - c))
            self._phase = "drafted"
            self.verify(None)
            rng_row = self.acceptor.read_results(self._result)[0].rng_row  # the step's RNG bookkeeping, as accept()
            final = i + c >= m
            if final:
                row = self.verify_logits()[0, c]
                self.inject_logits = row  # host fp32 [V]: the row the token after the phrase is picked from
                history = TokenHistory(self.history[:self._prompt_len], self.config.vocab_size)
                history.add(self.history[self._prompt_len:] + chunk)  # the earlier rounds' tokens are in history
                nxt = int(pick_token(row.reshape(1, -1), self.params, self._host_gen, history.now()))
            else:
                nxt = toks[i + c]
            self.acceptor.force_result(chunk + [nxt], c, rng_row)
            self._phase, self._accepted = "accepted", (c, rng_row)
            if final and self.depths is not None:
                self._planned_k = nxt_k
            self.commit({0: Acceptance(c, chunk + [nxt])})
            out += chunk + [nxt]
            if final:
                return {0: Acceptance(m, out)}
            i += c + 1

    def abort(self) -> None:
        if self._phase == "idle":
            raise RuntimeError("abort() outside a step")
        if self._phase in ("verified", "accepted"):
            abort_after_verify(self.step_state)  # shadow_commit refuses here (see mechanisms.ShadowCommit)
            if not self.params.greedy:
                # the acceptor advanced its RNG row counter on device; step back one row
                self.acceptor.uniforms.step_back()
        self._planned_k = None
        self.counters.aborts += 1
        self._phase = "idle"

    def release_prefix(self) -> None:
        """The request is over: drop its references to cached prefix blocks."""
        if self.last_prefill is not None and self.last_prefill.lease is not None:
            self.last_prefill.lease.release()
