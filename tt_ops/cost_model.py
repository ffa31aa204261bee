"""Cost model: turns emulator counts into *modelled* milliseconds on Blackhole P150a.

Two models live here. :class:`CalibratedP150aModel` (bottom of the file, docs/cost_model.md) is the one every P150a
figure uses: launch per program, kernel time per program by op class, DRAM-sharded bandwidth by readers per bank,
interleaved bandwidth by dtype and collective terms, each constant from a named public Blackhole measurement and
pinned against published Llama-3.1-8B decode figures (tests/tt_ops/test_cost_calibration.py). :class:`P150aCostModel`,
described next, is the earlier bandwidth/dispatch roofline; it is kept only as a named lower bound
(``ROOFLINE_LABEL``): against the published measurements it is 1.5-2x optimistic.

    predicted_ms = bytes read from DRAM per device / the bandwidth of their placement (below)
                 + programs x dispatch cost per program
                 + collectives x fixed cost per collective
                 + collective bytes per device / card-to-card link bandwidth

The terms are added, not overlapped: it is a bandwidth/dispatch roofline for decode-style steps where
weight streaming dominates, not a simulator.

How the DRAM term charges bytes (``breakdown``): by where the emulator saw each input read from (the suffix of
its ``bytes_read`` key, emulator/namespace.py ``read_placement``):

* DRAM-interleaved (plain dtype key): at one effective DRAM bandwidth (``dram_bw_gbps``), weights, activations
  (tile-padded to 32 rows in decode) and state alike; ttnn's default program configs read this way;
* DRAM-sharded over B banks (``@dram_sharded/B``, the weights of DRAM-sharded decode matmuls, bytes counted over
  the whole padded bank shards): at B x ``dram_sharded_bank_gbps``. Each reading core streams its own bank, so the
  banks run in parallel; the per-bank figure is the spec peak per bank (512 GB/s / 8) times the utilisation
  tt-metal's "Saturating DRAM bandwidth" tech report reached with one reader per bank on Wormhole and Grayskull
  (over 92 %). No Blackhole figure was found published, and none was measured here;
* L1 (``@l1``: width-sharded decode activations, height-sharded RoPE / KV-update inputs): not charged, an
  L1-resident operand never touches DRAM (its program is still charged by the dispatch term).

``breakdown_split``
charges the three kinds separately for whole-step what-if layouts (e.g. every weight DRAM-sharded, activations
width-sharded in L1, as tt_transformers runs all its decode matmuls): weight bytes at ``weight_bw_gbps``, DRAM-resident
state (KV cache, GDN state) at ``dram_bw_gbps``, activation bytes not at all when ``activations_in_l1``
(an L1-resident activation never touches DRAM; the program and collective terms still apply);
``decode_layout_bounds`` lists them, from the effective figure to the spec peak. Every constant is named, sourced and overridable
(``P150aCostModel(dram_bw_gbps=512)`` or ``dataclasses.replace``). Output is always labelled
"modelled" - never "measured".
"""

from __future__ import annotations

import dataclasses

from .emulator.counters import Counts

LABEL = "modelled"

# --- constants (per device) ---------------------------------------------------------------------
# P150a: 32 GB GDDR6, 512 GB/s peak (Tenstorrent P150a spec sheet). Public decode benchmarks reach about
# 405 GB/s effective (measured publicly on P150a, not by this project); we model with the effective number.
P150A_DRAM_BW_SPEC_GBPS = 512.0
P150A_DRAM_BW_EFFECTIVE_GBPS = 405.0
# Card-to-card all_gather on 2x P150a: ~84 GB/s effective with ~10 us fixed cost per collective
# (public TT reports).
P150A_LINK_BW_GBPS = 84.0
P150A_COLLECTIVE_FIXED_US = 10.0
# Per-program cost of the lower bound: the traced launch floor (tt-metal pgm_dispatch_blackhole_golden.json, 1.29 us),
# below the calibrated program time, so that the roofline stays a lower bound on steps of many small programs.
P150A_DISPATCH_US_PER_PROGRAM = 1.3
# DRAM-sharded reads: P150a has 8 DRAM banks (one GDDR6 channel each; tt-metal's Blackhole device reports a DRAM
# grid of 8 x 1), 512/8 = 64 GB/s spec per bank; one reader per bank reached over 92 % of peak in tt-metal's
# "Saturating DRAM bandwidth" tech report (Wormhole/Grayskull; not measured on Blackhole).
P150A_DRAM_BANKS = 8
P150A_DRAM_SHARDED_UTILISATION = 0.92
P150A_DRAM_SHARDED_BANK_GBPS = 512.0 / P150A_DRAM_BANKS * P150A_DRAM_SHARDED_UTILISATION


