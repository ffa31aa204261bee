"""The B-slot layout's pieces of :class:`~.spec_backend.TTSpecBackend` (host rows): its error, its users and draft
handle, the slot count a packed verify can lay out, the sampled-draft check, its step state (:class:`HostRowsState`)
and the row inputs the host writes before each step (docs/tt_spec.md, "The step (B slots)")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ...errors import UserError
from ...generation.sampling import SamplingParams, TokenLogprobs
from ..model.gdn import TILE_ROWS
from ..model.model_config import user_core_grid
from ..runtime.sampler_transform import SamplerStages
from .verify import SpecDeviceState


class BatchSpecError(UserError, ValueError):
    """A request for B user slots (host rows) this backend cannot serve (named in the message)."""


@dataclass
class SlotUser:
    """A user of the B-slot layout."""

    params: SamplingParams
    history: list[int]  # prompt + every emitted token; the last one is pending
    first_logprobs: TokenLogprobs | None
    prompt_len: int = 0
    host_gen: torch.Generator | None = None  # the host picks' stream (the join's token, then a forced phrase's next)


@dataclass
class BatchDraft:
    """The draft handle of the B-slot layout."""

    depths: dict[int, int]  # slot -> k_b
    drafts: dict[int, list[int]] | None  # slot -> d_1..d_{k_b} (host drafter); None: the drafts live on device only


def verify_slots(users: int, k: int) -> int:
    """The fewest slots >= ``users`` whose packed verify (slots x (K+1) rows) the decode path can lay out: at most
    ``TILE_ROWS`` rows, and above one row of user cores whole rows of them (``model_config.user_core_grid``). The
    slots past ``users`` stay free (their rows inert). Raises :class:`BatchSpecError` when no slot count fits."""
    for slots in range(max(users, 1), TILE_ROWS // (k + 1) + 1):
        try:
            user_core_grid(slots * (k + 1))
        except ValueError:
            continue
        return slots
    raise BatchSpecError(f"{users} users x (K+1 = {k + 1}) verify rows: the decode-path attention takes at most "
                         f"{TILE_ROWS} rows (one per core, whole rows of 8 cores above 8); use fewer prompts or a "
                         f"smaller --spec-k")


def is_packed_device_drafter(drafter) -> bool:
    return all(hasattr(drafter, m) for m in ("allocate", "join", "write_inputs", "device_chain", "device_reseed"))


def check_drafts(device_drafter: bool, params: SamplingParams, stages: SamplerStages | None,
                 slot: int | None = None) -> None:
    """Refuse sampled device drafts the packed MTP chain cannot draw (per-user params, or penalties)."""
    if not (device_drafter and params.sampled_drafts):
        return
    who = "" if slot is None else f"slot {slot}: "
    if stages is not None:
        raise BatchSpecError(f"{who}per-user params draft by argmax on the device drafter; pass draft='greedy'")
    if params.penalized:
        raise BatchSpecError(f"{who}penalties with sampled device drafts are not supported in a batch; pass "
                             "draft='greedy'")


class HostRowsState(SpecDeviceState):
    """The step state of B user slots (``users``): the verify's row inputs are persistent buffers the host writes
    before each step (B users x T rows; -1 = an inert row), with the GDN row mask and the step's active flags;
    positions and pending tokens are inputs of each step, not device state (tt/spec/verify.py module doc)."""

    @staticmethod
    def _check_users(users: int) -> None:
        if not isinstance(users, int) or users < 1:
            raise ValueError(f"users must be an int >= 1, got {users!r}")

    def allocate(self) -> None:
        """The row-input buffers the host writes per step (B users x T rows; -1 = an inert row), the row mask, the
        step's active flags, the per-user conv commit rows and the B-slot mechanism buffers."""
        ttnn, t, kc, b, a = self.ttnn, self.t, self.kc, self.users, self.model.args
        rm, i32 = ttnn.ROW_MAJOR_LAYOUT, torch.int32
        heads, pages = a.hkv_d, int(self.state.page_table.shape[-1])
        self.tokens = self._dev(torch.zeros(1, b * t, dtype=i32), ttnn.uint32, rm)
        self.rope_idx = self._dev(torch.zeros(1, b * t, dtype=i32), ttnn.uint32, rm)
        self.phys_rows = self._dev(torch.full((1, b * t), -1, dtype=i32), ttnn.int32, rm)
        self.bounds = self._dev(torch.full((b * heads * t,), -1, dtype=i32), ttnn.int32, rm)
        self.head_page_table = self._dev(torch.zeros(b * heads, pages, dtype=i32), ttnn.int32, rm)
        self.drafts = self._dev(torch.zeros(1, b, 1, self.k, dtype=i32), ttnn.uint32, rm)
        self.row_mask = self._dev(torch.zeros(b, t, 1))
        self.active = self._dev(torch.zeros(1, b, 1, 1))
        self.c_zero = self._dev(torch.zeros(1, b, 1, 1))
        self.c_rows = self._dev(torch.arange(t, dtype=torch.float32).reshape(1, t, 1))
        # conv commit: user b's new state row i = window row b*(Kc-1+T) + 1 + i + a_b of the [B*(Kc-1+T), Cd] table
        base = torch.arange(b)[:, None] * (kc - 1 + t) + torch.arange(1, kc)[None, :]
        self.c_conv_rows = self._dev(base.to(torch.float32).reshape(1, b, 1, kc - 1))
        for s in self.state.gdn_states():
            self.layer_bufs[id(s)] = self.mechanism.buffers(self, s)
        for layer in self.model.layers:
            if hasattr(layer.mixer, "prepare_batch_verify"):
                layer.mixer.prepare_batch_verify(b, t)


    def write(self, name: str, host: torch.Tensor) -> None:
        """Host rows: write one of the step's row-input buffers (between replays)."""
        buf = getattr(self, name)
        self.ttnn.copy_host_to_device_tensor(self.host(host, buf), buf)

    def start(self, n: int = 0, pending: int = 0) -> None:
        """The mechanism's start only (ring: every slot's live state into ring slot 0); eager, outside any capture."""
        self.mechanism.start(self)

    def verify_rows(self):
        """The buffers the host wrote (B*T rows, B*G heads; the shapes of :meth:`SpecDeviceState.verify_rows`)."""
        return self.tokens, self.rope_idx, self.bounds, self.phys_rows, self.head_page_table

    def commit_selection(self):
        """Per user: a_b = count_b for the users in the step, -1 for the others (conv rows 0.. unchanged, nothing
        re-advanced; count_b zeroed so the ring points the user at slot 0, its unchanged state)."""
        ttnn, b, acc = self.ttnn, self.users, self.acceptor
        ttnn.copy(ttnn.multiply(acc.count, self.active), acc.count)  # 0 for slots outside the step (ring slot 0)
        a_B111 = ttnn.add(acc.count, ttnn.subtract(self.active, 1.0))
        idx = ttnn.typecast(ttnn.add(self.c_conv_rows, a_B111), ttnn.uint32)  # [1, B, 1, Kc-1]
        idx = ttnn.reshape(ttnn.to_layout(idx, ttnn.ROW_MAJOR_LAYOUT), [1, b * (self.kc - 1)])
        mask = ttnn.le(self.c_rows, ttnn.reshape(a_B111, [b, 1, 1])) if self.mechanism.readvance else None
        return idx, mask

    def advance(self, result) -> None:
        """Nothing on device: positions and pending tokens are the host's inputs of the next step."""


