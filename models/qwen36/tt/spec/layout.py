"""What the two step layouts of :class:`~.spec_backend.TTSpecBackend` share (tt/spec/device_rows.py: one user, the
row inputs derived on device; tt/spec/host_slots.py: B slots, the row inputs written by the host): the
generator's model, the commit mechanism, the drafter, the counters, the step traces, the phase of the open step, and
the state views tests and probes read between steps. A layout implements the engine's protocol for its rows
(``speculative.engine.SpecBackend``); the backend picks one at construction and hands every call to it."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...speculative.engine import MechanismCounters
from ..runtime.generator import TTGenerator
from ..runtime.trace import StepTraces
from .mechanisms import TTMechanism
from .verify import VerifyOutputs


class StepLayout:
    """The shared half of a step layout (module doc). Subclasses set ``slots``, ``state``, ``step_state``,
    ``acceptor`` and ``verify_width`` (K of the last verify), and implement the protocol."""

    slots: int
    verify_width: int | None

    def __init__(self, gen: TTGenerator, mechanism: TTMechanism, drafter: Any, use_trace: bool, device_drafter: bool):
        self.gen, self.model = gen, gen.model
        self.ttnn, self.mesh = gen.ttnn, gen.mesh
        self.mechanism, self.drafter, self.use_trace = mechanism, drafter, use_trace
        self.device_drafter = device_drafter
        self.label = f"tt ({gen.label or 'mesh'})" + ("" if device_drafter else " + host drafter")
        self.counters = MechanismCounters()
        self._traces = StepTraces(self.ttnn, self.mesh, warmup_steps=1)
        self._phase = "idle"  # idle -> drafted -> verified -> accepted
        self._vout: VerifyOutputs | None = None
        self._result = None

    @property
    def phase(self) -> str:
        """Where the open step stands: idle -> drafted -> verified -> accepted (-> idle after commit or abort)."""
        return self._phase

    @property
    def traces(self) -> StepTraces:
        """The captured step traces, read-only for callers counting captures."""
        return self._traces

    @property
    def captures(self) -> int:
        """Trace captures so far."""
        return sum(self._traces.captures.values())

    @property
    def config(self):
        return self.model.args.cfg

    def _check_idle(self, what: str) -> None:
        if self._phase != "idle":
            raise RuntimeError(f"{what} inside an open step: commit() or abort() first")

    def _traced(self, name: str, fn: Callable[[], Any]):
        """Eager on the first step after setup, captured on the second, replayed afterwards."""
        return self._traces.run(name, fn, traced=self.use_trace)

    def close(self) -> None:
        self.release_prefix()
        self.release()

    # ---- state views (tests and probes; between steps) --------------------------------------------------------
    def verify_logits(self) -> torch.Tensor:
        """Host copy of the last verify's logits, fp32 [B, K+1, V] (tests; not part of a step)."""
        if self._vout is None:
            raise RuntimeError("no verify has run")
        k = self.verify_width
        return self.model.to_host(self._vout.out.logits).float().reshape(self.slots, k + 1, -1)

    def committed_gdn(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of user ``slot``'s committed GDN state per GDN layer: (recurrent [Hv, Dk, Dv] per device
        concatenated over the mesh, conv [K-1, Cd] likewise). Ring: read through the ring index. Between steps."""
        self._check_idle("committed_gdn()")
        self._check_user_slot(slot)
        ttnn, a = self.ttnn, self.model.args
        hv = a.gdn_hv_d
        out = []
        idx = None
        if self.mechanism.ring:
            idx = [ttnn.to_torch(x).reshape(-1).to(torch.int64) for x in ttnn.get_device_tensors(self.acceptor.block_idx)]
        for s in self.state.gdn_states():
            if self.mechanism.ring:
                ring = self.step_state.layer_bufs[id(s)].ring
                recs = [ttnn.to_torch(x)[i[slot * hv:(slot + 1) * hv]] for x, i in zip(ttnn.get_device_tensors(ring), idx)]
            else:
                recs = [ttnn.to_torch(x)[slot * hv:(slot + 1) * hv] for x in ttnn.get_device_tensors(s.recurrent)]
            convs = [ttnn.to_torch(x)[slot, 0] for x in ttnn.get_device_tensors(s.conv)]
            out.append((torch.cat([r.float() for r in recs], 0), torch.cat([c.float() for c in convs], -1)))
        return out

    def _check_user_slot(self, slot: int) -> None:
        """Refuse a slot the layout does not have (committed_gdn)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot}: this backend has slots 0..{self.slots - 1}")
