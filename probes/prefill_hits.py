"""What a prefix-cache hit adds to a prefill, as the vLLM adapter serves it (``tt/runtime/resume.py``): the GDN
checkpoint copies one layer's save and restore count, and the grid boundary a hit restores with the rows it re-runs.
Used by the prefill-cost probe's prefix-hit rows."""
from __future__ import annotations

from qwen36.errors import UserError


def parse_hits(text: str) -> list[tuple[int, int]]:
    """``--prefix-hits`` as (prompt, hit) pairs from ``PROMPT:HIT,...``."""
    out = []
    for pair in (x for x in text.split(",") if x.strip()):
        a, sep, b = pair.partition(":")
        if not sep:
            raise UserError(f"--prefix-hits takes PROMPT:HIT pairs, got {pair!r}")
        out.append((int(a), int(b)))
    return out


def checkpoint_counts(bench, gdn_index: int) -> dict:
    """Counts of saving and of restoring one GDN layer's checkpoint (``tt/runtime/resume.py`` ``CheckpointPool``:
    device copies of the recurrent and conv state): what a prefix hit adds per GDN layer."""
    from qwen36.tt.runtime.resume import CheckpointPool

    pool = CheckpointPool(bench.model, 1, gdn_layers=1)
    layer = [bench.state.layers[gdn_index]]
    try:
        with bench.ctx.counters.scope("checkpoint save") as save:
            pool.save(0, layer)
        with bench.ctx.counters.scope("checkpoint load") as load:
            pool.load(0, layer)
    finally:
        pool.release()
    return {"checkpoint_save": save.copy("checkpoint save (one GDN layer)"),
            "checkpoint_load": load.copy("checkpoint load (one GDN layer)")}


def hit_plan(prompt: int, hit: int, chunk: int, page: int) -> dict:
    """How the adapter serves a hit of ``hit`` cached tokens on a ``prompt``-token prompt (``tt/runtime/resume.py``):
    the grid boundary it restores, the rows it runs, the checkpoints the default policy saves on the way."""
    from qwen36.tt.runtime.resume import CheckpointPolicy

    if hit % page or not 0 < hit < prompt:
        raise UserError(f"prefix hit {hit} must be a multiple of the KV page ({page}) in (0, prompt {prompt})")
    u = chunk * (hit // chunk)
    saves = sum(CheckpointPolicy().wants(b, prompt, chunk) for b in range(u + chunk, prompt, chunk))
    return {"restored_from": u, "rerun_tokens": hit - u, "prefilled_tokens": prompt - u, "saves": saves}