def write_host_rows(st: HostRowsState, args, page_table_host: torch.Tensor, positions: Sequence[int],
                    users: Mapping[int, SlotUser], slots: int, k: int, vocab: int, depths: Mapping[int, int],
                    drafts: Mapping[int, list[int]] | None) -> None:
    """The step's row inputs into the persistent buffers of ``st`` (between replays): user s's rows from its position
    ``positions[s]``, inert rows past its k_b and for every slot outside the step (docs/tt_spec.md, "The step (B
    slots)", its paragraph "Rows"). ``drafts`` None: the device drafter's chain writes the token rows and the
    acceptor's drafts on device."""
    b, t = slots, k + 1
    heads, bs, last = args.hkv_d, args.block_size, args.max_seq_len - 1
    pt = page_table_host
    tokens = torch.zeros(b, t, dtype=torch.int32)
    rope = torch.zeros(b, t, dtype=torch.int32)
    phys = torch.full((b, t), -1, dtype=torch.int32)
    bounds = torch.full((b, heads, t), -1, dtype=torch.int32)
    acc_drafts = torch.full((1, b, 1, k), vocab, dtype=torch.int32)  # id V: never accepted
    mask = torch.zeros(b, t, 1)
    active = torch.zeros(1, b, 1, 1)
    for s, kb in depths.items():
        n = positions[s]
        pos = [min(n + j, last) for j in range(t)]
        if drafts is not None:
            real = [users[s].history[-1]] + drafts[s]
            tokens[s, : kb + 1] = torch.tensor(real, dtype=torch.int32)
            acc_drafts[0, s, 0, :kb] = torch.tensor(drafts[s], dtype=torch.int32)
        rope[s] = torch.tensor(pos, dtype=torch.int32)
        for j in range(kb + 1):
            phys[s, j] = int(pt[s, pos[j] // bs]) * bs + pos[j] % bs
        bounds[s] = torch.tensor(pos, dtype=torch.int32)[None, :]
        mask[s, : kb + 1] = 1.0
        active[0, s] = 1.0
    if drafts is not None:
        st.write("tokens", tokens.reshape(1, b * t))
        st.write("drafts", acc_drafts)
    st.write("rope_idx", rope.reshape(1, b * t))
    st.write("phys_rows", phys.reshape(1, b * t))
    st.write("bounds", bounds.reshape(-1))
    st.write("row_mask", mask)
    st.write("active", active)
