"""vLLM's automatic prefix caching on the hybrid model, the batch server's side: the plugin hands a prefix hit as a
prefill that starts past position 0 (``start_pos`` = the cached tokens, a whole number of vLLM blocks) with the
cached blocks in the row's block table; the model has the KV rows there but not the GDN state, which it keeps
itself (``tt/runtime/resume.py``: checkpoints at prefill-grid boundaries, the page ledger, the plan).

What ``ServedPrefix`` holds for one launch: the checkpoint store (its device pool allocated with the KV pool, before
any capture), the page ledger, the scratch pages the model appends to vLLM's pool (one prefill piece of pages: the
rows of cached pages a recomputation runs are written there), the counters, and what each row of the last prefill
call was served as (``served``: the recordings keep it, the soak oracle follows it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from loguru import logger

from ..runtime.resume import (CheckpointPolicy, CheckpointPool, CheckpointStore, PageLedger, ResumePlan,
                              ResumeStats, plan_resume)


@dataclass(frozen=True)
class PrefixConfig:
    """The launch's prefix-cache settings: ``enabled``: vLLM may send prefills past position 0 (its prefix caching or
    chunked prefill is on; otherwise such a row is refused as before, a continuation no slot holds named as such);
    ``checkpoints`` GDN checkpoint slots (0: none kept; a hit then recomputes from position 0, still exact), their
    ``policy``."""

    checkpoints: int = 0
    policy: CheckpointPolicy = CheckpointPolicy()
    enabled: bool = True

    @classmethod
    def off(cls) -> "PrefixConfig":
        return cls(0, enabled=False)

    @classmethod
    def from_tt_options(cls, tt: dict, enabled: bool, max_num_seqs: int) -> "PrefixConfig":
        """From the launch's ``additional_config`` ``tt`` options: ``prefix_checkpoints`` (slots; default with prefix
        caching or chunked prefill on (``enabled``): two per sequence plus two, at most 18),
        ``prefix_checkpoint_every`` (tokens, 0: only the last two boundaries of each prompt). Both off: no prefill
        past position 0 is served (PrefixConfig.off)."""
        if not enabled:
            return cls.off()
        n = tt.get("prefix_checkpoints", min(18, 2 * int(max_num_seqs) + 2))
        every = tt.get("prefix_checkpoint_every", 0)
        if not isinstance(n, int) or n < 0 or not isinstance(every, int) or every < 0:
            raise ValueError(f"additional_config tt.prefix_checkpoints={n!r} / tt.prefix_checkpoint_every={every!r}: "
                             f"non-negative integers expected")
        return cls(n, CheckpointPolicy(every=every))


class ServedPrefix:
    def __init__(self, model, config: PrefixConfig, scratch_pages: list[int]):
        a = model.args
        self.grid, self.page = a.prefill_chunk, a.block_size
        if scratch_pages and len(scratch_pages) < self.grid // self.page:
            raise ValueError(f"{len(scratch_pages)} scratch pages for a prefill piece of {self.grid // self.page}")
        self.config = config
        self.stats = ResumeStats()
        self.pool = CheckpointPool(model, config.checkpoints) if config.checkpoints else None
        self.store = (CheckpointStore(self.pool, self.grid, self.page, config.policy, self.stats)
                      if self.pool is not None else None)
        self.ledger = PageLedger()
        self.scratch = list(scratch_pages)
        self.served: list[dict] = []  # the last prefill call, per row

    def plan(self, tokens: list[int], start: int, end: int, row: torch.Tensor) -> ResumePlan:
        plan = plan_resume(tokens, end, start, [int(x) for x in row.reshape(-1).tolist()], self.ledger, self.store,
                           self.grid, self.page)
        if plan.divert and not self.scratch:
            raise RuntimeError(f"a prefill from position {start} must rerun cached rows but this model has no scratch "
                               f"pages (its KV pool did not come from allocate_kv_cache*)")
        s = self.stats
        s.prefills += 1
        s.computed_tokens += end - plan.start
        if start > 0:
            s.hits += 1
            s.hit_tokens += start
            s.recomputed_tokens += plan.recomputed
            s.misses += plan.start < plan.target
        if plan.checkpoint is not None:
            s.restores += 1
            s.restored_tokens += plan.start
        return plan

    def prefilled(self, plan: ResumePlan, row: torch.Tensor) -> None:
        """The plan ran: every whole page it wrote holds the canonical rows of its key."""
        r = row.reshape(-1)
        for j in range(plan.start // self.page, plan.end // self.page):
            if j not in plan.divert:
                self.ledger.prefilled(int(r[j]), plan.keys[j])

    def decoded(self, row: torch.Tensor, position: int, writer: int) -> None:
        """A decode step wrote the row at ``position`` into the page ``row`` names for it."""
        self.ledger.decoded(int(row.reshape(-1)[position // self.page]), writer)

    def repairs_checked(self, plan: ResumePlan, slot: int, tokens: list[int], fed: list, meta: list,
                        intact: list) -> None:
        """Cached pages the plan rewrites hold one sequence's decode rows; count and report those whose sequence may
        still be decoding: another slot than ``slot`` still holds its state (``intact``: no decode step left it out,
        which every running sequence is part of) and this prefill is not its resume (its prompt plus every token it
        emitted)."""
        self.stats.repaired_pages += len(plan.repairs)
        for j, writer in plan.repairs.items():
            holder = next((k for k, m in enumerate(meta) if m is not None and m.get("rid") == writer and k != slot
                           and intact[k]), None)
            if holder is None:
                continue
            held = fed[holder] or []
            if len(tokens) == len(held) + 1 and tokens[: len(held)] == held:
                continue  # its resume: the same request, preempted
            self.stats.unsafe_repairs += 1
            logger.warning(f"prefix cache: cached page {j} of a {len(tokens)}-token prefill held decode rows of the "
                           f"sequence in state slot {holder}; it is rewritten with the prefill's rows, and that "
                           f"sequence's later rows change if it is still decoding (the plugin does not say)")

    def clear(self) -> None:
        """Forget every checkpoint and page (after warmup: its prompts were dummies in scratch blocks)."""
        self.ledger.clear()
        if self.store is not None:
            self.store.clear()
        self.stats.__init__()

    def release(self) -> None:
        if self.pool is not None:
            self.pool.release()
            self.pool = self.store = None
