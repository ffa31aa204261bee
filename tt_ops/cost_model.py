"""Cost model: turns emulator counts into *modelled* milliseconds on Blackhole P150a.

    predicted_ms = bytes_read_per_device / DRAM bandwidth
                 + programs x dispatch cost per program
                 + collectives x fixed cost per collective
                 + collective bytes per device / card-to-card link bandwidth

The terms are added, not overlapped: it is a bandwidth/dispatch roofline for decode-style steps where
weight streaming dominates, not a simulator.

How the DRAM term charges bytes (``breakdown``): by default every byte an op reads is charged at one effective
DRAM bandwidth: weights, activations (tile-padded to 32 rows in decode) and state alike. That is what the model's
matmuls do today (DRAM-interleaved weights and activations, ttnn's default program configs). ``breakdown_split``
charges the three kinds separately for the decode layout tt_transformers uses instead (weights DRAM-sharded,
one bank per reading core, activations width-sharded in L1): weight bytes at ``weight_bw_gbps``, DRAM-resident
state (KV cache, GDN state) at ``dram_bw_gbps``, activation bytes not at all when ``activations_in_l1``
(an L1-resident activation never touches DRAM; the program and collective terms still apply). What
DRAM-sharded reads reach on a P150a has not been measured here or found published: ``decode_layout_bounds``
brackets it between the effective figure and the spec peak. Every constant is named, sourced and overridable
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

    def breakdown(self, counts: Counts) -> dict:
        """Per-term modelled milliseconds for one region (e.g. one decode step)."""
        read = counts.bytes_read_total
        dram_ms = read / (self.dram_bw_gbps * 1e9) * 1e3
        dispatch_ms = counts.programs * self.dispatch_us_per_program * 1e-3
        coll_fixed_ms = counts.collectives * self.collective_fixed_us * 1e-3
        coll_bw_ms = counts.collective_bytes / (self.link_bw_gbps * 1e9) * 1e3
        total = dram_ms + dispatch_ms + coll_fixed_ms + coll_bw_ms
        return {
            "label": LABEL,
            "region": counts.name,
            "total_ms": total,
            "dram_ms": dram_ms,
            "dispatch_ms": dispatch_ms,
            "collective_fixed_ms": coll_fixed_ms,
            "collective_bw_ms": coll_bw_ms,
            "inputs": {
                "bytes_read_per_device": read,
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
    """Cost models for the decode weight/activation layouts (module doc), all modelled:

    * ``interleaved``: the layout the model runs today (every byte at the effective DRAM bandwidth);
    * ``dram_sharded_effective``: DRAM-sharded weights at the same effective bandwidth, activations in L1;
    * ``dram_sharded_peak``: DRAM-sharded weights at the 512 GB/s spec peak, activations in L1 (a ceiling no
      real read pattern reaches)."""
    base = base or P150aCostModel()
    return {
        "interleaved": base,
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
]
