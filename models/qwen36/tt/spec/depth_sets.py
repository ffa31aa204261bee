"""Per-step draft depths of the one-user layout (``TTSpecBackend(depths=...)``, ``--spec-k auto``): every depth has its
own acceptor, drafts buffer, row constants, MTP head view and (shadow_commit) ring, all views of ONE device state
(position, pending token, KV caches, conv windows, live GDN state, the MTP KV cache, the acceptance RNG stream and the
penalty token counts are shared), allocated at the first step of a generation. The traces per depth and the switch
between depths: docs/depth.md and docs/tt_spec.md ("The step (one user)")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...generation.sampling import SamplingParams
from .accept import DeviceAcceptor
from .mechanisms import TTMechanism
from .verify import SpecDeviceState


@dataclass
class DepthBuffers:
    """The per-depth objects of one generation (views of the one device state)."""

    acceptor: DeviceAcceptor
    step_state: SpecDeviceState


def allocate_depth_set(ttnn, mesh, model, state, mechanism: TTMechanism, params: SamplingParams, rng: str,
                       depths: Sequence[int]) -> dict[int, DepthBuffers]:
    """Every depth's acceptor and step state over the one device state (``state``): one penalty context and one
    acceptance RNG stream for all depths; the first depth's buffers are the ones the others share."""
    v = model.args.cfg.vocab_size
    by_k: dict[int, DepthBuffers] = {}
    shared: DepthBuffers | None = None
    for d in depths:
        # one penalty context (token counts) for every depth: a step reads what every earlier step committed
        acc = DeviceAcceptor(ttnn, mesh, k=d, vocab=v, sampling_params=params, rng=rng,
                             ring_heads=model.args.gdn_hv_d,
                             token_counts=shared.acceptor.token_counts if shared is not None else None)
        if shared is not None:
            acc.uniforms = shared.acceptor.uniforms  # one acceptance RNG stream whatever the depth
        acc.allocate()
        st = SpecDeviceState(model, state, d, mechanism,
                             shared=shared.step_state if shared is not None else None)
        st.attach_acceptor(acc)
        by_k[d] = DepthBuffers(acc, st)
        shared = shared or by_k[d]
    return by_k