def split_read_bytes(bytes_read: dict) -> tuple[int, dict, int]:
    """(DRAM-interleaved bytes, {banks: DRAM-sharded bytes}, L1 bytes) from a ``bytes_read`` dict (module doc)."""
    inter, sharded, l1 = 0, {}, 0
    for k, v in bytes_read.items():
        if k.endswith("@l1"):
            l1 += v
        elif "@dram_sharded/" in k:
            banks = int(k.rsplit("/", 1)[1].split("x")[0])  # "B" or "BxR" (R readers per bank)
            sharded[banks] = sharded.get(banks, 0) + v
        else:
            inter += v
    return int(inter), sharded, int(l1)


@dataclasses.dataclass(frozen=True)
class P150aCostModel:
    dram_bw_gbps: float = P150A_DRAM_BW_EFFECTIVE_GBPS
    dispatch_us_per_program: float = P150A_DISPATCH_US_PER_PROGRAM
    collective_fixed_us: float = P150A_COLLECTIVE_FIXED_US
    link_bw_gbps: float = P150A_LINK_BW_GBPS
    include_activation_reads: bool = True  # count all op input bytes (weights + activations)
    # breakdown_split only: the weight stream's bandwidth (None: dram_bw_gbps) and whether activations live in L1
    weight_bw_gbps: float | None = None
    activations_in_l1: bool = False
    dram_sharded_bank_gbps: float = P150A_DRAM_SHARDED_BANK_GBPS  # per bank, for reads DRAM-sharded over B banks

    def breakdown(self, counts: Counts) -> dict:
        """Per-term modelled milliseconds for one region (e.g. one decode step)."""
        read = counts.bytes_read_total
        inter, sharded, l1 = split_read_bytes(counts.bytes_read)
        interleaved_ms = inter / (self.dram_bw_gbps * 1e9) * 1e3
        sharded_ms = sum(v / (b * self.dram_sharded_bank_gbps * 1e9) * 1e3 for b, v in sharded.items())
        dram_ms = interleaved_ms + sharded_ms
        dispatch_ms = counts.programs * self.dispatch_us_per_program * 1e-3
        coll_fixed_ms = counts.collectives * self.collective_fixed_us * 1e-3
        coll_bw_ms = counts.collective_bytes / (self.link_bw_gbps * 1e9) * 1e3
        total = dram_ms + dispatch_ms + coll_fixed_ms + coll_bw_ms
        return {
            "label": LABEL,
            "region": counts.name,
            "total_ms": total,
            "dram_ms": dram_ms,
            "dram_interleaved_ms": interleaved_ms,
            "dram_sharded_ms": sharded_ms,
            "dispatch_ms": dispatch_ms,
            "collective_fixed_ms": coll_fixed_ms,
            "collective_bw_ms": coll_bw_ms,
            "inputs": {
                "bytes_read_per_device": read,
                "bytes_read_dram_interleaved": inter,
                "bytes_read_dram_sharded": {str(b): int(v) for b, v in sorted(sharded.items())},
                "bytes_read_l1": l1,
                "programs_per_device": counts.programs,
                "collectives": counts.collectives,
                "collective_bytes_per_device": counts.collective_bytes,
            },
            "constants": dataclasses.asdict(self),
        }

    def breakdown_split(self, counts: Counts, weight_bytes: int, dram_resident_bytes: int) -> dict:
        """:meth:`breakdown` with the read bytes split into weights (``weight_bytes``, at ``weight_bw_gbps``),
        DRAM-resident state (``dram_resident_bytes``: KV cache, GDN state; at ``dram_bw_gbps``) and the rest, the
        activations (at ``dram_bw_gbps``, or free when ``activations_in_l1``). See the module doc."""
        read = counts.bytes_read_total
        act = read - weight_bytes - dram_resident_bytes
        if weight_bytes < 0 or dram_resident_bytes < 0 or act < 0:
            raise ValueError(f"split of {read} read bytes into weights {weight_bytes} + resident "
                             f"{dram_resident_bytes} leaves {act} activation bytes (must be >= 0)")
        wbw = self.dram_bw_gbps if self.weight_bw_gbps is None else self.weight_bw_gbps
        b = self.breakdown(counts)
        weight_ms = weight_bytes / (wbw * 1e9) * 1e3
        resident_ms = dram_resident_bytes / (self.dram_bw_gbps * 1e9) * 1e3
        act_ms = 0.0 if self.activations_in_l1 else act / (self.dram_bw_gbps * 1e9) * 1e3
        b.update(dram_ms=weight_ms + resident_ms + act_ms, weight_ms=weight_ms, resident_ms=resident_ms,
                 activation_ms=act_ms)
        b["total_ms"] = b["dram_ms"] + b["dispatch_ms"] + b["collective_fixed_ms"] + b["collective_bw_ms"]
        b["inputs"].update(weight_bytes=weight_bytes, dram_resident_bytes=dram_resident_bytes, activation_bytes=act)
        return b

    def predict_ms(self, counts: Counts) -> float:
        return self.breakdown(counts)["total_ms"]

    def tokens_per_s(self, counts: Counts, tokens_per_step: float = 1.0) -> float:
        ms = self.predict_ms(counts)
        return float("inf") if ms == 0 else tokens_per_step * 1e3 / ms

    def verify_cost_ratio(self, verify_counts: Counts, decode_counts: Counts) -> float:
        """cost(K+1-row verify step) / cost(1-row decode step), both modelled."""
        return self.predict_ms(verify_counts) / self.predict_ms(decode_counts)

    def describe(self, counts: Counts) -> str:
        b = self.breakdown(counts)
        return (
            f"[{LABEL}] {b['region']}: {b['total_ms']:.3f} ms on P150a "
            f"(DRAM {b['dram_ms']:.3f} + dispatch {b['dispatch_ms']:.3f} + collectives "
            f"{b['collective_fixed_ms']:.3f}+{b['collective_bw_ms']:.3f})"
        )


