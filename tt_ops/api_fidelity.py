"""API-fidelity scan: every ``ttnn.<name>`` the project's TT code uses must exist in the installed ttnn,
and every keyword argument passed to a ttnn op must be accepted by its real signature.

Scanned by default: ``models/qwen36/tt/**/*.py``, ``tests/support/**/*.py`` (test support outside the
package: the layer harness, the vLLM replay), ``tt_ops/**/*.py``, ``probes/**/*.py`` (the emulator's conformance
cases included).

What counts as a ttnn chain (static, via ``ast``):

* attribute chains rooted at the name ``ttnn`` (``ttnn.transformer.paged_update_cache``), and
* chains through an attribute named ``ttnn`` (``ctx.ttnn.linear``, ``self.ttnn.add``); there, private
  names (``_x``) are skipped because they belong to the emulating namespace object, not to ttnn.

Each chain is resolved step by step against the real module (``getattr``). For calls whose callee
resolves to a ttnn op or function with a parseable signature, keyword names are checked against the
union of the signature's overloads (``**kwargs`` expansions are not checkable and are skipped), and the
positional count against the largest overload.

Run: ``python -m tt_ops.api_fidelity [paths...]`` (exit status 1 on findings).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import sys
from typing import Iterable

DEFAULT_GLOBS = ("models/qwen36/tt/**/*.py", "tests/support/**/*.py", "tt_ops/**/*.py", "probes/**/*.py")
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Finding:
    path: str
    line: int
    chain: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.chain}: {self.problem}"


def _chain(node: ast.AST) -> tuple[list[str], bool] | None:
    """For an Attribute node return (['ttnn', 'a', 'b'], rooted_at_name) if it is a ttnn chain."""
    parts = []
    cur = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    if isinstance(cur, ast.Name):
        parts.append(cur.id)
    else:
        parts.append("<expr>")
    parts.reverse()
    if parts[0] == "ttnn":
        return parts, True
    if "ttnn" in parts[1:]:
        i = parts.index("ttnn", 1)
        return parts[i:], False
    return None


class _Resolver:
    def __init__(self, ttnn_module):
        self.ttnn = ttnn_module
        self._cache: dict[tuple, tuple] = {}

    def resolve(self, parts: list[str]) -> tuple[object | None, str | None]:
        key = tuple(parts)
        if key in self._cache:
            return self._cache[key]
        obj = self.ttnn
        for i, p in enumerate(parts[1:], start=1):
            try:
                obj = getattr(obj, p)
            except AttributeError:
                res = (None, f"'{'.'.join(parts[:i + 1])}' does not exist in the installed ttnn "
                             f"({getattr(self.ttnn, '__version__', '0.81.1')})")
                self._cache[key] = res
                return res
        self._cache[key] = (obj, None)
        return obj, None


def _check_call(call: ast.Call, parts: list[str], obj, path: str) -> list[Finding]:
    from qwen36.tt_ops.emulator.signatures import signature_of

    if inspect.isclass(obj) or inspect.ismodule(obj):
        return []
    name = ".".join(parts)
    try:
        sig = signature_of(name, obj)
    except Exception:  # pragma: no cover - unparseable: nothing to check
        return []
    if sig.source == "unknown":
        return []
    out = []
    has_star = any(isinstance(a, ast.Starred) for a in call.args)
    if not has_star and len(call.args) > sig.max_positional:
        out.append(Finding(path, call.lineno, name,
                           f"{len(call.args)} positional arguments, the real signature takes at most "
                           f"{sig.max_positional}"))
    if not sig.accepts_var_kwargs:
        accepted = sig.accepted_names
        for kw in call.keywords:
            if kw.arg is None:  # **kwargs expansion
                continue
            if kw.arg not in accepted:
                out.append(Finding(path, kw.value.lineno if hasattr(kw.value, "lineno") else call.lineno, name,
                                   f"keyword '{kw.arg}' is not accepted by the real signature"))
    return out


def scan_source(source: str, path: str = "<string>", ttnn_module=None) -> list[Finding]:
    if ttnn_module is None:
        import ttnn as ttnn_module  # noqa: PLC0415
    resolver = _Resolver(ttnn_module)
    tree = ast.parse(source, filename=path)
    findings: list[Finding] = []
    # outermost attribute chains only (a.b.c visits a.b too)
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        found = _chain(node)
        if not found:
            continue
        parts, rooted = found
        if len(parts) < 2:
            continue
        if not rooted and any(p.startswith("_") for p in parts[1:]):
            continue
        if isinstance(node.ctx, ast.Store):
            continue
        obj, problem = resolver.resolve(parts)
        if problem:
            findings.append(Finding(path, node.lineno, ".".join(parts), problem))
            continue
        call = calls.get(id(node))
        if call is not None:
            findings.extend(_check_call(call, parts, obj, path))
    return findings


def project_files(root: pathlib.Path = REPO_ROOT, globs: Iterable[str] = DEFAULT_GLOBS) -> list[pathlib.Path]:
    files: set[pathlib.Path] = set()
    for g in globs:
        files.update(p for p in root.glob(g) if p.is_file())
    return sorted(files)


def scan_paths(paths: Iterable[pathlib.Path], root: pathlib.Path = REPO_ROOT) -> list[Finding]:
    findings = []
    for p in paths:
        rel = str(p.relative_to(root)) if p.is_absolute() and root in p.parents else str(p)
        findings.extend(scan_source(p.read_text(), rel))
    return findings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [pathlib.Path(a).resolve() for a in argv] if argv else project_files()
    findings = scan_paths(paths)
    for f in findings:
        print(f)
    print(f"api-fidelity: {len(paths)} files, {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
