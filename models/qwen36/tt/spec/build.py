"""The one builder of the TT speculative backend: what the command line, chat, the probes, the vLLM class and the tests
call to get a :class:`~.spec_backend.TTSpecBackend` for ``users`` users on a generator's model.

    gen = build_generator(ckpt, device, precision=..., max_len=..., require_mtp=True)   # tt/runtime/generator.py
    backend = build_spec_backend(gen, TTMTPDrafter(reader), users=B, depth=K, mechanism=..., params=...)

One user runs the one-user layout (device rows; ``depth`` a fixed K, chosen at the first draft, or a depth
controller whose depths each get their traces); several run the B-slot layout (host rows) over the fewest slots whose
packed verify the core grid lays out (``host_rows.verify_slots``), every user verifying K+1 rows per step with the
shared ``params`` (seeds aside) or, with ``per_user``, each its own (the acceptor then holds their stages)."""
from __future__ import annotations

from typing import Any, Sequence

from loguru import logger

from ...generation.sampling import SamplingParams
from ...speculative.mechanisms import DEFAULT_MECHANISM
from ..runtime.generator import TTGenerator
from ..runtime.sampler_transform import SamplerStages
from .host_rows import BatchSpecError, verify_slots
from .spec_backend import TTSpecBackend


def check_spec_request(users: int, depth: Any = None, per_user: Sequence[SamplingParams] | None = None,
                       device_drafter: bool = True) -> int:
    """What :func:`build_spec_backend` refuses, checked before anything loads: several users need one fixed K (the
    B-slot layout verifies K+1 rows for every user), a slot count whose packed verify the core grid lays out, and
    argmax drafts from the device MTP when each user has its own params. Returns the slot count."""
    if users == 1:
        return 1
    if not isinstance(depth, int):
        raise BatchSpecError(f"{users} users on the TT B-slot layout verify one fixed K for every user: pass an integer "
                             f"depth (--spec-k K), got {depth!r}")
    if per_user is not None and device_drafter:
        odd = next((i for i, p in enumerate(per_user) if p.sampled_drafts), None)
        if odd is not None:
            raise BatchSpecError(f"user {odd} ({per_user[odd].describe()}): per-user settings in a TT speculative "
                                 f"batch draft by argmax on the device MTP chain; pass --draft greedy (draft='greedy')")
    return verify_slots(users, depth)


def build_spec_backend(gen: TTGenerator, drafter: Any, *, users: int = 1, depth: Any = None,
                       mechanism: str = DEFAULT_MECHANISM, params: SamplingParams | None = None,
                       per_user: Sequence[SamplingParams] | None = None, prefix_cache=None,
                       capped_accept: bool = False, use_trace: bool = True) -> TTSpecBackend:
    """The backend for ``users`` users on ``gen`` (module doc). ``drafter``: the device MTP (``TTMTPDrafter``) or a
    host callable ``(history, k) -> k ids``. ``depth``: one user: None or an int K (one depth per generation, picked
    at its first draft) or a depth controller (``.depths``: per-step depths); several users: the int K every user's
    verify holds. ``prefix_cache``: joins resume from cached blocks. ``capped_accept``: one user, the caller's drafts
    (the vLLM verify)."""
    if users == 1:
        depths = None if depth is None or isinstance(depth, int) else tuple(depth.depths)
        return TTSpecBackend(gen, mechanism, drafter=drafter, use_trace=use_trace, depths=depths,
                             prefix_cache=prefix_cache, capped_accept=capped_accept)
    slots = check_spec_request(users, depth, per_user, device_drafter=hasattr(drafter, "for_slots"))
    if slots != users:
        logger.info(f"{users} users at K={depth}: {slots} slots ({slots * (depth + 1)} verify rows; the verify's core "
                    f"grid takes whole rows of 8 above 8 rows), {slots - users} of them free and inert")
    if per_user is not None:
        return TTSpecBackend(gen, mechanism, drafter=drafter, use_trace=use_trace, prefix_cache=prefix_cache,
                             slots=slots, k=depth, rows="host",
                             stages=SamplerStages.of(list(per_user), gen.config.vocab_size))
    return TTSpecBackend(gen, mechanism, drafter=drafter, use_trace=use_trace, prefix_cache=prefix_cache, slots=slots,
                         k=depth, rows="host", params=params if params is not None else SamplingParams())