def decode_layout_bounds(base: P150aCostModel | None = None) -> dict[str, P150aCostModel]:
    """Cost models for whole-step what-if decode layouts, applied with :meth:`P150aCostModel.breakdown_split`
    (the weight/state/activation split of the counts, ignoring where the emulator saw each byte), all modelled:

    * ``interleaved``: every byte at the effective DRAM bandwidth (all weights and activations DRAM-interleaved);
    * ``dram_sharded_all``: every weight DRAM-sharded over the P150a's 8 banks at the per-bank figure (module doc),
      activations in L1: what DRAM-sharding the mixer projections and LM head too would reach;
    * ``dram_sharded_effective``: DRAM-sharded weights at the effective bandwidth, activations in L1;
    * ``dram_sharded_peak``: DRAM-sharded weights at the 512 GB/s spec peak, activations in L1 (a ceiling no
      real read pattern reaches).

    :meth:`P150aCostModel.breakdown` itself charges the layout the model ran."""
    base = base or P150aCostModel()
    return {
        "interleaved": base,
        "dram_sharded_all": dataclasses.replace(base, weight_bw_gbps=P150A_DRAM_BANKS * base.dram_sharded_bank_gbps,
                                                activations_in_l1=True),
        "dram_sharded_effective": dataclasses.replace(base, weight_bw_gbps=base.dram_bw_gbps, activations_in_l1=True),
        "dram_sharded_peak": dataclasses.replace(base, weight_bw_gbps=P150A_DRAM_BW_SPEC_GBPS, activations_in_l1=True),
    }


# =================================================================================================
# Calibrated model (the one every P150a figure now uses; the roofline above is kept as a named lower bound)
# =================================================================================================
CALIBRATED_LABEL = "modelled (calibrated)"
ROOFLINE_LABEL = "modelled (roofline lower bound)"


@dataclasses.dataclass(frozen=True)
class Constant:
    """One calibration constant: ``value`` (central), ``low`` / ``high`` (the band: the spread its sources give),
    its unit and where it comes from (repository, path or pull request, and the figure read there)."""

    name: str
    value: float
    low: float
    high: float
    unit: str
    source: str


# fitted to tt-metal PR 55080's two Llama-3.1-8B arms with every other constant at its source
# (tests/tt_ops/test_cost_calibration.py::test_fitted_utilisations_reproduce_pr_55080 re-fits them)
UTIL_1_FIT = 0.39
UTIL_MULTI_FIT = 0.54

