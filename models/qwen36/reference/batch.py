"""Batched plain decoding on the reference model: B users, each in its own slot of one batch-B state.

    dec = SlotDecoder(model, slots=4, max_len=512)
    logits = dec.join(0, prompt_ids)        # prefill user 0 alone into slot 0 -> its last-row logits [V]
    logits = dec.step(next_tokens)          # one decode step of every active slot -> [slots, V]
    dec.leave(0)                            # slot 0 is free again (its state reset)

    results = generate(model, prompts, 32, params)   # plain decoding: ReferenceDecoder + generation.plain

Slot b is row b of every state tensor: the GDN recurrent and conv state, the KV caches (each user's rows at its
own absolute positions) and the position, which is per row (``state.pos`` is a LongTensor [slots]; the attention
layer takes per-row positions, so users of different lengths decode in one forward). A decode step runs all slots;
an inactive slot is inert: its GDN state and position are put back after the forward, and the KV row it wrote
sits at its own next position, where no query reads it and the next write replaces it. Users join (prefill writes
only their slot) and leave between steps without touching the others.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..generation.plain import HostPicks, Pick, PlainResult, plain_generate
from ..generation.sampling import SamplingParams
from ..prefix_cache import PrefixCache
from .model import ForwardOutput, Qwen36Model
from .prefix import PrefillResult, prefill as cached_prefill
from .state import GDNState, KVCache, ModelState, MTPState


def _promote(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, other.dtype))


class SlotDecoder:
    """Plain decode of up to ``slots`` users at once. ``max_len`` bounds every user's prompt + generated tokens."""

    def __init__(self, model: Qwen36Model, slots: int, max_len: int, prefix_cache: PrefixCache | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model = model
        self.slots = slots
        self.max_len = max_len
        self.device = model.embed_tokens.weight.device
        self.state = model.new_state(slots, max_len)
        self.state.pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.prefix_cache = prefix_cache
        self.prefills: dict[int, PrefillResult] = {}  # slot -> its user's prefill (tokens reused, the lease)

    def positions(self) -> list[int]:
        return self.state.pos.tolist()

    def _slot_view(self, slot: int) -> ModelState:
        """A batch-1 state for one slot: KV caches are views (writes land in the slot), GDN tensors copies."""
        layers = []
        for s in self.state.layers:
            if isinstance(s, KVCache):
                layers.append(KVCache(s.k[slot:slot + 1], s.v[slot:slot + 1]))
            else:
                layers.append(GDNState(s.recurrent[slot:slot + 1].clone(), s.conv[slot:slot + 1].clone()))
        return ModelState(layers, int(self.state.pos[slot]))

    def _fresh_slot(self, slot: int) -> ModelState:
        """The slot view a joining user starts from: GDN state zero, position 0, and the slot's KV rows zeroed.
        Zeroing KV matters: a batched step reads every row up to the longest user's position, and a key row a
        user has not written yet gets probability 0, but 0 * NaN is NaN, so garbage left by an earlier user (or
        anything else) must not stay there."""
        view = self._slot_view(slot)
        for v in view.layers:
            if isinstance(v, KVCache):
                v.k.zero_()
                v.v.zero_()
            else:
                v.recurrent, v.conv = torch.zeros_like(v.recurrent), torch.zeros_like(v.conv)
        view.pos = 0
        return view

    def _write_slot(self, slot: int, view: ModelState) -> None:
        """Publish a slot view's GDN state and position (by reassignment: no state tensor is changed in place)."""
        idx = torch.tensor([slot], device=self.device)
        for s, v in zip(self.state.layers, view.layers):
            if isinstance(s, GDNState):  # the recurrence returns fp64 state for an fp64 model: keep the wider type
                s.recurrent = _promote(s.recurrent, v.recurrent).index_copy(0, idx, _promote(v.recurrent, s.recurrent))
                s.conv = _promote(s.conv, v.conv).index_copy(0, idx, _promote(v.conv, s.conv))
        self.state.pos = self.state.pos.index_copy(0, idx, torch.tensor([view.pos], device=self.device))

    @torch.no_grad()
    def join(self, slot: int, prompt: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompt`` into the free ``slot`` (the batch-1 prefill, alone: no other slot is read or
        written). Returns the last prompt row's logits [V] fp32."""
        return self.prefill(slot, prompt).logits[0]

    @torch.no_grad()
    def prefill(self, slot: int, prompt: Sequence[int], mtp: MTPState | None = None) -> PrefillResult:
        """:meth:`join`, returning the prefill result (last-row logits, the post-norm hiddens the speculative
        backend seeds its MTP from, tokens reused / computed). With a prefix cache the slot resumes from the
        longest cached block boundary (``reference.prefix``); users sharing a prefix share its cached blocks, each
        held until the user leaves. ``mtp``: the slot's batch-1 MTP state view (its cached rows are restored)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        if bool(self.active[slot]):
            raise ValueError(f"slot {slot} is in use: leave() it first")
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_len {self.max_len}")
        view = self._fresh_slot(slot)
        res = cached_prefill(self.model, view, prompt, self.prefix_cache, mtp)
        self._write_slot(slot, view)
        self.active = self.active.index_fill(0, torch.tensor([slot], device=self.device), True)
        self.prefills[slot] = res
        return res

    def leave(self, slot: int) -> None:
        """Free ``slot``: its GDN state, position and KV rows are reset."""
        if not bool(self.active[slot]):
            raise ValueError(f"slot {slot} is not in use")
        self._write_slot(slot, self._fresh_slot(slot))
        self.active = self.active.index_fill(0, torch.tensor([slot], device=self.device), False)
        res = self.prefills.pop(slot, None)
        if res is not None and res.lease is not None:
            res.lease.release()  # its cached blocks may be evicted now (unless another user holds them)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: tokens [slots] int64 (any value in inactive slots) -> logits [slots, V] fp32 (rows of
        inactive slots are meaningless). Active slots advance one position; inactive ones are left as they were."""
        if not bool(self.active.any()):
            raise ValueError("step() with no active slot")
        if int(self.state.pos.max()) + 1 > self.max_len:
            raise ValueError(f"KV cache full: a slot is at position {int(self.state.pos.max())}, max_len {self.max_len}")
        before_gdn = [(s.recurrent, s.conv) for s in self.state.gdn_states()]  # free snapshot: GDN is reassigned
        before_pos = self.state.pos
        out = self.model(tokens.to(self.device).view(self.slots, 1), self.state)
        keep = self.active
        for s, (rec, conv) in zip(self.state.gdn_states(), before_gdn):
            s.recurrent = torch.where(keep[:, None, None, None], s.recurrent, rec)
            s.conv = torch.where(keep[:, None, None], s.conv, conv)
        self.state.pos = torch.where(keep, self.state.pos, before_pos)
        return out.logits[:, -1]


@torch.no_grad()
def packed_forward(model: Qwen36Model, state: ModelState, tokens: torch.Tensor, n_valid: torch.Tensor,
                   occupied: torch.Tensor) -> ForwardOutput:
    """One forward over rows of several users at once, each user's trailing rows masked inert.

    ``state`` is a batch-B state whose ``pos`` is a LongTensor [B] (user b's next position); ``tokens`` [B, T]:
    row b holds user b's rows at positions pos[b]..pos[b]+T-1, of which only the first ``n_valid[b]`` are real
    (0 <= n_valid[b] <= T; 0 = the user takes no part). ``occupied`` [B] bool: slots that hold a user.

    After the call user b's GDN recurrent + conv state is the state after its row n_valid[b]-1 (unchanged when
    n_valid[b] = 0) and its position is pos[b] + n_valid[b]: the rows past n_valid[b] leave no GDN or conv trace
    (the recurrence is causal, so the state after row j never saw a later row). Their KV rows sit at positions
    >= the user's new position, which no query of that user reads before its own later rows overwrite them.
    Free slots run at position 0 (a free slot's position may be anything: what a leaving user left, or poison);
    their KV rows are zeroed when a user joins. The cache needs room for T rows past every occupied slot's
    position. Returns the model output with the per-row GDN states (``gdn_per_token``: layer -> state after
    every row, what shadow_commit selects from)."""
    b, t = tokens.shape
    if n_valid.shape != (b,) or int(n_valid.min()) < 0 or int(n_valid.max()) > t:
        raise ValueError(f"n_valid must be [{b}] counts in [0, {t}], got {n_valid.tolist()}")
    if bool((n_valid > 0)[~occupied].any()):
        raise ValueError("a free slot cannot have valid rows")
    kept = state.pos
    pos = torch.where(occupied, kept, 0)
    max_len = state.kv_caches()[0].max_len if state.kv_caches() else None
    if max_len is not None and int(pos.max()) + t > max_len:
        raise ValueError(f"KV cache full: a slot is at position {int(pos.max())}, {t} rows > max_len {max_len}")
    before = {i: (s.recurrent, s.conv) for i, s in enumerate(state.layers) if isinstance(s, GDNState)}
    state.pos = pos
    out = model(tokens, state, gdn_mode="recurrent", per_token_states=True)
    rows = torch.arange(b, device=tokens.device)
    last = (n_valid - 1).clamp(min=0).to(tokens.device)
    moved = (n_valid > 0).to(tokens.device)
    for i, (rec, conv) in before.items():
        s, per_row = state.layers[i], out.gdn_per_token[i]
        s.recurrent = torch.where(moved[:, None, None, None], per_row.recurrent[rows, last], rec)
        s.conv = torch.where(moved[:, None, None], per_row.conv[rows, last], conv)
    state.pos = torch.where(occupied, pos + n_valid.to(pos.device), kept)
    return out


class ReferenceDecoder:
    """The plain decoding backend on the reference (``generation.plain.DecodeBackend``): users in the slots of one
    :class:`SlotDecoder`, tokens picked on the host from each step's logits rows (``generation.plain.HostPicks``:
    each user's params, seeded generator and penalties). ``keep_logits``: every pick keeps its row."""

    def __init__(self, model: Qwen36Model, slots: int, max_len: int, prefix_cache: PrefixCache | None = None,
                 keep_logits: bool = False):
        self.dec = SlotDecoder(model, slots, max_len, prefix_cache)
        self.slots = slots
        self.label = f"reference (torch {self.dec.device.type.upper()})"
        self.picks = HostPicks(model.config.vocab_size, self.dec.device, keep_logits)
        # every slot's last fed token (a free slot keeps its last one: its row is inert)
        self.next_tok = torch.zeros(slots, dtype=torch.long, device=self.dec.device)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if not bool(self.dec.active[s])]

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams, forced: int | None = None) -> Pick:
        res = self.dec.prefill(slot, prompt)
        pick = self.picks.start(slot, prompt, params, res.logits[0], forced)
        pick.prefill = res
        return pick

    def step(self, tokens: Mapping[int, int], forced: Mapping[int, int]) -> dict[int, Pick]:
        for s, t in tokens.items():
            self.next_tok[s] = t
        logits = self.dec.step(self.next_tok)
        return {s: self.picks.next(s, logits[s], forced.get(s)) for s in tokens}

    def leave(self, slot: int) -> None:
        self.dec.leave(slot)
        self.picks.stop(slot)


def generate(model: Qwen36Model, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             params: SamplingParams | Sequence[SamplingParams] | None = None, eos_ids: Sequence[int] = (), *,
             prefix_cache: PrefixCache | None = None, keep_logits: bool = False, thinking=None,
             arrivals: Sequence[int] | None = None) -> list[PlainResult]:
    """Plain decoding of ``prompts`` on the reference, one slot per prompt (``generation.plain.plain_generate`` on a
    :class:`ReferenceDecoder`; one prompt is B = 1). ``prefix_cache``: each prompt resumes from its longest cached
    block boundary (its blocks released when it leaves)."""
    limit = max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens)
    longest = max(torch.as_tensor(p).numel() for p in prompts)
    backend = ReferenceDecoder(model, len(prompts), longest + limit + 1, prefix_cache,
                               keep_logits)
    return plain_generate(backend, prompts, max_new_tokens, params, eos_ids, arrivals=arrivals, thinking=thinking)
