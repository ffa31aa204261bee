"""On-device acceptance for MTP speculative decoding: greedy and stochastic, traceable.

Everything between "target verify logits + draft tokens are on device" and "host reads one small tensor"
is a composition of ttnn ops: no host reads or writes, no tensor creation (constants, scratch, RNG table
and the persistent result buffers are made in :meth:`DeviceAcceptor.allocate`, before any capture), so a
caller can record :meth:`DeviceAcceptor.greedy` / :meth:`DeviceAcceptor.stochastic` inside its traced spec
step. Semantics are those of the reference engine (``models/qwen36/speculative/acceptance.py`` and
``speculative/sampling.py``); see docs/tt_spec.md ("Acceptance on device") for the semantics and card caveats.

Shapes (B = batch/users, K = draft depth, R = K + 1 verify rows, V = vocab; all 4-D, TILE unless noted):

* target logits ``[1, B, R, V]`` bf16 or fp32; replicated on every device (``logits_layout="replicated"``),
  or vocab-sharded across the mesh (``"vocab_sharded"``: the acceptor all-gathers along V first).
* drafts ``[1, B, 1, K]`` uint32 (ROW_MAJOR or TILE), replicated.
* draft probabilities ``[1, B, K, V]`` fp32 from :meth:`DeviceAcceptor.probs_from_logits` (same transform
  as the target), or ``None`` = one-hot drafts (argmax drafting).
* result ``[1, B, 1, R + 2]`` int32, persistent (same buffer every call/replay):
  columns ``0..K`` emitted tokens with :data:`PLACEHOLDER_TOKEN_ID` after the ``a + 1`` emitted ones,
  column ``R`` the accepted count ``a``, column ``R + 1`` the RNG table row this step used (-1 for greedy).
* :attr:`DeviceAcceptor.count` ``[1, B, 1, 1]`` fp32, persistent: ``a`` on device for the commit step;
  :meth:`DeviceAcceptor.ring_block_idx` turns it into the GDN ring's ``initial_state_block_idx``.

Randomness: one row of a persistent fp32 table of uniforms ``[rng_rows, B*32]`` per stochastic step,
gathered on device by a device-resident counter that the step advances in place (``ttnn.embedding`` +
``ttnn.add`` + ``ttnn.copy``). The table is (re)filled outside any trace, either on device with seeded
``ttnn.uniform`` (``rng="device"``, default) or from a seeded torch generator on the host
(``rng="host"``: bit-identical across card and emulator). :meth:`read_result` refills it when the row
just used was the last one. Drawing in a trace would replay the same seed every step (captured runtime
args), which is why draws happen outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qwen36.errors import UserError
from qwen36.speculative.acceptance import PLACEHOLDER_TOKEN_ID
from qwen36.speculative.sampling import SamplingParams

from ..model.ccl import ccl_for
from ..model.model_config import compute_config_exact_count
from ..runtime.sampler import TokenCounts, UniformTable, inverse_cdf_draw, penalize, probs_from_logits

RESULT_EXTRA_COLS = 2  # accepted count, RNG row
MAX_EXACT_FP32_INT = 1 << 24  # token ids / counts are carried in fp32: exact below 2**24
UNIFORMS_PER_ROW = 32  # one tile row of uniforms per user per step: K accept draws + 1 categorical draw
LOGITS_LAYOUTS = ("replicated", "vocab_sharded")


@dataclass(frozen=True)
class AcceptResult:
    """Host view of one step's result for one user."""

    tokens: list[int]  # K+1 entries: a+1 emitted tokens then PLACEHOLDER_TOKEN_ID
    num_accepted: int
    rng_row: int  # table row the step used, -1 for greedy

    @property
    def emitted(self) -> list[int]:
        return self.tokens[: self.num_accepted + 1]


class DraftDepthError(UserError, ValueError):
    """A draft depth K the on-device acceptance cannot hold."""


