"""Draft depth per step: a fixed K, or a controller that picks K to maximise emitted tokens per unit of step cost.

Why a controller: the best K depends on the text (repetitive code accepts long blocks, prose short ones) and on
what one step costs on the backend (verify of K+1 rows plus K MTP drafts, against one plain decode step), so no
single fixed K is best everywhere.

The model behind :class:`DepthController`. Let ``p_i`` be the probability that draft i is accepted given drafts
1..i-1 were. Greedy and rejection acceptance both stop at the first rejected draft and always emit one more token
(the correction or the bonus), so a step of depth K emits on average

    E(K) = 1 + sum_{i=1..K} prod_{j<=i} p_j

tokens, and costs ``c(K)`` units of one plain decode step (a :class:`StepCosts` table per backend). The controller
picks ``argmax_K E(K) / c(K)`` before every step. It estimates ``p_i`` from decayed counts: after each step every
position's counts are multiplied by ``decay``, then position i gains one "reached" if drafts 1..i-1 were accepted
and K >= i, and one "accepted" if draft i was accepted. With a prior acceptance ``prior[i]`` worth
``prior_weight`` observations,

    p_i = (accepted_i + prior_weight * prior[i]) / (reached_i + prior_weight).

Positions the controller has stopped drafting drift back to their prior as their counts decay, so a text that turns
repetitive again gets deep drafts again. The parameters (decay, prior, prior_weight) are not hand-tuned: they are
fitted per backend cost table by ``scripts/fit_depth_policy.py`` on a prompt set and stored with the tables in the
versioned ``depth_policy.json`` beside this file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

POLICY_FILE = Path(__file__).resolve().parent / "depth_policy.json"
POLICY_VERSION = 1


@dataclass(frozen=True)
class StepCosts:
    """Cost of one speculative step of depth K in units of one plain decode step, for one backend.

    source: "measured" (wall-clock on that backend) or "modelled" (the cost model); never both.
    """

    backend: str
    source: str
    costs: dict[int, float]  # K -> cost of draft(K) + verify(K+1 rows) + accept + commit, plain decode = 1
    note: str = ""

    def __post_init__(self) -> None:
        if self.source not in ("measured", "modelled"):
            raise ValueError(f"step costs must be 'measured' or 'modelled', got {self.source!r}")
        if not self.costs or any(k < 1 or c <= 0 for k, c in self.costs.items()):
            raise ValueError(f"step costs need K >= 1 and positive costs, got {self.costs}")

    @property
    def depths(self) -> list[int]:
        return sorted(self.costs)


@dataclass(frozen=True)
class DepthParams:
    """The fitted controller parameters (see the module docstring)."""

    decay: float
    prior: tuple[float, ...]  # prior conditional acceptance per draft position 1..k_max
    prior_weight: float

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if not self.prior or any(not 0.0 <= p <= 1.0 for p in self.prior):
            raise ValueError(f"prior acceptances must lie in [0, 1], got {self.prior}")


def expected_emitted(p: Sequence[float], k: int) -> float:
    """E(K): 1 + sum over i <= K of the probability that drafts 1..i are all accepted."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= p[i]
        total += run
    return total


class FixedDepth:
    """The same K every step (the classic speculative decoder)."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"draft depth k must be >= 1, got {k}")
        self.k = self.k_max = k

    def choose(self) -> int:
        return self.k

    def observe(self, k: int, num_accepted: int) -> None:
        pass

    def describe(self) -> str:
        return f"K={self.k}"


class DepthController:
    """Picks K per step from decayed per-position acceptance counts and a step-cost table."""

    def __init__(self, params: DepthParams, costs: StepCosts, k_max: int | None = None):
        depths = [k for k in costs.depths if k <= len(params.prior) and (k_max is None or k <= k_max)]
        if not depths:
            raise ValueError(f"no draft depth is both in the cost table {costs.depths} and covered by the prior "
                             f"({len(params.prior)} positions)" + (f" up to k_max={k_max}" if k_max else ""))
        self.params, self.costs, self.depths = params, costs, depths
        self.k_max = max(depths)
        self.reached = [0.0] * self.k_max
        self.accepted = [0.0] * self.k_max
        self.chosen: list[int] = []

    def acceptance(self) -> list[float]:
        """Current estimate of p_i, i = 1..k_max."""
        w, prior = self.params.prior_weight, self.params.prior
        return [(self.accepted[i] + w * prior[i]) / (self.reached[i] + w) for i in range(self.k_max)]

    def choose(self) -> int:
        p = self.acceptance()
        k = max(self.depths, key=lambda d: (expected_emitted(p, d) / self.costs.costs[d], -d))
        self.chosen.append(k)
        return k

    def observe(self, k: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted {num_accepted} outside 0..{k}")
        d = self.params.decay
        self.reached = [r * d for r in self.reached]
        self.accepted = [a * d for a in self.accepted]
        for i in range(min(k, num_accepted + 1)):  # drafts 1..min(k, a+1) were judged
            self.reached[i] += 1.0
            if i < num_accepted:
                self.accepted[i] += 1.0

    def describe(self) -> str:
        return f"K=auto (1..{self.k_max}, {self.costs.source} costs for {self.costs.backend})"


@dataclass
class DepthPolicy:
    """The versioned policy file: per backend cost table, its step costs and the parameters fitted for it."""

    version: int
    costs: dict[str, StepCosts]  # cost-table key (see cost_key) -> step costs
    params: dict[str, DepthParams]  # cost-table key -> controller parameters fitted with those costs
    provenance: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = POLICY_FILE) -> "DepthPolicy":
        data = json.loads(Path(path).read_text())
        if data.get("version") != POLICY_VERSION:
            raise ValueError(f"{path}: depth policy version {data.get('version')!r}, this code reads {POLICY_VERSION}")
        costs, params = {}, {}
        for key, t in data["tables"].items():
            costs[key] = StepCosts(t["backend"], t["source"], {int(k): float(v) for k, v in t["costs"].items()},
                                   t.get("note", ""))
            p = t["params"]
            params[key] = DepthParams(float(p["decay"]), tuple(float(x) for x in p["prior"]), float(p["prior_weight"]))
        return cls(data["version"], costs, params, data.get("provenance", {}))

    def to_json(self) -> dict:
        return {"version": self.version,
                "tables": {key: {"backend": t.backend, "source": t.source, "note": t.note,
                                 "costs": {str(k): v for k, v in sorted(t.costs.items())},
                                 "params": {"decay": self.params[key].decay, "prior": list(self.params[key].prior),
                                            "prior_weight": self.params[key].prior_weight}}
                           for key, t in self.costs.items()},
                "provenance": self.provenance}

    def controller(self, cost_key: str, k_max: int | None = None) -> DepthController:
        if cost_key not in self.costs:
            raise ValueError(f"no step-cost table for {cost_key!r} in the depth policy; have {sorted(self.costs)}")
        return DepthController(self.params[cost_key], self.costs[cost_key], k_max)


def cost_key(device: str) -> str:
    """Which cost table a --device uses: the measured reference-CPU table for the torch reference (CPU or CUDA:
    the tiny models make both dispatch-bound), the modelled 27B P150a x2 table for the emulated mesh and cards."""
    if device.startswith("reference"):
        return "reference"
    return "p150x2-27b"


def parse_depth(value: str) -> int | str:
    """--spec-k: a positive integer or 'auto'."""
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--spec-k must be a positive integer or 'auto', got {value!r}") from None
    if k < 0:
        raise ValueError(f"--spec-k must be >= 0, got {k}")
    return k
