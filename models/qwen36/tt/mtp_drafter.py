"""The device drafter of the TT speculative step: the MTP head (tt/mtp.py) driven inside the commit trace, with
argmax or sampled draft picks (tt/sampler.py)."""
from __future__ import annotations

import torch

from .mtp import load_tt_mtp
from .sampler import SampledDraftPick, argmax_pick
from .verify import SpecDeviceState


class TTMTPDrafter:
    """Device drafter: the TT MTP head (models/qwen36/tt/mtp.py). Reseed over the K+1 verify rows (tokens = the
    acceptor's result, hidden = the verify's post-norm rows), select row a, chain K-1 drafts: all inside the
    commit trace, writing the drafts buffer the next verify reads.

    Draft choice follows the run's SamplingParams: greedy (temperature 0) or ``draft="greedy"`` -> argmax drafts
    (one-hot draft distribution for stochastic acceptance); temperature > 0 with ``draft="sample"`` (the
    default) -> :class:`SampledDraftPick`: each draft drawn on device from the acceptor's own transform of the
    MTP logits, uniforms from a seeded table (seed = the run's seed, an independent stream from the acceptor's),
    and the draft distributions handed to ``DeviceAcceptor.stochastic``."""

    def __init__(self, reader, cache_dir=None):
        self.reader, self.cache_dir = reader, cache_dir
        self.head = None
        self._k = None
        self.sampler = None  # SampledDraftPick when drafts are sampled

    def allocate(self, step_state: SpecDeviceState) -> None:
        ttnn, mesh, k = step_state.ttnn, step_state.mesh, step_state.k
        if self.head is None or self._k != k:
            self.head = load_tt_mtp(step_state.model, self.reader, k, cache_dir=self.cache_dir)
            self._k = k
        step_state.drafts = self.head.draft_tokens  # the verify reads the MTP's persistent draft buffer
        acc = step_state.acceptor
        if acc is not None and acc.params.sampled_drafts:
            probs_fn = acc.probs_from_logits
            if acc.params.penalized:  # drafts use the committed counts (their own chain is not added)
                probs_fn = lambda logits: acc.probs_from_logits(logits, acc.draft_penalties())  # noqa: E731
            self.sampler = SampledDraftPick(ttnn, mesh, k, acc.vocab, probs_fn, seed=acc.seed,
                                            rng=acc.rng).allocate()
            self.head.pick = self.sampler
        else:
            self.sampler = None
            self.head.pick = argmax_pick(ttnn)
        self.pos = ttnn.from_torch(torch.zeros(1, dtype=torch.int32), dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT,
                                   device=mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))

    def start(self, step_state: SpecDeviceState, history: list[int], prompt_hidden) -> None:
        """After the prompt: MTP prefill over rows t = 0..P-1 (x_{t+1}, h_t), then the first chain."""
        nxt = torch.tensor(history[1:])
        self.before_device_draft()
        self.head.prefill_draft(nxt, prompt_hidden)

    def before_device_draft(self) -> None:
        """Host side, outside any capture, before every chain execution (eager or replayed)."""
        if self.sampler is not None:
            self.sampler.before_chain()

    def device_draft(self, step_state: SpecDeviceState, vout) -> None:
        ttnn = step_state.ttnn
        pos = ttnn.to_layout(ttnn.reshape(ttnn.typecast(step_state.n, ttnn.int32), [1]), ttnn.ROW_MAJOR_LAYOUT)
        ttnn.copy(pos, self.pos)
        self.head.draft(step_state.acceptor.result, vout.out.hidden, self.pos, step_state.acceptor.count)

    def draft_probs(self, acceptor):
        """[1, 1, K, V] fp32 draft distributions (persistent) for sampled drafts; None = one-hot (argmax drafts)."""
        return self.sampler.draft_probs if self.sampler is not None else None