# The one table. "fit" marks the constants not read from a source: the two DRAM-sharded utilisations, fitted so that
# both arms of tt-metal PR 55080 (Llama-3.1-8B, one and two readers per bank) are reproduced
# (tests/tt_ops/test_cost_calibration.py holds every other pin out of sample). ``program_us`` is the device time of
# one program of any class but the fused recurrence (its own constant) and the collectives (their own terms); the
# dispatch of a traced program overlaps the previous kernel, so a program costs max(launch, kernel) plus its bytes.
CALIBRATION: dict[str, Constant] = {c.name: c for c in (
    Constant("launch_us", 1.3, 1.3, 5.0, "us/program",
             "tt-metal tests/tt_metal/tt_metal/perf_microbenchmark/dispatch/pgm_dispatch_blackhole_golden.json: "
             "traced launch of a one-kernel program 1.29 us (brisc_only_trace), 4.96 us with one CB per kernel "
             "group (kernel_groups_1_cb_trace); the floor of a traced program, hidden behind longer kernels "
             "(tenstorrent/vllm issue 442: the device-kernel times of Tenstorrent's qwen36 decode sum to its step)"),
    Constant("program_us", 3.8, 2.9, 4.4, "us/program",
             "tt-metal models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_PLAN.md: Blackhole decode profile of "
             "Tenstorrent's qwen36, 'GDN-layer internals ~260 us' for '~69 small ops/layer' (norm, matmuls of the "
             "recurrence, elementwise, data movement): 3.8 us per program; low end 2.9 (tenstorrent/vllm issue "
             "442's 0.442 ms GDN mixer through the restated program list), high end the '~' of both counts"),
    Constant("gdn_recurrence_us", 15.0, 10.0, 20.0, "us/program",
             "tt-metal models/demos/blackhole/qwen36/docs/gdn_decode_fused_design.md: fused conv + recurrence "
             "'~20-40 us' for the two programs incl. the state traffic (state bytes are charged separately here)"),
    Constant("dram_sharded_util_1_reader", UTIL_1_FIT, 0.36, 0.55, "x 512 GB/s",
             "fit (tt-metal PR 55080 'Main', Llama-3.1-8B, P150, batch 32, 30.53 ms, one reader per bank): in the "
             "model, below the isolated matmul's 55 % of tt-metal PR 54242 (the band's fast end), as Tenstorrent "
             "found for its qwen36 decode, whose 1D matmuls on interleaved weights beat the DRAM-sharded grid "
             "(QWEN38_OPTIMIZATION_LOG.md row 1.5: a microbenchmark gain 'did not show up end to end')"),
    Constant("dram_sharded_util_multi_reader", UTIL_MULTI_FIT, 0.50, 0.90, "x 512 GB/s",
             "fit (tt-metal PR 55080 'This PR', the same run at two readers per bank, 23.76 ms); fast end tt-metal "
             "PR 54242's isolated matmul (90 % with 2-3 readers per bank; PR 47885 bh_dram_read: 98 % is the "
             "read-only ceiling)"),
    Constant("interleaved_bf16_gbps", 405.0, 380.0, 420.0, "GB/s",
             "Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B docs/fabric-bandwidth-2026-09-19.md: '405 GB/s is a "
             "saturated GDDR6 subsystem at 79% "
             "of spec'; tt-metal issue 55898: bf16 decode-matmul weight stream 400 GB/s"),
    Constant("interleaved_bf8_gbps", 376.0, 350.0, 405.0, "GB/s",
             "tt-metal issue 55898: a 1088 B bfp8_b tile reaches 91 % of channel peak vs 98 % for a 2 KB bf16 "
             "tile (one read request per ~16 cycles per NoC): 405 x 91/98"),
    Constant("interleaved_bf4_gbps", 279.0, 260.0, 300.0, "GB/s",
             "tt-metal issue 55898: 'the bfp4 weight stream of a decode matmul runs at 279 GB/s where bf16 runs "
             "at 400' (576 B tiles at 62 % of channel peak)"),
    Constant("collective_fixed_us", 10.0, 8.0, 12.0, "us/collective",
             "Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B docs/fabric-bandwidth-2026-09-19.md: all_gather over "
             "the 2x P150a pair, fit of time = "
             "fixed + bytes/rate over 2.6-42 MB: about 10 us fixed"),
    Constant("link_gbps", 84.0, 76.0, 85.0, "GB/s",
             "Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B docs/fabric-bandwidth-2026-09-19.md: 83.74 GB/s at "
             "42 MB (asymptote near 85), 76.4 GB/s at 10.5 MB"),
)}

# op name -> class of its kernel time (the op names the emulator counts, ``Counts.programs_per_op``)
_CLASS_OF = {
    "ttnn.linear": "matmul", "ttnn.matmul": "matmul", "ttnn.sparse_matmul": "matmul",
    "ttnn.rms_norm": "norm", "ttnn.layer_norm": "norm",
    "ttnn.experimental.rotary_embedding_hf": "rope", "ttnn.experimental.rotary_embedding_llama": "rope",
    "ttnn.experimental.paged_fused_update_cache": "cache_update",
    "ttnn.experimental.paged_update_cache": "cache_update",
    "ttnn.experimental.indexed_fused_update_cache": "cache_update", "ttnn.update_cache": "cache_update",
    "ttnn.fill_cache": "cache_update", "ttnn.experimental.paged_fill_cache": "cache_update",
    "ttnn.transformer.paged_scaled_dot_product_attention_decode": "sdpa_decode",
    "ttnn.transformer.scaled_dot_product_attention_decode": "sdpa_decode",
    "ttnn.transformer.fused_recurrent_gated_delta_rule": "gdn_recurrence",
    "ttnn.transformer.chunk_gated_delta_rule": "gdn_recurrence",
    "ttnn.argmax": "sampling", "ttnn.sampling": "sampling", "ttnn.topk": "sampling",
    "ttnn.to_memory_config": "reshard", "ttnn.sharded_to_interleaved": "reshard",
    "ttnn.interleaved_to_sharded": "reshard", "ttnn.reshard": "reshard",
    "ttnn.slice": "data_movement", "ttnn.concat": "data_movement", "ttnn.reshape": "data_movement",
    "ttnn.typecast": "data_movement", "ttnn.to_layout": "data_movement", "ttnn.tilize": "data_movement",
    "ttnn.untilize": "data_movement", "ttnn.embedding": "data_movement", "ttnn.permute": "data_movement",
    "ttnn.transpose": "data_movement", "ttnn.pad": "data_movement", "ttnn.repeat": "data_movement",
    "ttnn.repeat_interleave": "data_movement", "ttnn.gather": "data_movement",
    "ttnn.experimental.nlp_create_qkv_heads_decode": "data_movement",
    "ttnn.experimental.nlp_concat_heads_decode": "data_movement",
    "ttnn.all_gather": "collective", "ttnn.all_reduce": "collective", "ttnn.reduce_scatter": "collective",
    "ttnn.experimental.all_gather_async": "collective", "ttnn.experimental.all_reduce_async": "collective",
    "ttnn.experimental.reduce_scatter_minimal_async": "collective",
}
# kernel-time constant of each class; "collective" programs are charged by the collective terms instead
CLASS_CONSTANT = {"eltwise": "program_us", "data_movement": "program_us", "reshard": "program_us",
                  "gdn_recurrence": "gdn_recurrence_us", "matmul": "program_us", "norm": "program_us",
                  "rope": "program_us", "cache_update": "program_us", "sdpa_decode": "program_us",
                  "sampling": "program_us", "collective": None}
