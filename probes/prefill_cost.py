"""Probe prefill-cost: calibrated time to first token (TTFT) on P150a, from the emulator's counts of the real
prefill programs (TTQwen36Model's chunked prefill) charged by tt_ops/cost_model.py. Never a measurement.

Method (``--preset 27b``, the decode-cost build: the real config with random weights, only the first GDN and the
first attention layer built, the vocabulary cut to ``--vocab-sample``):

  * two prefill chunks (``args.prefill_chunk`` rows each, positions 0.. and chunk..) run through the model's own
    prefill pieces in ``prefill_forward``'s order (``embed``, ``prefill_chunk_context``, ``layers_forward``,
    ``head`` of the last row), each piece under a counter scope (:func:`count_chunks`; a test checks their sum
    equals ``prefill_forward``'s counts);
  * a prompt shorter than one chunk (e.g. 128 tokens) is one partial chunk with its own shapes: it is counted
    directly (one more prefill from position 0, :func:`short_prompt_counts`), not extrapolated;
  * one correction, as decode-cost corrects its gathers: the emulator charges chunked SDPA the whole paged cache;
    on cards it reads the K and V blocks up to the chunk's last row (:func:`sdpa_chunk_counts`);
  * per layer kind the programs of every chunk are the same, and the only counts that change with the chunk's
    position are the SDPA program's FLOPs (linear in its start) and its KV blocks (tests/probes/test_prefill_cost.py
    proves both at CI size against chunks actually run), so a prompt of ``P`` tokens from position ``S`` is
    ``sum over its chunks (embed + n_gdn x GDN layer + n_attn x attention layer at that chunk's start) + head``,
    the head's LM-head matmul extrapolated linearly in vocab to the real 248,320;
  * ``--preset 35b-a3b``: built at 32 and at 64 routed experts, every per-chunk count extrapolated linearly to the
    real 256 (:func:`extrapolate_experts`: the MoE prefill runs every expert over the chunk, so its bytes and FLOPs
    are linear in the expert count; checked at CI size against a third build);
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

NAME = "prefill-cost"
HELP = ("calibrated P150a time to first token (prefill chunks + last-row LM head) at 27B / 35B-A3B shapes, from "
        "emulator counts")
SDPA = "ttnn.transformer.chunked_scaled_dot_product_attention"
GDN_PREFILL = ("fused", "composite")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="27b", choices=["27b", "35b-a3b", "ci", "moe-ci"],
                   help="27b / 35b-a3b: real shapes (first GDN + attention layer built, the rest by layer count; the "
                        "MoE sibling built at 32 and 64 experts and extrapolated to 256); ci / moe-ci: the tiny CI "
                        "configs")
    p.add_argument("--precision", default="performance", help="accuracy | performance | performance-bf4")
    p.add_argument("--prompts", default="4096,8192,16384",
                   help="prompt lengths in tokens (multiples of the prefill chunk, or one prompt shorter than a "
                        "chunk, counted as it runs)")
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


def parse_hits(text: str) -> list[tuple[int, int]]:
    out = []
    for pair in (x for x in text.split(",") if x.strip()):
        a, sep, b = pair.partition(":")
        if not sep:
            raise UserError(f"--prefix-hits takes PROMPT:HIT pairs, got {pair!r}")
        out.append((int(a), int(b)))
    return out


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


def sdpa_chunk_counts(counts, start: int, rows: int, kv_block_bytes: int, block: int, pair_flops: int,
                      name: str | None = None):
    """``counts`` (an attention layer's prefill chunk) with its chunked-SDPA program set to a chunk of ``rows``
    rows at ``start``: FLOPs of the causal pairs up to the chunk (``pair_flops`` = 4 B Hq D per attended (row, key)
    pair, emulator/work.py) and K/V bytes of the blocks up to ``start + rows`` (``kv_block_bytes`` per block of K,
    the same for V), where the emulator charged the whole cache. Its other reads (q, the page table) are kept."""
    out = counts.copy(name or counts.name)
    keys = [k for k in out.compute_work if k[0] == SDPA]
    if len(keys) != 1 or out.compute_work[keys[0]] != 1:
        raise ValueError(f"{counts.name}: expected one chunked SDPA program, found {len(keys)} keys")
    key = keys[0]
    op, flops, phases, fp32, read_items = key
    reads = dict(read_items)
    kv_key = max(reads, key=reads.get)  # the caches are the largest read (whole K and V)
    kv_bytes = 2 * (-(-(start + rows) // block)) * kv_block_bytes
    delta = kv_bytes - reads[kv_key]
    reads[kv_key] = kv_bytes
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


def _lin(lo: int, hi: int, x_lo: int, x_hi: int, x: int) -> int:
    num = lo * (x_hi - x) + hi * (x - x_lo)
    if num % (x_hi - x_lo):
        raise ValueError(f"{lo} -> {hi} over {x_lo} -> {x_hi} experts is not linear at {x} on whole bytes")
    return num // (x_hi - x_lo)


def extrapolate_experts(c_lo, c_hi, e_lo: int, e_hi: int, e: int, name: str):
    """Counts of one region at ``e`` routed experts from the same region built with ``e_lo`` and ``e_hi``: the
    programs must be the same, and every byte, collective byte and FLOP count is taken as linear in the expert
    count (the MoE prefill runs every expert over the chunk: its expert weights, its [1, E, M, *] activations, the
    router [H, E] and the [M, E] routing tensors all scale with E; E a multiple of 32 keeps the tiles whole).
    tests/probes/test_prefill_cost.py checks it at CI size against a third build."""
    from qwen36.tt_ops.emulator.counters import Counts

    if c_lo.programs_per_op != c_hi.programs_per_op or c_lo.collectives != c_hi.collectives:
        raise ValueError(f"{name}: the programs differ between {e_lo} and {e_hi} experts; not extrapolated")
    f = lambda a, b: _lin(a, b, e_lo, e_hi, e)  # noqa: E731
    out = Counts(name)
    out.programs, out.collectives = c_hi.programs, c_hi.collectives
    out.collective_bytes = f(c_lo.collective_bytes, c_hi.collective_bytes)
    for d in ("per_op", "programs_per_op", "collectives_per_op"):
        getattr(out, d).update(getattr(c_hi, d))
    for d in ("bytes_read", "bytes_written", "collective_bytes_per_op"):
        lo, hi = getattr(c_lo, d), getattr(c_hi, d)
        for k in set(lo) | set(hi):
            getattr(out, d)[k] = f(lo.get(k, 0), hi.get(k, 0))
    for op in set(c_lo.bytes_read_per_op) | set(c_hi.bytes_read_per_op):
        lo, hi = c_lo.bytes_read_per_op.get(op, {}), c_hi.bytes_read_per_op.get(op, {})
        for k in set(lo) | set(hi):
            out.bytes_read_per_op[op][k] = f(lo.get(k, 0), hi.get(k, 0))
    # compute programs: those the expert count does not change have the same key in both builds (kept as they are);
    # the others pair up by op, fidelity and read keys, in order of FLOPs (two programs may share a key in one build
    # and not in the other, so keys are paired per program, not per dict entry)
    from collections import Counter

    lo_all, hi_all = Counter(c_lo.compute_work), Counter(c_hi.compute_work)
    same = lo_all & hi_all
    for k, n in same.items():
        out.compute_work[k] += n
    groups: dict = {}
    for side, rest in ((0, lo_all - same), (1, hi_all - same)):
        for key, n in rest.items():
            op, fl, ph, fp, reads = key
            groups.setdefault((op, ph, fp, tuple(k for k, _ in reads)), ([], []))[side].extend([key] * n)
    for sig, (lo_keys, hi_keys) in groups.items():
        if len(lo_keys) != len(hi_keys):
            raise ValueError(f"{name}: {sig[0]} programs do not pair up between {e_lo} and {e_hi} experts")
        for (op, fl, ph, fp, rl), (_, fh, _, _, rh) in zip(sorted(lo_keys, key=lambda k: (k[1], k[4])),
                                                         sorted(hi_keys, key=lambda k: (k[1], k[4]))):
            out.compute_work[(op, f(fl, fh), ph, fp, tuple((k, f(a, b)) for (k, a), (_, b) in zip(rl, rh)))] += 1
    return out


def scale_head(counts, ratio: float, name: str):
    """The head region extrapolated in vocab (decode-cost's ``vocab_scaled_counts``) with its compute work scaled alike (the
    LM-head matmul's FLOPs and bytes are linear in the vocabulary)."""
    from qwen36.probes.decode_cost import vocab_scaled_counts

    out = vocab_scaled_counts(counts, name, ratio)
    for (op, f, ph, fp, items), n in counts.compute_work.items():
        out.compute_work[(op, int(f * ratio), ph, fp, tuple((k, int(v * ratio)) for k, v in items))] += n
    return out


def prompt_counts(unit: dict, n_gdn: int, n_attn: int, prompt: int, start: int = 0, name: str = "prompt"):
    """Counts of prefilling ``prompt`` tokens from position ``start`` (both multiples of the chunk) from the
    per-chunk unit counts (``unit``: embed, gdn, attention at chunk 0, head, chunk, kv_block_bytes, block)."""
    from qwen36.tt_ops.emulator.counters import Counts

    rows = unit["chunk"]
    if prompt <= 0 or prompt % rows or start % rows:
        raise UserError(f"prompt {prompt} and start {start} must be positive multiples of the prefill chunk "
                        f"({rows} tokens); a partial last chunk has other shapes and is not extrapolated here")
    total = Counts(name)
    for s in range(start, start + prompt, rows):
        attn = sdpa_chunk_counts(unit["attention"], s, rows, unit["kv_block_bytes"], unit["block"],
                                 unit["sdpa_pair_flops"])
        total.add(unit["embed"])
        total.add(unit["gdn"], n_gdn)
        total.add(attn, n_attn)
    total.add(unit["head"])
    return total


def measure_units_moe(device: str, cfg, real, precision: str, seed: int, numerics: str = "exact",
                      experts: tuple[int, int] | None = None) -> dict:
    """:func:`measure_units` for a MoE config built with fewer experts than ``real`` (decode-cost's build): two
    builds (``experts``, default half and all of ``cfg``'s) and every per-chunk unit extrapolated linearly to
    ``real.num_experts`` (:func:`extrapolate_experts`)."""
    import dataclasses

    e_lo, e_hi = experts or (cfg.num_experts // 2, cfg.num_experts)
    units = [measure_units(device, dataclasses.replace(cfg, num_experts=e), precision, seed, real.vocab_size,
                           numerics) for e in (e_lo, e_hi)]
    lo, hi = units
    unit = dict(hi)
    for part in ("embed", "gdn", "attention", "head"):
        unit[part] = extrapolate_experts(lo[part], hi[part], e_lo, e_hi, real.num_experts, hi[part].name)
    if lo["sdpa_pair_flops"] != hi["sdpa_pair_flops"]:
        raise ValueError("the SDPA work changed with the expert count")
    unit["experts"] = {"built": [e_lo, e_hi], "extrapolated_to": real.num_experts}
    return unit


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
                  short: tuple[int, ...] = (), gdn_prefill: str = "fused") -> dict:
    """Build the bench, count two chunks and return the per-chunk unit counts (module doc), plus the counts of each
    prompt in ``short`` (shorter than a chunk) prefilled from position 0 (``unit["short"]``). The emulator runs with
    ``numerics="exact"`` by default: the counts do not depend on the rounding rules (tests/probes/test_prefill_cost.py
    compares them with ``"strict"``), and exact is several times cheaper at 27B shapes on a CPU."""
    from qwen36.config import FULL
    from qwen36.probes.decode_cost import build_bench

    from qwen36.tt.model.model_config import TTModelArgs

    chunk = TTModelArgs.__dataclass_fields__["prefill_chunk"].default
    bench = build_bench(device, cfg, precision, context=2 * chunk, seed=seed, probe=NAME, numerics=numerics)
    try:
        a = bench.args
        rows = a.prefill_chunk
        path = force_gdn_prefill(bench.model, gdn_prefill)
        if a.max_seq_len < 2 * rows:
            raise UserError(f"the bench's max_seq_len {a.max_seq_len} is below two prefill chunks ({2 * rows})")
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (2 * rows,), generator=gen)
        chunks = count_chunks(bench, ids)
        gdn_i = next(i for i, layer in enumerate(bench.model.layers) if layer.layer_type != FULL)
        attn_i = next(i for i, layer in enumerate(bench.model.layers) if layer.layer_type == FULL)
        k = bench.state.layers[attn_i].k
        unit = {
            "chunk": rows, "block": a.block_size, "kv_block_bytes": k.bytes_per_device() // k.shape[0],
            "embed": chunks[0]["parts"]["embed"].copy("embed (one chunk)"),
            "gdn": chunks[0]["parts"][f"layer{gdn_i}"].copy("GDN layer (one chunk)"),
            "attention": chunks[0]["parts"][f"layer{attn_i}"].copy("attention layer (chunk at 0)"),
            "head": scale_head(chunks[1]["parts"]["head"], real_vocab / cfg.vocab_size, "head (vocab-extrapolated)"),
            "chunks": chunks, "tp": bench.ctx.num_devices, "backend": bench.ctx.label,
            "gdn_index": gdn_i, "attention_index": attn_i,
        }
        unit["sdpa_pair_flops"] = sdpa_pair_flops(unit["attention"], 0, rows)
        unit["gdn_prefill_path"] = path
        unit["short"] = {}
        for p in short:
            if not 0 < p < rows:
                raise UserError(f"a short prompt is 1..{rows - 1} tokens (one partial chunk), got {p}")
            bench.state.pos = 0
            (one,) = count_chunks(bench, ids[:p])
            unit["short"][p] = {"embed": one["parts"]["embed"], "gdn": one["parts"][f"layer{gdn_i}"],
                                "attention": one["parts"][f"layer{attn_i}"],
                                "head": scale_head(one["parts"]["head"], real_vocab / cfg.vocab_size,
                                                   "head (vocab-extrapolated)")}
        unit.update(checkpoint_counts(bench, gdn_i))
        return unit
    finally:
        bench.close()


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


def short_prompt_counts(unit: dict, n_gdn: int, n_attn: int, prompt: int, name: str = "prompt"):
    """Counts of a prompt shorter than one chunk, from its own counted chunk (``unit["short"][prompt]``): embed +
    n_gdn x GDN layer + n_attn x attention layer (its SDPA corrected to the KV blocks of ``prompt`` rows) + head."""
    from qwen36.tt_ops.emulator.counters import Counts

    one = unit["short"].get(prompt)
    if one is None:
        raise ValueError(f"prompt {prompt} was not counted as a short prompt")
    total = Counts(name)
    total.add(one["embed"])
    total.add(one["gdn"], n_gdn)
    total.add(sdpa_chunk_counts(one["attention"], 0, prompt, unit["kv_block_bytes"], unit["block"],
                                unit["sdpa_pair_flops"]), n_attn)
    total.add(one["head"])
    return total


def chunk_ranking(unit: dict, n_gdn: int, n_attn: int) -> list[dict]:
    """Every op of one chunk at position 0 by region (embed, GDN layers, attention layers), with its programs and
    calibrated ms per chunk (``cost_model.per_op_ms``: launches, kernel class, its own DRAM bytes and collectives,
    plus its compute excess), largest first."""
    from qwen36.tt_ops.cost_model import per_op_ms, prefill_compute_excess

    out = []
    for region, counts, times in (("embed", unit["embed"], 1), ("GDN layers", unit["gdn"], n_gdn),
                                  ("attention layers", unit["attention"], n_attn)):
        excess = prefill_compute_excess(counts)["by_op"]
        for op, row in per_op_ms(counts).items():
            ms = row["ms"] + excess.get(op, {}).get("excess_ms", 0.0)
            out.append({"region": region, "op": op, "class": row["class"], "programs": row["programs"] * times,
                        "ms": ms * times})
    return sorted(out, key=lambda r: -r["ms"])


def figures(unit: dict, n_gdn: int, n_attn: int, prompt: int, start: int = 0, restores: int = 0,
            saves: int = 0, eager: bool = True) -> dict:
    """Calibrated figures of prefilling ``prompt`` tokens from ``start``, plus ``restores`` / ``saves`` GDN
    checkpoints (every GDN layer's copies each). ``eager``: untraced, as the prefill runs today (each op at least
    its host dispatch); False prices the same programs as a captured trace would run them."""
    from qwen36.tt_ops.cost_model import calibrated_prefill_figures

    short = start == 0 and prompt in unit.get("short", {})
    c = short_prompt_counts(unit, n_gdn, n_attn, prompt) if short else prompt_counts(unit, n_gdn, n_attn, prompt, start)
    if restores or saves:
        c.add(unit["checkpoint_load"], restores * n_gdn)
        c.add(unit["checkpoint_save"], saves * n_gdn)
    f = calibrated_prefill_figures(c, prompt, eager=eager)
    f["prompt_tokens"], f["start"], f["chunks"] = prompt, start, -(-prompt // unit["chunk"])
    f["programs"], f["collectives"] = c.programs, c.collectives
    f["bytes_read_per_device"] = c.bytes_read_total
    return f


def run(args: argparse.Namespace) -> ProbeReport:
    from qwen36.probes.decode_cost import build_config

    device = args.device if args.device != "reference" else "emulated-p150x2"
    prompts = _int_list(args.prompts, "--prompts")
    hits = parse_hits(args.prefix_hits)
    if not prompts:
        raise UserError("--prompts is empty")
    cfg, base = build_config(args.preset, args.vocab_sample)
    n_gdn, n_attn = len(base.gdn_layer_ids), len(base.attention_layer_ids)
    from qwen36.tt.model.model_config import TTModelArgs

    chunk = TTModelArgs.__dataclass_fields__["prefill_chunk"].default
    short = tuple(sorted({p for p in prompts if 0 < p < chunk}))
    if base.is_moe and base.num_experts != cfg.num_experts:
        if short or args.gdn_prefill != "fused":
            raise UserError("--preset 35b-a3b prices whole chunks with the model's own GDN prefill (its expert "
                            "extrapolation is not done for a short prompt or --gdn-prefill composite)")
        unit = measure_units_moe(device, cfg, base, args.precision, args.seed)
    else:
        unit = measure_units(device, cfg, args.precision, args.seed, base.vocab_size, short=short,
                             gdn_prefill=args.gdn_prefill)
    for p in [p for p in prompts if p not in short] + [prompt for prompt, _ in hits]:
        if p % unit["chunk"]:
            raise UserError(f"{p} is not a multiple of the prefill chunk ({unit['chunk']} tokens)")
    rows = [figures(unit, n_gdn, n_attn, p) for p in prompts]
    reuse = []
    for prompt, hit in hits:
        plan = hit_plan(prompt, hit, unit["chunk"], unit["block"])
        u = plan["restored_from"]
        f = figures(unit, n_gdn, n_attn, prompt - u, start=u, restores=1, saves=plan["saves"])
        bare = figures(unit, n_gdn, n_attn, prompt - u, start=u)
        full = figures(unit, n_gdn, n_attn, prompt)
        traced = figures(unit, n_gdn, n_attn, prompt - u, start=u, restores=1, saves=plan["saves"], eager=False)
        reuse.append({"prompt_tokens": prompt, "hit_tokens": hit, **plan,
                      "ms": f["ms"], "ms_low": f["ms_low"], "ms_high": f["ms_high"],
                      "traced_ms": traced["ms"], "traced_ms_low": traced["ms_low"], "traced_ms_high": traced["ms_high"],
                      "copies_ms": f["ms"] - bare["ms"], "full_prompt_ms": full["ms"],
                      "saved_ms": full["ms"] - f["ms"]})
    c0, c1 = unit["chunks"][0]["parts"], unit["chunks"][1]["parts"]
    gi, ai = unit["gdn_index"], unit["attention_index"]
    same_programs = (c0["embed"].programs_per_op == c1["embed"].programs_per_op
                     and c0[f"layer{gi}"].programs_per_op == c1[f"layer{gi}"].programs_per_op
                     and c0[f"layer{ai}"].programs_per_op == c1[f"layer{ai}"].programs_per_op)
    cells = [{"cell": "chunk 1 runs the programs of chunk 0 (per layer kind)", "pass": same_programs},
             {"cell": "figures", "pass": all(r["ms"] > 0 for r in rows)}]
    ranking = chunk_ranking(unit, n_gdn, n_attn)
    label = rows[0]["label"]
    print(f"[{label}] prefill-cost {args.preset} {args.precision} tp{unit['tp']} batch 1 on {unit['backend']} "
          f"(chunk {unit['chunk']} rows; {n_gdn} GDN + {n_attn} attention layers):")
    print(f"  GDN prefill: {unit['gdn_prefill_path']}; programs per chunk: embed "
          f"{c0['embed'].programs}, GDN layer {c0[f'layer{gi}'].programs}, attention layer "
          f"{c0[f'layer{ai}'].programs}; head {unit['head'].programs}")
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
    print("  not in these figures: " + "; ".join(rows[0]["uncalibrated"]))
    perf = {"label": label, "backend": unit["backend"], "tp": unit["tp"], "batch": 1, "precision": args.precision,
            "chunk_tokens": unit["chunk"], "layers": {"gdn": n_gdn, "attention": n_attn},
            "gdn_prefill_path": unit["gdn_prefill_path"],
            "programs_per_chunk": {"embed": c0["embed"].programs, "gdn_layer": c0[f"layer{gi}"].programs,
                                   "attention_layer": c0[f"layer{ai}"].programs, "head": unit["head"].programs},
            "ttft": {str(r["prompt_tokens"]): {k: r[k] for k in ("ms", "ms_low", "ms_high", "tok_s", "chunks",
                                                                  "programs", "collectives", "flops_per_device",
                                                                  "bytes_read_per_device")}
                     | {"breakdown": {k: v for k, v in r["breakdown"].items() if k != "compute_by_op"},
                        "compute_by_op": r["breakdown"]["compute_by_op"]}
                     for r in rows},
            "prefix_reuse": reuse, "uncalibrated": rows[0]["uncalibrated"], "chunk_ranking": ranking,
            **({"experts": unit["experts"]} if "experts" in unit else {})}
    return ProbeReport(probe=NAME, backend=unit["backend"],
                       config={"preset": args.preset, "precision": args.precision, "prompts": prompts,
                               "prefix_hits": [list(h) for h in hits], "vocab_sample": cfg.vocab_size,
                               "real_vocab": base.vocab_size, "seed": args.seed, "gdn_prefill": args.gdn_prefill},
                       cells=cells, counters={"programs_per_chunk": perf["programs_per_chunk"]},
                       gate_complete=True, performance=perf)
