"""The report's record readings and plots (``qwen36 report``, commands/report.py): the step breakdowns, categories and
rates a record carries, the acceptance rows, and the PNG plots drawn from them (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path


class ReportError(ValueError):
    """Input the report cannot use; the message is one line naming the file and the problem."""


COMPONENT_ORDER = ("embed", "gdn", "attention", "mlp", "lm_head", "sampling_accept", "mtp_draft", "verify_setup",
                   "commit", "host_readback")


COMPONENT_NAMES = {"embed": "embed", "gdn": "GDN mixer", "attention": "attention mixer", "mlp": "MLP",
                   "lm_head": "LM head", "sampling_accept": "sampling / accept", "mtp_draft": "MTP draft",
                   "verify_setup": "verify setup", "commit": "commit", "host_readback": "host readback"}


def ms_text(x: float) -> str:
    return f"{x:.3f}"


def opt_text(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def step_title(step: dict) -> str:
    return "decode" if step["kind"] == "decode" else f"spec K={step['k']}"


def ordered_steps(perf: dict) -> list[tuple[str, dict]]:
    return sorted(perf["steps"].items(), key=lambda kv: (kv[1]["kind"] != "decode", kv[1]["k"]))


def components(perf: dict) -> list[str]:
    present = {c for s in perf["steps"].values() for c in s["components"]}
    return [c for c in COMPONENT_ORDER if c in present] + sorted(present - set(COMPONENT_ORDER))


CATEGORY_TAIL = ("kv_cache", "gdn_state", "other_reads", "dispatch", "collectives", "host_readback")


CATEGORY_NAMES = {"kv_cache": "KV-cache read", "gdn_state": "GDN-state read", "host_readback": "host readback",
                  "other_reads": "other reads (activations, conv state, ...)", "dispatch": "dispatch (programs)",
                  "collectives": "collectives"}


LAYER_ORDER = ("gdn_layer", "attention_layer", "mlp", "embed", "lm_head", "sampling_accept", "mtp_draft",
               "verify_setup", "commit")


def categories(perf: dict) -> list[str]:
    """Weight groups (largest first), then the other cost terms in a fixed order."""
    totals: dict = {}
    for s in perf["steps"].values():
        for c, v in (s.get("categories") or {}).items():
            totals[c] = totals.get(c, 0.0) + v
    weights = sorted((c for c in totals if c.startswith("weights:")), key=lambda c: -totals[c])
    tail = [c for c in CATEGORY_TAIL if c in totals]
    return weights + tail + sorted(set(totals) - set(weights) - set(tail))


def category_name(c: str) -> str:
    return f"weights: {c[8:]}" if c.startswith("weights:") else CATEGORY_NAMES.get(c, c)


def rates(perf: dict) -> list[str]:
    """Acceptance scenarios of a gate-0a record: single rates (highest first), then per-position profiles."""
    keys = {p for v in perf["spec_tok_s"].values() for p in v}
    return sorted(keys, key=lambda p: ("/" in p, [-float(v) for v in p.split("/")]))


def scenario(p: str) -> str:
    return f"profile {p} per position" if "/" in p else f"{p} per draft"


def setup(r: dict) -> str:
    c, p = r.get("config") or {}, r.get("performance") or {}
    return (f"{r.get('backend')}, preset {c.get('preset')}, {p.get('precision', c.get('precision'))}, "
            f"TP={p.get('tp')}, context {p.get('context_tokens', c.get('context'))}")


def acceptance_rows(r: dict) -> list[dict]:
    """lossless cells with acceptance stats -> [{k, mechanism, steps, mean_emitted, per_position}] sorted by K."""
    rows = []
    for c in r.get("cells") or []:
        st = c.get("stats")
        if st and "per_position" in st:
            rows.append({"k": int(st["k"]), "mechanism": c.get("mechanism", "-"), "steps": int(st["steps"]),
                         "mean_emitted": float(st["mean_emitted"]), "per_position": list(st["per_position"])})
    return sorted(rows, key=lambda x: (x["k"], x["mechanism"]))


# ---- plots ---------------------------------------------------------------------------------------------------------
def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report's plots need matplotlib: pip install -e '.[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, out: Path) -> Path:
    """Lay out, write (110 dpi) and close one figure."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def finish_lines(plt, fig, ax, xlabel: str, ylabel: str, title: str, out: Path) -> Path:
    """Axis labels, a y axis from 0, the title, legend and grid of a line plot; then write it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, None)
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(plt, fig, out)


def stacked(plt, out: Path, title: str, steps, keys: list[str], value, names: dict | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(10, 6))
    xs = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    cmap = plt.get_cmap("tab20")
    for i, key in enumerate(keys):
        vals = [value(s, key) for _, s in steps]
        ax.bar(xs, vals, bottom=bottom, label=(names or {}).get(key, key), color=cmap(i % 20), width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (_, s) in zip(xs, steps):
        ax.annotate(f"{s['ms']:.2f} ms", (x, s["ms"]), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(xs, [f"{step_title(s)}\n({s['rows']} row{'s' if s['rows'] > 1 else ''})" for _, s in steps])
    ax.set_ylabel("time per step (ms)")
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=11)
    ax.set_ylim(0, max(s["ms"] for _, s in steps) * 1.1)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(plt, fig, out)


def plot_breakdowns(plt, r: dict, out_dir: Path) -> list[Path]:
    perf, label = r["performance"], r["performance"]["label"]
    steps = ordered_steps(perf)
    files = [stacked(plt, out_dir / "step_time_by_component.png",
                      f"[{label}] step time by component\n{setup(r)}", steps, components(perf),
                      lambda s, c: s["components"].get(c, {}).get("ms", 0.0), COMPONENT_NAMES)]
    if all("categories" in s for _, s in steps):
        files.append(stacked(plt, out_dir / "step_time_by_cost_term.png",
                              f"[{label}] step time by cost term\n{setup(r)}", steps, categories(perf),
                              lambda s, c: s["categories"].get(c, 0.0), {c: category_name(c) for c in categories(perf)}))
    return files


def program_lists(src: dict) -> dict[str, dict[str, int]] | None:
    """{layer: {op: count}} of one decode step's layers, from gate-0a (preferred) or decode-cost."""
    perf = src["performance"] or {}
    if src["probe"] == "gate-0a":
        lists = perf.get("steps", {}).get("decode", {}).get("programs_per_layer")
        if not lists:
            return None
        rank = lambda name: next((i for i, p in enumerate(LAYER_ORDER) if name.startswith(p)), len(LAYER_ORDER))  # noqa: E731
        return {name: lists[name] for name in sorted(lists, key=lambda n: (rank(n), n))}
    per_op = perf.get("per_op")
    if per_op:
        return {"GDN layer": per_op["gdn_layer"], "attention layer": per_op["attention_layer"], "head": per_op["head"]}
    return None