class DeviceAcceptor:
    """Greedy + stochastic acceptance as ttnn op compositions (see module docstring).

    Typical traced use::

        acc = DeviceAcceptor(ttnn, mesh, k=3, vocab=V, sampling_params=SamplingParams(temperature=0.8, top_p=0.9))
        acc.allocate()                               # before any capture
        res = acc.stochastic(logits_buf, drafts_buf) # compile/warm-up eagerly once (also a valid step)
        acc.read_result(res)
        tid = ttnn.begin_trace_capture(mesh, cq_id=0)
        res = acc.stochastic(logits_buf, drafts_buf) # recorded, not executed
        ttnn.end_trace_capture(mesh, tid, cq_id=0)
        ... write new logits/drafts (or produce them on device) ...
        ttnn.execute_trace(mesh, tid, cq_id=0); tokens, a = acc.read_result(res)
    """

    def __init__(self, ttnn, mesh_device, k: int, vocab: int, sampling_params: SamplingParams | None = None,
                 seed: int | None = None, *, batch: int = 1, logits_layout: str = "replicated",
                 rng: str = "device", rng_rows: int = 1024, ring_heads: int | None = None,
                 token_counts: TokenCounts | None = None):
        if not isinstance(k, int) or k < 1:
            raise DraftDepthError(f"k (draft depth) must be an int >= 1, got {k!r}")
        if k + 1 > UNIFORMS_PER_ROW:
            raise DraftDepthError(f"k={k}: at most {UNIFORMS_PER_ROW - 1} drafts (K accept draws + 1 categorical draw "
                                  f"per {UNIFORMS_PER_ROW}-wide RNG row)")
        if not isinstance(vocab, int) or vocab < 2:
            raise ValueError(f"vocab must be an int >= 2, got {vocab!r}")
        if vocab > MAX_EXACT_FP32_INT:
            raise ValueError(f"vocab={vocab} > 2**24: token ids are carried in fp32 on device and would not be exact")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if logits_layout not in LOGITS_LAYOUTS:
            raise ValueError(f"logits_layout must be one of {LOGITS_LAYOUTS}, got {logits_layout!r}")
        self.ttnn = ttnn
        self.mesh = mesh_device
        ccl_for(ttnn, mesh_device)  # the all_gather's persistent semaphores exist before any trace capture
        self.k = k
        self.rows = k + 1
        self.vocab = vocab
        self.batch = batch
        self.params = sampling_params if sampling_params is not None else SamplingParams()
        if (self.params.penalized or self.params.logprobs is not None) and batch != 1:
            raise ValueError("penalties and logprobs on the device acceptor are implemented for batch 1")
        self.seed = int(self.params.seed if seed is None else seed)
        if token_counts is not None and token_counts.vocab != vocab:
            raise ValueError(f"token_counts are over vocab {token_counts.vocab}, the acceptor's is {vocab}")
        # the penalty context; passed in when several acceptors (one per draft depth) serve one generation
        self.token_counts = token_counts
        self.logits_layout = logits_layout
        self.rng = rng
        self.rng_rows = rng_rows
        self.ring_heads = ring_heads
        self.num_devices = self._num_devices()
        self.allocated = False
        seed_ = self.seed

        def device_seed(refill: int) -> int:  # distinct, nonzero, deterministic per refill (0 = unseeded)
            return (seed_ * 1_000_003 + refill * 7919 + 1) % 0x7FFFFFFF or 1

        # the table validates rng and rng_rows
        self.uniforms = UniformTable(ttnn, mesh_device, rng_rows, batch * UNIFORMS_PER_ROW, source=rng,
                                     device_seed=device_seed, host_seed=seed_)

    # ------------------------------------------------------------------------------------------------
    # setup (before capture)
    # ------------------------------------------------------------------------------------------------
    def _num_devices(self) -> int:
        for attr in ("get_num_devices",):
            f = getattr(self.mesh, attr, None)
            if callable(f):
                return int(f())
        n = getattr(self.mesh, "num_devices", None)
        if n is None:
            raise ValueError("cannot tell the number of devices of mesh_device")
        return int(n() if callable(n) else n)

    def _replicated(self, x: torch.Tensor, dtype, layout=None):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=dtype, layout=layout or ttnn.TILE_LAYOUT, device=self.mesh,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "DeviceAcceptor":
        """Create every constant, scratch and persistent buffer (call once, before any trace capture)."""
        if self.allocated:
            return self
        ttnn, b, r, k, v = self.ttnn, self.batch, self.rows, self.k, self.vocab
        f32 = ttnn.float32
        self._ckc = compute_config_exact_count(ttnn)
        ar = torch.arange
        self.c_row_idx = self._replicated(ar(r, dtype=torch.float32).reshape(1, 1, r, 1).expand(1, b, r, 1).clone(), f32)
        self.c_draft_row_idx = self._replicated(ar(k, dtype=torch.float32).reshape(1, 1, k, 1).expand(1, b, k, 1).clone(), f32)
        self.c_col_idx = self._replicated(ar(r, dtype=torch.float32).reshape(1, 1, 1, r).expand(1, b, 1, r).clone(), f32)
        self.c_vocab_idx = self._replicated(ar(v, dtype=torch.float32).reshape(1, 1, 1, v), f32)
        self.c_zero_col = self._replicated(torch.zeros(1, b, 1, 1), f32)
        self.c_minus_one_col = self._replicated(torch.full((1, b, 1, 1), -1.0), f32)
        # persistent outputs
        self.result = self._replicated(torch.zeros(1, b, 1, r + RESULT_EXTRA_COLS, dtype=torch.int32), ttnn.int32)
        self.count = self._replicated(torch.zeros(1, b, 1, 1), f32)
        if self.ring_heads is not None:
            hv = int(self.ring_heads)
            heads = ar(b * hv, dtype=torch.float32).reshape(1, b, 1, hv)  # h = b*HV + hv
            self.c_ring_heads = self._replicated(heads, f32)
            self.block_idx = self._replicated(torch.zeros(1, b * hv, dtype=torch.int64), ttnn.uint32,
                                              ttnn.ROW_MAJOR_LAYOUT)
        if self.params.logprobs is not None:
            self.logprobs = self._replicated(torch.zeros(1, 1, r, 2 + 2 * self.params.logprobs), f32,
                                             ttnn.ROW_MAJOR_LAYOUT)
        if self.params.penalized:
            if self.token_counts is None:
                self.token_counts = TokenCounts(ttnn, self.mesh, v)
            self.token_counts.allocate()
            self.c_zero_vocab_row = self._replicated(torch.zeros(1, b, 1, v), f32)
        # RNG: table of uniforms + device-side row counter (fp32, exact below 2**24 rows); first fill
        self.uniforms.allocate()
        self.allocated = True
        return self

    def refill_rng(self) -> None:
        """(Re)fill the uniform table and reset the device counter. Outside any capture; allocates nothing."""
        self._require_allocated()
        self.uniforms.refill()

    def _require_allocated(self):
        if not self.allocated:
            raise RuntimeError("DeviceAcceptor.allocate() must be called (before any trace capture) first")

    # ------------------------------------------------------------------------------------------------
    # device compositions
    # ------------------------------------------------------------------------------------------------
    def _check_dev(self, t, rows: int, what: str) -> None:
        shape = [int(s) for s in t.shape]
        v = self.vocab // self.num_devices if self.logits_layout == "vocab_sharded" else self.vocab
        want = [1, self.batch, rows, v]
        if shape != want:
            raise ValueError(f"{what}: device shape {shape} != {want} (logits_layout={self.logits_layout!r}, "
                             f"B={self.batch}, K={self.k}, V={self.vocab})")

    def _gathered(self, x):
        """Full-vocab view of a (possibly vocab-sharded) [1, B, rows, V] device tensor."""
        if self.logits_layout == "vocab_sharded":
            return ccl_for(self.ttnn, self.mesh).all_gather(x, dim=3)
        return x

    def _drafts_f32(self, drafts_dev):
        ttnn = self.ttnn
        shape = [int(s) for s in drafts_dev.shape]
        if shape != [1, self.batch, 1, self.k]:
            raise ValueError(f"drafts: device shape {shape} != [1, B={self.batch}, 1, K={self.k}]")
        d = drafts_dev
        if d.layout != ttnn.TILE_LAYOUT:
            d = ttnn.to_layout(d, ttnn.TILE_LAYOUT)
        row = ttnn.typecast(d, ttnn.float32)  # [1, B, 1, K]
        col = ttnn.reshape(row, [1, self.batch, self.k, 1])
        return row, col

    def _num_accepted(self, accepted_col):
        """accepted [1, B, K, 1] 0/1 fp32 -> a [1, B, 1, 1] fp32 (length of the all-ones prefix)."""
        ttnn = self.ttnn
        prefix = ttnn.cumprod(accepted_col, dim=2)
        return ttnn.sum(prefix, dim=2, keepdim=True, compute_kernel_config=self._ckc)

    def _finish(self, drafts_row, a, final, rng_col):
        """Assemble [tokens(R) | a | rng_row] into the persistent int32 result; a into :attr:`count`."""
        ttnn = self.ttnn
        dr = ttnn.concat([drafts_row, self.c_zero_col], dim=3)  # [1, B, 1, R]; column K is never < a
        before = ttnn.lt(self.c_col_idx, a)  # j < a: accepted draft
        at = ttnn.eq(self.c_col_idx, a)  # j == a: correction / bonus token
        # before*(d+1) + at*(final+1) - 1: exact in fp32 for ids < 2**24, -1 (placeholder) elsewhere
        toks = ttnn.add(ttnn.multiply(before, ttnn.add(dr, 1.0)), ttnn.multiply(at, ttnn.add(final, 1.0)))
        toks = ttnn.subtract(toks, 1.0)
        res = ttnn.concat([toks, a, rng_col], dim=3)
        ttnn.copy(ttnn.typecast(res, ttnn.int32), self.result)
        ttnn.copy(a, self.count)
        return self.result

    def greedy(self, logits_dev, drafts_dev):
        """Greedy acceptance. logits [1,B,R,V] (bf16/fp32), drafts [1,B,1,K] uint32 -> persistent result.

        a = longest prefix with d_i == argmax(row i-1); final = argmax(row a). argmax ties: lowest index.
        """
        self._require_allocated()
        ttnn, b, k = self.ttnn, self.batch, self.k
        self._check_dev(logits_dev, self.rows, "greedy logits")
        x = self._gathered(logits_dev)
        drafts_row, drafts_col = self._drafts_f32(drafts_dev)
        if self.params.penalized:  # argmax of the penalised rows: row j counts d_1..d_j (plain greedy's context)
            x = x if x.dtype == ttnn.float32 else ttnn.typecast(x, ttnn.float32)
            x = penalize(ttnn, x, self.params, *self.row_penalties(drafts_col))
        am = ttnn.argmax(x, dim=3, keepdim=True)  # [1, B, R, 1] uint32 (ROW_MAJOR on cards)
        am = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        am_k = ttnn.slice(am, [0, 0, 0, 0], [1, b, k, 1])
        a = self._num_accepted(ttnn.eq(am_k, drafts_col))
        sel = ttnn.eq(self.c_row_idx, a)  # [1, B, R, 1] one-hot at row a
        final = ttnn.sum(ttnn.multiply(am, sel), dim=2, keepdim=True, compute_kernel_config=self._ckc)
        res = self._finish(drafts_row, a, final, self.c_minus_one_col)
        self._row_logprobs(logits_dev)
        return res

    def probs_from_logits(self, logits_dev, penalties=None):
        """Device twin of ``speculative.sampling.probs_from_logits``: [1,B,rows,V] -> fp32 probabilities (full V),
        by :func:`.sampler.probs_from_logits` (the one device transform). ``penalties``: ``(seen, counts)`` fp32
        broadcastable to the rows (needed when the params have penalties on)."""
        self._require_allocated()
        ttnn, p = self.ttnn, self.params
        if p.greedy:
            raise ValueError("probs_from_logits needs temperature > 0 (greedy decoding uses argmax)")
        x = self._gathered(logits_dev)
        if x.dtype != ttnn.float32:
            x = ttnn.typecast(x, ttnn.float32)
        if p.penalized:
            if penalties is None:
                raise ValueError("penalties are on but no (seen, counts) were given")
            x = penalize(ttnn, x, p, *penalties)
        return probs_from_logits(ttnn, x, p, self._ckc)

    # ---- logprobs of the emitted tokens (B == 1) ------------------------------------------------------------
    def _row_logprobs(self, logits_dev) -> None:
        """Raw logprobs (log-softmax of the unprocessed verify rows) of each row's emitted token (the result's token
        columns), its rank and the top n, into the persistent :attr:`logprobs` ``[1, 1, R, 2 + 2n]`` fp32 ROW_MAJOR
        (rows after ``a`` hold placeholders' values: ignored). No-op unless the params ask for logprobs."""
        if self.params.logprobs is None:
            return
        ttnn, r, n, ckc = self.ttnn, self.rows, self.params.logprobs, self._ckc
        x = self._gathered(logits_dev)
        x = x if x.dtype == ttnn.float32 else ttnn.typecast(x, ttnn.float32)
        shifted = ttnn.subtract(x, ttnn.max(x, dim=3, keepdim=True))
        lp = ttnn.subtract(shifted, ttnn.log(ttnn.sum(ttnn.exp(shifted), dim=3, keepdim=True, compute_kernel_config=ckc)))
        toks = ttnn.typecast(ttnn.slice(self.result, [0, 0, 0, 0], [1, 1, 1, r]), ttnn.float32)
        onehot = ttnn.eq(self.c_vocab_idx, ttnn.reshape(toks, [1, 1, r, 1]))  # [1, 1, R, V]
        own = ttnn.sum(ttnn.multiply(lp, onehot), dim=3, keepdim=True, compute_kernel_config=ckc)
        rank = ttnn.add(ttnn.sum(ttnn.gt(lp, own), dim=3, keepdim=True, compute_kernel_config=ckc), 1.0)
        cols = [own, rank]
        if n:
            vals, idx = ttnn.topk(lp, n, dim=3)
            cols += [ttnn.typecast(ttnn.to_layout(idx, ttnn.TILE_LAYOUT), ttnn.float32), vals]
        ttnn.copy(ttnn.to_layout(ttnn.concat(cols, dim=3), ttnn.ROW_MAJOR_LAYOUT), self.logprobs)

    def read_logprobs(self, tokens: list[int]) -> list:
        """Host read of :attr:`logprobs` -> one ``TokenLogprobs`` per emitted token (rows 0..a)."""
        from qwen36.speculative.sampling import TokenLogprobs

        ttnn, n = self.ttnn, self.params.logprobs
        rows = ttnn.to_torch(ttnn.get_device_tensors(self.logprobs)[0]).reshape(self.rows, 2 + 2 * n).double()
        out = []
        for j, t in enumerate(tokens):
            row = rows[j].tolist()
            top = [(int(i), v) for i, v in zip(row[2: 2 + n], row[2 + n:])]
            out.append(TokenLogprobs(int(t), row[0], int(row[1]), top))
        return out

    # ---- penalties: token counts on device (B == 1) ------------------------------------------------------
    def start_penalties(self, prompt_len: int, history) -> None:
        """Write the penalty state of a generation: ``history`` = prompt then every emitted token (the pending one
        included); the first ``prompt_len`` are the prompt. Host writes, outside any capture."""
        self._require_allocated()
        if self.params.penalized:
            self.token_counts.start(prompt_len, history)

    @property
    def seen(self):
        """``[1, 1, 1, V]`` fp32 0/1: in the prompt or the output (the :class:`.sampler.TokenCounts` buffer)."""
        return self.token_counts.seen

    @property
    def counts(self):
        """``[1, 1, 1, V]`` fp32: occurrences in the output (the :class:`.sampler.TokenCounts` buffer)."""
        return self.token_counts.counts

    def row_penalties(self, drafts_col):
        """(seen, counts) ``[1, 1, R, V]`` of the verify rows: row j adds d_1..d_j to the committed counts (it is
        used only when they were all accepted, so it sees what plain decoding would). Traceable."""
        ttnn = self.ttnn
        onehot = ttnn.eq(self.c_vocab_idx, drafts_col)  # [1, 1, K, V]
        added = ttnn.concat([self.c_zero_vocab_row, ttnn.cumsum(onehot, dim=2)], dim=2)  # [1, 1, R, V]
        return ttnn.maximum(self.seen, ttnn.gt(added, 0.0)), ttnn.add(self.counts, added)

    def draft_penalties(self):
        """(seen, counts) of the committed tokens: the context the sampled drafts use (the chain's own drafts
        are not added; the draft distribution only has to be the one the drafts were drawn from)."""
        return self.seen, self.counts

    def commit_counts(self):
        """Add the step's emitted tokens (the result's token columns; placeholders match nothing) to the counts,
        in place: part of the commit, inside its trace. Acceptors sharing one :class:`.sampler.TokenCounts` see each
        other's commits."""
        ttnn, r = self.ttnn, self.rows
        toks = ttnn.typecast(ttnn.slice(self.result, [0, 0, 0, 0], [1, 1, 1, r]), ttnn.float32)
        onehot = ttnn.eq(self.c_vocab_idx, ttnn.reshape(toks, [1, 1, r, 1]))  # [1, 1, R, V]
        added = ttnn.sum(onehot, dim=2, keepdim=True, compute_kernel_config=self._ckc)  # [1, 1, 1, V]
        self.token_counts.add(added)

    def _uniforms(self):
        """-> (u_accept [1,B,K,1], u_final [1,B,1,1], rng_row [1,B,1,1]); advances the device counter in place."""
        ttnn, b, k = self.ttnn, self.batch, self.k
        row_B1132, rng_col_B111 = self.uniforms.next_row([1, b, 1, UNIFORMS_PER_ROW], index_base=self.c_zero_col)
        u_acc = ttnn.reshape(ttnn.slice(row_B1132, [0, 0, 0, 0], [1, b, 1, k]), [1, b, k, 1])
        u_fin = ttnn.slice(row_B1132, [0, 0, 0, k], [1, b, 1, k + 1])
        return u_acc, u_fin, rng_col_B111

    def stochastic(self, logits_dev, drafts_dev, draft_probs_dev=None):
        """Stochastic acceptance (exact speculative sampling) -> persistent result.

        logits [1,B,R,V] target verify logits (transformed here with the acceptor's SamplingParams);
        drafts [1,B,1,K] uint32; draft_probs [1,B,K,V] fp32 (from :meth:`probs_from_logits` of the draft
        logits, full V even when logits are vocab-sharded) or None for one-hot (argmax) drafts.
        Accept d_i iff u_i * p_d(d_i) < p_t(d_i); on the first rejection (row a) sample from
        normalise(max(p_t(row a) - p_d(row a), 0)) (p_t(row a) if that has zero mass); if all K are accepted
        sample the bonus from p_t(row K). Categorical draws by inverse CDF with one uniform.
        """
        self._require_allocated()
        ttnn, b, k, r = self.ttnn, self.batch, self.k, self.rows
        self._check_dev(logits_dev, r, "stochastic logits")
        if draft_probs_dev is not None:
            shape = [int(s) for s in draft_probs_dev.shape]
            if shape != [1, b, k, self.vocab]:
                raise ValueError(f"draft_probs: device shape {shape} != [1, B={b}, K={k}, V={self.vocab}] "
                                 "(full vocab: pass probs_from_logits(draft_logits))")
        drafts_row, drafts_col = self._drafts_f32(drafts_dev)
        pen = self.row_penalties(drafts_col) if self.params.penalized else None
        pt = self.probs_from_logits(logits_dev, pen)  # [1, B, R, V]
        onehot = ttnn.eq(self.c_vocab_idx, drafts_col)  # [1, B, K, V]
        pt_k = ttnn.slice(pt, [0, 0, 0, 0], [1, b, k, self.vocab])
        pt_d = ttnn.sum(ttnn.multiply(pt_k, onehot), dim=3, keepdim=True, compute_kernel_config=self._ckc)
        u_acc, u_fin, rng_col = self._uniforms()
        if draft_probs_dev is None:
            draft_dist = onehot
            accepted = ttnn.lt(u_acc, pt_d)  # p_d(d_i) = 1
        else:
            draft_dist = draft_probs_dev
            pd_d = ttnn.sum(ttnn.multiply(draft_probs_dev, onehot), dim=3, keepdim=True, compute_kernel_config=self._ckc)
            accepted = ttnn.lt(ttnn.multiply(u_acc, pd_d), pt_d)
        a = self._num_accepted(accepted)  # [1, B, 1, 1]
        sel_r = ttnn.eq(self.c_row_idx, a)  # [1, B, R, 1]
        sel_k = ttnn.eq(self.c_draft_row_idx, a)  # [1, B, K, 1]; all zero when a == K (bonus row)
        pt_a = ttnn.sum(ttnn.multiply(pt, sel_r), dim=2, keepdim=True, compute_kernel_config=self._ckc)  # [1,B,1,V]
        pd_a = ttnn.sum(ttnn.multiply(draft_dist, sel_k), dim=2, keepdim=True, compute_kernel_config=self._ckc)
        residual = ttnn.relu(ttnn.subtract(pt_a, pd_a))  # == p_t(row K) when a == K
        mass = ttnn.sum(residual, dim=3, keepdim=True, compute_kernel_config=self._ckc)
        has_mass = ttnn.gt(mass, 0.0)
        dist = ttnn.add(ttnn.multiply(residual, has_mass), ttnn.multiply(pt_a, ttnn.rsub(has_mass, 1.0)))
        final = inverse_cdf_draw(ttnn, dist, u_fin)
        res = self._finish(drafts_row, a, final, rng_col)
        self._row_logprobs(logits_dev)
        return res

    def ring_block_idx(self):
        """GDN ring slot of the accepted state per head: idx[b*HV + hv] = (a_b * B + b) * HV + hv
        (= a_b * B*HV + h), uint32 [1, B*HV] ROW_MAJOR, persistent (:attr:`block_idx`). Slot a = state after
        verify row a (row 0 = the pending token, rows 1..a = the accepted drafts). Traceable."""
        self._require_allocated()
        if self.ring_heads is None:
            raise ValueError("ring_block_idx needs DeviceAcceptor(..., ring_heads=HV) at construction")
        ttnn, b, hv = self.ttnn, self.batch, int(self.ring_heads)
        blk = ttnn.add(ttnn.multiply(self.count, float(b * hv)), self.c_ring_heads)  # [1, B, 1, HV]
        blk = ttnn.reshape(ttnn.typecast(blk, ttnn.uint32), [1, b * hv])
        ttnn.copy(ttnn.to_layout(blk, ttnn.ROW_MAJOR_LAYOUT), self.block_idx)
        return self.block_idx

    # ------------------------------------------------------------------------------------------------
    # host read-back (the only device->host transfer)
    # ------------------------------------------------------------------------------------------------
    def read_results(self, result_dev=None, *, check_replicas: bool = True) -> list[AcceptResult]:
        """Read the result tensor (one small int32 tensor) -> one :class:`AcceptResult` per user.

        Checks that every device holds the same result (replicated acceptance must agree across cards) and
        refills the RNG table when the step used its last row. Call it after each step, before the next.
        """
        self._require_allocated()
        ttnn = self.ttnn
        t = result_dev if result_dev is not None else self.result
        shards = [ttnn.to_torch(s).to(torch.int64) for s in ttnn.get_device_tensors(t)]
        host = shards[0]
        if check_replicas:
            for i, s in enumerate(shards[1:], 1):
                if not torch.equal(s, host):
                    raise RuntimeError(f"acceptance result differs between device 0 and device {i}: "
                                       f"{host.flatten().tolist()} vs {s.flatten().tolist()}")
        host = host.reshape(self.batch, self.rows + RESULT_EXTRA_COLS)
        out = []
        for row in host.tolist():
            toks, a, rng_row = row[: self.rows], row[self.rows], row[self.rows + 1]
            if not 0 <= a <= self.k:
                raise RuntimeError(f"device acceptance returned a={a} outside [0, {self.k}]: {row}")
            out.append(AcceptResult(tokens=toks, num_accepted=a, rng_row=rng_row))
        used = max(r.rng_row for r in out)
        if used >= self.rng_rows - 1:
            self.refill_rng()
        return out

    def read_result(self, result_dev=None) -> tuple[list[int], int]:
        """B == 1 convenience: -> (tokens [K+1] with PLACEHOLDER_TOKEN_ID after the emitted ones, a)."""
        if self.batch != 1:
            raise ValueError(f"read_result is for batch 1 (this acceptor has B={self.batch}); use read_results")
        r = self.read_results(result_dev)[0]
        return r.tokens, r.num_accepted


__all__ = ["DeviceAcceptor", "AcceptResult", "PLACEHOLDER_TOKEN_ID", "UNIFORMS_PER_ROW"]
