"""Probe prefill-cost: calibrated time to first token (TTFT) on P150a, from the emulator's counts of the real
prefill programs (TTQwen36Model's chunked prefill) charged by tt_ops/cost_model.py. Never a measurement.

Method (``--preset 27b``, the decode-cost build: the real config with random weights, only the first GDN and the
first attention layer built, the vocabulary cut to ``--vocab-sample``):

  * two whole prefill chunks (``--chunk`` rows, default ``TTModelArgs.prefill_chunk``; positions 0.. and chunk..)
    run through the model's own prefill pieces in ``prefill_forward``'s order (``embed``, ``prefill_chunk_context``,
    ``layers_forward``, ``head`` of the last row), each piece under a counter scope (:func:`count_chunks`; a test
    checks their sum equals ``prefill_forward``'s counts), and one chunk of each other row count a prompt needs (its
    partial last chunk, e.g. all of a 128-token prompt), the GDN layers on the model's own prefill path (ttnn's
    fused ops where the config's heads fit them) or, with ``--gdn-prefill composite``, the composite one
    (:func:`force_gdn_prefill`; the record's ``gdn_prefill_path`` says which ran);
  * one correction, as decode-cost corrects its gathers: the emulator charges a token-embedding or RoPE-table
    gather its whole table; on cards it reads one row per token (``CostBench.corrected_embed``);
  * per layer kind the programs of every chunk of a given row count are the same, and the only counts that change
    with the chunk's position are the SDPA program's FLOPs (linear in its start) and the K/V pages it reads (those up
    to the chunk's end: :func:`sdpa_chunk_counts`), so a prompt of ``P`` tokens from position ``S`` is
    ``sum over its chunks (embed + n_gdn x GDN layer + n_attn x attention layer at that chunk's start) + head``,
    the head's LM-head matmul extrapolated linearly in vocab to the real 248,320. tests/probes/test_prefill_cost.py
    proves it at CI size against chunks actually run, and every run checks it at a long position: one chunk's
    attention layer is run at ``--long-check`` (default the longest prompt's last whole chunk, up to 262,144 - chunk:
    chunked SDPA over that many K/V positions) and its counts must equal the chunk moved there from position 0
    (:func:`long_position_check`, a cell of the record);
  * ``--preset 35b-a3b``: built at 32, 64 and 96 routed experts, every per-chunk count extrapolated to the real 256
    as a polynomial of degree 2 in the expert count (:func:`extrapolate_experts`; checked at CI size against a fourth
    build);
  * the total is charged by ``cost_model.calibrated_prefill_figures`` as an eager region (the prefill is not
    traced): per op, the larger of its device time (the decode constants: programs, DRAM, collectives, plus the
    compute term) and its programs' host dispatch (``eager_dispatch_us``; docs/cost_model.md "Prefill and time to
    first token").

TTFT here = the time of the prefill, the last row's LM head and its all_gather. Not in it: the host's token upload,
logits readback and sampling.
"""
from __future__ import annotations

import argparse

import torch

from qwen36.errors import UserError
from qwen36.probes.records import ProbeReport
from qwen36.probes.prefill_hits import checkpoint_counts, hit_plan, parse_hits

NAME = "prefill-cost"
HELP = ("calibrated P150a time to first token (prefill chunks + last-row LM head) at 27B / 35B-A3B shapes, from "
        "emulator counts")