def plot_programs(plt, r: dict, lists: dict, out: Path) -> Path:
    layers = list(lists)
    ops = sorted({op for d in lists.values() for op in d}, key=lambda op: -sum(d.get(op, 0) for d in lists.values()))
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(layers) + 3))
    cmap = plt.get_cmap("tab20")
    left = [0] * len(layers)
    ys = list(range(len(layers)))
    for i, op in enumerate(ops):
        vals = [lists[layer].get(op, 0) for layer in layers]
        ax.barh(ys, vals, left=left, color=cmap(i % 20), label=op.removeprefix("ttnn."), height=0.6,
                hatch="//" if i >= 20 else None)
        left = [a + b for a, b in zip(left, vals)]
    for y, n in zip(ys, left):
        ax.annotate(str(n), (n, y), va="center", xytext=(3, 0), textcoords="offset points", fontsize=9)
    ax.set_xlim(0, max(left) * 1.1)
    ax.set_yticks(ys, layers)
    ax.invert_yaxis()
    ax.set_xlabel("device programs per layer per decode step (count)")
    ax.set_title(f"Programs per layer by op (emulator counts, {r['probe']})\n{setup(r)}", fontsize=11)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False, ncol=1 + len(ops) // 24)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(plt, fig, out)


def plot_acceptance(plt, r: dict, rows: list[dict], out: Path) -> Path:
    mech = sorted({x["mechanism"] for x in rows})[0] if rows else "-"
    mine = [x for x in rows if x["mechanism"] == mech]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    for x in mine:
        a1.plot(range(1, x["k"] + 1), x["per_position"], marker="o", label=f"K={x['k']} ({x['steps']} verify steps)")
    a1.set_xticks(range(1, max(x["k"] for x in mine) + 1))
    a1.set_xlabel("draft position i")
    a1.set_ylabel("fraction of verify steps accepting drafts 1..i")
    a1.set_ylim(0, 1.05)
    a1.set_title("acceptance per position")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    ks = [x["k"] for x in mine]
    a2.plot(ks, [x["mean_emitted"] for x in mine], marker="o", label="measured (mean emitted)")
    a2.plot(ks, [k + 1 for k in ks], ls="--", color="grey", label="upper bound K+1")
    a2.set_xticks(ks)
    a2.set_ylim(0, max(ks) + 1.5)
    a2.set_xlabel("draft depth K")
    a2.set_ylabel("tokens emitted per verify step")
    a2.set_title("tokens per step vs K")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    ck = Path(str((r.get("config") or {}).get("checkpoint", "?"))).name
    fig.suptitle(f"[measured] greedy acceptance, lossless probe, checkpoint {ck}, {mech}\non {r.get('backend')}",
                 fontsize=11)
    return save_figure(plt, fig, out)


