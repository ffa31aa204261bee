"""Batched plain sampling on device: every row of a B-slot decode step picks its token with its own user's
parameters (temperature, top-k, top-p, min_p, repetition / presence / frequency penalties) and its own seeded
uniform stream, inside the traced step.

:class:`DeviceSampler` (tt/sampler.py) bakes one user's parameters into its trace as constants. Here they are
per-row device tensors ``[1, 1, B, 1]`` written from the host when a user joins a slot, so one captured step
serves any mix of users; the transform is the same sequence of ops, with a per-row operand where the batch-1
sampler has a scalar, and a row whose parameter is "off" gets the neutral value (temperature scale 1 for a greedy
row, top-k index V-1 = keep all, top-p threshold 2 = drop none, log min_p = -inf = drop none, penalties 1 / 0 /
0), which leaves its values unchanged. Greedy rows take the argmax of the penalised logits (a per-row mask
selects it). Each slot has its own :class:`UniformTable` seeded like the batch-1 sampler's for the user's seed
(``plain_sampler_seeds``) and restarted when the user joins, so a user's draws are the ones its batch-1 run makes,
and its tokens are that run's tokens wherever the per-row transform rounds like the scalar one (the tests check
token equality against ``TTGenerator.generate``).

Penalty context: ``seen`` / ``counts`` ``[1, 1, B, V]`` fp32, one row per slot, written for a joining user's row
(prompt and first token) and updated in place by every step with the row's own token.

Logprobs are not produced here (refused): the batch-1 generator serves them.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from qwen36.speculative.sampling import SamplingParams

from .batch import TTBatchDecoder
from .model_config import compute_config_exact_count
from .sampler import DRAFT_UNIFORMS_PER_ROW, UniformTable, inverse_cdf_draw, plain_sampler_seeds

NEUTRAL = {"inv_temp": 1.0, "greedy": 1.0, "kth": None, "top_p": 2.0, "log_min_p": float("-inf"),
           "inv_rep": 1.0, "rep": 1.0, "freq": 0.0, "pres": 0.0}


class BatchDeviceSampler:
    def __init__(self, ttnn, mesh_device, vocab: int, slots: int, *, rng: str = "device", rng_rows: int = 1024):
        if vocab >= 1 << 24:
            raise ValueError(f"vocab={vocab} >= 2**24: sampled ids are counted in fp32 and would not be exact")
        self.ttnn, self.mesh, self.vocab, self.slots, self.rng_rows = ttnn, mesh_device, vocab, slots, rng_rows
        self.uniforms = [UniformTable(ttnn, mesh_device, rng_rows, DRAFT_UNIFORMS_PER_ROW, source=rng,
                                      device_seed=plain_sampler_seeds(0)[0], host_seed=plain_sampler_seeds(0)[1])
                         for _ in range(slots)]
        self.rows_used = [0] * slots  # host mirror of each slot's uniform counter
        self.params: list[SamplingParams | None] = [None] * slots
        self.host = {k: torch.full((1, 1, slots, 1), float(vocab - 1) if v is None else v)
                     for k, v in NEUTRAL.items()}
        self.allocated = False

    def _replicated(self, x: torch.Tensor, layout=None, device=True):
        ttnn = self.ttnn
        return ttnn.from_torch(x, dtype=ttnn.float32, layout=layout or ttnn.TILE_LAYOUT,
                               device=self.mesh if device else None, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

    def allocate(self) -> "BatchDeviceSampler":
        """Every per-row parameter, penalty, constant, uniform and result buffer (before any capture)."""
        if self.allocated:
            return self
        ttnn, v, b = self.ttnn, self.vocab, self.slots
        self._ckc = compute_config_exact_count(ttnn)
        self.c_idx = self._replicated(torch.arange(v, dtype=torch.float32).reshape(1, 1, 1, v))
        self.dev = {k: self._replicated(t) for k, t in self.host.items()}
        self.seen = self._replicated(torch.zeros(1, 1, b, v))
        self.counts = self._replicated(torch.zeros(1, 1, b, v))
        self.result = self._replicated(torch.zeros(1, 1, b, 1), layout=ttnn.ROW_MAJOR_LAYOUT)
        for u in self.uniforms:
            u.allocate()
        self.allocated = True
        return self

    def release(self) -> None:
        """Free the device buffers (no trace may be live that reads them)."""
        if not self.allocated:
            return
        ts = [self.c_idx, self.seen, self.counts, self.result, *self.dev.values()]
        for u in self.uniforms:
            ts += [u.table, u.counter, u._zero]
        for t in ts:
            self.ttnn.deallocate(t)
        self.allocated = False

    # ---- host: users ------------------------------------------------------------------------------------------
    def start(self, slot: int, params: SamplingParams, prompt: Sequence[int], first: int) -> None:
        """Slot ``slot`` now samples for a user with ``params`` whose prompt is ``prompt`` and whose first (prefill)
        token was ``first``: its parameter rows, its penalty rows and its uniform stream (restarted at the seed's
        first fill). Outside any capture."""
        if not self.allocated:
            raise RuntimeError("BatchDeviceSampler.allocate() first")
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range ({self.slots} slots)")
        if params.logprobs is not None:
            raise NotImplementedError("logprobs in a batched sampled decode: use the batch-1 generator")
        ttnn, p, v = self.ttnn, params, self.vocab
        row = {"greedy": 1.0 if p.greedy else 0.0,
               "inv_temp": 1.0 if p.greedy else 1.0 / p.temperature,
               "kth": float(p.top_k - 1) if 0 < p.top_k < v else float(v - 1),
               "top_p": p.top_p if p.top_p < 1.0 else 2.0,
               "log_min_p": math.log(p.min_p) if p.min_p > 0.0 else float("-inf"),
               "rep": p.repetition_penalty, "inv_rep": 1.0 / p.repetition_penalty,
               "freq": p.frequency_penalty, "pres": p.presence_penalty}
        for k, val in row.items():
            self.host[k][0, 0, slot, 0] = val
            ttnn.copy_host_to_device_tensor(self._replicated(self.host[k], device=False), self.dev[k])
        seen, counts = (ttnn.to_torch(ttnn.get_device_tensors(t)[0]).reshape(1, 1, self.slots, v).float()
                        for t in (self.seen, self.counts))
        seen[0, 0, slot] = 0.0
        seen[0, 0, slot, torch.as_tensor(list(prompt) + [first], dtype=torch.long)] = 1.0
        counts[0, 0, slot] = 0.0
        counts[0, 0, slot, first] = 1.0
        ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
        ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)
        u = self.uniforms[slot]
        u.device_seed, u.host_seed = plain_sampler_seeds(p.seed)
        u.restart()
        self.rows_used[slot] = 0
        self.params[slot] = params

    def resync(self, slot: int, prompt_len: int, history: Sequence[int]) -> None:
        """Rewrite slot ``slot``'s penalty rows from its whole ``history`` (prompt then every emitted token) after
        tokens it did not sample (a step sampled elsewhere); the parameters and the uniform stream go on."""
        ttnn, v = self.ttnn, self.vocab
        seen, counts = (ttnn.to_torch(ttnn.get_device_tensors(t)[0]).reshape(1, 1, self.slots, v).float()
                        for t in (self.seen, self.counts))
        seen[0, 0, slot] = 0.0
        seen[0, 0, slot, torch.as_tensor(list(history), dtype=torch.long)] = 1.0
        counts[0, 0, slot] = 0.0
        out = torch.as_tensor(list(history[prompt_len:]), dtype=torch.long)
        counts[0, 0, slot].index_add_(0, out, torch.ones(out.numel()))
        ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
        ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)

    def export_rows(self, slots: list[int]) -> list[dict]:
        """Everything of the given slots (parameter rows, penalty rows, uniform table, counter and host stream
        state) on the host, for :meth:`import_rows` into another sampler (a bucket move). Outside any capture."""
        ttnn, v = self.ttnn, self.vocab
        dev0 = lambda t: ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()  # noqa: E731
        seen, counts = (dev0(t).reshape(self.slots, v) for t in (self.seen, self.counts))
        rows = []
        for s in slots:
            u = self.uniforms[s]
            rows.append({"params": self.params[s], "host": {k: float(t[0, 0, s, 0]) for k, t in self.host.items()},
                         "seen": seen[s].clone(), "counts": counts[s].clone(), "table": dev0(u.table),
                         "counter": dev0(u.counter), "rng": (u.device_seed, u.host_seed, u.refills, u._host_gen),
                         "rows_used": self.rows_used[s]})
        return rows

    def import_rows(self, slots: list[int], rows: list[dict]) -> None:
        ttnn, v = self.ttnn, self.vocab
        dev0 = lambda t: ttnn.to_torch(ttnn.get_device_tensors(t)[0]).float()  # noqa: E731
        seen, counts = (dev0(t).reshape(1, 1, self.slots, v) for t in (self.seen, self.counts))
        for s, r in zip(slots, rows):
            for k, val in r["host"].items():
                self.host[k][0, 0, s, 0] = val
            seen[0, 0, s], counts[0, 0, s] = r["seen"], r["counts"]
            u = self.uniforms[s]
            ttnn.copy_host_to_device_tensor(self._replicated(r["table"], device=False), u.table)
            ttnn.copy_host_to_device_tensor(self._replicated(r["counter"], device=False), u.counter)
            u.device_seed, u.host_seed, u.refills, u._host_gen = r["rng"]
            self.rows_used[s], self.params[s] = r["rows_used"], r["params"]
        for k, t in self.host.items():
            ttnn.copy_host_to_device_tensor(self._replicated(t, device=False), self.dev[k])
        ttnn.copy_host_to_device_tensor(self._replicated(seen, device=False), self.seen)
        ttnn.copy_host_to_device_tensor(self._replicated(counts, device=False), self.counts)

    def before_step(self) -> None:
        """Host bookkeeping before each step execution (outside capture): every slot's counter advances once per
        step; a table used up is refilled (the batch-1 sampler refills at the same count)."""
        for s, u in enumerate(self.uniforms):
            if self.rows_used[s] >= self.rng_rows:
                u.refill()
                self.rows_used[s] = 0
            self.rows_used[s] += 1

    # ---- device (traceable) -------------------------------------------------------------------------------------
    def pick(self, logits_11BV):
        """fp32 logits [1, 1, B, V] -> the persistent result [1, 1, B, 1] (token ids as fp32, ROW_MAJOR); updates
        the penalty rows in place."""
        ttnn, d = self.ttnn, self.dev
        x = logits_11BV if logits_11BV.dtype == ttnn.float32 else ttnn.typecast(logits_11BV, ttnn.float32)
        b, v = self.slots, self.vocab
        # penalties (vLLM's order and meaning; neutral rows: x * 1, x - 0)
        scaled = ttnn.where(ttnn.gt(x, 0.0), ttnn.multiply(x, d["inv_rep"]), ttnn.multiply(x, d["rep"]))
        x = ttnn.where(self.seen, scaled, x)
        x = ttnn.subtract(x, ttnn.multiply(self.counts, d["freq"]))
        x = ttnn.subtract(x, ttnn.multiply(ttnn.gt(self.counts, 0.0), d["pres"]))
        am = ttnn.argmax(ttnn.to_layout(x, ttnn.ROW_MAJOR_LAYOUT), dim=3, keepdim=True)
        greedy_tok = ttnn.typecast(ttnn.to_layout(am, ttnn.TILE_LAYOUT), ttnn.float32)
        # temperature, min_p, top-k, top-p, softmax (probs_from_logits with per-row operands)
        xt = ttnn.multiply(x, d["inv_temp"])
        floor = ttnn.add(ttnn.max(xt, dim=3, keepdim=True), d["log_min_p"])
        xt = ttnn.where(ttnn.lt(xt, floor), float("-inf"), xt)
        sorted_x, order = ttnn.sort(xt, dim=3, descending=True)
        kth = ttnn.max(ttnn.where(ttnn.eq(self.c_idx, d["kth"]), sorted_x, float("-inf")), dim=3, keepdim=True)
        xt = ttnn.where(ttnn.lt(xt, kth), float("-inf"), xt)
        sorted_x = ttnn.where(ttnn.lt(sorted_x, kth), float("-inf"), sorted_x)
        sp = ttnn.softmax(sorted_x, dim=3, numeric_stable=True, compute_kernel_config=self._ckc)
        mass_before = ttnn.subtract(ttnn.cumsum(sp, dim=3), sp)
        drop_sorted = ttnn.ge(mass_before, d["top_p"])
        drop = ttnn.scatter(drop_sorted, 3, order, drop_sorted)
        xt = ttnn.where(drop, float("-inf"), xt)
        probs = ttnn.softmax(xt, dim=3, numeric_stable=True, compute_kernel_config=self._ckc)
        rows = [u.next_row([1, 1, 1, DRAFT_UNIFORMS_PER_ROW])[0] for u in self.uniforms]
        urow = rows[0] if b == 1 else ttnn.concat(rows, dim=2)
        u = ttnn.slice(urow, [0, 0, 0, 0], [1, 1, b, 1])
        sampled_tok = inverse_cdf_draw(ttnn, probs, u)
        tok = ttnn.where(d["greedy"], greedy_tok, sampled_tok)
        onehot = ttnn.eq(self.c_idx, tok)  # [1, 1, B, V]
        ttnn.copy(ttnn.add(self.counts, onehot), self.counts)
        ttnn.copy(ttnn.maximum(self.seen, onehot), self.seen)
        ttnn.copy(ttnn.to_layout(tok, ttnn.ROW_MAJOR_LAYOUT), self.result)
        return self.result

    def read(self) -> list[int]:
        """The one readback per step: every row's token (device 0's replica of the small result)."""
        ttnn = self.ttnn
        row = ttnn.to_torch(ttnn.get_device_tensors(self.result)[0]).reshape(-1).tolist()
        toks = [int(t) for t in row]
        if any(not 0 <= t < self.vocab for t in toks):
            raise RuntimeError(f"batched device sampler returned tokens outside [0, {self.vocab}): {toks}")
        return toks


def sampled_step(dec: TTBatchDecoder, sampler: BatchDeviceSampler, tokens: dict[int, int],
                 traced: bool | None = None) -> list[int]:
    """One decode forward over ``dec``'s slots followed by the batched device pick, as one traced step (its own
    trace name, captured once like the greedy step); returns the token of every slot (rows of slots not in
    ``tokens`` are meaningless)."""
    m = dec.model
    if sampler.slots != dec.slots:
        raise ValueError(f"sampler has {sampler.slots} rows, the decoder {dec.slots} slots")
    for s in tokens:
        dec._check_slot(s)
        if dec.pos[s] < 0:
            raise ValueError(f"slot {s} has no user (join it first)")
        if dec.pos[s] >= m.args.max_seq_len:
            raise ValueError(f"slot {s}: position {dec.pos[s]} reached max_seq_len {m.args.max_seq_len}")
    toks = [int(tokens.get(s, 0)) for s in range(dec.slots)]
    pos = [dec.pos[s] if s in tokens else -1 for s in range(dec.slots)]
    m.copy_host_to_device(m.prepare_decode_inputs_host(toks, pos), dec.inputs)
    sampler.before_step()
    dec.traces.run(f"decode+sample/B{dec.slots}", lambda: sampler.pick(m.decode_forward(dec.inputs, dec.state).logits),
                   traced=dec.use_trace if traced is None else traced)
    dec.traces.step_done()
    out = sampler.read()
    for s in tokens:
        dec.pos[s] += 1
    return out


@torch.no_grad()
def batched_generate(dec: TTBatchDecoder, sampler: BatchDeviceSampler, prompts: list, params: list[SamplingParams],
                     max_new_tokens: int | list[int], eos_ids=()) -> list[list[int]]:
    """Plain decoding of every prompt as one batch, user i with ``params[i]``: user i joins slot i, its first
    token is picked on the host from its prompt's last row (as ``TTGenerator.generate`` does), every later token
    on device by the batched sampler; a user leaves at its EOS (kept) or after its token budget."""
    from qwen36.speculative.sampling import TokenHistory, pick_token

    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(params) != n or len(limits) != n:
        raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(limits)} token limits")
    if n > dec.slots:
        raise ValueError(f"{n} prompts for a decoder of {dec.slots} slots")
    if min(limits, default=1) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    out: list[list[int]] = [[] for _ in range(n)]
    active: set[int] = set()
    for u, (prompt, p) in enumerate(zip(prompts, params)):
        ids = [int(t) for t in torch.as_tensor(prompt).reshape(-1).tolist()]
        logits = dec.join(u, ids)
        gen = p.generator() if not p.greedy else None
        tok = int(pick_token(logits.reshape(1, -1), p, gen, TokenHistory(ids, sampler.vocab).now()))
        sampler.start(u, p, ids, tok)
        out[u].append(tok)
        if tok in eos_ids or len(out[u]) >= limits[u]:
            dec.leave(u)
        else:
            active.add(u)
    while active:
        toks = sampled_step(dec, sampler, {u: out[u][-1] for u in sorted(active)})
        for u in sorted(active):
            out[u].append(toks[u])
            if toks[u] in eos_ids or len(out[u]) >= limits[u]:
                active.discard(u)
                dec.leave(u)
    return out
