"""Cost model: turns emulator counts into *modelled* milliseconds on Blackhole P150a.

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
# Per-program dispatch cost with fast dispatch, untraced/traced: "several us per program" (public TT reports;
# public tt-metal discussions put traced dispatch at a few us). We take 4 us as the default.
P150A_DISPATCH_US_PER_PROGRAM = 4.0
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
            banks = int(k.rsplit("/", 1)[1])
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


__all__ = [
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
