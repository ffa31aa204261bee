"""TTSpecBackend: the speculative engine's ``SpecBackend`` on the TT target, one user slot (``slots = 1``).

It speaks the engine's one protocol with slot 0 only: ``join(0, prompt, params)``, ``draft({0: k})``,
``accept(...) -> {0: Acceptance}``, ``commit({0: acceptance})``, ``plan_next_depths({0: k})``, ``leave(0)``.

One step = two device programs sequences, each captured once and replayed:

    trace A (verify):  mechanism pre-copies -> ONE K+1-row target forward -> on-device acceptance
    host:              read the acceptor's result (emitted tokens + count): the only device->host transfer
    trace B (commit):  conv window select, ring index / masked re-advance, n' = n+a+1, pending' = token a
                       [+ the device MTP's reseed + K-draft chain writing the next drafts, when attached]

The first step after a prefill runs both halves eagerly (compiles every program); the second captures them and
every later step replays. Traces are released before a new prompt (prefill allocates). Nothing is written from
the host inside a capture; between replays the host writes only draft tokens when a *host drafter* is used
(tests / no device MTP), never state.

Drafting: ``drafter`` is either an object with ``device_draft(step_state, vout)`` (the device MTP,
``tt/spec/mtp_drafter.py``; runs inside trace B and writes ``step_state.drafts``) or a host callable
``(history: list[int], k) -> list[int]`` (written into the drafts buffer with copy_host_to_device_tensor before the
verify replay). Capture and replay go through ``tt/runtime/trace.py``.

Draft depth per step (``depths=``, what ``--spec-k auto`` builds): the next step's drafts are made on device
inside the current step's commit, so the depth K' of step n+1 must be known before step n's commit is launched.
The engine decides it on the host between accept() and commit() (``plan_next_depths``) from the accepted count
accept() just read back (the step's one device->host transfer), so choosing K adds no device sync. Every depth
has its own acceptor, drafts buffer, row constants, MTP head view and (shadow_commit) ring, all allocated at the
first step of a generation, and all of them are views of ONE device state: position, pending token, KV caches,
conv windows, live GDN state (snapshot/recompute buffers), the MTP KV cache, the acceptance RNG stream and the
penalty token counts (``tt/runtime/sampler.py`` ``TokenCounts``: every depth's acceptor reads and commits the same
buffers) are shared. Per step:

    trace verify:K            verify + acceptance at depth K (as above)
    host                      read the result; the engine picks K'
    trace commit:K            MTP reseed over the K+1 rows, row a -> persistent buffers; then the commit
                              (+ the emitted tokens into the shared token counts, with penalties)
    [K' != K, shadow_commit:  trace leave:K  (ring slot a -> live recurrent state),
                              trace enter:K' (live -> ring K' slot 0, ring index -> slot 0)]
    trace chain:K'            the K'-draft MTP chain into depth K''s drafts buffer

so the commit of step n is complete on device (same command queue, in order) before any trace of step n+1 reads
the state. Each name is captured once, on its first use; a compile pass at the first step runs every depth's
programs once eagerly before any capture (with the GDN/conv state saved and restored around it), because traces
record compiled programs and no device allocation may happen once a trace is live.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ...speculative.engine import Acceptance, MechanismCounters
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ...speculative.sampling import SamplingParams, TokenHistory, TokenLogprobs, pick_token, token_logprobs
from .accept import DeviceAcceptor
from .commit import abort_after_verify, commit
from ..runtime.generator import TTGenerator
from ..runtime.prefix import prefill as tt_prefix_prefill
from .mechanisms import TTMechanism, tt_mechanism
from ..runtime.trace import StepTraces
from .verify import SpecDeviceState, VerifyOutputs, check_verify_shape


@dataclass
class _DepthBuffers:
    """The per-depth objects of one generation (views of the one device state)."""

    acceptor: DeviceAcceptor
    step_state: SpecDeviceState


class TTSpecBackend:
    slots = 1  # one user; tt/spec/batch_spec.py holds several

    def __init__(self, gen: TTGenerator, mechanism: str | TTMechanism = DEFAULT_MECHANISM, drafter: Any = None,
                 use_trace: bool = True, rng: str = "device", depths: Sequence[int] | None = None,
                 prefix_cache=None):
        """``depths``: the draft depths steps of one generation may use (``--spec-k auto``); None = one depth per
        generation (the first draft()'s K), the single-depth traces "verify" / "commit"."""
        mechanism = tt_mechanism(mechanism)
        if drafter is None:
            raise ValueError("TTSpecBackend needs a drafter: the device MTP (models/qwen36/tt/spec/mtp_drafter.py) or a "
                             "host callable (history, k) -> k draft ids")
        self.gen, self.model, self.state = gen, gen.model, gen.state
        self.prefix_cache = prefix_cache  # qwen36.prefix_cache.PrefixCache (tt/runtime/prefix.py; the MTP prefill is redone)
        self.last_prefill = None  # tt/runtime/prefix.py TTPrefillResult of the last prompt (tokens reused, its lease)
        self.ttnn, self.mesh = gen.ttnn, gen.mesh
        self.mechanism, self.drafter, self.use_trace, self.rng = mechanism, drafter, use_trace, rng
        self.device_drafter = hasattr(drafter, "device_draft")
        self.label = f"tt ({gen.label or 'mesh'})" + ("" if self.device_drafter else " + host drafter")
        self.counters = MechanismCounters()
        self.params = SamplingParams()
        self._first_logprobs: TokenLogprobs | None = None  # the join token's, when the params ask for logprobs
        self.step_state: SpecDeviceState | None = None
        self.acceptor: DeviceAcceptor | None = None
        self.history: list[int] = []
        self.n = 0  # host mirror of the device position (bookkeeping / max_len checks only)
        self._k = None
        self._phase = "idle"  # idle -> drafted -> verified -> accepted
        self._vout: VerifyOutputs | None = None
        self._result = None
        self._traces = StepTraces(self.ttnn, self.mesh, warmup_steps=1)  # "verify" and "commit"
        self._host_gen: torch.Generator | None = None
        self.depths: tuple[int, ...] | None = None
        if depths is not None:
            self.depths = tuple(sorted(set(int(d) for d in depths)))
            if not self.depths:
                raise ValueError("depths must name at least one draft depth")
            for d in self.depths:
                check_verify_shape(self.model.args, d)
        self._by_k: dict[int, _DepthBuffers] = {}
        self._next_k: int | None = None  # depth of the drafts now on device (made by the last commit)
        self._planned_k: int | None = None  # plan_next_depths() of the open step

    @property
    def phase(self) -> str:
        """Where the open step stands: idle -> drafted -> verified -> accepted (-> idle after commit or abort)."""
        return self._phase

    @property
    def depth(self) -> int | None:
        """K of the open (or last) step; None before the first draft of a generation."""
        return self._k

    @property
    def next_depth(self) -> int | None:
        """K of the drafts already on device for the next step (made inside the last commit); None before it."""
        return self._next_k

    @property
    def traces(self) -> StepTraces:
        """The captured verify / commit traces (per depth), read-only for callers counting captures."""
        return self._traces

    @property
    def config(self):
        return self.model.args.cfg

    # ---- setup -----------------------------------------------------------------------------------------
    def release(self) -> None:
        self._traces.release()

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

    def _setup_depths(self, k_first: int) -> None:
        """Allocate every depth's buffers over one shared device state, compile them, start at k_first."""
        self.release()
        v = self.model.args.cfg.vocab_size
        self._by_k = {}
        shared: _DepthBuffers | None = None
        for d in self.depths:
            # one penalty context (token counts) for every depth: a step reads what every earlier step committed
            acc = DeviceAcceptor(self.ttnn, self.mesh, k=d, vocab=v, sampling_params=self.params, rng=self.rng,
                                 ring_heads=self.model.args.gdn_hv_d,
                                 token_counts=shared.acceptor.token_counts if shared is not None else None)
            if shared is not None:
                acc.uniforms = shared.acceptor.uniforms  # one acceptance RNG stream whatever the depth
            acc.allocate()
            st = SpecDeviceState(self.model, self.state, d, self.mechanism,
                                 shared=shared.step_state if shared is not None else None)
            st.attach_acceptor(acc)
            self._by_k[d] = _DepthBuffers(acc, st)
            shared = shared or self._by_k[d]
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
                self.drafter.device_chain(d)
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

    def _name(self, what: str, k: int) -> str:
        return what if self.depths is None else f"{what}:{k}"

    def _run(self, name: str, fn: Callable[[], Any]):
        """Eager on the first step after setup, captured on the second, replayed afterwards."""
        return self._traces.run(name, fn, traced=self.use_trace)

    def _verify_and_accept(self):
        vout = self.step_state.verify()
        if self.params.greedy:
            res = self.acceptor.greedy(vout.out.logits, self.step_state.drafts)
        else:
            probs = self.drafter.draft_probs(self.acceptor) if self.device_drafter else None
            res = self.acceptor.stochastic(vout.out.logits, self.step_state.drafts, probs)
        return vout, res

    def verify(self, draft) -> VerifyOutputs:
        if self._phase != "drafted":
            raise RuntimeError("verify() needs exactly one draft() before it")
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
        toks, a = self.acceptor.read_result(self._result)  # the one readback: tokens + count
        lps = self.acceptor.read_logprobs(toks[: a + 1]) if self.params.logprobs is not None else None  # (+ asked)
        self._phase = "accepted"
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
                self._run(f"chain:{k2}", lambda: self.drafter.device_chain(k2))
            self._next_k, self._planned_k = k2, None
        self.mechanism.count_commit(c, self._k + 1, n_gdn, self.step_state.state_bytes)
        c.steps += 1
        self.n += a + 1
        self.history += acceptance.tokens
        self._traces.step_done()
        self._phase = "idle"

    def abort(self) -> None:
        if self._phase == "idle":
            raise RuntimeError("abort() outside a step")
        if self._phase in ("verified", "accepted"):
            abort_after_verify(self.step_state)  # shadow_commit refuses here (see mechanisms.ShadowCommit)
            if not self.params.greedy:
                # the acceptor advanced its RNG row counter on device; step back one row
                self.acceptor.uniforms.step_back()
        self.counters.aborts += 1
        self._planned_k = None
        self._phase = "idle"

    def release_prefix(self) -> None:
        """The request is over: drop its references to cached prefix blocks."""
        if self.last_prefill is not None and self.last_prefill.lease is not None:
            self.last_prefill.lease.release()

    def close(self) -> None:
        self.release_prefix()
        self.release()
