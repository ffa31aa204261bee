"""Layering you can see: every module of the installed package is parsed (``ast``, nothing is imported) and its
imports, module-level and inside functions alike, are checked against the rules below.

    command line   qwen36.cli, qwen36.commands: wires everything together; nothing else imports it
    probes         qwen36.probes: may use the models, the engine, the TT backend and qwen36.testing
    TT backend     qwen36.tt: gets ttnn only through qwen36.tt_ops.device (the real module on cards, the emulator here)
    engine, model  qwen36.speculative, qwen36.reference: torch only, no ttnn, no TT backend (a CUDA box without ttnn
                   runs them), nothing from above
    test support   qwen36.testing: used by tests and probes only (the TP test checkpoints, the emulator's
                   conformance cases); runtime code (models, engine, TT backend, tt_ops, command line) never imports it

The checker is a plain function over {module name: source}, so the test below plants each kind of violation and
shows that it is caught.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMMAND_LINE = ("qwen36.cli", "qwen36.commands")
TT_SIDE = ("ttnn", "qwen36.tt", "qwen36.tt_ops")
TEST_SUPPORT = "qwen36.testing"


def under(name: str, prefixes) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """{module name: (source, is_package)} of every module pyproject.toml installs."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out = {}
    for pkg in cfg["packages"]:
        base = next(b for b in sorted(dirs, key=len, reverse=True) if under(pkg, b))
        folder = root / dirs[base] / Path(*pkg[len(base):].strip(".").split(".")) if pkg != base else root / dirs[base]
        for f in sorted(folder.glob("*.py")):
            name = pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"
            out[name] = (f.read_text(), f.stem == "__init__")
    return out


def imports_of(name: str, source: str, is_package: bool = False) -> set[str]:
    """Absolute names a module imports (``from a import b`` counts as ``a`` and ``a.b``: b may be a module)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return found


def rule_breaks(name: str, imp: str) -> list[tuple[str, str]]:
    """(rule, message) for each rule that module ``name`` importing ``imp`` breaks."""
    out = []
    if under(imp, COMMAND_LINE) and not under(name, COMMAND_LINE):
        out.append(("cli", f"{name} imports the command line ({imp}); only qwen36.cli / qwen36.commands may"))
    if under(name, ("qwen36.speculative", "qwen36.reference")) and under(imp, TT_SIDE + (TEST_SUPPORT,)):
        out.append(("engine", f"{name} imports {imp}: the engine and the reference model stay free of ttnn, the TT "
                              "backend and test support"))
    if under(name, "qwen36.tt") and under(imp, "ttnn"):
        out.append(("ttnn", f"{name} imports ttnn directly; the TT backend gets it from qwen36.tt_ops.device"))
    if under(imp, TEST_SUPPORT) and not under(name, (TEST_SUPPORT, "qwen36.probes")):
        out.append(("testing", f"{name} imports test support ({imp}); only tests and probes may"))
    if under(imp, "tests"):
        out.append(("tests", f"{name} imports {imp}: a foreign `tests` package may come first on sys.path"))
    return out


def layering_violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    bad, seen = [], set()
    for name, (source, is_pkg) in modules.items():
        for imp in sorted(imports_of(name, source, is_pkg)):  # a parent sorts before its children
            for rule, msg in rule_breaks(name, imp):
                if not any((name, rule, p) in seen for p in (imp.rsplit(".", i)[0] for i in range(1, imp.count(".") + 1))):
                    bad.append(msg)  # `from a.b import C` reported once, as a.b
                seen.add((name, rule, imp))
    return bad


def test_the_package_keeps_its_layers():
    modules = package_sources()
    assert {"qwen36.cli", "qwen36.speculative.engine", "qwen36.tt.verify", "qwen36.tt_ops.device",
            "qwen36.probes.gdn_transaction_tp", "qwen36.testing.tt",
            "qwen36.testing.emulator_conformance"} <= set(modules)  # the walk saw everything
    assert layering_violations(modules) == []


def test_tests_do_not_import_the_tests_package():
    for f in sorted((ROOT / "tests").glob("*.py")):
        bad = [i for i in imports_of(f"tests.{f.stem}", f.read_text()) if under(i, "tests")]
        assert not bad, f"{f.name} imports {bad}: share helpers through qwen36.testing instead"


@pytest.mark.parametrize("module,source,is_pkg,expect", [
    ("qwen36.speculative.engine", "from ..tt.verify import SpecDeviceState", False, "free of ttnn"),
    ("qwen36.speculative", "def f():\n    import ttnn\n", True, "free of ttnn"),  # lazy imports count too
    ("qwen36.reference.model", "from qwen36.tt_ops.device import open_mesh", False, "free of ttnn"),
    ("qwen36.speculative.oracle", "from ..commands.backends import load_target", False, "command line"),
    ("qwen36.probes.lossless", "from qwen36.commands.common import DEFAULT_CHECKPOINT", False, "command line"),
    ("qwen36.tt.model", "from qwen36 import cli", False, "command line"),
    ("qwen36.tt.gdn", "import ttnn", False, "from qwen36.tt_ops.device"),
    ("qwen36.tt.spec_backend", "from ..testing.speculative import oracle_drafter", False, "test support"),
    ("qwen36.tt.spec_backend", "from tests.test_tt_spec import oracle_drafter", False, "foreign `tests`"),
    # the emulator's conformance cases are test support: the emulator and the device layer never load them
    ("qwen36.tt_ops.emulator.mesh", "from qwen36.testing.emulator_conformance import CASES", False, "test support"),
    ("qwen36.tt_ops.device", "def f():\n    from ..testing import emulator_conformance\n", False, "test support"),
    ("qwen36.commands.probe", "from ..testing.emulator_conformance import run_cases", False, "test support"),
])
def test_checker_catches_planted_violations(module, source, is_pkg, expect):
    bad = layering_violations({module: (source, is_pkg)})
    assert bad and any(expect in b for b in bad), bad


def test_checker_allows_what_the_layers_allow():
    ok = {
        "qwen36.commands.generate": ("from ..tt.generator import load_tt_target\nfrom ..speculative import engine", False),
        "qwen36.tt.model": ("from ..tt_ops.device import open_mesh\nfrom ..speculative.sampling import SamplingParams", False),
        "qwen36.probes.verify_tp": ("from qwen36.testing.tt import make_bf16_checkpoint", False),
        "qwen36.probes.emu_conformance": ("def run(a):\n    from qwen36.testing.emulator_conformance import run_cases", False),
        "qwen36.tt_ops.emulator.ttnn_import": ("import ttnn", False),
    }
    assert layering_violations(ok) == []
    assert imports_of("qwen36.tt.verify", "from .mechanisms import tt_mechanism") >= {"qwen36.tt.mechanisms"}
    assert imports_of("qwen36.speculative", "from . import engine", True) >= {"qwen36.speculative.engine"}
