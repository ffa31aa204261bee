"""The installed package imports cleanly beside tt-metal.

On card machines tt-metal's repository root is on PYTHONPATH, and it has its own top-level `models` package; vllm-tt
registers model classes by module path. So the wheel must install exactly one import root (`qwen36`), and nothing
in it may import `models`, `tt_ops`, `probes`, `scripts` or `tests` by those names, nor the test support (`support`,
tests/support/, which the wheel does not carry). These tests build the real wheel
(an editable install resolves names through its own finder and would hide a clash), unpack it into a fresh
directory, and run the CLI, the vllm-tt model class and every probe module with foreign packages of those names
first on sys.path. The foreign packages raise on import, so any accidental use of them fails loudly.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# source folder -> import name (pyproject.toml [tool.setuptools.package-dir])
SOURCE_ROOTS = {"models/qwen36": "qwen36", "tt_ops": "qwen36.tt_ops", "probes": "qwen36.probes"}
FOREIGN = ("models", "tt_ops", "probes", "scripts", "tests", "support")
TEST_SUPPORT = ("support", "testing")  # the test-support package's name, and its name when it sat inside the package
pytestmark = pytest.mark.slow  # every test here needs the built wheel, and the last runs the CLI and a probe from it


def source_packages() -> set[str]:
    names = set()
    for folder, import_name in SOURCE_ROOTS.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            names.add(".".join([import_name, *rel.parts]) if rel.parts else import_name)
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the source files git knows (tracked or not ignored): setuptools builds in-tree under
    build/, where modules deleted since an earlier build would linger and end up in the wheel."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (whl,) = out.glob("qwen36_tt-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    """Packages named like ours-of-old (and tt-metal's `models`), each raising if anything imports it."""
    root = tmp_path_factory.mktemp("foreign")
    for name in FOREIGN:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(
            f"raise ImportError('foreign package {name!r} imported: qwen36 must not use this name')\n")
    return root


def run_isolated(code: str, installed: Path, foreign: Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` with the unpacked wheel (not the editable install) and the foreign packages first on sys.path.
    `-S` keeps site's .pth processing (and so the editable finder) out; the dependencies come from this
    interpreter's site-packages directories, added explicitly after ours."""
    deps = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(foreign), str(installed), *deps]))
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_wheel_installs_one_import_root_with_every_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    tops = {f.split("/", 1)[0] for f in files if not f.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"qwen36"}, f"wheel installs top-level names {sorted(tops)}; only 'qwen36' is collision-free"
    in_wheel = {f[: -len("/__init__.py")].replace("/", ".") for f in files if f.endswith("/__init__.py")}
    missing = source_packages() - in_wheel
    assert not missing, f"package folders missing from the wheel (add them to pyproject's packages list): {missing}"
    for data in ("qwen36/default_checkpoint/model.safetensors", "qwen36/default_checkpoint/config.json",
                 "qwen36/tt_ops/mock_clusters/blackhole_2xp150.yaml",
                 "qwen36/tt_ops/mesh_graph/p150x2_one_cable.textproto"):
        assert data in files, f"package data {data} missing from the wheel"


def support_imports_in(sources: dict[str, str]) -> list[str]:
    """'file: name' for each import of test support in {file: source} (absolute or relative, at module level or inside
    a function)."""
    bad = []
    for f, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                names, level = [a.name for a in node.names], 0
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module or ''}.{a.name}".lstrip(".") for a in node.names]
                level = node.level
            else:
                continue
            for n in names:
                parts = [x for x in n.split(".") if x]
                if (level and any(x in TEST_SUPPORT for x in parts)) or (not level and parts and (
                        parts[0] in TEST_SUPPORT or n.startswith("qwen36.testing"))):
                    bad.append(f"{f}: {'.' * level}{n}")
    return sorted(set(bad))


def test_test_support_import_check_on_planted_sources():
    planted = {"a.py": "import support.tt", "b.py": "def f():\n    from support import cli\n",
               "c.py": "from ..testing import tt", "d.py": "from qwen36.testing.pcc import comp_pcc",
               "ok.py": "import torch.testing\nfrom qwen36.numerics import PCC_GATES\nfrom . import cases"}
    assert [b.split(":")[0] for b in support_imports_in(planted)] == ["a.py", "b.py", "b.py", "c.py", "c.py", "d.py",
                                                                         "d.py"]


def test_wheel_carries_no_test_support(wheel):
    """No package of the wheel is test support, and no module in it imports test support: the harnesses, checkpoint
    makers and vLLM call replay live in tests/support/ (the package `support`, not installed)."""
    with zipfile.ZipFile(wheel) as z:
        sources = {f: z.read(f).decode() for f in z.namelist() if f.endswith(".py")}
    assert "qwen36/probes/conformance/cases.py" in sources and "qwen36/tiny.py" in sources  # what probes ship
    packages = {f.rsplit("/", 1)[0].replace("/", ".") for f in sources if f.endswith("/__init__.py")}
    assert not [p for p in packages if p.split(".")[-1] in TEST_SUPPORT], sorted(packages)
    bad = support_imports_in(sources)
    assert not bad, "wheel modules importing test support:\n" + "\n".join(bad)


def test_console_script_points_into_the_package(wheel, installed, foreign, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        (ep_file,) = [f for f in z.namelist() if f.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep_file).decode()
    line = next(ln for ln in entry_points.splitlines() if ln.startswith("qwen36 "))
    module, func = line.split("=", 1)[1].strip().split(":")
    proc = run_isolated(f"import sys; from {module} import {func} as m; sys.exit(m(['--help']))", installed, foreign,
                        tmp_path)
    assert proc.returncode == 0 and "usage: qwen36" in proc.stdout, (line, proc.stderr[-2000:])


def test_foreign_packages_really_raise(installed, foreign, tmp_path):
    """The guard itself: importing a foreign name fails, so the next test can fail."""
    proc = run_isolated("import models", installed, foreign, tmp_path)
    assert proc.returncode != 0 and "foreign package 'models' imported" in proc.stderr


def test_cli_vllm_class_and_probes_import_and_run_beside_foreign_packages(installed, foreign, tmp_path):
    code = r"""
import importlib, sys
import qwen36
assert qwen36.__file__.startswith(%(site)r), qwen36.__file__
from qwen36.cli import main
from qwen36.probes.registry import PROBES, load_probe
for name in sorted(PROBES):
    load_probe(name)
from qwen36.tt.serving.qwen36_vllm import Qwen36ForCausalLM
assert callable(getattr(Qwen36ForCausalLM, "initialize_vllm_model"))
for argv in (["--help"], ["probe", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), (argv, e.code)
rc = main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--device", "reference"])
assert rc in (0, None), rc
rc = main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--device", "reference", "--spec-k", "2"])
assert rc in (0, None), rc
rc = main(["probe", "verify-tp", "--device", "emulated-p150x2", "--ks", "1", "--records", "rec.jsonl"])
assert rc == 0, rc
print("OK", sorted(PROBES))
""" % {"site": str(installed)}
    proc = run_isolated(code, installed, foreign, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    assert (tmp_path / "rec.jsonl").exists()