def plot_tok_s(plt, r: dict, out: Path) -> Path:
    perf = r["performance"]
    label = perf["label"]
    ks = sorted(int(k) for k in perf["spec_tok_s"])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for p in rates(perf):
        kp = [k for k in ks if p in perf["spec_tok_s"][str(k)]]
        ax.plot(kp, [perf["spec_tok_s"][str(k)][p] for k in kp], marker="s" if "/" in p else "o",
                ls=":" if "/" in p else "-", label=f"speculative, assumed acceptance {scenario(p)}")
    ax.axhline(perf["decode_tok_s"], ls="--", color="black", label=f"plain decode ({perf['decode_tok_s']:.1f})")
    ax.set_xticks(ks)
    return finish_lines(plt, fig, ax, "draft depth K", "tokens per second (batch 1)",
                        f"[{label}] tok/s vs K\n{setup(r)}", out)


# ---- several users per step ----------------------------------------------------------------------------------------
BATCH_SCENARIO = "0.8"  # the acceptance scenario of the batch plot


def plot_batch(plt, dec: list[dict], spec: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels = sorted({x["label"] for x in dec + spec})
    if dec:
        ax.plot([x["batch"] for x in dec], [x["aggregate"] for x in dec], marker="o", color="black",
                label="plain decode (decode-cost)")
    for k in sorted({x["k"] for x in spec if x["refused"] is None}):
        rows = [x for x in spec if x["k"] == k and x["refused"] is None and BATCH_SCENARIO in x["mtp_per_user"]]
        if not rows:
            continue
        ax.plot([x["batch"] for x in rows], [x["batch"] * x["mtp_per_user"][BATCH_SCENARIO] for x in rows],
                marker="s", ls="--", label=f"MTP K={k}, assumed acceptance {BATCH_SCENARIO} per draft (gate-0b)")
    ax.set_xscale("log", base=2)
    bs_all = sorted({x["batch"] for x in dec + spec})
    ax.set_xticks(bs_all, [str(b) for b in bs_all])
    return finish_lines(plt, fig, ax, "users per step B", "aggregate tokens per second (all users)",
                        f"[{', '.join(labels)}] aggregate tok/s vs batch", out)