OP_CLASSES = tuple(CLASS_CONSTANT)


def op_class(op_name: str) -> str:
    """The kernel-time class of an op (``_CLASS_OF``); every other op on the emulated mesh is elementwise (unary /
    binary / reduction / fill: one pass over tile-row-sized operands in decode)."""
    return _CLASS_OF.get(op_name, "eltwise")


def parse_read_key(key: str) -> tuple[str, str, int, int]:
    """(dtype, placement, banks, readers per bank) of a ``bytes_read`` key: ``DTYPE`` (DRAM-interleaved),
    ``DTYPE@l1``, ``DTYPE@dram_sharded/B`` (one reader per bank) or ``DTYPE@dram_sharded/BxR`` (R readers)."""
    if key.endswith("@l1"):
        return key[:-3], "l1", 0, 0
    if "@dram_sharded/" in key:
        dtype, rest = key.split("@dram_sharded/")
        banks, _, readers = rest.partition("x")
        return dtype, "dram_sharded", int(banks), int(readers or 1)
    return key, "interleaved", 0, 0


def _pick(which: str, c: Constant) -> float:
    return {"value": c.value, "low": c.low, "high": c.high}[which]


@dataclasses.dataclass(frozen=True)
class CalibratedP150aModel:
    """Per device: ``sum over programs (launch + kernel time of the op's class) + interleaved bytes / bandwidth of
    their dtype + DRAM-sharded bytes / (utilisation of their readers per bank x 512 GB/s) + collectives x fixed +
    collective bytes / link bandwidth``. The terms add (no overlap), as in the roofline; the difference is what each
    term charges (docs/cost_model.md). ``which`` picks the central value or one end of every constant's band:
    ``"low"`` is the optimistic end (fast constants), ``"high"`` the pessimistic one."""

    which: str = "value"
    overrides: tuple = ()  # ((constant name, value), ...): what-if figures

    def k(self, name: str) -> float:
        for n, v in self.overrides:
            if n == name:
                return float(v)
        c = CALIBRATION[name] if name in CALIBRATION else PREFILL_CALIBRATION[name]
        if name.startswith("dram_sharded_util") or name.endswith("_gbps") or name in FAST_IS_HIGH:  # fast = high
            return _pick({"low": "high", "high": "low"}.get(self.which, self.which), c)
        return _pick(self.which, c)

    def interleaved_gbps(self, dtype: str) -> float:
        d = dtype.upper()
        if d == "BFLOAT4_B":
            return self.k("interleaved_bf4_gbps")
        if d == "BFLOAT8_B":
            return self.k("interleaved_bf8_gbps")
        return self.k("interleaved_bf16_gbps")

    def dram_sharded_gbps(self, banks: int, readers: int) -> float:
        util = self.k("dram_sharded_util_1_reader" if readers <= 1 else "dram_sharded_util_multi_reader")
        return util * P150A_DRAM_BW_SPEC_GBPS * banks / P150A_DRAM_BANKS

    def kernel_us(self, op_name: str) -> float:
        const = CLASS_CONSTANT[op_class(op_name)]
        return 0.0 if const is None else self.k(const)

    def breakdown(self, counts: Counts) -> dict:
        by_class = {c: 0.0 for c in OP_CLASSES}
        launch_us = 0.0
        programs_per_op = counts.programs_per_op or {}
        if sum(programs_per_op.values()) != counts.programs:
            raise ValueError(f"{counts.name}: programs_per_op sums to {sum(programs_per_op.values())}, programs is "
                             f"{counts.programs} (a Counts built by hand must fill both)")
        for op, n in programs_per_op.items():
            kernel = self.kernel_us(op)
            by_class[op_class(op)] += n * kernel
            if op_class(op) != "collective":  # a traced launch overlaps the previous kernel: the floor of a program
                launch_us += n * max(0.0, self.k("launch_us") - kernel)
        inter_ms, sharded_ms = 0.0, 0.0
        for key, nbytes in counts.bytes_read.items():
            dtype, place, banks, readers = parse_read_key(key)
            if place == "interleaved":
                inter_ms += nbytes / (self.interleaved_gbps(dtype) * 1e9) * 1e3
            elif place == "dram_sharded":
                sharded_ms += nbytes / (self.dram_sharded_gbps(banks, readers) * 1e9) * 1e3
        kernel_ms = sum(by_class.values()) * 1e-3
        coll_fixed = counts.collectives * self.k("collective_fixed_us") * 1e-3
        coll_bw = counts.collective_bytes / (self.k("link_gbps") * 1e9) * 1e3
        total_ms = launch_us * 1e-3 + kernel_ms + inter_ms + sharded_ms + coll_fixed + coll_bw
        return {"label": CALIBRATED_LABEL, "which": self.which, "region": counts.name, "total_ms": total_ms,
                "launch_ms": launch_us * 1e-3, "kernel_ms": kernel_ms,
                "kernel_ms_by_class": {c: v * 1e-3 for c, v in by_class.items() if v},
                "dram_interleaved_ms": inter_ms, "dram_sharded_ms": sharded_ms,
                "collective_fixed_ms": coll_fixed, "collective_bw_ms": coll_bw}

    def predict_ms(self, counts: Counts) -> float:
        return self.breakdown(counts)["total_ms"]

    def program_us(self, op_name: str) -> float:
        """Time of one program of ``op_name``: its kernel, at least the traced launch (its bytes and collective terms
        come on top)."""
        return max(self.k("launch_us"), self.kernel_us(op_name))


