"""Layering you can see: every module of the installed package is parsed (``ast``, nothing is imported) and its
imports, module-level and inside functions alike, are checked against the rules below.

    command line   qwen36.cli, qwen36.commands: wires everything together; nothing else imports it
    probes         qwen36.probes: may use the models, the engine, the TT backend and qwen36.testing
    TT backend     qwen36.tt: gets ttnn only through qwen36.tt_ops.device (the real module on cards, the emulator here)
                   its wings import downwards only: tt.model <- tt.runtime <- tt.spec <- tt.serving
    engine, model  qwen36.speculative, qwen36.reference: torch only, no ttnn, no TT backend (a CUDA box without ttnn
                   runs them), nothing from above; the reference model sits below the speculative engine
    generation     qwen36.generation (sampling, thinking budget, the plain driver): below the reference, the engine and
                   the TT backend, which all import it; it imports none of them
    test support   qwen36.testing: used by tests and probes only (the TP test checkpoints, the emulator's
                   conformance cases); runtime code (models, engine, TT backend, tt_ops, command line) never imports it;
                   qwen36.testing.cli alone runs the command line (in-process, as a test does)
    tests          no test file imports another test file or conftest.py: shared helpers live in qwen36.testing,
                   shared fixtures in conftest.py

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
CLI_RUNNER = "qwen36.testing.cli"  # test support that runs the command line in-process, as the tests do
TT_SIDE = ("ttnn", "qwen36.tt", "qwen36.tt_ops")
TEST_SUPPORT = "qwen36.testing"
# what qwen36.generation (sampling, thinking budget, the plain driver) sits below
GENERATION_ABOVE = ("qwen36.reference", "qwen36.speculative", "qwen36.prefix_cache", "qwen36.chat_session",
                    "qwen36.probes", "qwen36.commands", "qwen36.cli") + TT_SIDE + (TEST_SUPPORT,)


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
    if under(imp, COMMAND_LINE) and not under(name, COMMAND_LINE + (CLI_RUNNER,)):
        out.append(("cli", f"{name} imports the command line ({imp}); only qwen36.cli / qwen36.commands may"))
    if under(name, ("qwen36.speculative", "qwen36.reference")) and under(imp, TT_SIDE + (TEST_SUPPORT,)):
        out.append(("engine", f"{name} imports {imp}: the engine and the reference model stay free of ttnn, the TT "
                              "backend and test support"))
    if under(name, "qwen36.reference") and under(imp, "qwen36.speculative"):
        out.append(("reference", f"{name} imports {imp}: the reference model sits below the speculative engine"))
    if under(name, "qwen36.generation") and under(imp, GENERATION_ABOVE):
        out.append(("generation", f"{name} imports {imp}: generation sits below the models, the engine and the TT "
                                  "backend"))
    if under(name, "qwen36.tt") and under(imp, "ttnn"):
        out.append(("ttnn", f"{name} imports ttnn directly; the TT backend gets it from qwen36.tt_ops.device"))
    if under(imp, TEST_SUPPORT) and not under(name, (TEST_SUPPORT, "qwen36.probes")):
        out.append(("testing", f"{name} imports test support ({imp}); only tests and probes may"))
    if under(imp, "tests"):
        out.append(("tests", f"{name} imports {imp}: a foreign `tests` package may come first on sys.path"))
    wing, imp_wing = tt_wing(name), tt_wing(imp)
    if wing is not None and imp_wing is not None and TT_WINGS.index(imp_wing) > TT_WINGS.index(wing):
        out.append(("wings", f"{name} ({wing}) imports {imp} ({imp_wing}): the TT wings import downwards only, "
                             f"{' <- '.join(TT_WINGS)}"))
    return out


# The TT backend's wings, lowest first: the model (layers, weights, state, model config, collectives), the runtime
# that runs it (generator, slot decoders, sampler, traces, prefix cache), speculation on top of it (MTP head, drafter,
# verify, accept, commit, mechanisms, backends) and serving (the vLLM class). A wing imports only wings below it.
TT_WINGS = ("model", "runtime", "spec", "serving")


def tt_wing(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] == ["qwen36", "tt"] and len(parts) >= 3 and parts[2] in TT_WINGS:
        return parts[2]
    return None


def layering_violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    bad, seen = [], set()
    for name, (source, is_pkg) in modules.items():
        for imp in sorted(imports_of(name, source, is_pkg)):  # a parent sorts before its children
            for rule, msg in rule_breaks(name, imp):
                if not any((name, rule, p) in seen for p in (imp.rsplit(".", i)[0] for i in range(1, imp.count(".") + 1))):
                    bad.append(msg)  # `from a.b import C` reported once, as a.b
                seen.add((name, rule, imp))
    return bad


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, module-level and function-level imports alike: an import moved
    into a function still runs whenever that function does, so it hides a cycle from Python, not from a reader."""
    return {n: {i for i in imports_of(n, src, is_pkg) if i in modules and i != n} for n, (src, is_pkg) in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The knots of the graph: each set of modules that all reach one another (a strongly connected component of
    two or more), so one entry per tangle however many cycles run through it."""
    reach = {v: _reachable(graph, v) for v in graph}
    return {frozenset(w for w in reach[v] if v in reach[w]) for v in graph if v in reach[v]}


def describe_cycle(graph: dict[str, set[str]], knot: frozenset[str]) -> str:
    """One shortest cycle through the knot's first module, then every import inside the knot (what to cut)."""
    start = min(knot)
    prev, layer = {start: None}, [start]  # breadth first from start until an import leads back to it
    while not any(start in graph[v] for v in layer):
        nxt = []
        for v in layer:
            for w in sorted(graph[v] & knot):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        layer = nxt
    path = [next(v for v in layer if start in graph[v])]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    edges = ", ".join(f"{a} -> {b}" for a in sorted(knot) for b in sorted(graph[a] & knot))
    return " -> ".join(reversed(path)) + f" -> {start}   (imports inside: {edges})"


# Cycles left to remove, one entry per knot. The test fails when the knots found differ from this set either way: a
# new cycle appears, or one is removed without its entry being deleted here. Imports under `if TYPE_CHECKING:` count
# (they are a dependency a reader has to follow, even though they do not run).
KNOWN_CYCLES: set[frozenset[str]] = set()  # none left


def test_no_import_cycles_beyond_the_known_ones():
    graph = import_graph(package_sources())
    found = import_cycles(graph)
    lines = [describe_cycle(graph, k) for k in sorted(found, key=min)]
    print("import cycles in the installed package:\n" + ("\n".join(lines) or "none"))
    new = sorted((describe_cycle(graph, k) for k in found - KNOWN_CYCLES))
    gone = sorted(" / ".join(sorted(k)) for k in KNOWN_CYCLES - found)
    assert not new, "new import cycle(s); cut one import of each:\n" + "\n".join(new)
    assert not gone, "cycle(s) removed: delete their KNOWN_CYCLES entries:\n" + "\n".join(gone)


def package_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """The import graph one level down: ``qwen36.X`` (a subpackage, or a top-level module) -> the ``qwen36.Y`` it
    imports, so a loop through several packages (a -> b.x -> a) shows even when no two files import each other."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for a, imps in import_graph(modules).items():
        graph.setdefault(top(a), set()).update(top(b) for b in imps if top(b) != top(a))
    return graph


# Package-level loops left to remove (test support and the probes import each other).
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = {frozenset({"qwen36.probes", "qwen36.testing"})}


def test_no_package_level_loops_beyond_the_known_ones():
    graph = package_graph(package_sources())
    found = import_cycles(graph)
    new = sorted(describe_cycle(graph, k) for k in found - KNOWN_PACKAGE_CYCLES)
    gone = sorted(" / ".join(sorted(k)) for k in KNOWN_PACKAGE_CYCLES - found)
    assert not new, "new package-level loop(s):\n" + "\n".join(new)
    assert not gone, "loop(s) removed: delete their KNOWN_PACKAGE_CYCLES entries:\n" + "\n".join(gone)


def test_package_graph_sees_a_loop_through_two_packages():
    modules = {"qwen36.a.x": ("from qwen36.b import y", False), "qwen36.b.y": ("def f():\n    import qwen36.a.z", False),
               "qwen36.a.z": ("", False)}
    assert import_cycles(import_graph(modules)) == set()  # no file-level cycle ...
    assert import_cycles(package_graph(modules)) == {frozenset({"qwen36.a", "qwen36.b"})}  # ... but a package loop


@pytest.mark.parametrize("modules,expect", [
    ({"p.a": ("from . import b", False), "p.b": ("def f():\n    from .a import g\n", False)},  # dodged in a function
     {frozenset({"p.a", "p.b"})}),
    ({"p.a": ("import p.b", False), "p.b": ("import p.c", False), "p.c": ("from p.a import x", False),
      "p.d": ("import p.a", False)}, {frozenset({"p.a", "p.b", "p.c"})}),  # p.d imports the knot but is not in it
    ({"p.a": ("import p.b\nimport p.c", False), "p.b": ("import p.c", False), "p.c": ("", False)}, set()),
    ({"p": ("from . import a", True), "p.a": ("from . import x", False)}, {frozenset({"p", "p.a"})}),  # via __init__
])
def test_cycle_finder_on_planted_graphs(modules, expect):
    graph = import_graph(modules)
    assert import_cycles(graph) == expect
    for knot in expect:
        text = describe_cycle(graph, knot)
        assert text.startswith(min(knot)) and text.split("   ")[0].endswith(min(knot)), text


def test_the_package_keeps_its_layers():
    modules = package_sources()
    assert {"qwen36.cli", "qwen36.speculative.engine", "qwen36.tt.spec.verify", "qwen36.tt_ops.device",
            "qwen36.probes.gdn_transaction_tp", "qwen36.testing.tt",
            "qwen36.testing.emulator_conformance"} <= set(modules)  # the walk saw everything
    assert layering_violations(modules) == []


def sources_under_tests(root: Path = ROOT) -> dict[str, str]:
    """{path under tests/ (posix): source} of every Python file under tests/, subfolders included."""
    tests = root / "tests"
    return {p.relative_to(tests).as_posix(): p.read_text() for p in sorted(tests.rglob("*.py"))}


def cross_test_imports(sources: dict[str, str]) -> list[str]:
    """Imports of one test file by another: a module named like any Python file under tests/ (conftest included),
    any relative import, or a `tests` package. Helpers shared by tests belong in qwen36.testing, fixtures in
    conftest.py; an import by file name depends on which folders pytest put on sys.path."""
    local = {Path(rel).stem for rel in sources}
    bad = []
    for rel, src in sources.items():
        name = "tests." + rel.removesuffix(".py").replace("/", ".")
        found: list[str] = []
        for imp in sorted(imports_of(name, src)):  # a parent sorts before its children: `from a import b` once, as a
            if (imp.split(".")[0] in local or under(imp, "tests")) and not any(under(imp, f) for f in found):
                found.append(imp)
        bad += [f"tests/{rel} imports {imp}" for imp in found]
    return bad


def test_no_test_file_imports_another():
    sources = sources_under_tests()
    assert "conftest.py" in sources and "test_layering.py" in {Path(r).name for r in sources}  # the walk saw them
    bad = cross_test_imports(sources)
    assert not bad, "test files importing test files (move the helper to qwen36.testing):\n" + "\n".join(bad)


def test_test_file_basenames_are_unique():
    """pytest imports each test file by its base name (its folder is put on sys.path; tests/ has no __init__.py, so
    no `tests` package can collide with a foreign one): two files of one name in different folders would clash.
    conftest.py files are the exception: pytest loads each one afresh."""
    seen: dict[str, str] = {}
    for rel in sources_under_tests():
        name = Path(rel).name
        if name == "conftest.py":
            continue
        assert name not in seen, f"tests/{rel} and tests/{seen[name]}: test files need distinct base names"
        seen[name] = rel


def top_level_names(source: str) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports), ``if`` / ``try`` blocks
    included: what ``from module import name`` can find without importing a submodule."""
    names: set[str] = set()
    todo = list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


def stale_package_imports(sources: dict[str, str], modules: dict[str, tuple[str, bool]]) -> list[str]:
    """Imports of ``qwen36`` names in test files that name no module of the package and nothing its parent module
    defines (a module moved, e.g. into one of the TT wings). Collection alone misses those in files that skip
    first (the dev-only tests). A module with a module-level ``__getattr__`` (lazy exports) is taken at its word."""
    bad, defined_in = [], {}
    for rel, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                bad += [f"tests/{rel}:{node.lineno}: import {a.name}" for a in node.names
                        if under(a.name, "qwen36") and a.name not in modules]
            elif isinstance(node, ast.ImportFrom) and not node.level and under(node.module or "", "qwen36"):
                if node.module not in modules:
                    bad.append(f"tests/{rel}:{node.lineno}: from {node.module}")
                    continue
                if node.module not in defined_in:
                    defined_in[node.module] = top_level_names(modules[node.module][0])
                defined = defined_in[node.module]
                if "__getattr__" in defined:
                    continue  # lazy exports (tt_ops.emulator): any name may resolve at run time
                bad += [f"tests/{rel}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                        if a.name != "*" and f"{node.module}.{a.name}" not in modules and a.name not in defined]
    return bad


def test_tests_import_what_the_package_has():
    bad = stale_package_imports(sources_under_tests(), package_sources())
    assert not bad, "imports of names the package does not have:\n" + "\n".join(bad)


def test_stale_import_check_on_planted_sources():
    modules = {"qwen36": ("", True), "qwen36.tt": ("", True), "qwen36.tt.serving": ("", True),
               "qwen36.tt.serving.vllm_types": ("X = 1\nif True:\n    def f(): pass\n", False),
               "qwen36.lazy": ("def __getattr__(name):\n    return 1\n", False)}
    ok = ("from qwen36.tt.serving import vllm_types\nfrom qwen36.tt.serving.vllm_types import X, f\nimport qwen36.tt\n"
          "from qwen36.lazy import Anything")
    assert stale_package_imports({"a/test_a.py": ok}, modules) == []
    bad = stale_package_imports({"a/test_a.py": "from qwen36.tt import vllm_types\nimport qwen36.vllm\n"
                                                "from qwen36.tt.serving.vllm_types import Y\nfrom qwen36.gone import Z"},
                                modules)
    assert bad == ["tests/a/test_a.py:1: from qwen36.tt import vllm_types", "tests/a/test_a.py:2: import qwen36.vllm",
                   "tests/a/test_a.py:3: from qwen36.tt.serving.vllm_types import Y",
                   "tests/a/test_a.py:4: from qwen36.gone"], bad


@pytest.mark.parametrize("source,expect", [
    ("from test_b import helper", "test_b"),
    ("def f():\n    import test_b as other\n", "test_b"),  # inside a function too
    ("from conftest import card_device", "conftest"),
    ("from .test_b import helper", "tests"),  # relative: resolved under tests
    ("from tests.test_b import helper", "tests.test_b"),
])
def test_test_file_check_catches_planted_imports(source, expect):
    bad = cross_test_imports({"sub/test_a.py": source, "other/test_b.py": "", "conftest.py": ""})
    assert bad and all(b.startswith("tests/sub/test_a.py imports ") for b in bad) and any(expect in b for b in bad), bad
    assert cross_test_imports({"sub/test_a.py": "from qwen36.testing.stats import chi2_p\nimport torch",
                              "test_b.py": ""}) == []


@pytest.mark.parametrize("module,source,is_pkg,expect", [
    ("qwen36.speculative.engine", "from ..tt.verify import SpecDeviceState", False, "free of ttnn"),
    ("qwen36.speculative", "def f():\n    import ttnn\n", True, "free of ttnn"),  # lazy imports count too
    ("qwen36.reference.model", "from qwen36.tt_ops.device import open_mesh", False, "free of ttnn"),
    ("qwen36.speculative.oracle", "from ..commands.backends import load_target", False, "command line"),
    ("qwen36.reference.batch", "def f():\n    from qwen36.speculative.thinking import ForcedFeed\n", False,
     "below the speculative engine"),
    ("qwen36.generation.plain", "from ..reference.batch import SlotDecoder", False, "generation sits below"),
    ("qwen36.generation.sampling", "from ..tt.runtime.sampler import DeviceSampler", False, "generation sits below"),
    ("qwen36.probes.lossless", "from qwen36.commands.common import DEFAULT_CHECKPOINT", False, "command line"),
    ("qwen36.tt.model.model", "from qwen36 import cli", False, "command line"),
    ("qwen36.tt.model.gdn", "import ttnn", False, "from qwen36.tt_ops.device"),
    ("qwen36.tt.spec.spec_backend", "from ...testing.speculative import oracle_drafter", False, "test support"),
    # the TT wings import downwards only (model <- runtime <- spec <- serving), inside functions too
    ("qwen36.tt.model.gdn", "from ..runtime.generator import TTGenerator", False, "wings import downwards"),
    ("qwen36.tt.runtime.generator", "def f():\n    from ..spec.spec_backend import TTSpecBackend\n", False,
     "wings import downwards"),
    ("qwen36.tt.spec.verify", "from qwen36.tt.serving import vllm_types", False, "wings import downwards"),
    ("qwen36.tt.spec.spec_backend", "from tests.test_tt_spec import oracle_drafter", False, "foreign `tests`"),
    # the emulator's conformance cases are test support: the emulator and the device layer never load them
    ("qwen36.tt_ops.emulator.mesh", "from qwen36.testing.emulator_conformance import CASES", False, "test support"),
    ("qwen36.tt_ops.device", "def f():\n    from ..testing import emulator_conformance\n", False, "test support"),
    ("qwen36.commands.probe", "from ..testing.emulator_conformance import run_cases", False, "test support"),
    # test support other than its CLI runner keeps off the command line
    ("qwen36.testing.tt_batch", "from ..cli import main", False, "command line"),
])
def test_checker_catches_planted_violations(module, source, is_pkg, expect):
    bad = layering_violations({module: (source, is_pkg)})
    assert bad and any(expect in b for b in bad), bad


def test_checker_allows_what_the_layers_allow():
    ok = {
        "qwen36.commands.generate": ("from ..tt.runtime.generator import build_generator\nfrom ..speculative import engine", False),
        "qwen36.tt.model.model": ("from ...tt_ops.device import open_mesh\nfrom ...generation.sampling import SamplingParams", False),
        "qwen36.tt.spec.verify": ("from ..model.model import TTQwen36Model\nfrom ..runtime.trace import StepTraces", False),
        "qwen36.tt.serving.qwen36_vllm": ("from ..spec.spec_backend import TTSpecBackend\nfrom ..runtime import generator", False),
        "qwen36.probes.verify_tp": ("from qwen36.testing.tt import make_bf16_checkpoint", False),
        "qwen36.testing.cli": ("def run(a):\n    from ..cli import main", False),
        "qwen36.probes.emu_conformance": ("def run(a):\n    from qwen36.testing.emulator_conformance import run_cases", False),
        "qwen36.tt_ops.emulator.ttnn_import": ("import ttnn", False),
    }
    assert layering_violations(ok) == []
    assert imports_of("qwen36.tt.spec.verify", "from .mechanisms import tt_mechanism") >= {"qwen36.tt.spec.mechanisms"}
    assert imports_of("qwen36.speculative", "from . import engine", True) >= {"qwen36.speculative.engine"}


# ---- no private attribute read across a module boundary ---------------------------------------------------------
def private_reads(name: str, source: str) -> list[str]:
    """``obj._x`` reads in module ``name`` where ``obj`` is not ``self`` / ``cls`` and the module does not define ``_x``
    itself (a def or class of its own, an attribute or name it assigns, a parameter), and imports of another
    module's ``_name``: a private name is its module's own business (a caller that needs it needs a public name)."""
    tree = ast.parse(source)
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                out.append(f"{name}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{name}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


# Private reads left to remove (the emulator's tensor fields and helpers), one entry per read as
# the check words it. The test fails when the reads found differ from this list either way.
KNOWN_PRIVATE_READS = {
    "qwen36.tt_ops.emulator.l1: t._shards",
    "qwen36.tt_ops.emulator.namespace: t._shards",
    "qwen36.tt_ops.emulator.namespace: t._deallocated",
    "qwen36.tt_ops.emulator.namespace: t._tile",
    "qwen36.tt_ops.emulator.namespace: mesh.counters._sink",
    "qwen36.tt_ops.emulator.namespace: t._freed",
    "qwen36.tt_ops.emulator.ops_core: mesh.ttnn._dispatcher",
    "qwen36.tt_ops.emulator.ops_kv_cache: t._tile",
    "qwen36.tt_ops.emulator.ops_kv_cache: a._base",
    "qwen36.tt_ops.emulator.ops_kv_cache: b._base",
    "qwen36.tt_ops.emulator.tensor_index: t._ns",
    "qwen36.tt_ops.emulator.trace: t._freed",
}


def test_no_private_reads_across_modules_beyond_the_known_ones():
    found = {r for name, (src, _) in package_sources().items() if not under(name, TEST_SUPPORT)
             for r in private_reads(name, src)}
    new, gone = sorted(found - KNOWN_PRIVATE_READS), sorted(KNOWN_PRIVATE_READS - found)
    assert not new, "private attributes read across a module boundary (give them a public name):\n" + "\n".join(new)
    assert not gone, "private read(s) removed: delete their KNOWN_PRIVATE_READS entries:\n" + "\n".join(gone)


def test_private_read_check_on_planted_sources():
    src = ("from .other import _helper\n"
           "class A:\n    def f(self, dec):\n        self._mine = 1\n        dec._write(self._mine)\n"
           "        other._mine\n        cls_thing = A._kind\n\n    _kind = 3\n")
    # dec._write: another object's private name this module does not define; other._mine / A._kind: names this
    # module defines itself (an attribute it assigns, a class attribute), allowed
    assert sorted(private_reads("p.m", src)) == ["p.m: dec._write", "p.m: from other import _helper"]


# ---- no production module over 600 lines ------------------------------------------------------------------------
MAX_MODULE_LINES = 600
# Modules over the limit left to split (the emulator's core ops, its owners' to split), with their length when
# listed: the test fails when another module passes the limit, and when a listed one is back under it.
KNOWN_LONG_MODULES = {"qwen36.tt_ops.emulator.ops_core": 622}


def test_no_production_module_over_the_limit():
    lengths = {n: len(src.splitlines()) for n, (src, _) in package_sources().items() if not under(n, TEST_SUPPORT)}
    long = {n: k for n, k in lengths.items() if k > MAX_MODULE_LINES}
    new = sorted(f"{n}: {k} lines" for n, k in long.items() if n not in KNOWN_LONG_MODULES)
    gone = sorted(n for n in KNOWN_LONG_MODULES if n not in long)
    assert not new, f"production modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(new)
    assert not gone, "back under the limit: delete their KNOWN_LONG_MODULES entries:\n" + "\n".join(gone)
