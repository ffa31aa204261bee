"""The calibrated figures of Tenstorrent's qwen36 (restated in calibration_qwen36.py and calibration_qwen36_prefill.py)
and the measurements they are pinned to or compared with.

A figure is the device time from :class:`~qwen36.tt_ops.cost_model.CalibratedP150aModel` (its band: every constant at
its fast / slow end) plus the host part of Tenstorrent's demo loop, which its measurements include: per decode step
the host's input update, sync and readback, and at TP=2 the read of the gathered bf16 logits for host sampling; per
prompt the read of the last row tile's logits. The host constants are here (they price Tenstorrent's harness, not a
device program); each names its source.
"""
from __future__ import annotations

from dataclasses import dataclass

from .calibration_qwen36 import QWEN36_27B, gdn_mixer_counts, tt_qwen36_decode
from .calibration_qwen36_prefill import tt_qwen36_prefill
from .cost_model import CALIBRATED_LABEL, Constant, calibrated_figures, calibrated_prefill_figures

HOST_CALIBRATION: dict[str, Constant] = {c.name: c for c in (
    Constant("host_step_us", 500.0, 400.0, 600.0, "us/step",
             "tt-metal models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_PLAN.md: qwen36 main at TP=4 '36.1 ms "
             "(35.6 device + 0.5 host)'; the demo loop's host input update, device sync and token readback"),
    Constant("host_read_gbps", 7.9, 7.7, 33.5, "GB/s",
             "tt-metal issue 27846: Blackhole device-to-host EnqueueReadBuffer 7.21-7.38 GiB/s at 1-2 KB pages "
             "(unpinned host memory); 20.6-31.2 GiB/s into pinned memory (the band's fast end)"),
)}


def host_ms(readback_bytes: int, which: str = "value") -> float:
    """The host part of one step or one first token: the loop's fixed host time plus the logits read."""
    pick = {"value": "value", "low": "low", "high": "high"}[which]
    step = getattr(HOST_CALIBRATION["host_step_us"], pick)
    gbps = getattr(HOST_CALIBRATION["host_read_gbps"], {"value": "value", "low": "high", "high": "low"}[which])
    return step * 1e-3 + readback_bytes / (gbps * 1e9) * 1e3


def _with_host(fig: dict, readback: int) -> dict:
    out = dict(fig)
    for which, key in (("value", "ms"), ("low", "ms_low"), ("high", "ms_high")):
        out[key] = fig[key] + host_ms(readback, which)
    out["host_ms"] = host_ms(readback)
    out["device_ms"] = fig["ms"]
    return out


def decode_figures(tp: int, batch: int, context: int) -> dict:
    """One decode step of Tenstorrent's qwen36 (device + host), with its band, breakdown and per-region figures."""
    w = tt_qwen36_decode(tp, batch, context)
    fig = _with_host(calibrated_figures(w.counts), w.readback_bytes)
    regions = {name: {"programs": reg.counts.programs, "times": w.layers[name],
                      "ms": calibrated_figures(reg.counts)["ms"]} for name, reg in w.regions.items()}
    return {**fig, "label": CALIBRATED_LABEL, "programs": w.counts.programs, "collectives": w.counts.collectives,
            "bytes_read_per_device": w.counts.bytes_read_total, "regions": regions, "tp": tp, "batch": batch,
            "context": context}


def ttft_figures(tp: int, prompt: int) -> dict:
    """Time to first token for a prompt of ``prompt`` tokens (B = 1): the prefill passes (eager or replayed from the
    chunk trace), the last-row head, the host's logits read."""
    w = tt_qwen36_prefill(tp, prompt)
    parts = [calibrated_prefill_figures(ps.counts, ps.rows, eager=ps.eager) for ps in w.passes]
    parts.append(calibrated_prefill_figures(w.head, 0))
    fig = {key: sum(p[key] for p in parts) for key in ("ms", "ms_low", "ms_high")}
    fig = _with_host(fig, w.readback_bytes)
    passes = [{"rows": ps.rows, "start": ps.start, "eager": ps.eager, "programs": ps.counts.programs,
               "ms": p["ms"]} for ps, p in zip(w.passes, parts)]
    return {**fig, "label": CALIBRATED_LABEL, "passes": passes, "head_ms": parts[-1]["ms"], "tp": tp,
            "prompt": prompt, "flops_per_device": sum(p["flops_per_device"] for p in parts)}


def gdn_mixer_figures(tp: int, batch: int = 1) -> dict:
    """The GDN mixer of one decode layer on one device (device time only, as a Tracy profile gives it)."""
    c = gdn_mixer_counts(tp, batch)
    return {**calibrated_figures(c), "programs": c.programs}


# ---- the measurements (by their authors, read from the cited sources) -------------------------------------------
@dataclass(frozen=True)
class QwenAnchor:
    name: str
    kind: str  # decode | ttft | mixer
    measured_ms: float
    tp: int
    size: int  # context (decode), prompt tokens (ttft), batch (mixer)
    source: str
    pinned: bool  # held within +-15 % in CI; else a reported comparison
    why: str = ""  # for a comparison: why it is not pinned
    batch: int = 1  # decode users