def calibrated_figures(counts: Counts, tokens_per_step: float = 1.0, overrides: tuple = ()) -> dict:
    """The calibrated figure of one step with its band: ``ms`` (central), ``ms_low`` / ``ms_high`` (every constant at
    the fast / slow end of its band), ``tok_s`` / ``tok_s_low`` / ``tok_s_high`` (tokens_per_step per step; low
    tok/s goes with high ms), the central breakdown, and the label."""
    b = {w: CalibratedP150aModel(w, overrides).breakdown(counts) for w in ("value", "low", "high")}
    ms, lo, hi = b["value"]["total_ms"], b["low"]["total_ms"], b["high"]["total_ms"]
    rate = lambda t: tokens_per_step * 1e3 / t if t > 0 else None  # noqa: E731  (an empty region has no rate)
    return {"label": CALIBRATED_LABEL, "ms": ms, "ms_low": lo, "ms_high": hi,
            "tok_s": rate(ms), "tok_s_low": rate(hi), "tok_s_high": rate(lo), "breakdown": b["value"]}


def calibration_markdown_rows() -> list[str]:
    """The table as markdown rows, as docs/cost_model.md prints it (a test keeps the two identical)."""
    return [f"| `{c.name}` | {c.value:g} | {c.low:g}-{c.high:g} | {c.unit} | {c.source} |"
            for c in CALIBRATION.values()]


def calibration_table() -> list[dict]:
    """The constants as records (docs/cost_model.md prints the same table)."""
    return [dataclasses.asdict(c) for c in CALIBRATION.values()]


__all__ = [
    "CALIBRATED_LABEL",
    "CALIBRATION",
    "CalibratedP150aModel",
    "Constant",
    "ROOFLINE_LABEL",
    "calibrated_figures",
    "calibration_markdown_rows",
    "calibration_table",
    "op_class",
    "parse_read_key",
    "per_op_ms",
    "decode_layout_bounds",
    "LABEL",
    "P150aCostModel",
    "P150A_DRAM_BW_SPEC_GBPS",
    "P150A_DRAM_BW_EFFECTIVE_GBPS",
    "P150A_LINK_BW_GBPS",
    "P150A_COLLECTIVE_FIXED_US",
    "P150A_DISPATCH_US_PER_PROGRAM",
    "P150A_DRAM_BANKS",
    "P150A_DRAM_SHARDED_BANK_GBPS",
    "P150A_DRAM_SHARDED_UTILISATION",
    "split_read_bytes",
]


