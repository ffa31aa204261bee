"""The MTP head packed over the B user slots of the B-slot step layout (``TTSpecBackend`` with B slots, host rows):
the layer of :class:`~.mtp.TTMTPHead` (tt/spec/mtp.py: weights, body, LM head, prompt prefill) over a B-slot MTP KV
cache of its own, every op over all users, host-written positions. At one slot it is the batched step at B = 1 (the
same numbers as the one-user head, other programs)."""
from __future__ import annotations

import torch

from ...config import FULL
from ..model.model import TTQwen36Model
from ..model.model_config import TensorGroup
from ..model.state import new_layer_state
from ..model.weights import MTPWeights
from ..runtime.sampler_tables import DRAFT_UNIFORMS_PER_ROW, UniformTable, draft_uniform_seeds
from ..runtime.sampler_transform import inverse_cdf_draw
from .mtp import MTPAttentionContext, TTMTPHead, load_mtp_head


class PackedMTPHead(TTMTPHead):
    """MTP draft head of depth ``k`` over ``slots`` user slots (module doc): :meth:`reseed_select_batch` (in the
    commit), :meth:`chain_batch` (its own draft trace), :meth:`join_slot` (a user's MTP prefill), host inputs written
    between replays (:meth:`write_reseed_inputs`, :meth:`write_chain_inputs`). One depth K: users draft k_b <= K
    through masks.

    Packed layout, per step (all device ops, traceable; the host only writes the positions below between
    replays, as it writes the verify's row inputs):

        reseed (in the commit)  rows b*R + i (user-major, R = K+1): token = the acceptor's result[b, i]
                                (placeholders -> 0), hidden = verify row b*R + i, position n_b + i. A row past
                                the user's k_b, and every row of a slot not in the step, has position -1: no KV
                                write (``paged_update_cache`` skips it), no attention (the SDPA skips it), so
                                such slots' MTP pages are never touched. KV rows are written in R calls, call i
                                writing row i of every user (B rows, one per update core, each into its own pages).
                                Row a_b of user b -> row b of the persistent :attr:`h_sel` (a slot not in the step
                                keeps its row: the gather reads it back from the old buffer).
        chain (before verify)   step i: row b = user b's draft i at position pos_b + i, written and attended
                                only when user b needs draft i+1 (i + 1 < k_b); the others get -1. The drafts
                                become the next verify's inputs on device: tokens [pending_b, d_1..d_K] per user
                                (rows past k_b zeroed) and the acceptor's drafts (id V past k_b: never accepted).

    A joining user's MTP prefill (:meth:`join_slot`) zeroes and fills only that slot's pages and installs its
    last row into row b of :attr:`h_sel`. Argmax drafts, or (:meth:`enable_sampling`) drafts sampled on device
    from the acceptor's own transform of the MTP logits, each user with its own uniform columns. Name suffixes:
    B users, R rows per user, N = B*R, K drafts, H hidden."""

    def __init__(self, target: TTQwen36Model, weights: MTPWeights, k: int, slots: int):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        super().__init__(target, weights, k)
        self.slots = slots
        self.sampler_acceptor = None  # the DeviceAcceptor whose transform sampled drafts follow (enable_sampling)
        self.uniforms = self.draft_probs = None  # enable_sampling's uniform table and draft distributions
        self.rows_used = 0  # host mirror of the draft uniform table's row counter

    def for_depth(self, k: int) -> "TTMTPHead":
        raise NotImplementedError("the packed MTP head drafts at one depth K (users draft k_b <= K through masks)")

    def reseed_select(self, tokens_dev, hidden_dev, pos_dev, select_dev):
        raise NotImplementedError("the packed MTP head reseeds every user's rows: reseed_select_batch")

    def chain(self, h_first, base_f):
        raise NotImplementedError("the packed MTP head chains every user's rows: chain_batch")

    def allocate(self) -> "PackedMTPHead":
        """The B-slot MTP KV cache, page tables, host-written inputs, the persistent row buffer and outputs."""
        if self.allocated:
            return self
        ttnn, a, b, r, k = self.ttnn, self.args, self.slots, self.rows, self.k
        rm, tile, i32 = ttnn.ROW_MAJOR_LAYOUT, ttnn.TILE_LAYOUT, torch.int32
        hsz, bps = a.cfg.hidden_size, a.blocks_per_seq
        self.kv = new_layer_state(a, ttnn, self.mesh, FULL, slots=b)
        table = torch.arange(b * bps, dtype=i32).reshape(b, bps)
        self.page_table_host = table
        self.page_table = self._dev(table, ttnn.int32, rm)
        self.rows_page_table = self._dev(table.repeat_interleave(r, dim=0), ttnn.int32, rm)  # row b*R + i -> slot b
        self.slot_page_table = self._dev(torch.zeros(1, bps, dtype=i32), ttnn.int32, rm)  # a joining slot's row
        self.kv_zeros = self._dev(torch.zeros(1, a.hkv_d, bps * a.block_size, a.cfg.head_dim),
                                  a.dtype(TensorGroup.KV_CACHE, ttnn), tile)
        steps = max(k - 1, 1)
        # host-written inputs (between replays)
        self.reseed_pos = self._dev(torch.full((b * r,), -1, dtype=i32), ttnn.int32, rm)  # user-major
        self.reseed_row_pos = self._dev(torch.full((r * b,), -1, dtype=i32), ttnn.int32, rm)  # row-major: [i*B + b]
        self.reseed_rope = self._dev(torch.zeros(1, b * r, dtype=i32), ttnn.uint32, rm)
        self.chain_pos = self._dev(torch.full((steps * b,), -1, dtype=i32), ttnn.int32, rm)  # [i*B + b]
        self.chain_rope = self._dev(torch.zeros(1, steps * b, dtype=i32), ttnn.uint32, rm)
        self.pending = self._dev(torch.zeros(1, 1, b, 1), ttnn.float32, tile)
        self.draft_mask = self._dev(torch.zeros(1, 1, b, k), ttnn.float32, tile)
        self.install_idx = self._dev(torch.zeros(1, b, dtype=i32), ttnn.uint32, rm)
        # row select: user b in the step -> reseed row b*R + a_b; otherwise its old h_sel row (table row N + b)
        slots_f = torch.arange(b, dtype=torch.float32).reshape(1, b, 1, 1)
        self.c_sel_keep = self._dev(b * r + slots_f, ttnn.float32, tile)
        self.c_sel_row0 = self._dev(slots_f * r - b * r - slots_f, ttnn.float32, tile)
        # persistent state and outputs
        self.h_sel = self._dev(torch.zeros(1, 1, b, hsz), a.dtype(TensorGroup.RESIDUAL, ttnn), tile)
        self.draft_tokens = self._dev(torch.zeros(1, 1, b, k, dtype=i32), ttnn.uint32, rm)
        self.draft_logits = self._dev(torch.zeros(1, 1, k * b, a.cfg.vocab_size), ttnn.float32, tile)  # [i*B + b]
        self.allocated = True
        return self

    def enable_sampling(self, acceptor, rng_rows: int = 1024) -> None:
        """Sampled drafts (before any capture): draft i of user b drawn by inverse CDF from
        ``acceptor.probs_from_logits`` of its MTP logits (the target's temperature / top-k / top-p / min-p transform,
        so rejection sampling is exact) with uniform column b*32 + i of one table row per chain (a stream of its own,
        seeded from the acceptor's seed like the single-user draft pick's); the K draft distributions of every
        user go to the persistent :attr:`draft_probs` [1, B, K, V] (zero past k_b), what
        ``DeviceAcceptor.stochastic`` takes."""
        self._require()
        if self.k > DRAFT_UNIFORMS_PER_ROW:
            raise ValueError(f"sampled drafts take at most {DRAFT_UNIFORMS_PER_ROW} drafts per chain, K = {self.k}")
        ttnn, b = self.ttnn, self.slots
        device_seed, host_seed = draft_uniform_seeds(acceptor.seed)
        self.uniforms = UniformTable(ttnn, self.mesh, rng_rows, b * DRAFT_UNIFORMS_PER_ROW, source=acceptor.rng,
                                     device_seed=device_seed, host_seed=host_seed).allocate()
        self.draft_probs = self._dev(torch.zeros(1, b, self.k, self.args.cfg.vocab_size), ttnn.float32,
                                     ttnn.TILE_LAYOUT)
        self.sampler_acceptor, self.rows_used = acceptor, 0

    def before_chain(self) -> None:
        """Host side, outside any capture, before every chain execution: refill the draft uniforms when used up."""
        if self.uniforms is None:
            return
        if self.rows_used >= self.uniforms.rows:
            self.uniforms.refill()
            self.rows_used = 0
        self.rows_used += 1

    def chain_step_back(self) -> None:
        """Give the last chain's uniform row back (an aborted step)."""
        if self.uniforms is not None and self.rows_used > 0:
            self.uniforms.step_back()
            self.rows_used -= 1

    # ---- host inputs (between replays) -------------------------------------------------------------------------
    def _write(self, host: torch.Tensor, buf) -> None:
        ttnn = self.ttnn
        h = ttnn.from_torch(host.to(torch.float32 if buf.dtype == ttnn.float32 else torch.int32), dtype=buf.dtype,
                            layout=buf.layout, mesh_mapper=self.replicate)
        ttnn.copy_host_to_device_tensor(h, buf)

    def _check_room(self, slot: int, pos: int, kb: int) -> None:
        last = self.args.max_seq_len - 1
        if pos + kb > last:  # the verify's own bound: the reseed writes pos..pos+k_b, the chain stays below it
            raise ValueError(f"slot {slot}: MTP rows up to position {pos + kb} pass max_seq_len {last + 1}")

    def write_reseed_inputs(self, depths: dict[int, int], pos: dict[int, int]) -> None:
        """Positions of the reseed rows of the step about to be verified: user b in ``depths`` (k_b drafts,
        verify row 0 at ``pos[b]``) writes rows 0..k_b at pos_b..pos_b+k_b; every other row -1."""
        b, r = self.slots, self.rows
        p = torch.full((b, r), -1, dtype=torch.int32)
        for s, kb in depths.items():
            self._check_room(s, pos[s], kb)
            p[s, : kb + 1] = torch.arange(pos[s], pos[s] + kb + 1, dtype=torch.int32)
        self._write(p.reshape(-1), self.reseed_pos)
        self._write(p.t().reshape(-1), self.reseed_row_pos)
        self._write(p.clamp(min=0).reshape(1, -1), self.reseed_rope)

    def write_chain_inputs(self, depths: dict[int, int], pos: dict[int, int], pending: dict[int, int]) -> None:
        """The chain's inputs for the users of the next verify: user b's draft 1 predicts the token after
        ``pending[b]`` (at position ``pos[b]``); chain step i writes row pos_b + i while i + 1 < k_b."""
        b, k = self.slots, self.k
        steps = max(k - 1, 1)
        cp = torch.full((steps, b), -1, dtype=torch.int32)
        pend = torch.zeros(1, 1, b, 1)
        mask = torch.zeros(1, 1, b, k)
        for s, kb in depths.items():
            self._check_room(s, pos[s], kb)
            for i in range(kb - 1):
                cp[i, s] = pos[s] + i
            pend[0, 0, s, 0] = float(pending[s])
            mask[0, 0, s, :kb] = 1.0
        self._write(cp.reshape(-1), self.chain_pos)
        self._write(cp.clamp(min=0).reshape(1, -1), self.chain_rope)
        self._write(pend, self.pending)
        self._write(mask, self.draft_mask)

    def read_batch_drafts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft ids [B, K] int64, fp32 draft logits [B, K, V]) of the last chain, every slot (device 0)."""
        b, k = self.slots, self.k
        toks = self.target.to_host(self.draft_tokens).reshape(b, k).to(torch.int64)
        logits = self.target.to_host(self.draft_logits).float().reshape(k, b, -1).transpose(0, 1).contiguous()
        return toks, logits

    # ---- device (traceable) ------------------------------------------------------------------------------------
    def reseed_select_batch(self, result_dev, hidden_dev, count_dev, active_dev) -> None:
        """Reseed over every user's verify rows and row a_b of each user into :attr:`h_sel` (class doc).
        result [1, B, 1, >=R] int32 (the acceptor's), hidden [1, 1, N, H], count / active [1, B, 1, 1] fp32
        (count already 0 for slots outside the step)."""
        self._require()
        ttnn, b, r, hsz = self.ttnn, self.slots, self.rows, self.args.cfg.hidden_size
        rm, n = ttnn.ROW_MAJOR_LAYOUT, self.slots * self.rows
        if [int(x) for x in hidden_dev.shape] != [1, 1, n, hsz]:
            raise ValueError(f"hidden: device shape {list(hidden_dev.shape)} != [1, 1, B*(K+1)={n}, H={hsz}]")
        t = result_dev if result_dev.layout == ttnn.TILE_LAYOUT else ttnn.to_layout(result_dev, ttnn.TILE_LAYOUT)
        t = ttnn.relu(ttnn.typecast(ttnn.slice(t, [0, 0, 0, 0], [1, b, 1, r]), ttnn.float32))  # placeholder -1 -> 0
        tokens_1N = ttnn.reshape(ttnn.to_layout(ttnn.typecast(t, ttnn.uint32), rm), [1, n])
        row_pos = [ttnn.slice(self.reseed_row_pos, [i * b], [(i + 1) * b]) for i in range(r)]
        cos, sin = self.target.rope_rows(self.reseed_rope)
        ctx = MTPAttentionContext("decode", cos, sin, self.page_table, pos=self.reseed_pos,
                                  rows_page_table=self.rows_page_table, row_pos=row_pos, users=b)
        h_11NH = self.body(tokens_1N, hidden_dev, ctx)
        idx = ttnn.add(self.c_sel_keep, ttnn.multiply(active_dev, ttnn.add(self.c_sel_row0, count_dev)))
        idx_1B = ttnn.reshape(ttnn.to_layout(ttnn.typecast(idx, ttnn.uint32), rm), [1, b])
        h_sel = self.h_sel
        if h_11NH.dtype != h_sel.dtype:
            raise RuntimeError(f"MTP hidden rows are {h_11NH.dtype}, the persistent row buffer {h_sel.dtype}")
        table = ttnn.concat([ttnn.reshape(h_11NH, [n, hsz]), ttnn.reshape(h_sel, [b, hsz])], dim=0)
        table = ttnn.to_layout(table, rm)
        rows = ttnn.embedding(idx_1B, table, layout=ttnn.TILE_LAYOUT, dtype=h_sel.dtype)
        ttnn.copy(ttnn.reshape(rows, [1, 1, b, hsz]), h_sel)

    def chain_batch(self, verify_tokens, acceptor_drafts) -> None:
        """K argmax drafts per user from :attr:`h_sel` (B rows per step), into :attr:`draft_tokens` /
        :attr:`draft_logits`, the verify's token rows ``verify_tokens`` [1, B*(K+1)] uint32 and the acceptor's
        ``acceptor_drafts`` [1, B, 1, K] uint32 (class doc)."""
        self._require()
        ttnn, b, k, rm = self.ttnn, self.slots, self.k, self.ttnn.ROW_MAJOR_LAYOUT
        h, lg = self.h_sel, self.logits(self.h_sel)
        toks, lgs, probs = [], [], []
        acc = self.sampler_acceptor
        u_11B32 = None
        if acc is not None:  # one uniform row per chain: user b's draft i reads column b*32 + i
            u_11B32, _ = self.uniforms.next_row([1, 1, b, DRAFT_UNIFORMS_PER_ROW])
        for i in range(k):
            if acc is None:
                t = ttnn.argmax(lg, dim=3, keepdim=True)  # [1, 1, B, 1] (lowest index on ties)
            else:
                p_11BV = acc.probs_from_logits(lg)
                t = ttnn.typecast(inverse_cdf_draw(ttnn, p_11BV, ttnn.slice(u_11B32, [0, 0, 0, i], [1, 1, b, i + 1])),
                                  ttnn.uint32)
                probs.append(ttnn.reshape(p_11BV, [1, b, 1, self.args.cfg.vocab_size]))
            t = t if t.layout == rm else ttnn.to_layout(t, rm)
            toks.append(t)
            lgs.append(lg)
            if i + 1 < k:
                cur = ttnn.slice(self.chain_pos, [i * b], [(i + 1) * b])
                ridx = ttnn.slice(self.chain_rope, [0, i * b], [1, (i + 1) * b])
                cos, sin = self.target.rope_rows(ridx)
                ctx = MTPAttentionContext("decode", cos, sin, self.page_table, pos=cur, one_row_per_user=True)
                h = self.body(ttnn.reshape(t, [1, b]), h, ctx)
                lg = self.logits(h)
        ttnn.copy(toks[0] if k == 1 else ttnn.concat(toks, dim=3), self.draft_tokens)
        ttnn.copy(lgs[0] if k == 1 else ttnn.concat(lgs, dim=2), self.draft_logits)
        d_f = ttnn.typecast(ttnn.to_layout(self.draft_tokens, ttnn.TILE_LAYOUT), ttnn.float32)  # ids exact below 2**24
        mask = self.draft_mask
        acc = ttnn.add(ttnn.multiply(ttnn.subtract(d_f, float(self.args.cfg.vocab_size)), mask),
                       float(self.args.cfg.vocab_size))  # id V past k_b
        acc = ttnn.reshape(ttnn.to_layout(ttnn.typecast(acc, ttnn.uint32), rm), [1, b, 1, k])
        ttnn.copy(acc, acceptor_drafts)
        rows = ttnn.concat([self.pending, ttnn.multiply(d_f, mask)], dim=3)  # [1, 1, B, K+1]
        rows = ttnn.reshape(ttnn.to_layout(ttnn.typecast(rows, ttnn.uint32), rm), [1, b * (k + 1)])
        ttnn.copy(rows, verify_tokens)
        if probs:  # zero past k_b: a user accepting all its k_b drafts then draws the bonus from p_target alone
            p_1BKV = probs[0] if k == 1 else ttnn.concat(probs, dim=2)
            ttnn.copy(ttnn.multiply(p_1BKV, ttnn.reshape(mask, [1, b, k, 1])), self.draft_probs)

    # ---- a joining user (eager, between replays) -------------------------------------------------------------
    def join_slot(self, slot: int, next_tokens: torch.Tensor, hidden) -> None:
        """MTP prefill of the user joining ``slot`` (rows t = 0..P-1 from x_{t+1} and h_t, as :meth:`prefill`)
        into that slot's pages only (zeroed first: a reseed row reads the last page up to its position, and what
        a previous user left there must not be non-finite), then its last row into row ``slot`` of :attr:`h_sel`.
        Allocates transient buffers: call inside ttnn's corruptible_allocation_scope when traces are live."""
        self._require()
        ttnn, b, hsz = self.ttnn, self.slots, self.args.cfg.hidden_size
        if not 0 <= slot < b:
            raise ValueError(f"slot {slot} out of range (the MTP head has {b} slots)")
        row = self.page_table_host[slot: slot + 1].contiguous()
        self._write(row, self.slot_page_table)
        for cache in (self.kv.k, self.kv.v):
            ttnn.experimental.paged_fill_cache(cache, self.kv_zeros, self.slot_page_table, batch_idx=0)
        self.prefill(next_tokens, hidden, page_table=self.slot_page_table, page_table_host=row)
        last = self.last_hidden
        if last.dtype != self.h_sel.dtype:
            last = ttnn.typecast(last, self.h_sel.dtype)
        idx = torch.arange(b, dtype=torch.int32)
        idx[slot] = b
        self._write(idx.reshape(1, b), self.install_idx)
        table = ttnn.to_layout(ttnn.concat([ttnn.reshape(self.h_sel, [b, hsz]), ttnn.reshape(last, [1, hsz])], dim=0),
                               ttnn.ROW_MAJOR_LAYOUT)
        rows = ttnn.embedding(self.install_idx, table, layout=ttnn.TILE_LAYOUT, dtype=self.h_sel.dtype)
        ttnn.copy(ttnn.reshape(rows, [1, 1, b, hsz]), self.h_sel)


def load_packed_mtp(target: TTQwen36Model, reader, k: int, slots: int, cache_dir=None) -> PackedMTPHead:
    """Convert ``mtp.*`` of ``reader`` and allocate the head of depth ``k`` packed over ``slots`` user slots."""
    return PackedMTPHead(target, load_mtp_head(target, reader, cache_dir), k, slots).allocate()
