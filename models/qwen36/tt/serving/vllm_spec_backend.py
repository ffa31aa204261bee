"""The vllm-tt adapter's speculative backend: :class:`TTSpecBackend` with the joins and the capped greedy acceptance
the plugin's deferred-slot contract needs (one sequence)."""
from __future__ import annotations

import torch

from ...speculative.sampling import SamplingParams
from ..spec.spec_backend import TTSpecBackend


class _VllmSpecBackend(TTSpecBackend):
    """TTSpecBackend whose join replaces the last sequence (the prompt's last-row logits, which the vllm-tt
    contract returns, are its ``prefill_logits``) and whose greedy acceptor reads a separate draft buffer
    (``accept_drafts``) in which the placeholder columns of a short row hold an id no argmax equals, so acceptance
    stops at ``num_valid_drafts`` like vLLM's host walk."""

    _accept_bufs: dict = {}

    @property
    def accept_drafts(self):
        return self._accept_bufs[self._k]

    def join(self, slot: int, prompt, params: SamplingParams = SamplingParams()) -> int:
        """A new sequence replaces the last one (this path has one sequence slot and no explicit leave)."""
        if self.history:
            self._phase = "idle"  # an outstanding proposal belonged to the replaced sequence
            self.leave(slot)
        return super().join(slot, prompt, params)

    def _alloc_accept_drafts(self, ks) -> None:
        ttnn = self.ttnn
        self._accept_bufs = {k: ttnn.from_torch(torch.zeros(1, 1, 1, k, dtype=torch.int32), dtype=ttnn.uint32,
                                                layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                                                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
                             for k in ks}

    def _setup(self, k: int) -> None:
        super()._setup(k)
        self._alloc_accept_drafts([k])

    def _setup_depths(self, k_first: int) -> None:
        self.release()  # before allocating: no trace may be live
        self._alloc_accept_drafts(self.depths)
        super()._setup_depths(k_first)

    def write_accept_drafts(self, ids: list[int]) -> None:
        x = torch.tensor(ids, dtype=torch.int32).reshape(1, 1, 1, self._k)
        self.ttnn.copy_host_to_device_tensor(self.step_state.host(x, self.accept_drafts), self.accept_drafts)

    def _verify_and_accept(self):
        if not self.params.greedy:
            raise NotImplementedError("the vllm path verifies greedily (accept mode argmax_ids)")
        vout = self.step_state.verify()
        return vout, self.acceptor.greedy(vout.out.logits, self.accept_drafts)