THATCH = "Thatch-cloud/Tenstorrent.Blackhole-Qwen3.8-27B README (2x P150a, tt-metal v0.77.0-rc1 + PRs 53314/53319/53320, 2026-08-24)"
QB2_LOG = "tt-metal models/demos/blackhole/qwen36/QWEN38_OPTIMIZATION_LOG.md row 0, qwen36 main on P300x2 (TP=4), text_demo"
BENCH = "tt-metal models/demos/blackhole/qwen36/BENCHMARKS.md (P300x2, TP=4, vllm bench serve, concurrency 1)"
QWEN36_ANCHORS = (
    QwenAnchor("decode tp2 ctx128", "decode", 1e3 / 18.19, 2, 128, f"{THATCH}: decode 18.19 tok/s at 128 context", True),
    QwenAnchor("decode tp2 ctx4k", "decode", 1e3 / 18.01, 2, 4096, f"{THATCH}: decode 18.01 tok/s at 4,096", True),
    QwenAnchor("ttft tp2 128", "ttft", 190.0, 2, 128, f"{THATCH}: TTFT 0.19 s at 128", True,
               "fitted: eager_dispatch_us is set by this figure"),
    QwenAnchor("ttft tp2 4k", "ttft", 1040.0, 2, 4096, f"{THATCH}: TTFT 1.04 s at 4,096", True,
               "fitted: matmul_util_fp32_acc is set by this figure"),
    QwenAnchor("gdn mixer tp2", "mixer", 0.442, 2, 1,
               "tenstorrent/vllm issue 442 (Tracy device time, TP=2, 2026-08-25): the Gated DeltaNet mixer 0.442 ms "
               "per layer per device", True),
    QwenAnchor("decode tp2 b8 ctx128 (serving)", "decode", 1e3 / 12.56, 2, 128,
               f"{THATCH}: batched serving B=8, 12.56 tok/s per user at 128", False,
               "vLLM serving's batched decode (QWEN36_BATCHED_DECODE_MODE=host), not the restated demo loop", 8),
    QwenAnchor("decode tp2 b8 ctx4k (serving)", "decode", 1e3 / 12.23, 2, 4096,
               f"{THATCH}: batched serving B=8, 12.23 tok/s per user at 4,096", False,
               "vLLM serving's batched decode (QWEN36_BATCHED_DECODE_MODE=host), not the restated demo loop", 8),
    QwenAnchor("decode tp4 ctx128 (demo)", "decode", 1e3 / 27.74, 4, 128,
               f"{QB2_LOG}: decode 27.74 t/s/u at ISL 128 (the same pre-fused program list)", True),
    QwenAnchor("decode tp4 ctx128 (serving, optimizations off)", "decode", 41.4, 4, 128,
               f"{BENCH}: TPOT 41.4 ms, baseline column (all optimizations off)", True),
    QwenAnchor("decode tp4 ctx128 (serving, fused GDN decode)", "decode", 30.4, 4, 128,
               f"{BENCH}: TPOT 30.4 ms, optimized column", False,
               "another program list: the fused GDN decode op, the single all-reduce per block, the lean attention "
               "(QWEN38_OPTIMIZATION_LOG.md rows 1.1-1.6), none of it in the restated tree"),
    QwenAnchor("ttft tp4 128 (demo)", "ttft", 125.0, 4, 128, f"{QB2_LOG}: TTFT 0.13 / 0.12 s at ISL 128", False,
               "a later tree (2026-10) than the pinned TTFTs; see docs/cost_model.md"),
    QwenAnchor("ttft tp4 2642 (demo)", "ttft", 460.0, 4, 2642, f"{QB2_LOG}: traced_4k (2,642-token prompt) TTFT 0.46 s",
               False, "a later tree (2026-10) than the pinned TTFTs; see docs/cost_model.md"),
    QwenAnchor("ttft tp4 128 (serving, optimizations off)", "ttft", 323.0, 4, 128, f"{BENCH}: TTFT 323 ms, baseline",
               False, "vLLM serving adds its own request path to the first token"),
    QwenAnchor("ttft tp4 4k (serving, optimizations off)", "ttft", 814.0, 4, 4096, f"{BENCH}: TTFT 814 ms, baseline",
               False, "vLLM serving adds its own request path to the first token"),
    QwenAnchor("ttft tp4 16k (serving, optimizations off)", "ttft", 3059.0, 4, 16384, f"{BENCH}: TTFT 3,059 ms, "
               "baseline", False, "vLLM serving adds its own request path to the first token"),
    QwenAnchor("ttft tp4 128 (serving, optimized)", "ttft", 94.0, 4, 128, f"{BENCH}: TTFT 94 ms, optimized", False,
               "traced prefill buckets and TP prefill kernels not in the restated tree"),
    QwenAnchor("ttft tp4 4k (serving, optimized)", "ttft", 515.0, 4, 4096, f"{BENCH}: TTFT 515 ms, optimized", False,
               "traced prefill buckets and TP prefill kernels not in the restated tree"),
    QwenAnchor("ttft tp4 16k (serving, optimized)", "ttft", 2101.0, 4, 16384, f"{BENCH}: TTFT 2,101 ms, optimized",
               False, "traced prefill buckets and TP prefill kernels not in the restated tree"),
)


def anchor_figures(a: QwenAnchor) -> dict:
    if a.kind == "decode":
        return decode_figures(a.tp, a.batch, a.size)
    if a.kind == "ttft":
        return ttft_figures(a.tp, a.size)
    return gdn_mixer_figures(a.tp, a.size)


__all__ = ["HOST_CALIBRATION", "QWEN36_27B", "QWEN36_ANCHORS", "QwenAnchor", "anchor_figures", "decode_figures",
           "gdn_mixer_figures", "host_ms", "ttft_figures"]
