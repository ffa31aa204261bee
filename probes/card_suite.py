"""The card suite: every card-only test and every TT probe, in a fixed order, on one backend, one record per step.

``qwen36 cards-check --device p150x2`` (and ``make test-cards``) runs it on two P150a cards, on ttsim when
``TT_METAL_SIMULATOR`` is set, or on the emulated mesh with ``--device emulated-p150x2`` (how CI tests the
sequence itself). It stops at the first failing step and prints one line with the reason and the record path.

Steps, in order:
  smoke               open the mesh, one replicated ``ttnn.add``, read every device's shard back
  layer-pcc           the ``cards``-marked layer PCC tests (tests/tt/test_on_cards.py) through pytest on the device
  traced-decode       the ``cards``-marked traced greedy test (same file)
  <probes>            the registered probes named in ``PROBE_ORDER`` (probes/registry.py), each through the same
                      code as ``qwen36 probe NAME``; a name not registered in this checkout is listed and skipped

Every registered probe is either in ``PROBE_ORDER`` or in ``NOT_IN_SUITE`` with the reason (a test checks), so a
new probe has to be placed here on purpose. ``--size ci`` passes each probe its small options (``--preset ci``
where the probe has one, plus ``CI_ARGS``) and keeps the pytest steps to the accuracy preset: it exercises the
sequence, not the gates at their real sizes.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

from qwen36.probes.records import SOURCE_ROOT, ProbeReport, append_record, to_record

# Registered probes run after the pytest steps in this order (a name missing from the registry is reported as not run).
PROBE_ORDER = ("verify-tp", "gdn-transaction-tp", "lossless", "prefix-cache", "decode-cost", "gate-0a", "gate-0b")
# Registered probes deliberately left out, with the reason.
NOT_IN_SUITE = {
    "gdn-transaction": "reference-only (pure torch); its TT counterpart gdn-transaction-tp is in the suite",
    "emu-conformance": "checks the emulator against Tenstorrent's op-test cases; it refuses a non-emulated device",
    "memory": "a DRAM plan computed from the tensors the TT code allocates, not a measurement; on cards the "
              "allocator's own report is what to read",
    "prefill-cost": "a calibrated model of P150a prefill time from the emulator's counters, not a card check; "
                    "on cards, time the prefill itself",
    "precision-gate": "a decision between two precision presets (may a candidate replace the default?), run when a "
                      "preset changes; not a health check of one tree (its default candidate, bf4 gate/up, fails it "
                      "by design)",
    "acceptance": "a choice between precisions of the MTP layer / LM head by measured acceptance x modelled step "
                  "time, run when a preset changes; on cards the same command measures acceptance there",
    "calibration": "the cost model's prediction for a published workload beside the measurements it is pinned to; "
                   "nothing runs on a device, and CI checks the pins",
}
# Probes that only make sense on some backends: name -> (backend kinds, why not elsewhere).
BACKEND_ONLY = {
    "decode-cost": ({"emulated"}, "reads the emulator's op counters; on cards and ttsim gate-0b measures instead"),
}
# Small options for --size ci (on top of --preset ci where a probe has that option).
CI_ARGS = {
    "verify-tp": ["--ks", "1"],
    "gdn-transaction-tp": ["--ks", "1", "--mechanisms", "snapshot", "--accepts", "1"],
    "lossless": ["--ks", "1", "--mechanisms", "snapshot", "--max-new-tokens", "4"],
    "prefix-cache": ["--turns", "2", "--max-new-tokens", "4"],
    "gate-0b": ["--ks", "1", "--commit-k", "1"],
}
# Options at --size full (the gate sizes), where a probe's defaults are smaller.
FULL_ARGS = {
    "gdn-transaction-tp": ["--full"],
}
CARD_TESTS = "tests/tt/test_on_cards.py"
PYTEST_STEPS = {
    # step -> pytest -k expression at (full, ci) size
    "layer-pcc": ("layers_on_cards", "layers_on_cards and accuracy and gdn"),
    "traced-decode": ("traced", "traced"),
}
SIZES = ("full", "ci")


@dataclasses.dataclass
class Step:
    name: str
    kind: str  # "smoke" | "pytest" | "probe" | "unavailable"
    detail: str = ""  # what runs, or why it is unavailable
    args: list[str] = dataclasses.field(default_factory=list)  # pytest: [-k expression]; probe: its options

    def describe(self) -> str:
        return f"{self.name:20s} {self.kind:12s} {self.detail}".rstrip()


@dataclasses.dataclass
class StepResult:
    step: Step
    verdict: str  # "pass" | "fail" | "skipped"
    reason: str
    record: Path | None
    seconds: float


def _probe_args(name: str, module, size: str) -> list[str]:
    from qwen36.probes.registry import probe_parser

    if size != "ci":
        return list(FULL_ARGS.get(name, []))
    takes_preset = "--preset" in probe_parser(name, module).format_help().split()  # its options, as help lists them
    return (["--preset", "ci"] if takes_preset else []) + CI_ARGS.get(name, [])


def build_steps(device: str, size: str = "full") -> list[Step]:
    """The suite for ``device`` (a resolved TT device name) at ``size``, in run order."""
    from qwen36.probes.registry import PROBES, load_probe
    from qwen36.tt_ops.device import EMULATED_DEVICES, HARDWARE_DEVICES, select_backend

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    backend = select_backend(device)
    steps = [Step("smoke", "smoke", "open the mesh, one replicated ttnn.add, read every shard back")]
    n_devices = (EMULATED_DEVICES.get(device) or HARDWARE_DEVICES[device])
    for name, (full_k, ci_k) in PYTEST_STEPS.items():
        if n_devices != 2:
            steps.append(Step(name, "unavailable", f"the card tests are written for a 2-device mesh; {device} has "
                                                   f"{n_devices}"))
            continue
        k_expr = ci_k if size == "ci" else full_k
        steps.append(Step(name, "pytest", f"{CARD_TESTS} -m cards -k '{k_expr}'", [k_expr]))
    for name in PROBE_ORDER:
        if name not in PROBES:
            steps.append(Step(name, "unavailable", "not registered in probes/registry.py in this checkout"))
            continue
        kinds, why = BACKEND_ONLY.get(name, (None, ""))
        if kinds is not None and backend not in kinds:
            steps.append(Step(name, "unavailable", f"not run on {backend}: {why}"))
            continue
        args = _probe_args(name, load_probe(name), size)
        steps.append(Step(name, "probe", " ".join(args), args))
    return steps


def unplaced_probes() -> list[str]:
    """Registered probes neither in the suite's order nor deliberately left out (should be empty)."""
    from qwen36.probes.registry import probe_names

    return [n for n in probe_names() if n not in PROBE_ORDER and n not in NOT_IN_SUITE]


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure_report(step: Step, backend: str, reason: str, config: dict) -> ProbeReport:
    return ProbeReport(probe=f"cards-{step.name}", backend=backend, config=config,
                       cells=[{"cell": step.name, "pass": False, "failed": [reason]}])


