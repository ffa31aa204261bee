"""The host side of :class:`~.accept.DeviceAcceptor`: the one device -> host read of a step (every user's emitted tokens,
accepted count and RNG row; the logprobs when asked) and the forced results a thinking budget's cut or phrase writes
between the verify and commit replays. Host work only: reads and persistent-buffer writes, no device op."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen36.speculative.acceptance import PLACEHOLDER_TOKEN_ID

RESULT_EXTRA_COLS = 2  # accepted count, RNG row


@dataclass(frozen=True)
class AcceptResult:
    """Host view of one step's result for one user."""

    tokens: list[int]  # K+1 entries: a+1 emitted tokens then PLACEHOLDER_TOKEN_ID
    num_accepted: int
    rng_row: int  # table row the step used, -1 for greedy

    @property
    def emitted(self) -> list[int]:
        return self.tokens[: self.num_accepted + 1]



class ResultReadback:
    """The acceptor's host-side methods (module doc), over the persistent ``result`` / ``count`` / ``logprobs``
    buffers the device side writes."""

    def read_logprobs(self, tokens: list[int], row: int = 0) -> list:
        """Host read of row ``row``'s :attr:`logprobs` -> one ``TokenLogprobs`` per emitted token (rows 0..a), with
        the top n its user asked for."""
        from qwen36.generation.sampling import TokenLogprobs

        ttnn, n = self.ttnn, self.n_logprobs
        p = self.row_params[row]
        if n is None or p is None or p.logprobs is None:
            raise ValueError(f"row {row}: no logprobs asked")
        m = p.logprobs
        rows = ttnn.to_torch(ttnn.get_device_tensors(self.logprobs)[0]).reshape(self.batch, self.rows, 2 + 2 * n)
        rows = rows[row].double()
        out = []
        for j, t in enumerate(tokens):
            row_ = rows[j].tolist()
            top = [(int(i), v) for i, v in zip(row_[2: 2 + m], row_[2 + n: 2 + n + m])]
            out.append(TokenLogprobs(int(t), row_[0], int(row_[1]), top))
        return out

    def read_results(self, result_dev=None, *, check_replicas: bool = True, idle_rows=()) -> list[AcceptResult]:
        """Read the result tensor (one small int32 tensor) -> one :class:`AcceptResult` per user.

        Checks that every device holds the same result (replicated acceptance must agree across cards) and
        refills a row's RNG table when the step used its last row. ``idle_rows``: rows whose users were not in the
        step: their stream row is given back (a user's draws follow its own steps only). Call it after each step,
        before the next.
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
        idle = set(idle_rows)
        for b, (u, r) in enumerate(zip(self.row_uniforms, out)):
            if b in idle:
                if r.rng_row >= 0:  # back to the row it did not use (a host write: no device op, any trace live)
                    self.ttnn.copy_host_to_device_tensor(self._replicated_host(torch.full((1, 1, 1, 1),
                                                                                          float(r.rng_row))), u.counter)
            elif r.rng_row >= self.rng_rows - 1:  # a row's stream used up: refill it
                u.refill()
        return out

    def force_result(self, tokens: list[int], num_accepted: int, rng_row: int) -> None:
        """B == 1: overwrite the step's result and count with a forced acceptance (host writes into the persistent
        buffers, between the verify and the commit replays): ``tokens`` = the a accepted rows' tokens then the next
        pending one. The commit, the MTP reseed and the token-count commit then take these, as they would the
        device's own. The thinking budget's forced phrase goes through a verify this way."""
        self._require_allocated()
        if self.batch != 1:
            raise ValueError(f"force_result is for batch 1 (this acceptor has B={self.batch})")
        a = int(num_accepted)
        if not 0 <= a <= self.k or len(tokens) != a + 1:
            raise ValueError(f"force_result: {len(tokens)} tokens for a={a} (need a+1, a in [0, {self.k}])")
        row = [int(t) for t in tokens] + [PLACEHOLDER_TOKEN_ID] * (self.rows - a - 1) + [a, int(rng_row)]
        ttnn = self.ttnn
        host = ttnn.from_torch(torch.tensor(row, dtype=torch.int32).reshape(1, 1, 1, -1), dtype=ttnn.int32,
                               layout=self.result.layout, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        ttnn.copy_host_to_device_tensor(host, self.result)
        ttnn.copy_host_to_device_tensor(self._replicated_host(torch.full((1, 1, 1, 1), float(a))), self.count)

    def force_rows(self, forced: dict[int, tuple[list[int], int]], results: list[AcceptResult]) -> None:
        """B rows: overwrite the step's result and count with forced acceptances for the rows in ``forced``
        (row -> (tokens, a): the a accepted rows' tokens then the next pending one), every other row written back as
        ``results`` (this step's :meth:`read_results`) read it, so its values are unchanged. Host writes into the
        persistent buffers between the verify and the commit replays, like :meth:`force_result`: the per-user
        commit, the MTP reseed and the token-count commit then take them (a thinking budget's cut or forced rows)."""
        self._require_allocated()
        if len(results) != self.batch:
            raise ValueError(f"force_rows: {len(results)} results for {self.batch} rows")
        rows, counts = [], []
        for b, r in enumerate(results):
            toks, a, rng_row = (list(r.tokens), r.num_accepted, r.rng_row)
            if b in forced:
                emitted, a = forced[b]
                a = int(a)
                if not 0 <= a <= self.k or len(emitted) != a + 1:
                    raise ValueError(f"force_rows: row {b}: {len(emitted)} tokens for a={a} (need a+1, a in "
                                     f"[0, {self.k}])")
                toks = [int(t) for t in emitted] + [PLACEHOLDER_TOKEN_ID] * (self.rows - a - 1)
            rows.append(toks + [a, rng_row])
            counts.append(float(a))
        ttnn = self.ttnn
        host = ttnn.from_torch(torch.tensor(rows, dtype=torch.int32).reshape(1, self.batch, 1, -1), dtype=ttnn.int32,
                               layout=self.result.layout, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))
        ttnn.copy_host_to_device_tensor(host, self.result)
        ttnn.copy_host_to_device_tensor(self._replicated_host(torch.tensor(counts).reshape(1, self.batch, 1, 1)),
                                        self.count)

    def read_result(self, result_dev=None) -> tuple[list[int], int]:
        """B == 1 convenience: -> (tokens [K+1] with PLACEHOLDER_TOKEN_ID after the emitted ones, a)."""
        if self.batch != 1:
            raise ValueError(f"read_result is for batch 1 (this acceptor has B={self.batch}); use read_results")
        r = self.read_results(result_dev)[0]
        return r.tokens, r.num_accepted
