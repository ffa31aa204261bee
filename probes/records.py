"""Run records: one JSON object per line, appended atomically, so that a probe's result outlives the terminal it
ran in and two runs (emulator vs cards, before vs after a change) can be compared field by field.

Fields of every record: probe, time_utc, run_id, git_commit, git_dirty, config, backend (derived from what
ran, never typed by hand), cells (per-cell results, each with a "pass" bool), counters, verdict
("pass" | "fail"), gate_complete (every cell of the gate matrix ran, none skipped), performance
(null unless the run is a performance run, whose numbers must then be labelled measured/modelled), ttnn_version
(the installed ttnn, null when none is installed as a package; the TT code is written against 0.81.1).

Where records go, first match wins: ``--records FILE``; ``--records-dir DIR``; ``$QWEN36_RECORDS_DIR``;
``bench/runs/`` under the current directory. Never inside the installed package: for a normal install that is
site-packages, where results would be hard to find and lost on reinstall.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwen36.io_utils import atomic_append_line
from qwen36.tt_ops.device import installed_ttnn_version

SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the source checkout (git commit of the code that ran)
RECORDS_DIR_ENV = "QWEN36_RECORDS_DIR"
DEFAULT_RUNS_SUBDIR = Path("bench") / "runs"
PASS, FAIL = "pass", "fail"


@dataclass
class ProbeReport:
    """What a probe's run() returns; the probe command adds the run metadata and writes it."""

    probe: str
    backend: str
    config: dict[str, Any]
    cells: list[dict[str, Any]]
    counters: dict[str, Any] = field(default_factory=dict)
    gate_complete: bool = False
    performance: dict[str, Any] | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return PASS if self.cells and all(c.get("pass") for c in self.cells) else FAIL


def git_commit(root: Path = SOURCE_ROOT) -> tuple[str | None, bool | None]:
    """(HEAD commit, working tree dirty) or (None, None) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, None


def to_record(report: ProbeReport, *, now: _dt.datetime | None = None, run_id: str | None = None) -> dict[str, Any]:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    commit, dirty = git_commit()
    return {
        "probe": report.probe,
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run_id": run_id or uuid.uuid4().hex[:8],
        "git_commit": commit,
        "git_dirty": dirty,
        "config": report.config,
        "backend": report.backend,
        "cells": report.cells,
        "counters": report.counters,
        "verdict": report.verdict,
        "gate_complete": report.gate_complete,
        "performance": report.performance,
        "notes": report.notes,
        "ttnn_version": installed_ttnn_version(),
        "host": host_environment(),
    }


def host_environment() -> dict[str, Any]:
    """What ran the host side: Python, torch and the CPU capability torch's kernels dispatch to (the emulator's
    numbers do not depend on it, rule N8 in docs/emulator_ops.md; the reference model's and wall-clock figures do)."""
    import platform

    import torch

    return {"python": platform.python_version(), "torch_version": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine()}


def records_dir(records_dir: str | Path | None = None) -> Path:
    """``records_dir`` if given, else ``$QWEN36_RECORDS_DIR``, else ``bench/runs`` under the current directory."""
    if records_dir is not None:
        return Path(records_dir)
    env = os.environ.get(RECORDS_DIR_ENV)
    if env:
        return Path(env)
    return Path.cwd() / DEFAULT_RUNS_SUBDIR


def default_records_path(record: dict[str, Any], records_dir_arg: str | Path | None = None) -> Path:
    stamp = record["time_utc"].replace("-", "").replace(":", "")
    return records_dir(records_dir_arg) / f"{record['probe']}-{stamp}-{record['run_id']}.jsonl"


def append_record(record: dict[str, Any], path: str | Path | None = None, *,
                  records_dir_arg: str | Path | None = None) -> Path:
    """Append one JSON line atomically (a reader never sees half a line) to ``path``, or to a new file in
    :func:`records_dir`."""
    path = Path(path) if path is not None else default_records_path(record, records_dir_arg)
    return atomic_append_line(path, json.dumps(record, sort_keys=True, default=_jsonable))


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def summarize(records: list[dict[str, Any]]) -> str:
    """A plain-text table: one line per run, then per-group cell counts and counters when present."""
    rows = [["probe", "time (UTC)", "commit", "backend", "cells", "failed", "verdict", "gate_complete"]]
    for r in records:
        cells = r.get("cells") or []
        failed = sum(1 for c in cells if not c.get("pass"))
        rows.append([str(r.get("probe")), str(r.get("time_utc")), (r.get("git_commit") or "-")[:10],
                     str(r.get("backend")), str(len(cells)), str(failed), str(r.get("verdict")),
                     str(r.get("gate_complete"))])
    parts = [_table(rows)]
    for r in records:
        counters = r.get("counters") or {}
        if counters and all(isinstance(v, dict) for v in counters.values()):
            keys = sorted({k for v in counters.values() for k in v})
            crow = [["counters"] + keys] + [[name] + [str(v.get(k, "")) for k in keys] for name, v in counters.items()]
            parts.append(f"\n{r.get('probe')} {r.get('run_id')}:\n" + _table(crow))
        bad = [c for c in (r.get("cells") or []) if not c.get("pass")]
        for c in bad[:20]:
            parts.append(f"  FAIL {c.get('cell', c)}: {', '.join(c.get('failed', [])) or '?'}")
    return "\n".join(parts)
