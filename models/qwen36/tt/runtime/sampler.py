"""Plain decoding's token pick on device: :class:`DeviceSampler`, inside the traced decode step, for ``rows`` users at
once (batch 1 is ``rows=1``): each row greedy or sampled with its own user's parameters and seeded stream, penalties
from device-resident token counts updated in place, raw logprobs; only a few numbers per row cross to the host.
:class:`SamplerStages` (tt/runtime/sampler_transform.py, with the per-row transform it runs) says which parts of the
transform its traced step contains; its uniform table is tt/runtime/sampler_tables.py's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from qwen36.generation.sampling import SamplingParams, TokenLogprobs

from ..model.model_config import compute_config_exact_count
from .sampler_tables import DRAFT_UNIFORMS_PER_ROW, RNG_SOURCES, UniformTable, plain_sampler_seeds
from .sampler_transform import (SamplerStages, inverse_cdf_draw, neutral_value, penalize_rows, probs_rows,
                                row_operand_keys, row_values)


SAMPLER_HEAD_COLS = 3  # result columns before the top-n: token id, its raw logprob, its rank

class DeviceSampler:
    """Plain decoding's pick for ``rows`` users at once, on device and traceable: logits ``[1, 1, B, V]`` (one row
    per user) -> one persistent ROW_MAJOR fp32 result ``[1, 1, B, 1]``, or with logprob columns
    ``[1, 1, B, 3 + 2n]`` = ``[token, logprob, rank, top-n ids, top-n logprobs]`` per row. That result is all the
    host reads per step. Batch 1 is ``rows=1``.

    Every row samples with its own user's :class:`SamplingParams`: the parameters are per-row device tensors
    ``[1, 1, B, 1]`` that :meth:`start` writes when a user joins a row (outside capture), so one captured step
    serves any mix of users whose needs the sampler's :class:`SamplerStages` cover; a row whose parameter is off
    holds the neutral value, which leaves its values exactly unchanged. Per row, after vLLM's order:

    * penalties: ``seen`` (prompt or output) and ``counts`` (output occurrences) ``[1, 1, B, V]`` fp32 on device,
      written for a joining user's row (prompt and first token) and updated in place by every step with the row's
      token (inside the trace);
    * greedy rows: argmax of the penalised logits, on a ROW_MAJOR view (multi-core on cards; ties: lowest index);
    * sampled rows: temperature, min_p, top-k, top-p, softmax (the steps of :func:`probs_from_logits`, with a
      per-row operand where that function takes a scalar; one descending sort serves top-k and top-p), then
      :func:`inverse_cdf_draw` with one uniform from the row's own :class:`UniformTable` (column 0 of one table
      row per step), seeded by :func:`plain_sampler_seeds` of the user's seed and restarted when the user joins:
      a user's draws do not depend on its row or its neighbours. The host calls :meth:`before_step` (outside
      capture) before every execution: it refills a row's table when used up (every row's counter advances once
      per step);
    * a step with both kinds of rows computes both picks and selects per row;
    * logprobs: raw (vLLM's default ``raw_logprobs``): log-softmax of the unpenalised logits; the token's own,
      its rank and the top ``n`` by ``ttnn.topk`` (n = ``stages.logprobs``; a row that asked for fewer reads its
      first ones).

    Operands are fp32 tensors, so a per-row value enters the arithmetic as the fp32 number a card's binary op
    receives for a scalar (tt-metal packs a float scalar as fp32 for fp32 operands).
    """

    def __init__(self, ttnn, mesh_device, vocab: int, rows: int = 1, *, stages: SamplerStages | None = None,
                 rng: str = "device", rng_rows: int = 1024):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: sampled ids are counted in fp32 and would not be exact")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        if rng not in RNG_SOURCES:
            raise ValueError(f"rng must be one of {RNG_SOURCES}, got {rng!r}")
        self.ttnn, self.mesh, self.vocab, self.rows = ttnn, mesh_device, vocab, rows
        self.rng, self.rng_rows = rng, rng_rows
        self.stages = SamplerStages.every() if stages is None else stages
        st = self.stages
        if not (st.greedy or st.sampled):
            raise ValueError("a sampler needs the greedy or the sampled stage (or both)")
        self.n_top = st.logprobs
        self.width = 1 if self.n_top is None else SAMPLER_HEAD_COLS + 2 * self.n_top
        seeds = plain_sampler_seeds(0)  # each row's are its user's, set by start()
        self.uniforms = [UniformTable(ttnn, mesh_device, rng_rows, DRAFT_UNIFORMS_PER_ROW, source=rng,
                                      device_seed=seeds[0], host_seed=seeds[1])
                         for _ in range(rows)] if st.sampled else []
        self.rows_used = [0] * rows  # host mirror of each row's uniform counter
        self.params: list[SamplingParams | None] = [None] * rows
        self.host = {k: torch.full((1, 1, rows, 1), neutral_value(k, vocab)) for k in row_operand_keys(st)}
        self.allocated = False

    def _replicated(self, x: torch.Tensor, layout=None, device=True):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=layout or ttnn.TILE_LAYOUT,
                               device=self.mesh if device else None, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def _dev0(self, t) -> torch.Tensor:
        return self.ttnn.to_torch(self.ttnn.get_device_tensors(t)[0]).float()

    def allocate(self) -> "DeviceSampler":
        """Every per-row parameter, penalty, constant, uniform and result buffer (before any capture); fills the
        uniform tables."""
        if self.allocated:
            return self
        ttnn, v, b = self.ttnn, self.vocab, self.rows
        self._ckc = compute_config_exact_count(ttnn)
        self.c_vocab_idx = self._replicated(torch.arange(v, dtype=torch.float32).reshape(1, 1, 1, v))
        self.dev = {k: self._replicated(t) for k, t in self.host.items()}
        if self.stages.penalized:
            self.seen = self._replicated(torch.zeros(1, 1, b, v))
            self.counts = self._replicated(torch.zeros(1, 1, b, v))
        self.result = self._replicated(torch.zeros(1, 1, b, self.width), layout=ttnn.ROW_MAJOR_LAYOUT)
        for u in self.uniforms:
            u.allocate()
        self.allocated = True
        return self

    def release(self) -> None:
        """Free the device buffers (no trace may be live that reads them)."""
        if not self.allocated:
            return
        ts = [self.c_vocab_idx, self.result, *self.dev.values()]
        if self.stages.penalized:
            ts += [self.seen, self.counts]
        for u in self.uniforms:
            ts += u.buffers()
        for t in ts:
            self.ttnn.deallocate(t)
        self.allocated = False

    # ---- host: users ------------------------------------------------------------------------------------------
    def _check_row(self, row: int) -> None:
        if not self.allocated:
            raise RuntimeError("DeviceSampler.allocate() first")
        if not isinstance(row, int) or not 0 <= row < self.rows:
            raise ValueError(f"row {row!r} out of range ({self.rows} rows)")

    def _write_penalties(self, rows: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Rewrite the given rows' (seen [V], counts [V]); the other rows keep their device values (read back
        first, unless every row is rewritten)."""
        if not self.stages.penalized:
            return
        ttnn, b, v = self.ttnn, self.rows, self.vocab
        if len(rows) == b:
            seen, counts = torch.zeros(1, 1, b, v), torch.zeros(1, 1, b, v)
        else:
            seen, counts = (self._dev0(t).reshape(1, 1, b, v) for t in (self.seen, self.counts))
        for r, (s, c) in rows.items():
            seen[0, 0, r], counts[0, 0, r] = s, c
        ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
        ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)

    def _history_rows(self, prompt_len: int, history: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seen, counts = torch.zeros(self.vocab), torch.zeros(self.vocab)
        seen[torch.as_tensor(list(history), dtype=torch.long)] = 1.0
        out = torch.as_tensor(list(history[prompt_len:]), dtype=torch.long)
        counts.index_add_(0, out, torch.ones(out.numel()))
        return seen, counts

    def _write_params(self) -> None:
        for k, t in self.host.items():
            self.ttnn.copy_host_to_device_tensor(self._replicated(t, device=False), self.dev[k])

    def start(self, row: int, params: SamplingParams, prompt: Sequence[int], first: int) -> None:
        """Row ``row`` now samples for a user with ``params`` whose prompt is ``prompt`` and whose first (prefill)
        token was ``first``: its parameter rows, its penalty rows and its uniform stream (restarted at the seed's
        first fill, so a seeded run replays). Outside any capture."""
        self._check_row(row)
        missing = self.stages.missing(params, self.vocab)
        if missing:
            raise ValueError(f"row {row}: {params.describe()} needs {', '.join(missing)}, which this sampler's "
                             f"traced step does not contain (its stages: {self.stages})")
        p = params
        vals = row_values(p, self.vocab)
        for k, t in self.host.items():
            t[0, 0, row, 0] = vals[k]
        self._write_params()
        self._write_penalties({row: self._history_rows(len(prompt), list(prompt) + [int(first)])})
        if self.uniforms:
            u = self.uniforms[row]
            u.device_seed, u.host_seed = plain_sampler_seeds(p.seed)
            u.restart()
        self.rows_used[row] = 0
        self.params[row] = params

    def resync(self, row: int, prompt_len: int, history: Sequence[int]) -> None:
        """Rewrite row ``row``'s penalty rows from its whole ``history`` (prompt then every emitted token) after
        tokens it did not sample (a step sampled elsewhere); the parameters and the uniform stream go on."""
        self._check_row(row)
        self._write_penalties({row: self._history_rows(prompt_len, history)})

    def export_rows(self, rows: list[int]) -> list[dict]:
        """Everything of the given rows (parameters, penalty rows, uniform table, counter and host stream state)
        on the host, for :meth:`import_rows` into another sampler with the same stages (a bucket move). Outside
        any capture."""
        b, v = self.rows, self.vocab
        pen = ([t.reshape(b, v) for t in (self._dev0(self.seen), self._dev0(self.counts))]
               if self.stages.penalized else None)
        out = []
        for r in rows:
            d = {"params": self.params[r], "host": {k: float(t[0, 0, r, 0]) for k, t in self.host.items()},
                 "penalties": None if pen is None else (pen[0][r].clone(), pen[1][r].clone()),
                 "rows_used": self.rows_used[r]}
            if self.uniforms:
                u = self.uniforms[r]
                d.update(table=self._dev0(u.table), counter=self._dev0(u.counter),
                         rng=(u.device_seed, u.host_seed, u.refills, u._host_gen))
            out.append(d)
        return out

    def import_rows(self, rows: list[int], data: list[dict]) -> None:
        for r, d in zip(rows, data):
            self._check_row(r)
            if d["host"].keys() != self.host.keys():
                raise ValueError(f"import_rows: rows of a sampler with other stages ({sorted(d['host'])} vs "
                                 f"{sorted(self.host)})")
        ttnn = self.ttnn
        for r, d in zip(rows, data):
            for k, val in d["host"].items():
                self.host[k][0, 0, r, 0] = val
            if self.uniforms:
                u = self.uniforms[r]
                ttnn.copy_host_to_device_tensor(self._replicated(d["table"], device=False), u.table)
                ttnn.copy_host_to_device_tensor(self._replicated(d["counter"], device=False), u.counter)
                u.device_seed, u.host_seed, u.refills, u._host_gen = d["rng"]
            self.rows_used[r], self.params[r] = d["rows_used"], d["params"]
        self._write_params()
        self._write_penalties({r: d["penalties"] for r, d in zip(rows, data)})

    def before_step(self) -> None:
        """Host bookkeeping before each step execution (outside capture): every row's uniform counter advances once
        per step; a table used up is refilled."""
        for r, u in enumerate(self.uniforms):
            if self.rows_used[r] >= self.rng_rows:
                u.refill()
                self.rows_used[r] = 0
            self.rows_used[r] += 1

    # ---- device (traceable) ------------------------------------------------------------------------------
    def pick(self, logits_11BV):
        """fp32 (or bf16) logits [1, 1, B, V] -> the persistent result (see the class docstring); updates the
        penalty rows in place."""
        ttnn, st, d, b = self.ttnn, self.stages, self.dev, self.rows
        raw = logits_11BV if logits_11BV.dtype == ttnn.float32 else ttnn.typecast(logits_11BV, ttnn.float32)
        x = penalize_rows(ttnn, raw, st, d, self.seen, self.counts) if st.penalized else raw
        if st.greedy:
            am = ttnn.argmax(ttnn.to_layout(x, ttnn.ROW_MAJOR_LAYOUT), dim=3, keepdim=True)  # multi-core layout
            tok = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        if st.sampled:
            rows = [u.next_row([1, 1, 1, DRAFT_UNIFORMS_PER_ROW])[0] for u in self.uniforms]
            urow = rows[0] if b == 1 else ttnn.concat(rows, dim=2)
            u = ttnn.slice(urow, [0, 0, 0, 0], [1, 1, b, 1])
            drawn = inverse_cdf_draw(ttnn, self._probs(x), u)
            tok = ttnn.where(d["greedy"], tok, drawn) if st.greedy else drawn
        cols = [tok]
        onehot = None
        if st.penalized or self.n_top is not None:
            onehot = ttnn.eq(self.c_vocab_idx, tok)  # [1, 1, B, V]
        if st.penalized:
            ttnn.copy(ttnn.add(self.counts, onehot), self.counts)
            ttnn.copy(ttnn.maximum(self.seen, onehot), self.seen)
        if self.n_top is not None:
            cols += self._logprobs(raw, onehot)
        res = cols[0] if len(cols) == 1 else ttnn.concat(cols, dim=3)
        ttnn.copy(ttnn.to_layout(res, ttnn.ROW_MAJOR_LAYOUT), self.result)
        return self.result

    def _probs(self, x):
        return probs_rows(self.ttnn, x, self.stages, self.dev, self.c_vocab_idx, self._ckc)

    def _logprobs(self, raw, onehot) -> list:
        """Raw log-softmax of the unprocessed logits, per row: [own, rank, top-n ids, top-n values] columns."""
        ttnn, ckc = self.ttnn, self._ckc
        shifted = ttnn.subtract(raw, ttnn.max(raw, dim=3, keepdim=True))
        lse = ttnn.log(ttnn.sum(ttnn.exp(shifted), dim=3, keepdim=True, compute_kernel_config=ckc))
        lp = ttnn.subtract(shifted, lse)
        own = ttnn.sum(ttnn.multiply(lp, onehot), dim=3, keepdim=True, compute_kernel_config=ckc)
        rank = ttnn.add(ttnn.sum(ttnn.gt(lp, own), dim=3, keepdim=True, compute_kernel_config=ckc), 1.0)
        out = [own, rank]
        if self.n_top:
            vals, idx = ttnn.topk(lp, self.n_top, dim=3)
            out += [ttnn.typecast(ttnn.to_layout(idx, ttnn.TILE_LAYOUT), ttnn.float32), vals]
        return out

    # ---- host ----------------------------------------------------------------------------------------------
    def read(self) -> list[tuple[int, TokenLogprobs | None]]:
        """The one readback per step (device 0's replica of the small result) -> per row (token, logprobs or None:
        logprobs for the rows whose user asked, its own top-n). Rows without a user hold meaningless tokens."""
        res = self._dev0(self.result).double().reshape(self.rows, self.width).tolist()
        toks = [int(r[0]) for r in res]
        if any(not 0 <= t < self.vocab for t in toks):
            raise RuntimeError(f"device sampler returned tokens outside [0, {self.vocab}): {toks}")
        out = []
        for r, (tok, row) in enumerate(zip(toks, res)):
            p = self.params[r]
            if self.n_top is None or p is None or p.logprobs is None:
                out.append((tok, None))
                continue
            n, c = p.logprobs, SAMPLER_HEAD_COLS
            ids, vals = row[c: c + n], row[c + self.n_top: c + self.n_top + n]
            out.append((tok, TokenLogprobs(tok, row[1], int(row[2]), [(int(i), v) for i, v in zip(ids, vals)])))
        return out
