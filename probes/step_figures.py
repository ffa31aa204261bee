"""The summarising piece of the step-cost probes (gate-0b, gate-0a): from phase figures to what a record reports
(the shadow-commit step time per K, MTP tok/s per acceptance scenario, the calibrated block with its bands) and the
console lines that print it. Pure arithmetic on figures; no device."""
from __future__ import annotations

ACCEPTANCE_SCENARIOS = ("0.8", "0.6", "0.5", "0.8/0.6/0.5")  # per-draft rates, and a per-position profile


def tokens_per_step(scenario: str, k: int) -> float | None:
    """Expected tokens per speculative step: the bonus/correction token plus the expected accepted drafts. A rate p:
    p + p^2 + ... + p^K. A profile (fraction of steps accepting drafts 1..i): a1 + ... + aK; None past its length."""
    vals = [float(v) for v in scenario.split("/")]
    if len(vals) == 1:
        return sum(vals[0] ** i for i in range(k + 1))
    return 1 + sum(vals[:k]) if k <= len(vals) else None


def mtp_tok_s(fig: dict, ks) -> dict:
    """Speculative tok/s per acceptance scenario and K: expected tokens per step (gate-0a's rule: a rate p gives
    1 + p + ... + p^K, a profile a1/a2/... gives 1 + a1 + ... + aK) over the shadow-commit step time. None where a
    profile is shorter than K. Same label as the step times (modelled on the emulator)."""
    return {scen: {str(k): (None if tokens_per_step(scen, k) is None else tokens_per_step(scen, k) * 1e3
                            / fig["step_ms_shadow_commit"][str(k)]) for k in ks}
            for scen in ACCEPTANCE_SCENARIOS}


def step_ms(out: dict, ks) -> dict:
    """Shadow-commit step time per K: verify + accept + draft + commit."""
    return {str(k): out["verify"][str(k)]["ms"] + out["accept"][str(k)]["ms"] + out["draft"][str(k)]["total"]["ms"]
            + out["commit_shadow_commit_by_k"][str(k)]["ms"] for k in ks}


def calibrated_summary(fig: dict, ks, users: int = 1) -> dict:
    """The record's calibrated block (docs/cost_model.md "Record keys"): decode, verify_cost_ratio, the shadow-commit
    step and MTP tok/s per acceptance scenario, each with its band (every constant at the fast / slow end of its
    band; a ratio's band pairs the verify and the decode at the same end). Phase figures carry ``calibrated_ms*``."""
    from qwen36.tt_ops.cost_model import CALIBRATED_LABEL

    ends = ("calibrated_ms", "calibrated_ms_low", "calibrated_ms_high")

    def step(k, e):
        s = str(k)
        return (fig["verify"][s][e] + fig["accept"][s][e] + fig["draft"][s]["total"][e]
                + fig["commit_shadow_commit_by_k"][s][e])

    dec = [fig["decode"][e] for e in ends]
    out = {"label": CALIBRATED_LABEL, "decode_ms": dec,
           "plain_decode_tok_s": [1e3 / dec[0], 1e3 / dec[2], 1e3 / dec[1]],
           "plain_decode_aggregate_tok_s": [users * 1e3 / dec[0], users * 1e3 / dec[2], users * 1e3 / dec[1]],
           "verify_cost_ratio": {str(k): [fig["verify"][str(k)][e] / fig["decode"][e] for e in ends] for k in ks},
           "step_ms_shadow_commit": {str(k): [step(k, e) for e in ends] for k in ks}}
    out["mtp_tok_s_shadow_commit"] = {
        scen: {str(k): (None if tokens_per_step(scen, k) is None else
                        [tokens_per_step(scen, k) * 1e3 / out["step_ms_shadow_commit"][str(k)][i] for i in (0, 2, 1)])
               for k in ks}
        for scen in ACCEPTANCE_SCENARIOS}
    out["note"] = "[central, low, high]; tok/s low goes with ms high"
    return out


def batch_mtp_tok_s(fig: dict, ks) -> dict:
    """Aggregate MTP tok/s (B x :func:`mtp_tok_s`'s per-user figure), every user accepting at the scenario's rate."""
    b = fig["batch"]
    return {scen: {k: None if v is None else b * v for k, v in by_k.items()}
            for scen, by_k in mtp_tok_s(fig, ks).items()}


def print_calibrated(fig: dict, ks) -> None:
    cal = fig.get("calibrated")
    if cal is None:  # cards: measured, nothing modelled
        return
    lab, (d, dlo, dhi) = cal["label"], cal["decode_ms"]
    print(f"  [{lab}] decode {d:.2f} ms ({dlo:.2f}-{dhi:.2f}), {cal['plain_decode_tok_s'][0]:.1f} tok/s per user; "
          f"the figures above are the roofline lower bound")
    for k in map(str, ks):
        r, st = cal["verify_cost_ratio"][k], cal["step_ms_shadow_commit"][k]
        print(f"  [{lab}] K={k}: verify_cost_ratio {r[0]:.3f} ({min(r[1:]):.3f}-{max(r[1:]):.3f}), step {st[0]:.2f} ms "
              f"({st[1]:.2f}-{st[2]:.2f})")
    for scen, by_k in cal["mtp_tok_s_shadow_commit"].items():
        cols = [f"K={k} {v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})" for k, v in by_k.items() if v is not None]
        if cols:
            print(f"  [{lab}] MTP tok/s per user, acceptance {scen}: " + ", ".join(cols))


def expected_distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected number of distinct experts ``rows`` rows touch when each row picks ``top_k`` of ``num_experts``
    uniformly at random (a model of routing, not a measurement): E * (1 - (1 - k/E)^rows)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)
