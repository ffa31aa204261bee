"""The emulator's modules form a one-way import chain: no module imports one above it (no cycles)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import qwen36.tt_ops.emulator as emulator_pkg

PKG = "qwen36.tt_ops.emulator"
EMU_DIR = pathlib.Path(emulator_pkg.__file__).resolve().parent

# Level of every module: a module may import only modules of a strictly lower level.
LEVELS = [
    ("errors", "faults", "ttnn_import", "counters", "signatures", "registry", "tensor_index"),
    ("tensor",),
    ("numerics", "programs", "mappers", "program_cache", "dram_sharded_readers", "op_accounting", "l1",
     "shard_specs"),
    ("goldens", "kda_common", "matmul_1d"),
    ("trace", "ops_core", "ops_mappers", "ops_compute", "ops_ccl", "ops_attention", "ops_kv_cache", "ops_gdn",
     "ops_trace", "ops_sampling", "ops_gather", "ops_sparse", "ops_sdpa_prefill", "ops_kda", "ops_gdn_chunk",
     "ops_kda_scan"),
    ("work",),
    ("namespace",),
    ("mesh",),
]
LEVEL = {m: i for i, names in enumerate(LEVELS) for m in names}
CHAIN = [m for names in LEVELS for m in names]


def _emulator_imports(path: pathlib.Path) -> set[str]:
    """Emulator modules named by any import statement in ``path`` (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif node.module and node.module.startswith(PKG + "."):
                out.add(node.module[len(PKG) + 1 :].split(".")[0])
            elif node.module == PKG:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PKG + "."):
                    out.add(a.name[len(PKG) + 1 :].split(".")[0])
    return out


def test_every_module_has_a_level():
    files = {p.stem for p in EMU_DIR.glob("*.py") if p.stem != "__init__"}
    assert files == set(LEVEL), f"modules without a level: {files - set(LEVEL)}; stale: {set(LEVEL) - files}"


def test_no_module_imports_one_above_it():
    bad = []
    for mod, lvl in LEVEL.items():
        for dep in _emulator_imports(EMU_DIR / f"{mod}.py"):
            if dep in LEVEL and LEVEL[dep] >= lvl and dep != mod:
                bad.append(f"{mod} (level {lvl}) imports {dep} (level {LEVEL[dep]})")
    assert not bad, "emulator import chain broken:\n" + "\n".join(bad)


def test_ast_check_catches_an_upward_import(tmp_path):
    """The checker itself sees relative, absolute and function-level imports."""
    f = tmp_path / "x.py"
    f.write_text("from .tensor import EmuTensor\n\ndef g():\n    from . import mesh\n    import qwen36.tt_ops.emulator.trace\n")
    assert _emulator_imports(f) == {"tensor", "mesh", "trace"}


@pytest.mark.slow  # one fresh interpreter per module
def test_fresh_interpreter_imports_in_chain_order():
    """Importing each module in chain order, in a clean interpreter, loads nothing above it."""
    code = f"""
import sys
levels = {LEVEL!r}
for mod in {CHAIN!r}:
    __import__("{PKG}." + mod)
    loaded = {{n.rsplit(".", 1)[1] for n in sys.modules if n.startswith("{PKG}.")}}
    above = sorted(m for m in loaded if m in levels and levels[m] > levels[mod])
    if above:
        print(f"importing {{mod}} loaded {{above}}")
        sys.exit(1)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
