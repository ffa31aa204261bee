"""On-device acceptance for MTP speculative decoding: greedy and stochastic, traceable.

Everything between "target verify logits + draft tokens are on device" and "host reads one small tensor"
is a composition of ttnn ops: no host reads or writes, no tensor creation (constants, scratch, RNG table
and the persistent result buffers are made in :meth:`DeviceAcceptor.allocate`, before any capture), so a
caller can record :meth:`DeviceAcceptor.greedy` / :meth:`DeviceAcceptor.stochastic` inside its traced spec
step. Semantics are those of the reference engine (``models/qwen36/speculative/acceptance.py`` and
``generation/sampling.py``); see docs/tt_mtp_accept.md ("Acceptance on device") for the semantics and card caveats.

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

Parameters: one :class:`SamplingParams` for every row (scalar operands; the batch-1 form), or, with
``stages=SamplerStages(...)``, each row (user) its own, written by :meth:`DeviceAcceptor.set_row` outside any
capture as fp32 per-row operands ``[1, B, 1, 1]`` (the plain-decode sampler's, ``tt/runtime/sampler_transform.py``:
temperature, min_p, top-k, top-p, penalties; the same functions compute both). The traced step then holds only
the stages the rows may need; with greedy and sampled rows in one step it runs both acceptances and selects per
row, so a greedy row's tokens and count are exactly the greedy acceptance's.

Randomness: each row (user) has its own persistent fp32 table of uniforms ``[rng_rows, 32]`` and a
device-resident row counter; a stochastic step gathers the row at each counter (``ttnn.embedding``) and advances
the counters in place. The tables are (re)filled outside any trace, either on device with seeded
``ttnn.uniform`` (``rng="device"``, default) or from a seeded torch generator on the host (``rng="host"``:
bit-identical across card and emulator), seeded from the row's user's seed (:meth:`DeviceAcceptor.set_row`
restarts the row's stream), so a user's draws are the same in whichever row and batch it runs.
:meth:`DeviceAcceptor.read_results` refills a row's table when the row just used was its last one. Drawing in a
trace would replay the same seed every step (captured runtime args), which is why draws happen outside.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qwen36.errors import UserError
from qwen36.speculative.acceptance import PLACEHOLDER_TOKEN_ID
from qwen36.generation.sampling import SamplingParams

from ..model.ccl import ccl_for
from ..model.model_config import compute_config_exact_count
from ..runtime.sampler_tables import TokenCounts, UniformTable
from .accept_results import RESULT_EXTRA_COLS, AcceptResult, ResultReadback
from ..runtime.sampler_transform import (SamplerStages, inverse_cdf_draw, neutral_value, penalize, penalize_rows,
                                         probs_from_logits, probs_rows, row_operand_keys, row_values)

MAX_EXACT_FP32_INT = 1 << 24  # token ids / counts are carried in fp32: exact below 2**24
UNIFORMS_PER_ROW = 32  # one tile row of uniforms per user per step: K accept draws + 1 categorical draw
LOGITS_LAYOUTS = ("replicated", "vocab_sharded")


class DraftDepthError(UserError, ValueError):
    """A draft depth K the on-device acceptance cannot hold."""


def acceptor_uniform_seeds(seed: int):
    """(device_seed(refill), host_seed) of the acceptance uniform stream of a user with ``seed``: nonzero and
    deterministic per (seed, refill) (0 means unseeded to ``ttnn.uniform``), an affine map of its own (the draft
    picks' and plain decoding's differ)."""
    s = int(seed)
    return (lambda refill: (s * 1_000_003 + refill * 7919 + 1) % 0x7FFFFFFF or 1), s


class DeviceAcceptor(ResultReadback):
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
                 token_counts: TokenCounts | None = None, stages: SamplerStages | None = None):
        """``sampling_params``: every row's parameters (scalar operands), unless ``stages`` is given: then each row
        takes its own user's (:meth:`set_row`), as per-row operands for the stages listed (a row needing a stage
        the acceptor lacks is refused), and ``sampling_params`` only seeds the rows' streams until they get users.
        ``seed`` (default: the params') seeds row 0's uniform stream; row b's starts at ``seed + b``."""
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
        if stages is not None and not (stages.greedy or stages.sampled):
            raise ValueError("per-row acceptance needs the greedy or the sampled stage (or both)")
        self.stages = stages
        # what the traced step contains: the params' needs (scalar) or the stages' (per row)
        self.penalized = self.params.penalized if stages is None else stages.penalized
        self.n_logprobs = self.params.logprobs if stages is None else stages.logprobs
        self.row_params: list[SamplingParams | None] = [self.params if stages is None else None] * batch
        self.seed = int(self.params.seed if seed is None else seed)
        if token_counts is not None and (token_counts.vocab, token_counts.rows) != (vocab, batch):
            raise ValueError(f"token_counts are over vocab {token_counts.vocab} x {token_counts.rows} rows, the "
                             f"acceptor's are {vocab} x {batch}")
        # the penalty context; passed in when several acceptors (one per draft depth) serve one generation
        self.token_counts = token_counts
        self.logits_layout = logits_layout
        self.rng = rng
        self.rng_rows = rng_rows
        self.ring_heads = ring_heads
        self.num_devices = self._num_devices()
        self.allocated = False
        # one uniform table per row (each validates rng and rng_rows)
        self.row_uniforms = []
        for b in range(batch):
            device_seed, host_seed = acceptor_uniform_seeds(self.seed + b)
            self.row_uniforms.append(UniformTable(ttnn, mesh_device, rng_rows, UNIFORMS_PER_ROW, source=rng,
                                                  device_seed=device_seed, host_seed=host_seed))

    @property
    def uniforms(self) -> UniformTable:
        """Batch 1: the one uniform table (single-user callers share it across acceptors of several depths)."""
        if self.batch != 1:
            raise ValueError(f"uniforms is the batch-1 table; this acceptor has B={self.batch} (row_uniforms)")
        return self.row_uniforms[0]

    @uniforms.setter
    def uniforms(self, table: UniformTable) -> None:
        if self.batch != 1 or self.allocated:
            raise ValueError("only a batch-1 acceptor's table can be replaced, before allocate()")
        self.row_uniforms[0] = table

    @property
    def advances_rng(self) -> bool:
        """Whether a step advances the uniform counters (it has sampled rows)."""
        return (not self.params.greedy) if self.stages is None else self.stages.sampled

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
        if self.n_logprobs is not None:
            self.logprobs = self._replicated(torch.zeros(1, b, r, 2 + 2 * self.n_logprobs), f32,
                                             ttnn.ROW_MAJOR_LAYOUT)
        if self.penalized:
            if self.token_counts is None:
                self.token_counts = TokenCounts(ttnn, self.mesh, v, rows=b)
            self.token_counts.allocate()
            self.c_zero_vocab_row = self._replicated(torch.zeros(1, b, 1, v), f32)
        if self.stages is not None:  # per-row operands, neutral until a row gets a user
            self.ops_host = {key: torch.full((1, b, 1, 1), neutral_value(key, v))
                             for key in row_operand_keys(self.stages)}
            self.ops = {key: self._replicated(t, f32) for key, t in self.ops_host.items()}
        if b > 1:
            self.c_zero_1 = self._replicated(torch.zeros(1, 1, 1, 1), f32)
        # RNG: a table of uniforms + device-side row counter per row (fp32, exact below 2**24 rows); first fill
        for u in self.row_uniforms:
            u.allocate()
        self.allocated = True
        return self

    def refill_rng(self) -> None:
        """(Re)fill every row's uniform table and reset its device counter. Outside any capture; allocates nothing."""
        self._require_allocated()
        for u in self.row_uniforms:
            u.refill()

    def restart_rng(self) -> None:
        """Every row back to its stream's first fill (same seeds again)."""
        self._require_allocated()
        for u in self.row_uniforms:
            u.restart()

    def step_back_rng(self, rows=None) -> None:
        """Undo an aborted step's advance of the uniform counters of ``rows`` (default: every row; no-op when steps
        draw nothing). Outside any capture."""
        if self.advances_rng:
            for b in range(self.batch) if rows is None else rows:
                self.row_uniforms[b].step_back()

    def _check_row(self, row: int) -> None:
        self._require_allocated()
        if not isinstance(row, int) or not 0 <= row < self.batch:
            raise ValueError(f"row {row!r} out of range (B={self.batch})")

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Row ``row`` now serves a user with ``params`` (outside any capture): its per-row operands (with
        ``stages``; without, the params must be the acceptor's apart from the seed) and its uniform stream,
        restarted at the first fill of ``params.seed``'s stream (a batch-1 acceptor seeded alike draws the same).
        Penalty context: :meth:`start_penalties` with this row."""
        self._check_row(row)
        if self.stages is None:
            if replace(params, seed=self.params.seed) != self.params:
                raise ValueError(f"row {row}: {params.describe()} differ from this acceptor's "
                                 f"{self.params.describe()} (per-row params need DeviceAcceptor(..., stages=...))")
        else:
            missing = self.stages.missing(params, self.vocab)
            if missing:
                raise ValueError(f"row {row}: {params.describe()} needs {', '.join(missing)}, which this acceptor's "
                                 f"traced step does not contain (its stages: {self.stages})")
            vals = row_values(params, self.vocab)
            for key, t in self.ops_host.items():
                t[0, row, 0, 0] = vals[key]
                self.ttnn.copy_host_to_device_tensor(self._replicated_host(t), self.ops[key])
        u = self.row_uniforms[row]
        u.device_seed, u.host_seed = acceptor_uniform_seeds(params.seed)
        u.restart()
        self.row_params[row] = params

    def _replicated_host(self, x: torch.Tensor):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

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

    def _penalize(self, x, seen, counts):
        """fp32 logits after each row's penalties (scalar params, or the per-row operands)."""
        if self.stages is None:
            return penalize(self.ttnn, x, self.params, seen, counts)
        return penalize_rows(self.ttnn, x, self.stages, self.ops, seen, counts)

    def _greedy_select(self, x, drafts_col):
        """(a, final) [1, B, 1, 1] fp32 of greedy acceptance over the (penalised) rows x [1, B, R, V]."""
        ttnn, b, k = self.ttnn, self.batch, self.k
        am = ttnn.argmax(x, dim=3, keepdim=True)  # [1, B, R, 1] uint32 (ROW_MAJOR on cards)
        am = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        am_k = ttnn.slice(am, [0, 0, 0, 0], [1, b, k, 1])
        a = self._num_accepted(ttnn.eq(am_k, drafts_col))
        sel = ttnn.eq(self.c_row_idx, a)  # [1, B, R, 1] one-hot at row a
        final = ttnn.sum(ttnn.multiply(am, sel), dim=2, keepdim=True, compute_kernel_config=self._ckc)
        return a, final

    def greedy(self, logits_dev, drafts_dev):
        """Greedy acceptance. logits [1,B,R,V] (bf16/fp32), drafts [1,B,1,K] uint32 -> persistent result.

        a = longest prefix with d_i == argmax(row i-1); final = argmax(row a). argmax ties: lowest index.
        """
        self._require_allocated()
        if self.stages is not None and not self.stages.greedy:
            raise ValueError("greedy(): this acceptor's stages have no greedy rows")
        ttnn = self.ttnn
        self._check_dev(logits_dev, self.rows, "greedy logits")
        x = self._gathered(logits_dev)
        drafts_row, drafts_col = self._drafts_f32(drafts_dev)
        if self.penalized:  # argmax of the penalised rows: row j counts d_1..d_j (plain greedy's context)
            x = x if x.dtype == ttnn.float32 else ttnn.typecast(x, ttnn.float32)
            x = self._penalize(x, *self.row_penalties(drafts_col))
        a, final = self._greedy_select(x, drafts_col)
        res = self._finish(drafts_row, a, final, self.c_minus_one_col)
        self._row_logprobs(logits_dev)
        return res

    def probs_from_logits(self, logits_dev, penalties=None):
        """Device twin of ``generation.sampling.probs_from_logits``: [1,B,rows,V] -> fp32 probabilities (full V),
        by :func:`.sampler.probs_from_logits` (scalar params) or :func:`.sampler.probs_rows` (per-row operands; the
        one device transform either way). ``penalties``: ``(seen, counts)`` fp32 broadcastable to the rows (needed
        when penalties are on)."""
        self._require_allocated()
        ttnn, p = self.ttnn, self.params
        if (p.greedy if self.stages is None else not self.stages.sampled):
            raise ValueError("probs_from_logits needs temperature > 0 (greedy decoding uses argmax)")
        if self.stages is not None and int(logits_dev.shape[1]) != self.batch:
            # the per-row operands are [1, B, 1, 1]: users must be dim 1 or they would broadcast across users
            raise ValueError(f"per-row probs_from_logits takes [1, B={self.batch}, rows, V] (users in dim 1), got "
                             f"{[int(d) for d in logits_dev.shape]}")
        x = self._gathered(logits_dev)
        if x.dtype != ttnn.float32:
            x = ttnn.typecast(x, ttnn.float32)
        if self.penalized:
            if penalties is None:
                raise ValueError("penalties are on but no (seen, counts) were given")
            x = self._penalize(x, *penalties)
        if self.stages is None:
            return probs_from_logits(ttnn, x, p, self._ckc)
        return probs_rows(ttnn, x, self.stages, self.ops, self.c_vocab_idx, self._ckc)

    # ---- logprobs of the emitted tokens ---------------------------------------------------------------------
    def _row_logprobs(self, logits_dev) -> None:
        """Raw logprobs (log-softmax of the unprocessed verify rows) of each row's emitted token (the result's token
        columns), its rank and the top n, into the persistent :attr:`logprobs` ``[1, B, R, 2 + 2n]`` fp32 ROW_MAJOR
        (rows after ``a`` hold placeholders' values: ignored). No-op unless logprobs are on."""
        if self.n_logprobs is None:
            return
        ttnn, b, r, n, ckc = self.ttnn, self.batch, self.rows, self.n_logprobs, self._ckc
        x = self._gathered(logits_dev)
        x = x if x.dtype == ttnn.float32 else ttnn.typecast(x, ttnn.float32)
        shifted = ttnn.subtract(x, ttnn.max(x, dim=3, keepdim=True))
        lp = ttnn.subtract(shifted, ttnn.log(ttnn.sum(ttnn.exp(shifted), dim=3, keepdim=True, compute_kernel_config=ckc)))
        toks = ttnn.typecast(ttnn.slice(self.result, [0, 0, 0, 0], [1, b, 1, r]), ttnn.float32)
        onehot = ttnn.eq(self.c_vocab_idx, ttnn.reshape(toks, [1, b, r, 1]))  # [1, B, R, V]
        own = ttnn.sum(ttnn.multiply(lp, onehot), dim=3, keepdim=True, compute_kernel_config=ckc)
        rank = ttnn.add(ttnn.sum(ttnn.gt(lp, own), dim=3, keepdim=True, compute_kernel_config=ckc), 1.0)
        cols = [own, rank]
        if n:
            vals, idx = ttnn.topk(lp, n, dim=3)
            cols += [ttnn.typecast(ttnn.to_layout(idx, ttnn.TILE_LAYOUT), ttnn.float32), vals]
        ttnn.copy(ttnn.to_layout(ttnn.concat(cols, dim=3), ttnn.ROW_MAJOR_LAYOUT), self.logprobs)

    # ---- penalties: token counts on device, one row per user ----------------------------------------------
    def start_penalties(self, prompt_len: int, history, row: int = 0) -> None:
        """Write the penalty state of row ``row``'s generation: ``history`` = prompt then every emitted token (the
        pending one included); the first ``prompt_len`` are the prompt. Host writes, outside any capture."""
        self._require_allocated()
        if self.penalized:
            self.token_counts.start(prompt_len, history, row)

    @property
    def seen(self):
        """``[1, B, 1, V]`` fp32 0/1: in the prompt or the output (the :class:`.sampler.TokenCounts` buffer)."""
        return self.token_counts.seen

    @property
    def counts(self):
        """``[1, B, 1, V]`` fp32: occurrences in the output (the :class:`.sampler.TokenCounts` buffer)."""
        return self.token_counts.counts

    def row_penalties(self, drafts_col):
        """(seen, counts) ``[1, B, R, V]`` of the verify rows: row j adds d_1..d_j to the committed counts (it is
        used only when they were all accepted, so it sees what plain decoding would). Traceable."""
        ttnn = self.ttnn
        onehot = ttnn.eq(self.c_vocab_idx, drafts_col)  # [1, B, K, V]
        added = ttnn.concat([self.c_zero_vocab_row, ttnn.cumsum(onehot, dim=2)], dim=2)  # [1, B, R, V]
        return ttnn.maximum(self.seen, ttnn.gt(added, 0.0)), ttnn.add(self.counts, added)

    def draft_penalties(self):
        """(seen, counts) of the committed tokens: the context the sampled drafts use (the chain's own drafts
        are not added; the draft distribution only has to be the one the drafts were drawn from)."""
        return self.seen, self.counts

    def commit_counts(self, active=None):
        """Add the step's emitted tokens (the result's token columns; placeholders match nothing) to the counts,
        in place: part of the commit, inside its trace. Acceptors sharing one :class:`.sampler.TokenCounts` see each
        other's commits. ``active``: ``[1, B, 1, 1]`` fp32 0/1, the rows whose users were in the step (the others'
        results come from inert rows and are not added)."""
        ttnn, b, r = self.ttnn, self.batch, self.rows
        toks = ttnn.typecast(ttnn.slice(self.result, [0, 0, 0, 0], [1, b, 1, r]), ttnn.float32)
        onehot = ttnn.eq(self.c_vocab_idx, ttnn.reshape(toks, [1, b, r, 1]))  # [1, B, R, V]
        added = ttnn.sum(onehot, dim=2, keepdim=True, compute_kernel_config=self._ckc)  # [1, B, 1, V]
        if active is not None:
            added = ttnn.multiply(added, active)
        self.token_counts.add(added)

    def _uniforms(self):
        """-> (u_accept [1,B,K,1], u_final [1,B,1,1], rng_row [1,B,1,1]); advances the device counter in place."""
        ttnn, b, k = self.ttnn, self.batch, self.k
        if b == 1:
            row_B1132, rng_col_B111 = self.row_uniforms[0].next_row([1, 1, 1, UNIFORMS_PER_ROW],
                                                                    index_base=self.c_zero_col)
        else:  # each row's own stream: one gather per row
            rows = [u.next_row([1, 1, 1, UNIFORMS_PER_ROW], index_base=self.c_zero_1) for u in self.row_uniforms]
            row_B1132 = ttnn.concat([x[0] for x in rows], dim=1)
            rng_col_B111 = ttnn.concat([x[1] for x in rows], dim=1)
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
        if self.stages is not None and self.stages.greedy:
            raise ValueError("stochastic(): this acceptor's stages have greedy rows (use accept())")
        self._check_step(logits_dev, draft_probs_dev, "stochastic logits")
        drafts_row, drafts_col = self._drafts_f32(drafts_dev)
        pen = self.row_penalties(drafts_col) if self.penalized else None
        pt = self.probs_from_logits(logits_dev, pen)  # [1, B, R, V]
        a, final, rng_col = self._stochastic_select(pt, drafts_col, draft_probs_dev)
        res = self._finish(drafts_row, a, final, rng_col)
        self._row_logprobs(logits_dev)
        return res

    def _check_step(self, logits_dev, draft_probs_dev, what: str) -> None:
        b, k = self.batch, self.k
        self._check_dev(logits_dev, self.rows, what)
        if draft_probs_dev is not None:
            shape = [int(s) for s in draft_probs_dev.shape]
            if shape != [1, b, k, self.vocab]:
                raise ValueError(f"draft_probs: device shape {shape} != [1, B={b}, K={k}, V={self.vocab}] "
                                 "(full vocab: pass probs_from_logits(draft_logits))")

    def _stochastic_select(self, pt, drafts_col, draft_probs_dev):
        """(a, final, rng_row) [1, B, 1, 1] fp32 of rejection sampling against the target probabilities pt."""
        ttnn, b, k = self.ttnn, self.batch, self.k
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
        return a, final, rng_col

    def accept(self, logits_dev, drafts_dev, draft_probs_dev=None):
        """The step's acceptance for whatever rows this acceptor serves -> persistent result: :meth:`greedy` or
        :meth:`stochastic` when every row is of one kind; with greedy and sampled rows (per-row stages with both),
        both acceptances over the same (penalised) rows and a per-row select, so a greedy row's tokens and count are
        exactly the greedy acceptance's and a sampled row's the stochastic one's. Its RNG column then holds the
        stream row for every row (a greedy row's stream advances with the others' and is not read)."""
        if self.stages is None:
            greedy = self.params.greedy
        elif self.stages.greedy != self.stages.sampled:
            greedy = self.stages.greedy
        else:
            return self._mixed(logits_dev, drafts_dev, draft_probs_dev)
        if greedy:
            return self.greedy(logits_dev, drafts_dev)
        return self.stochastic(logits_dev, drafts_dev, draft_probs_dev)

    def _mixed(self, logits_dev, drafts_dev, draft_probs_dev):
        self._require_allocated()
        ttnn = self.ttnn
        self._check_step(logits_dev, draft_probs_dev, "accept logits")
        x = self._gathered(logits_dev)
        drafts_row, drafts_col = self._drafts_f32(drafts_dev)
        x32 = x if x.dtype == ttnn.float32 else ttnn.typecast(x, ttnn.float32)
        if self.penalized:
            x32 = x = self._penalize(x32, *self.row_penalties(drafts_col))
        a_g, final_g = self._greedy_select(x, drafts_col)  # the penalised rows, or the raw ones as greedy() takes them
        pt = probs_rows(ttnn, x32, self.stages, self.ops, self.c_vocab_idx, self._ckc)
        a_s, final_s, rng_col = self._stochastic_select(pt, drafts_col, draft_probs_dev)
        g = self.ops["greedy"]  # [1, B, 1, 1]: 1 = greedy row
        a = ttnn.where(g, a_g, a_s)
        final = ttnn.where(g, final_g, final_s)
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


__all__ = ["DeviceAcceptor", "AcceptResult", "PLACEHOLDER_TOKEN_ID", "UNIFORMS_PER_ROW", "acceptor_uniform_seeds"]