def per_op_ms(counts: Counts, model: CalibratedP150aModel | None = None) -> dict:
    """{op name: {"class", "programs", "ms"}} of one region, each op charged its launches, its class's kernel time,
    its own read bytes (``Counts.bytes_read_per_op``) and its collectives; the values sum to the region's total
    (a ranking of the step's programs by calibrated time)."""
    m = model or CalibratedP150aModel()
    out = {}
    for op, n in counts.programs_per_op.items():
        c = Counts(op)
        c.programs = n
        c.programs_per_op[op] = n
        for k, v in counts.bytes_read_per_op.get(op, {}).items():
            c.bytes_read[k] += v
        c.collectives = counts.collectives_per_op.get(op, 0)
        c.collective_bytes = counts.collective_bytes_per_op.get(op, 0)
        out[op] = {"class": op_class(op), "programs": n, "ms": m.predict_ms(c)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


# =================================================================================================
# Prefill: the compute term (docs/cost_model.md "Prefill and time to first token")
# =================================================================================================
# A decode step moves weights; a prefill chunk of 256 rows also multiplies them 256 times, so a matmul may take
# longer to compute than to stream its operands. The emulator records each matmul-like program's FLOPs and math
# fidelity (emulator/work.py, ``Counts.compute_work``); a program is charged max(compute, its own DRAM bytes) on top
# of its launch and fixed kernel time, i.e. the breakdown above plus the excess of compute over bytes.
#
# Peak of the fidelity: the matrix engine does an 8x16 by 16x16 product per cycle (4,096 FLOPs) at 1.35 GHz on
# Blackhole, divided by the fidelity phases (LoFi 1, HiFi2 2, HiFi4 4): tt-metal tech_reports/GEMM_FLOPS/GEMM_FLOPS.md,
# "Matrix Multiplication TFLOPS on Wormhole/Blackhole". Over the 11 x 10 grid its P150 out-of-box table ran on,
# LoFi is 608 TFLOPS; the utilization below was measured relative to that same grid and peak.
P150_MATMUL_GRID_CORES = 110
P150_MATMUL_FLOPS_PER_CYCLE = 2 * 8 * 16 * 16
P150_CLOCK_HZ = 1.35e9
P150_MATMUL_PEAK_TFLOPS_LOFI = P150_MATMUL_GRID_CORES * P150_MATMUL_FLOPS_PER_CYCLE * P150_CLOCK_HZ / 1e12

PREFILL_CALIBRATION: dict[str, Constant] = {c.name: c for c in (
    Constant("matmul_util", 0.83, 0.80, 0.87, "x fidelity peak",
             "tt-metal tech_reports/GEMM_FLOPS/GEMM_FLOPS.md, 'P150 Out of Box Results (11x10 grid)': device-based "
             "utilization of DRAM-interleaved matmuls with auto-selected program configs, M >= 2560: 80.3-87.0 % "
             "(bfloat16 HiFi2 and bfloat8_b LoFi, with and without trace)"),
    Constant("prefill_matmul_fixed_us", 12.7, 10.0, 18.0, "us/program",
             "fit (tt-metal tech_reports/GEMM_FLOPS/GEMM_FLOPS.md, 'P150 Out of Box Results (11x10 grid)', the six "
             "traced rows of tests/probes/test_prefill_cost.py): what a whole-grid 2D matmul program takes beyond "
             "program_us and max(compute, its bytes), the per-op time of the traced benchmark loop over the device "
             "kernel the table's device-based utilization implies; charged on every program with a compute term"),
    Constant("matmul_util_fp32_acc", 0.27, 0.22, 0.37, "x fidelity peak",
             "fit (Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B README, 2x P150a, Tenstorrent's qwen36: TTFT "
             "1.04 s for a 4,096-token prompt): matmuls accumulating in fp32 Dst, on the grids a model gives them; "
             "high end tt-metal models/demos/blackhole/qwen36/tt/gdn/tp.py's own measure of its fused GDN "
             "in-projection in prefill, '36.6% of peak' with fp32_dest_acc_en (subblock capped at 4 tiles)"),
    Constant("eager_dispatch_us", 35.0, 18.0, 40.0, "us/program",
             "fit (Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B README: TTFT 0.19 s for a 128-token prompt, "
             "prefilled eagerly by Tenstorrent's qwen36): host time of one untraced op, the floor of each program "
             "of an eager region; low end tt-metal models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_LOG.md row "
             "1.4, tracing the ~3.3k-op 128-token prefill saved 50 ms (0.13 -> 0.08 s)"),
)}
FAST_IS_HIGH = frozenset({"matmul_util", "matmul_util_fp32_acc"})
# what the compute term does not cover, stated with every figure
PREFILL_UNCALIBRATED = (
    "SDPA prefill and chunked GDN kernels charged at the matmul utilization (no Blackhole figure for either kernel "
    "found); the GDN FLOPs are an estimate of the chunked algorithm's products (emulator/work.py)",
    "the fp32-Dst utilization and the eager host time per op are fitted to Tenstorrent's qwen36 time to first "
    "token on 2x P150a (two figures, two constants), not measured per op",
)


def matmul_peak_tflops(phases: int) -> float:
    """Peak TFLOPS of the P150 matmul grid at a fidelity of ``phases`` FPU phases (LoFi 1 ... HiFi4 4)."""
    return P150_MATMUL_PEAK_TFLOPS_LOFI / max(1, int(phases))


def _read_ms(model: "CalibratedP150aModel", read_items) -> float:
    ms = 0.0
    for key, nbytes in read_items:
        dtype, place, banks, readers = parse_read_key(key)
        if place == "interleaved":
            ms += nbytes / (model.interleaved_gbps(dtype) * 1e9) * 1e3
        elif place == "dram_sharded":
            ms += nbytes / (model.dram_sharded_gbps(banks, readers) * 1e9) * 1e3
    return ms


def prefill_compute_excess(counts: Counts, model: "CalibratedP150aModel | None" = None) -> dict:
    """The compute term of a region: over its matmul-like programs (``Counts.compute_work``), the sum of
    ``max(0, compute time - the program's own DRAM read time) + prefill_matmul_fixed_us``, compute time = FLOPs /
    (fidelity peak x ``matmul_util``, or ``matmul_util_fp32_acc`` for a program accumulating in fp32 Dst). Returns ``excess_ms``, ``compute_ms`` (all the work at that rate), ``flops`` and both by op."""
    m = model or CalibratedP150aModel()
    excess, compute, flops = 0.0, 0.0, 0
    by_op: dict = {}
    fixed_us = m.k("prefill_matmul_fixed_us")
    for (op, f, phases, fp32, read_items), n in counts.compute_work.items():
        util = m.k("matmul_util_fp32_acc" if fp32 else "matmul_util")
        t = f / (matmul_peak_tflops(phases) * 1e12 * util) * 1e3
        e = max(0.0, t - _read_ms(m, read_items)) + fixed_us * 1e-3
        excess, compute, flops = excess + n * e, compute + n * t, flops + n * f
        row = by_op.setdefault(op, {"programs": 0, "flops": 0, "compute_ms": 0.0, "excess_ms": 0.0})
        row["programs"] += n
        row["flops"] += n * f
        row["compute_ms"] += n * t
        row["excess_ms"] += n * e
    return {"excess_ms": excess, "compute_ms": compute, "flops": flops, "by_op": by_op}


def eager_region_ms(counts: Counts, model: "CalibratedP150aModel | None" = None) -> dict:
    """An untraced region: the host enqueues each op in ``eager_dispatch_us`` while the device runs the previous ones,
    so an op name's programs take ``max(programs x eager_dispatch_us, their device time)`` (launch, kernel, own bytes,
    own collectives, own compute excess). Returns ``ms`` and the device and host sums."""
    m = model or CalibratedP150aModel()
    excess = prefill_compute_excess(counts, m)["by_op"]
    host_us = m.k("eager_dispatch_us")
    total = dev_total = host_total = 0.0
    for op, row in per_op_ms(counts, m).items():
        dev = row["ms"] + excess.get(op, {}).get("excess_ms", 0.0)
        host = row["programs"] * host_us * 1e-3
        total, dev_total, host_total = total + max(dev, host), dev_total + dev, host_total + host
    return {"ms": total, "device_ms": dev_total, "host_ms": host_total}


def calibrated_prefill_figures(counts: Counts, tokens: int, eager: bool = False) -> dict:
    """The calibrated time of a prefill region (e.g. a whole prompt's chunks and the last-row head) with its band:
    the decode breakdown (launch, kernels, DRAM, collectives) plus the compute excess, for every constant at its
    central value and at both band ends. ``tokens``: prompt tokens the region prefills (for tok/s). ``eager``: the
    region runs untraced, each op at least its host dispatch (``eager_region_ms``)."""
    out = {"label": CALIBRATED_LABEL, "eager": eager}
    for which, key in (("value", "ms"), ("low", "ms_low"), ("high", "ms_high")):
        m = CalibratedP150aModel(which)
        b = m.breakdown(counts)
        c = prefill_compute_excess(counts, m)
        out[key] = eager_region_ms(counts, m)["ms"] if eager else b["total_ms"] + c["excess_ms"]
        if which == "value":
            out["breakdown"] = {**{k: v for k, v in b.items() if k not in ("label", "which", "region")},
                                "compute_excess_ms": c["excess_ms"], "compute_ms_at_util": c["compute_ms"],
                                "compute_by_op": c["by_op"]}
            if eager:
                e = eager_region_ms(counts, m)
                out["breakdown"]["eager_device_ms"], out["breakdown"]["eager_host_ms"] = e["device_ms"], e["host_ms"]
            out["flops_per_device"] = c["flops"]
    out["tok_s"] = tokens * 1e3 / out["ms"] if out["ms"] > 0 else None
    out["uncalibrated"] = list(PREFILL_UNCALIBRATED)
    return out


def prefill_calibration_markdown_rows() -> list[str]:
    """The prefill constants as docs/cost_model.md prints them (a test keeps the two identical)."""
    return [f"| `{c.name}` | {c.value:g} | {c.low:g}-{c.high:g} | {c.unit} | {c.source} |"
            for c in PREFILL_CALIBRATION.values()]


__all__ += ["PREFILL_CALIBRATION", "PREFILL_UNCALIBRATED", "calibrated_prefill_figures", "eager_region_ms",
            "matmul_peak_tflops",
            "prefill_calibration_markdown_rows", "prefill_compute_excess", "P150_MATMUL_PEAK_TFLOPS_LOFI"]
