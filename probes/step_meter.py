"""The measuring piece of the step-cost probes (gate-0b, gate-0a): named regions of device work turned into a cost
vector (emulator counters: programs, bytes read per device by dtype, collectives; cards: synchronized wall-clock),
linear so a phase is a sum of regions and extrapolation is vector arithmetic; and a phase's figures from it
(``phase_figures``: the roofline cost model and the calibrated band on the emulator, wall-clock on cards)."""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

class Cost(dict):
    """A linear cost vector: programs, collectives, collective_bytes, ``read:<DTYPE>`` bytes per device (emulator)
    and wall_ms (cards). Phases are linear combinations of regions, so extrapolation is vector arithmetic."""

    def plus(self, other: "Cost", times: float = 1.0) -> "Cost":
        out = Cost(self)
        for k, v in other.items():
            out[k] = out.get(k, 0) + v * times
        return out

    def vocab_scaled(self, ratio: float) -> "Cost":
        """Bytes (read and sent) scale with the vocabulary; program and collective counts do not."""
        return Cost({k: v * ratio if k.startswith(("read:", "opread:", "opcollb:")) or k == "collective_bytes" else v
                     for k, v in self.items()})

    def counts(self, name: str):
        from qwen36.tt_ops.emulator.counters import Counts

        c = Counts(name)
        c.programs, c.collectives = round(self.get("programs", 0)), round(self.get("collectives", 0))
        c.collective_bytes = round(self.get("collective_bytes", 0))
        for k, v in self.items():
            if k.startswith("read:"):
                c.bytes_read[k[5:]] = round(v)
            elif k.startswith("prog:") and round(v):
                c.programs_per_op[k[5:]] = round(v)
            elif k.startswith("opread:"):
                op, _, key = k[7:].partition("|")
                c.bytes_read_per_op[op][key] = round(v)
            elif k.startswith("opcoll:"):
                c.collectives_per_op[k[7:]] = round(v)
            elif k.startswith("opcollb:"):
                c.collective_bytes_per_op[k[8:]] = round(v)
        return c


def total(parts) -> Cost:
    out = Cost()
    for c, times in parts:
        out = out.plus(c, times)
    return out


class Meter:
    """Named regions of device work: counter scopes on the emulator, synchronized wall-clock on cards. Also
    records the rows of every embedding / RoPE gather (the emulator byte correction)."""

    def __init__(self, bench):
        self.bench, self.ctx, self.ttnn, self.mesh = bench, bench.ctx, bench.ttnn, bench.mesh
        self.emulated = bool(bench.ctx.is_emulated)
        self.log: list = []
        self.gathers: list = []

    @contextlib.contextmanager
    def region(self, name: str):
        if self.emulated:
            with self.ctx.counters.scope(name) as c:
                yield
            cost = Cost(programs=c.programs, collectives=c.collectives, collective_bytes=c.collective_bytes)
            cost.update({f"read:{k}": v for k, v in c.bytes_read.items()})
            cost.update({f"prog:{k}": v for k, v in c.programs_per_op.items()})  # the calibrated model's op classes
            # per op: its read bytes and collectives (a ranking of the phase's programs by calibrated time)
            cost.update({f"opread:{op}|{k}": v for op, r in c.bytes_read_per_op.items() for k, v in r.items()})
            cost.update({f"opcoll:{op}": v for op, v in c.collectives_per_op.items()})
            cost.update({f"opcollb:{op}": v for op, v in c.collective_bytes_per_op.items()})
        else:
            self.ttnn.synchronize_device(self.mesh)
            t0 = time.perf_counter()
            yield
            self.ttnn.synchronize_device(self.mesh)
            cost = Cost(wall_ms=(time.perf_counter() - t0) * 1e3)
        self.log.append((name, cost))

    def take(self) -> tuple[dict, Cost]:
        """-> (summed cost per region name, gather correction of the calls since the last take)."""
        regs: dict = defaultdict(Cost)
        for name, c in self.log:
            regs[name] = regs[name].plus(c)
        corr = Cost()
        if self.emulated:
            from qwen36.tt.model.model_config import TensorGroup

            b, w = self.bench, self.bench.weights
            h, d = b.cfg.hidden_size, b.cfg.head_dim
            for kind, rows in self.gathers:
                if kind == "embed":
                    key, table, row = b.dtype_name(TensorGroup.EMBEDDING), w.embedding.bytes_per_device(), h * 2
                else:
                    key = b.dtype_name(TensorGroup.ROPE)
                    table, row = w.rope_cos.bytes_per_device() + w.rope_sin.bytes_per_device(), 2 * d * 4
                corr = corr.plus(Cost({f"read:{key}": -(table - rows * row)}))
        self.log, self.gathers = [], []
        return regs, corr

    def run(self, name: str, fn):
        """Cards: one untimed call first (compiles the programs), then the timed one."""
        if not self.emulated:
            fn()
            self.take()
        with self.region(name):
            return fn()

    def instrument(self, obj, method: str, region_name=None, gather: str | None = None):
        """Wrap ``obj.method`` (instance attribute): a region named ``region_name(args)`` and/or a gather record."""
        fn = getattr(obj, method)

        def wrapped(*a, **kw):
            if gather:
                self.gathers.append((gather, int(a[0].shape[-1])))
            if region_name is None:
                return fn(*a, **kw)
            with self.region(region_name(*a)):
                return fn(*a, **kw)

        setattr(obj, method, wrapped)


def phase_figures(cost: Cost, cm, emulated: bool) -> dict:
    if not emulated:
        return {"ms": cost.get("wall_ms", 0.0)}
    from qwen36.tt_ops.cost_model import calibrated_figures

    c = cost.counts("phase")
    cal = calibrated_figures(c)
    return {"ms": cm.predict_ms(c), "programs": c.programs, "collectives": c.collectives,
            "collective_bytes_per_device": c.collective_bytes, "bytes_read_per_device": dict(sorted(c.bytes_read.items())),
            "calibrated_ms": cal["ms"], "calibrated_ms_low": cal["ms_low"], "calibrated_ms_high": cal["ms_high"]}


def ranking(cost: Cost, top: int = 20) -> list:
    """The ``top`` ops of a phase by calibrated time (cost_model ``per_op_ms``: launches, kernel time, own bytes and
    collectives per op name)."""
    from qwen36.tt_ops.cost_model import per_op_ms

    return [{"op": op, **r} for op, r in list(per_op_ms(cost.counts("phase")).items())[:top]]