def run_smoke(device: str) -> ProbeReport:
    import torch

    from qwen36.tt_ops.device import open_mesh

    with open_mesh(device) as ctx:
        ttnn, mesh = ctx.ttnn, ctx.mesh_device
        host = torch.arange(32 * 32, dtype=torch.float32).reshape(1, 1, 32, 32) % 64  # exact in bfloat16
        x = ttnn.from_torch(host, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                            mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
        y = ttnn.add(x, x)
        cells = []
        for i, shard in enumerate(ttnn.get_device_tensors(y)):
            got = ttnn.to_torch(shard).float().reshape(host.shape)
            err = float((got - 2 * host).abs().max())
            cells.append({"cell": f"device {i}: add", "pass": err == 0.0, "max_abs": err,
                          "failed": [] if err == 0.0 else [f"max_abs {err} != 0"]})
        if len(cells) != ctx.num_devices:
            cells.append({"cell": "shards", "pass": False,
                          "failed": [f"{len(cells)} shards read back from a {ctx.num_devices}-device mesh"]})
        return ProbeReport(probe="cards-smoke", backend=ctx.label, config={"device": device},
                           cells=cells, gate_complete=True, notes={"ttnn_version": ctx.ttnn_version})


def _junit_cells(xml_path: Path) -> list[dict]:
    cells = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = [(c.tag, c.get("message") or c.text or "") for c in case if c.tag in ("failure", "error", "skipped")]
        cells.append({"cell": name, "pass": not bad, "seconds": float(case.get("time") or 0),
                      "failed": [f"{tag}: {_one_line(msg, 200)}" for tag, msg in bad]})
    return cells


def run_pytest(step: Step, device: str, backend: str, out_dir: Path, k_expr: str) -> ProbeReport:
    tests = SOURCE_ROOT / CARD_TESTS
    if not tests.is_file():
        raise FileNotFoundError(f"{tests} not found: the card tests run from a clone of the repository")
    xml = out_dir / f"{step.name}.junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-m", "cards", "-k", k_expr,
           "--tt-device", device, f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=SOURCE_ROOT, capture_output=True, text=True)
    (out_dir / f"{step.name}.pytest.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    cells = _junit_cells(xml) if xml.is_file() else []
    if not cells:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        cells = [{"cell": step.name, "pass": False, "failed": [f"pytest exit {proc.returncode}, no test ran: {tail[0]}"]}]
    elif proc.returncode != 0 and all(c["pass"] for c in cells):
        cells.append({"cell": "pytest", "pass": False, "failed": [f"pytest exit {proc.returncode}"]})
    return ProbeReport(probe=f"cards-{step.name}", backend=backend, config={"device": device, "k": k_expr,
                       "command": " ".join(cmd[1:])}, cells=cells, gate_complete=True,
                       notes={"log": str(out_dir / f"{step.name}.pytest.log")})


def run_probe(step: Step, device: str) -> ProbeReport:
    from qwen36.probes.registry import probe_parser
    from qwen36.probes.registry import load_probe

    module = load_probe(step.name)
    args = probe_parser(step.name, module).parse_args(["--device", device, *step.args])
    return module.run(args)


def run_suite(device: str, size: str = "full", records_dir: Path | None = None, *,
              steps: list[Step] | None = None, echo: Callable[[str], None] = print) -> list[StepResult]:
    """Run the steps in order, one record file per step in ``records_dir``; stop at the first failure."""
    from qwen36.probes import records as _records
    from qwen36.tt_ops.device import backend_label, resolve_device_name, select_backend

    device = resolve_device_name(device)
    backend = backend_label(device, select_backend(device))
    steps = build_steps(device, size) if steps is None else steps
    if records_dir is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        records_dir = _records.records_dir(None) / f"cards-check-{stamp}"
    records_dir = Path(records_dir)
    records_dir.mkdir(parents=True, exist_ok=True)
    echo(f"cards-check on {backend}, size {size}: {len(steps)} steps, records in {records_dir}")
    results: list[StepResult] = []
    for i, step in enumerate(steps, 1):
        tag = f"[{i}/{len(steps)}] {step.name}"
        if step.kind == "unavailable":
            echo(f"{tag}: skipped ({step.detail})")
            results.append(StepResult(step, "skipped", step.detail, None, 0.0))
            continue
        t0 = time.perf_counter()
        path = records_dir / f"{i:02d}-{step.name}.jsonl"
        try:
            if step.kind == "smoke":
                report = run_smoke(device)
            elif step.kind == "pytest":
                report = run_pytest(step, device, backend, records_dir, step.args[0])
            elif step.kind == "probe":
                report = run_probe(step, device)
            else:
                raise ValueError(f"unknown step kind {step.kind!r}")
        except BaseException as e:  # noqa: BLE001 - the suite records every failure, then stops
            if isinstance(e, KeyboardInterrupt):
                raise
            reason = _one_line(f"{type(e).__name__}: {e}")
            (records_dir / f"{i:02d}-{step.name}.traceback.txt").write_text(traceback.format_exc(), encoding="utf-8")
            report = _failure_report(step, backend, reason, {"device": device, "args": step.args})
        record = to_record(report)
        append_record(record, path)
        seconds = time.perf_counter() - t0
        bad = [c for c in report.cells if not c.get("pass")]
        if record["verdict"] == "pass":
            echo(f"{tag}: pass ({len(report.cells)} cells, {seconds:.1f} s) [{report.backend}] record {path}")
            results.append(StepResult(step, "pass", "", path, seconds))
            continue
        first = bad[0] if bad else {"cell": step.name, "failed": ["no cells"]}
        reason = _one_line(f"{first.get('cell')}: {', '.join(first.get('failed') or ['failed'])}"
                           + (f" (+{len(bad) - 1} more failed cells)" if len(bad) > 1 else ""))
        echo(f"{tag}: FAIL ({seconds:.1f} s) {reason}")
        results.append(StepResult(step, "fail", reason, path, seconds))
        echo(f"cards-check FAILED at {step.name} on {backend}: {reason} | record {path}")
        return results
    ran = [r for r in results if r.verdict == "pass"]
    skipped = [r.step.name for r in results if r.verdict == "skipped"]
    echo(f"cards-check passed on {backend}: {len(ran)} steps passed"
         + (f", not run: {', '.join(skipped)}" if skipped else "") + f" | records {records_dir}")
    return results
