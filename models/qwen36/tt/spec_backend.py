"""TTSpecBackend: the speculative engine's SpecBackend on the TT target.

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
``tt/mtp_drafter.py``; runs inside trace B and writes ``step_state.drafts``) or a host callable
``(history: list[int], k) -> list[int]`` (written into the drafts buffer with copy_host_to_device_tensor before the
verify replay). Capture and replay go through ``tt/trace.py``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..speculative.engine import Acceptance, MechanismCounters
from ..speculative.mechanisms import DEFAULT_MECHANISM
from ..speculative.sampling import SamplingParams, TokenHistory, pick_token, token_logprobs
from .accept import DeviceAcceptor
from .commit import abort_after_verify, commit
from .generator import TTGenerator
from .mechanisms import TTMechanism, tt_mechanism
from .trace import StepTraces
from .verify import SpecDeviceState, VerifyOutputs


class TTSpecBackend:
    def __init__(self, gen: TTGenerator, mechanism: str | TTMechanism = DEFAULT_MECHANISM, drafter: Any = None,
                 use_trace: bool = True, rng: str = "device"):
        mechanism = tt_mechanism(mechanism)
        if drafter is None:
            raise ValueError("TTSpecBackend needs a drafter: the device MTP (models/qwen36/tt/mtp_drafter.py) or a "
                             "host callable (history, k) -> k draft ids")
        self.gen, self.model, self.state = gen, gen.model, gen.state
        self.ttnn, self.mesh = gen.ttnn, gen.mesh
        self.mechanism, self.drafter, self.use_trace, self.rng = mechanism, drafter, use_trace, rng
        self.device_drafter = hasattr(drafter, "device_draft")
        self.label = f"tt ({gen.label or 'mesh'})" + ("" if self.device_drafter else " + host drafter")
        self.counters = MechanismCounters()
        self.params = SamplingParams()
        self.first_logprobs = None  # the prefill token's TokenLogprobs when the params ask for logprobs
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

    # ---- the contract --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        self.release()
        self.params = params
        self._host_gen = params.generator(torch.device("cpu"))
        self.gen.reset()  # releases the plain-decode trace, zeroes state
        hs: list = [] if self.device_drafter else None
        logits = self.model.prefill_forward(torch.tensor(list(prompt)), self.state, hidden_out=hs)[-1]
        self.prefill_logits = logits  # host fp32 [V]: the last prompt row (the vllm-tt contract returns it)
        first = int(pick_token(logits.reshape(1, -1), params, self._host_gen,
                               TokenHistory(prompt, self.config.vocab_size).now()))
        self._prompt_len = len(prompt)
        self.first_logprobs = token_logprobs(logits, first, params.logprobs) if params.logprobs is not None else None
        self._prompt_hidden = None
        if hs:
            self._prompt_hidden = hs[0] if len(hs) == 1 else self.ttnn.concat(hs, dim=2)
        self.n = len(prompt)
        self.history = list(prompt) + [first]
        self.step_state, self.acceptor, self._k = None, None, None
        self._phase = "idle"
        return first

    def draft(self, k: int):
        if not self.history:
            raise RuntimeError("draft() before prefill()")
        if self._phase != "idle":
            raise RuntimeError("draft() inside an open step: commit() or abort() first")
        if self.n + k + 1 > self.model.args.max_seq_len:
            raise ValueError(f"KV cache full: position {self.n} + {k + 1} rows > max_seq_len {self.model.args.max_seq_len}")
        if self._k is not None and k != self._k:
            # the next step's drafts were made inside the last commit trace at depth self._k, and the ring slots,
            # acceptor and draft buffers are per-K: a new K needs a new generation (prefill) on this backend
            raise ValueError(f"draft depth changed from {self._k} to {k} within one generation; the TT step keeps "
                             "one K per generation (prefill again to change it)")
        if k != self._k:
            self._setup(k)
        if not self.device_drafter:
            self.step_state.write_drafts([int(t) for t in self.drafter(list(self.history), k)])
        self._phase = "drafted"
        self.counters.mtp_forwards += k
        return self.step_state.drafts

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
        self._vout, self._result = self._run("verify", self._verify_and_accept)
        self._phase = "verified"
        c, n_gdn, t = self.counters, len(self.state.gdn_states()), self._k + 1
        c.target_forwards += 1
        c.recurrence_steps += t * n_gdn
        self.mechanism.count_verify(c, t, n_gdn, self.step_state.state_bytes)
        return self._vout

    def accept(self, draft, verify) -> Acceptance:
        if self._phase != "verified":
            raise RuntimeError("accept() needs verify() first")
        toks, a = self.acceptor.read_result(self._result)  # the one readback: tokens + count
        lps = self.acceptor.read_logprobs(toks[: a + 1]) if self.params.logprobs is not None else None  # (+ asked)
        self._phase = "accepted"
        return Acceptance(a, toks[: a + 1], lps)

    def _commit_device(self):
        if self.device_drafter:  # reads n before the commit advances it
            self.drafter.device_draft(self.step_state, self._vout)
        commit(self.step_state, self._vout, self._result)
        if self.params.penalized:
            self.acceptor.commit_counts()  # the token counts are part of the state transaction
        return None

    def commit(self, acceptance: Acceptance) -> None:
        if self._phase != "accepted":
            raise RuntimeError("commit() needs accept() first")
        if self.device_drafter:
            self.drafter.before_device_draft()  # outside capture: sampled-draft RNG table refill when used up
        self._run("commit", self._commit_device)
        a, c, n_gdn = acceptance.num_accepted, self.counters, len(self.state.gdn_states())
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
        self._phase = "idle"

    def close(self) -> None:
        self.release()