SDPA = "ttnn.transformer.chunked_scaled_dot_product_attention"
PAGE_TABLE_KEY = "INT32"  # the page table's dtype: the counters' key of its bytes
GDN_PREFILL = ("fused", "composite")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "35b-a3b", "ci", "moe-ci"],
                   help="27b / 35b-a3b: real shapes (first GDN + attention layer built, the rest by layer count; the "
                        "MoE sibling built at 32 and 64 experts and extrapolated to 256); ci / moe-ci: the tiny CI "
                        "configs")
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--prompts", default="128,4096,16384,65536,131072,262144",
                   help="prompt lengths in tokens (a partial last chunk is counted at its own size)")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk in rows (TTModelArgs.prefill_chunk; default: the model's)")
    p.add_argument("--long-check", type=int, default=None,
                   help="position at which one whole chunk's attention layer is run and compared with the chunk moved "
                        "there from position 0 (default: the longest prompt's last whole chunk; 0: none)")
    p.add_argument("--prefix-hits", default="",
                   help="prefix-cache hits to price as the vLLM adapter serves them, PROMPT:HIT pairs (e.g. "
                        "4096:3840; HIT a multiple of the KV page): the GDN checkpoint at the prefill-grid boundary "
                        "u <= HIT is restored (device copies), the rows from u are prefilled (those below HIT rerun), "
                        "and the checkpoints the policy keeps are saved on the way")
    p.add_argument("--vocab-sample", type=int, default=4096,
                   help="vocabulary actually built (LM head extrapolated to the real vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gdn-prefill", default="fused", choices=list(GDN_PREFILL),
                   help="fused: the GDN layers' prefill on ttnn's fused ops where the config's heads fit them (the "
                        "model's choice); composite: the composite GDN prefill forced, for an A/B of the two")


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


def count_chunks(bench, ids: torch.Tensor) -> list[dict]:
    """Counts of each prefill chunk of ``ids`` (from ``state.pos``), by piece: ``embed`` (token embedding, RoPE
    rows and the chunk's attention inputs), ``layer<i>`` (each built layer), ``head`` (the last chunk only: final
    norm, last-row LM head, all_gather). The same calls, in the same order, as ``TTQwen36Model.prefill_forward``
    with ``all_rows=False``."""
    model, state, ctx = bench.model, bench.state, bench.ctx
    ttnn, a = bench.ttnn, bench.args
    from qwen36.tt.model.model_config import activation_memory_config

    rm, mc = ttnn.ROW_MAJOR_LAYOUT, activation_memory_config(ttnn)
    ids = ids.reshape(-1).to(torch.int32)
    start0, chunks = state.pos, []
    for off in range(0, ids.numel(), a.prefill_chunk):
        chunk = ids[off: off + a.prefill_chunk]
        rows, start = chunk.numel(), start0 + off
        parts = {}
        bench.regions.clear()
        with ctx.counters.scope("embed") as emb:
            tokens = ttnn.from_torch(chunk[None], dtype=ttnn.uint32, layout=rm, device=model.mesh, memory_config=mc)
            pctx = model.prefill_chunk_context(start, rows, state.page_table, state.page_table_host)
            x = model.embed(tokens)
        parts["embed"] = emb
        x = model.layers_forward(x, state, pctx)  # records layer<i> through model.region
        parts.update(bench.regions)
        if off + a.prefill_chunk >= ids.numel():
            with ctx.counters.scope("head") as hd:
                model.head(x, last_row_only=True)
            parts["head"] = hd
        state.pos = start + rows
        chunks.append({"start": start, "rows": rows, "parts": parts})
    return chunks


def sdpa_chunk_counts(counts, start: int, rows: int, kv_key: str, kv_block_bytes: int, block: int, pair_flops: int,
                      counted_start: int = 0, name: str | None = None, table: tuple[int, int] | None = None):
    """``counts`` (an attention layer's prefill chunk of ``rows`` rows counted at ``counted_start``) moved to a chunk
    of the same rows at ``start``: its chunked-SDPA program's FLOPs become those of the causal pairs up to the chunk
    (``pair_flops`` = 4 B Hq D per attended (row, key) pair, emulator/work.py) and its K and V reads (``kv_key``, the
    cache's dtype) the blocks up to ``start + rows`` (the emulator charges the op the pages up to its chunk's end).
    Every other count of the layer is the same at any position (tests/probes/test_prefill_cost.py). ``table``:
    (page-table bytes the counted op read, bytes of the page table it reads at ``start``): the op reads its whole
    page-table row, whose length is the sequence capacity (max_seq_len / block_size entries), not the position."""
    out = counts.copy(name or counts.name)
    keys = [k for k in out.compute_work if k[0] == SDPA]
    if len(keys) != 1 or out.compute_work[keys[0]] != 1:
        raise ValueError(f"{counts.name}: expected one chunked SDPA program, found {len(keys)} keys")
    key = keys[0]
    op, flops, phases, fp32, read_items = key
    reads = dict(read_items)
    blocks = lambda s: -(-(s + rows) // block)  # noqa: E731
    delta = 2 * (blocks(start) - blocks(counted_start)) * kv_block_bytes
    reads[kv_key] += delta
    pt_delta = 0 if table is None else table[1] - table[0]
    if pt_delta:
        reads[PAGE_TABLE_KEY] += pt_delta
        out.bytes_read[PAGE_TABLE_KEY] += pt_delta
        out.bytes_read_per_op[SDPA][PAGE_TABLE_KEY] += pt_delta
    new_flops = pair_flops * (rows * start + rows * (rows + 1) // 2)
    del out.compute_work[key]
    out.compute_work[(op, new_flops, phases, fp32, tuple(sorted(reads.items())))] += 1
    out.bytes_read[kv_key] += delta
    out.bytes_read_per_op[SDPA][kv_key] += delta
    return out


def sdpa_pair_flops(counts, start: int, rows: int) -> int:
    """4 B Hq D of the chunked SDPA program in ``counts`` (a chunk of ``rows`` at ``start``): its FLOPs per
    attended (row, key) pair."""
    (key,) = [k for k in counts.compute_work if k[0] == SDPA]
    pairs = rows * start + rows * (rows + 1) // 2
    if key[1] % pairs:
        raise ValueError(f"SDPA FLOPs {key[1]} are not a multiple of its {pairs} causal pairs")
    return key[1] // pairs


def _poly(values, xs, x: int) -> int:
    """The polynomial through (xs[i], values[i]) (degree len(xs) - 1, Lagrange) at ``x``, on whole numbers."""
    from fractions import Fraction

    total = Fraction(0)
    for i, (xi, vi) in enumerate(zip(xs, values)):
        term = Fraction(vi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    if total.denominator != 1:
        raise ValueError(f"{values} over {xs} experts is not a degree-{len(xs) - 1} polynomial at {x} on whole bytes")
    return int(total)


def extrapolate_experts(builds: list, experts: list[int], e: int, name: str):
    """Counts of one region at ``e`` routed experts from the same region built at each count of ``experts``: the
    programs must be the same, and every byte, collective byte and FLOP count is taken as a polynomial in the expert
    count of degree ``len(experts) - 1`` through the builds. The MoE prefill's counts are at most quadratic in E
    for E a multiple of 32 (tiles whole): the router [M, E], the one-hot ranks [E, S] and the dispatch buffer and the
    grouped matmuls over E + S/32 blocks are linear, the per-block expert ownership [32 NB, E] and the sparsity
    [NB, E] quadratic (tt/model/moe_dispatch.py); tests/probes/test_prefill_cost.py checks it at CI size against a
    fourth build."""
    from collections import Counter

    from qwen36.tt_ops.emulator.counters import Counts

    first = builds[0]
    for c in builds[1:]:
        if c.programs_per_op != first.programs_per_op or c.collectives != first.collectives:
            raise ValueError(f"{name}: the programs differ between {experts} experts; not extrapolated")
    f = lambda *vals: _poly(vals, experts, e)  # noqa: E731
    out = Counts(name)
    out.programs, out.collectives = first.programs, first.collectives
    out.collective_bytes = f(*(c.collective_bytes for c in builds))
    for d in ("per_op", "programs_per_op", "collectives_per_op"):
        getattr(out, d).update(getattr(first, d))
    for d in ("bytes_read", "bytes_written", "collective_bytes_per_op"):
        for k in set().union(*(getattr(c, d) for c in builds)):
            getattr(out, d)[k] = f(*(getattr(c, d).get(k, 0) for c in builds))
    for op in set().union(*(c.bytes_read_per_op for c in builds)):
        for k in set().union(*(c.bytes_read_per_op.get(op, {}) for c in builds)):
            out.bytes_read_per_op[op][k] = f(*(c.bytes_read_per_op.get(op, {}).get(k, 0) for c in builds))
    # compute programs: those the expert count does not change have the same key in every build (kept as they are);
    # the others pair up by op, fidelity and read keys, in order of FLOPs (two programs may share a key in one build
    # and not in another, so keys are paired per program, not per dict entry)
    counters = [Counter(c.compute_work) for c in builds]
    same = counters[0]
    for c in counters[1:]:
        same = same & c
    for k, n in same.items():
        out.compute_work[k] += n
    groups: dict = {}
    for side, c in enumerate(counters):
        for key, n in (c - same).items():
            op, fl, ph, fp, reads = key
            groups.setdefault((op, ph, fp, tuple(k for k, _ in reads)), [[] for _ in builds])[side].extend([key] * n)
    for sig, sides in groups.items():
        if len({len(x) for x in sides}) != 1:
            raise ValueError(f"{name}: {sig[0]} programs do not pair up between {experts} experts")
        for keys in zip(*(sorted(x, key=lambda k: (k[1], k[4])) for x in sides)):
            op, _, ph, fp, _ = keys[0]
            reads = tuple((kk, f(*(dict(k[4])[kk] for k in keys))) for kk, _ in keys[0][4])
            out.compute_work[(op, f(*(k[1] for k in keys)), ph, fp, reads)] += 1
    return out


def scale_head(counts, ratio: float, name: str):
    """The head region extrapolated in vocab (decode-cost's ``vocab_scaled_counts``) with its compute work scaled alike (the
    LM-head matmul's FLOPs and bytes are linear in the vocabulary)."""
    from qwen36.probes.decode_cost import vocab_scaled_counts

    out = vocab_scaled_counts(counts, name, ratio)
    for (op, f, ph, fp, items), n in counts.compute_work.items():
        out.compute_work[(op, int(f * ratio), ph, fp, tuple((k, int(v * ratio)) for k, v in items))] += n
    return out


def chunk_plan(prompt: int, start: int, chunk: int, block: int) -> list[tuple[int, int]]:
    """(start, rows) of each prefill chunk of ``prompt`` tokens from position ``start``, as ``prefill_forward`` runs
    them: whole chunks of ``chunk`` rows, the last one partial. A prefill starts on a KV page (``block``)."""
    if prompt <= 0:
        raise UserError(f"a prompt must have at least one token, got {prompt}")
    if start % block:
        raise UserError(f"a prefill starts on a KV page: {start} is not a multiple of block_size {block}")
    return [(s, min(chunk, start + prompt - s)) for s in range(start, start + prompt, chunk)]


def table_bytes(unit: dict, capacity: int) -> int:
    """Bytes of one user's page-table row for a sequence capacity of ``capacity`` positions (int32 per page)."""
    return 4 * -(-capacity // unit["block"])


def prompt_counts(unit: dict, n_gdn: int, n_attn: int, prompt: int, start: int = 0, name: str = "prompt",
                  capacity: int | None = None):
    """Counts of prefilling ``prompt`` tokens from position ``start`` from the unit counts (``unit["rows"][r]``:
    embed, gdn, attention at position 0 and head of a chunk of r rows; :func:`measure_units`). ``capacity``: the
    sequence capacity the model was built for (its page-table row; default: exactly the prompt's end)."""
    from qwen36.tt_ops.emulator.counters import Counts

    capacity = start + prompt if capacity is None else capacity

    total = Counts(name)
    plan = chunk_plan(prompt, start, unit["chunk"], unit["block"])
    missing = sorted({rows for _, rows in plan} - set(unit["rows"]))
    if missing:
        raise UserError(f"no counted chunk of {missing[0]} rows (counted: {sorted(unit['rows'])}); measure_units "
                        "counts the row counts it is given (rows_needed)")
    for s, rows in plan:
        u = unit["rows"][rows]
        attn = sdpa_chunk_counts(u["attention"], s, rows, unit["kv_key"], unit["kv_block_bytes"], unit["block"],
                                 unit["sdpa_pair_flops"], table=(unit["table_bytes"], table_bytes(unit, capacity)))
        total.add(u["embed"])
        total.add(u["gdn"], n_gdn)
        total.add(attn, n_attn)
    total.add(unit["rows"][plan[-1][1]]["head"])
    return total


def rows_needed(chunk: int, block: int, prompts, hits) -> set[int]:
    """Row counts of every chunk the prompts (from 0) and prefix hits (from the hit) run."""
    out = set()
    for p in prompts:
        out |= {r for _, r in chunk_plan(p, 0, chunk, block)}
    for p, h in hits:
        out |= {r for _, r in chunk_plan(p - h, h, chunk, block)}
    return out


PARTS = ("embed", "gdn", "attention", "head")


MOE_BUILDS = (32, 64, 96)  # expert counts the 35B-A3B prefill is built at (three points: counts up to quadratic in E)


def measure_units_moe(device: str, cfg, real, precision: str, seed: int, numerics: str = "exact",
                      experts: tuple[int, ...] = MOE_BUILDS, chunk: int | None = None, rows=(),
                      gdn_prefill: str = "fused") -> dict:
    """:func:`measure_units` for a MoE config built with fewer experts than ``real`` (decode-cost's build): one
    build per count in ``experts`` and every per-chunk unit extrapolated to ``real.num_experts``
    (:func:`extrapolate_experts`)."""
    import dataclasses

    units = [measure_units(device, dataclasses.replace(cfg, num_experts=e), precision, seed, real.vocab_size,
                           numerics, chunk=chunk, rows=rows, gdn_prefill=gdn_prefill) for e in experts]
    unit = dict(units[-1])
    unit["rows"] = {r: {part: extrapolate_experts([u["rows"][r][part] for u in units], list(experts),
                                                  real.num_experts, units[-1]["rows"][r][part].name) for part in PARTS}
                    for r in units[-1]["rows"]}
    if len({u["sdpa_pair_flops"] for u in units}) != 1:
        raise ValueError("the SDPA work changed with the expert count")
    unit["experts"] = {"built": list(experts), "extrapolated_to": real.num_experts}
    unit["built_rows"] = units[-1]["rows"]  # what the last build counts (the long-position check runs that build)
    return unit


def default_chunk() -> int:
    from qwen36.tt.model.model_config import TTModelArgs

    return TTModelArgs.__dataclass_fields__["prefill_chunk"].default


def _parts(bench, counted: dict, rows: int, head_ratio: float, gdn_i: int, attn_i: int) -> dict:
    """The unit counts of one counted chunk: the embedding and RoPE gathers corrected to the rows they read (the
    emulator charges a gather its whole table; decode-cost's correction), the built GDN and attention layer, the
    head extrapolated in vocab."""
    p = counted["parts"]
    out = {"embed": bench.corrected_embed(p["embed"], rows).copy(f"embed ({rows} rows)"),
           "gdn": p[f"layer{gdn_i}"].copy(f"GDN layer ({rows} rows)"),
           "attention": p[f"layer{attn_i}"].copy(f"attention layer ({rows} rows at {counted['start']})")}
    if "head" in p:
        out["head"] = scale_head(p["head"], head_ratio, f"head after {rows} rows (vocab-extrapolated)")
    return out


def force_gdn_prefill(model, path: str) -> str:
    """Set every GDN layer's prefill to ``path`` (``GDN_PREFILL``): "fused" keeps the model's own choice,
    "composite" drops the fused prefill (the composite one runs). Returns the layers' ``prefill_path``."""
    if path not in GDN_PREFILL:
        raise UserError(f"--gdn-prefill must be one of {', '.join(GDN_PREFILL)}, got {path!r}")
    mixers = [layer.mixer for layer in model.layers if hasattr(layer.mixer, "prefill_path")]
    if path == "composite":
        for m in mixers:
            m.fused_prefill, m.prefill_path = None, "composite (forced: --gdn-prefill composite)"
    paths = {m.prefill_path for m in mixers}
    if len(paths) != 1:
        raise ValueError(f"the built GDN layers prefill differently: {sorted(paths)}")
    return paths.pop()


def measure_units(device: str, cfg, precision: str, seed: int, real_vocab: int, numerics: str = "exact",
                  chunk: int | None = None, rows=(), gdn_prefill: str = "fused") -> dict:
    """Build the bench (prefill chunks of ``chunk`` rows), count two whole chunks (positions 0 and ``chunk``) and
    one chunk of every other row count in ``rows`` (a prompt's partial last chunk, run from position 0), and return
    the per-chunk unit counts (module doc). The emulator runs with ``numerics="exact"`` by default: the counts do not
    depend on the rounding rules (tests/probes/test_prefill_cost.py compares them with ``"strict"``), and exact is
    several times cheaper at 27B shapes on a CPU. ``gdn_prefill``: :func:`force_gdn_prefill`."""
    from qwen36.config import FULL
    from qwen36.probes.decode_cost import build_bench

    chunk = chunk or default_chunk()
    bench = build_bench(device, cfg, precision, context=2 * chunk, seed=seed, probe=NAME, numerics=numerics,
                        prefill_chunk=chunk)
    try:
        a = bench.args
        path = force_gdn_prefill(bench.model, gdn_prefill)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (2 * chunk,), generator=gen)
        chunks = count_chunks(bench, ids)
        gdn_i = next(i for i, layer in enumerate(bench.model.layers) if layer.layer_type != FULL)
        attn_i = next(i for i, layer in enumerate(bench.model.layers) if layer.layer_type == FULL)
        ratio = real_vocab / cfg.vocab_size
        full = _parts(bench, chunks[0], chunk, ratio, gdn_i, attn_i)
        full["head"] = _parts(bench, chunks[1], chunk, ratio, gdn_i, attn_i)["head"]
        units = {chunk: full}
        for r in sorted(set(rows) - {chunk}):
            if not 0 < r < chunk:
                raise UserError(f"a chunk of {r} rows: the prefill chunk is {chunk} rows")
            bench.state.pos = 0
            units[r] = _parts(bench, count_chunks(bench, ids[:r])[0], r, ratio, gdn_i, attn_i)
        k = bench.state.layers[attn_i].k
        unit = {
            "chunk": chunk, "block": a.block_size, "kv_block_bytes": k.bytes_per_device() // k.shape[0],
            "kv_key": _dtype_key(k), "table_bytes": bench.state.page_table.bytes_per_device(),
            "rows": units, "chunks": chunks, "tp": bench.ctx.num_devices, "backend": bench.ctx.label,
            "gdn_index": gdn_i, "attention_index": attn_i,
        }
        unit["sdpa_pair_flops"] = sdpa_pair_flops(full["attention"], 0, chunk)
        unit["gdn_prefill_path"] = path
        unit.update(checkpoint_counts(bench, gdn_i))
        return unit
    finally:
        bench.close()


def _dtype_key(t) -> str:
    """The counters' bytes key of a DRAM-interleaved tensor (its dtype name)."""
    from qwen36.tt_ops.emulator.tensor import dtype_name

    return dtype_name(t.dtype)


def long_position_check(device: str, cfg, precision: str, seed: int, unit: dict, start: int,
                        numerics: str = "exact") -> dict:
    """The attention layer of one whole chunk actually run at ``start`` (a bench whose KV holds ``start`` + one
    chunk positions: chunked SDPA over that long KV, its page-table entries and RoPE rows there) against the same
    chunk moved from position 0 by :func:`sdpa_chunk_counts`: whether every count (programs, bytes by key and op,
    collectives, compute work) agrees."""
    from qwen36.config import FULL
    from qwen36.probes.decode_cost import build_bench
    from qwen36.tt.model.model_config import activation_memory_config

    c = unit["chunk"]
    bench = build_bench(device, cfg, precision, context=start + c, seed=seed, probe=NAME, numerics=numerics,
                        prefill_chunk=c)
    try:
        model, state, ttnn = bench.model, bench.state, bench.ttnn
        attn_i = next(i for i, layer in enumerate(model.layers) if layer.layer_type == FULL)
        ids = torch.randint(0, cfg.vocab_size, (1, c), generator=torch.Generator().manual_seed(seed))
        tokens = ttnn.from_torch(ids.to(torch.int32), dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT,
                                 device=model.mesh, memory_config=activation_memory_config(ttnn))
        pctx = model.prefill_chunk_context(start, c, state.page_table, state.page_table_host)
        x = model.embed(tokens)
        with bench.ctx.counters.scope("attention at start") as got:
            model.layers[attn_i].forward(x, state.layers[attn_i], pctx)
        want = sdpa_chunk_counts(unit.get("built_rows", unit["rows"])[c]["attention"], start, c, unit["kv_key"],
                                 unit["kv_block_bytes"], unit["block"], unit["sdpa_pair_flops"],
                                 table=(unit["table_bytes"], state.page_table.bytes_per_device()))
        same = {
            "programs": got.programs_per_op == want.programs_per_op,
            "bytes_read": dict(got.bytes_read) == dict(want.bytes_read),
            "bytes_read_per_op": {k: dict(v) for k, v in got.bytes_read_per_op.items()}
            == {k: dict(v) for k, v in want.bytes_read_per_op.items()},
            "collectives": (got.collectives, got.collective_bytes) == (want.collectives, want.collective_bytes),
            "compute_work": dict(got.compute_work) == dict(want.compute_work),
        }
        return {"start": start, "rows": c, "kv_positions": start + c, "agree": all(same.values()), "fields": same,
                "sdpa_flops": int(sum(k[1] * n for k, n in got.compute_work.items() if k[0] == SDPA)),
                "bytes_read": got.bytes_read_total}
    finally:
        bench.close()


def chunk_ranking(unit: dict, n_gdn: int, n_attn: int) -> list[dict]:
    """Every op of one chunk at position 0 by region (embed, GDN layers, attention layers), with its programs and
    calibrated ms per chunk (``cost_model.per_op_ms``: launches, kernel class, its own DRAM bytes and collectives,
    plus its compute excess), largest first."""
    from qwen36.tt_ops.cost_model import per_op_ms, prefill_compute_excess

    out = []
    u = unit["rows"][unit["chunk"]]
    for region, counts, times in (("embed", u["embed"], 1), ("GDN layers", u["gdn"], n_gdn),
                                  ("attention layers", u["attention"], n_attn)):
        excess = prefill_compute_excess(counts)["by_op"]
        for op, row in per_op_ms(counts).items():
            ms = row["ms"] + excess.get(op, {}).get("excess_ms", 0.0)
            out.append({"region": region, "op": op, "class": row["class"], "programs": row["programs"] * times,
                        "ms": ms * times})
    return sorted(out, key=lambda r: -r["ms"])


def figures(unit: dict, n_gdn: int, n_attn: int, prompt: int, start: int = 0, capacity: int | None = None,
            restores: int = 0, saves: int = 0, eager: bool = True) -> dict:
    """Calibrated figures of prefilling ``prompt`` tokens from ``start`` (page tables sized for ``capacity``), plus
    ``restores`` / ``saves`` GDN checkpoints (every GDN layer's copies each). ``eager``: untraced, as the prefill runs
    today (each op at least its host dispatch); False prices the same programs as a captured trace would run them."""
    from qwen36.tt_ops.cost_model import calibrated_prefill_figures

    c = prompt_counts(unit, n_gdn, n_attn, prompt, start, capacity=capacity)
    if restores or saves:
        if "checkpoint_load" not in unit:
            raise UserError("prefix hits are priced on the dense presets (the MoE bench counts no GDN checkpoint)")
        c.add(unit["checkpoint_load"], restores * n_gdn)
        c.add(unit["checkpoint_save"], saves * n_gdn)
    f = calibrated_prefill_figures(c, prompt, eager=eager)
    f["prompt_tokens"], f["start"], f["chunks"] = prompt, start, -(-prompt // unit["chunk"])
    f["programs"], f["collectives"] = c.programs, c.collectives
    f["bytes_read_per_device"] = c.bytes_read_total
    return f


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.probes.decode_cost import build_config
    from qwen36.tt.model.model_config import TTModelArgs

    device = args.device if args.device != "reference" else "emulated-p150x2"
    prompts = _int_list(args.prompts, "--prompts")
    hits = parse_hits(args.prefix_hits)
    if not prompts:
        raise UserError("--prompts is empty")
    cfg, base = build_config(args.preset, args.vocab_sample)
    chunk = args.chunk or default_chunk()
    block = TTModelArgs.__dataclass_fields__["block_size"].default
    if chunk <= 0 or chunk % block:
        raise UserError(f"--chunk {chunk} must be a positive multiple of the KV page ({block} rows)")
    too_long = [p for p in prompts + [p for p, _ in hits] if p > base.max_position_embeddings]
    if too_long:
        raise UserError(f"prompts {too_long} exceed the model's {base.max_position_embeddings} positions")
    n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)
    need = rows_needed(chunk, block, prompts, hits)
    if base.is_moe and base.num_experts != cfg.num_experts:
        unit = measure_units_moe(device, cfg, base, args.precision, args.seed, chunk=chunk, rows=need,
                                 gdn_prefill=args.gdn_prefill)
    else:
        unit = measure_units(device, cfg, args.precision, args.seed, base.vocab_size, chunk=chunk, rows=need,
                             gdn_prefill=args.gdn_prefill)
    capacity = max(prompts + [p for p, _ in hits])  # one model serves every prompt: its page-table rows hold this
    rows = [figures(unit, n_gdn, n_attn, p, capacity=capacity) for p in prompts]
    reuse = []
    for prompt, hit in hits:
        plan = hit_plan(prompt, hit, chunk, block)
        u = plan["restored_from"]
        kw = {"start": u, "capacity": capacity}
        f = figures(unit, n_gdn, n_attn, prompt - u, restores=1 if u else 0, saves=plan["saves"], **kw)
        bare = figures(unit, n_gdn, n_attn, prompt - u, **kw)
        full = figures(unit, n_gdn, n_attn, prompt, capacity=capacity)
        traced = figures(unit, n_gdn, n_attn, prompt - u, restores=1 if u else 0, saves=plan["saves"], eager=False,
                         **kw)
        reuse.append({"prompt_tokens": prompt, "hit_tokens": hit, **plan,
                      "ms": f["ms"], "ms_low": f["ms_low"], "ms_high": f["ms_high"],
                      "traced_ms": traced["ms"], "traced_ms_low": traced["ms_low"], "traced_ms_high": traced["ms_high"],
                      "copies_ms": f["ms"] - bare["ms"], "full_prompt_ms": full["ms"],
                      "saved_ms": full["ms"] - f["ms"]})
    long_at = args.long_check
    if long_at is None:
        long_at = max(0, (max(prompts) // chunk - 1) * chunk)
    long_check = None
    if long_at:
        if long_at % chunk:
            raise UserError(f"--long-check {long_at} must be a multiple of the chunk ({chunk})")
        long_check = long_position_check(device, cfg, args.precision, args.seed, unit, long_at)
    c0, c1 = unit["chunks"][0]["parts"], unit["chunks"][1]["parts"]
    gi, ai = unit["gdn_index"], unit["attention_index"]
    same_programs = (c0["embed"].programs_per_op == c1["embed"].programs_per_op
                     and c0[f"layer{gi}"].programs_per_op == c1[f"layer{gi}"].programs_per_op
                     and c0[f"layer{ai}"].programs_per_op == c1[f"layer{ai}"].programs_per_op)
    cells = [{"cell": "chunk 1 runs the programs of chunk 0 (per layer kind)", "pass": same_programs},
             {"cell": "figures", "pass": all(r["ms"] > 0 for r in rows)}]
    if long_check is not None:
        cells.append({"cell": f"a chunk run at position {long_check['start']} counts what the chunk moved there "
                              "from position 0 counts (attention layer)", "pass": long_check["agree"], **long_check})
    ranking = chunk_ranking(unit, n_gdn, n_attn)
    label = rows[0]["label"]
    print(f"[{label}] prefill-cost {args.preset} {args.precision} tp{unit['tp']} batch 1 on {unit['backend']} "
          f"(chunk {unit['chunk']} rows; {n_gdn} GDN + {n_attn} attention layers):")
    print(f"  GDN prefill: {unit['gdn_prefill_path']}; programs per chunk: embed {c0['embed'].programs}, GDN "
          f"layer {c0[f'layer{gi}'].programs}, attention layer {c0[f'layer{ai}'].programs}; head "
          f"{unit['rows'][unit['chunk']]['head'].programs}")
    for r in rows:
        b = r["breakdown"]
        print(f"  [{label}] TTFT {r['prompt_tokens']} tokens: {r['ms']:.0f} ms (band {r['ms_low']:.0f}-"
              f"{r['ms_high']:.0f}), {r['tok_s']:.0f} prompt tok/s; launch {b['launch_ms']:.0f} + kernels "
              f"{b['kernel_ms']:.0f} + DRAM {b['dram_interleaved_ms'] + b['dram_sharded_ms']:.0f} + collectives "
              f"{b['collective_fixed_ms'] + b['collective_bw_ms']:.0f} + compute excess {b['compute_excess_ms']:.0f} "
              f"ms ({r['flops_per_device'] / 1e12:.1f} TFLOP/device); untraced: per op the larger of device "
              f"{b['eager_device_ms']:.0f} and host dispatch {b['eager_host_ms']:.0f} ms")
    for r in reuse:
        print(f"  [{label}] prefix hit {r['hit_tokens']} of {r['prompt_tokens']}: checkpoint at {r['restored_from']} "
              f"restored, {r['prefilled_tokens']} tokens prefilled ({r['rerun_tokens']} of them rerun below the hit), "
              f"{r['saves']} checkpoint(s) saved: {r['ms']:.0f} ms (band {r['ms_low']:.0f}-{r['ms_high']:.0f}; the "
              f"checkpoint copies {r['copies_ms']:.1f} ms of it) vs {r['full_prompt_ms']:.0f} ms for the whole prompt; "
              f"as a captured trace {r['traced_ms']:.0f} ms ({r['traced_ms_low']:.0f}-{r['traced_ms_high']:.0f})")
    print(f"  [{label}] one chunk at position 0, top programs: " + "; ".join(
        f"{r['region']} {r['op'].replace('ttnn.', '')} x{r['programs']} {r['ms']:.1f} ms" for r in ranking[:8]))
    if long_check is not None:
        print(f"  one chunk's attention layer run at position {long_check['start']} (KV of {long_check['kv_positions']} "
              f"positions): counts {'equal' if long_check['agree'] else 'DIFFER from'} the chunk moved there from "
              f"position 0 ({long_check['fields']})")
    print("  not in these figures: " + "; ".join(rows[0]["uncalibrated"]))
    perf = {"label": label, "backend": unit["backend"], "tp": unit["tp"], "batch": 1, "precision": args.precision,
            "chunk_tokens": unit["chunk"], "layers": {"gdn": n_gdn, "attention": n_attn},
            "gdn_prefill_path": unit["gdn_prefill_path"],
            "programs_per_chunk": {"embed": c0["embed"].programs, "gdn_layer": c0[f"layer{gi}"].programs,
                                   "attention_layer": c0[f"layer{ai}"].programs,
                                   "head": unit["rows"][unit["chunk"]]["head"].programs},
            "ttft": {str(r["prompt_tokens"]): {k: r[k] for k in ("ms", "ms_low", "ms_high", "tok_s", "chunks",
                                                                  "programs", "collectives", "flops_per_device",
                                                                  "bytes_read_per_device")}
                     | {"breakdown": {k: v for k, v in r["breakdown"].items() if k != "compute_by_op"},
                        "compute_by_op": r["breakdown"]["compute_by_op"]}
                     for r in rows},
            "prefix_reuse": reuse, "uncalibrated": rows[0]["uncalibrated"], "chunk_ranking": ranking,
            "long_position_check": long_check,
            **({"experts": unit["experts"]} if "experts" in unit else {})}
    return ProbeReport(probe=NAME, backend=unit["backend"],
                       config={"preset": args.preset, "precision": args.precision, "prompts": prompts, "chunk": chunk,
                               "long_check": long_at,
                               "prefix_hits": [list(h) for h in hits], "vocab_sample": cfg.vocab_size,
                               "real_vocab": base.vocab_size, "seed": args.seed, "gdn_prefill": args.gdn_prefill},
                       cells=cells, counters={"programs_per_chunk": perf["programs_per_chunk"]},
                       gate_complete=True, performance=perf)
