"""Real op signatures of the installed ttnn, parsed from ``type(op.function).__call__.__doc__``.

``inspect.signature`` on a ttnn op only shows ``*args, **kwargs``; the nanobind ``__call__`` docstring
holds one line per overload: ``__call__(self, a: T, b: T = d, *, kw: T = d) -> R``. We parse each
overload into positional-capable names and keyword-only names, and validate calls against the union:
a keyword no overload accepts, or more positional arguments than any overload takes, raises
``TypeError`` naming the op and the argument - the same mistakes that raise on cards.

Python-registered ops (``is_cpp_operation`` False) are validated with ``inspect.signature``.
Ops whose signature cannot be determined are not validated (reported by :func:`signature_of`).

Dtype/layout tables: many ops' ``__doc__`` carry a "Supported dtypes/layouts" table; we parse the common
row format (``| BFLOAT16, FLOAT32 | TILE |``) per tensor argument, where present, and enforce it for
device tensor inputs (see :func:`dtype_layout_table`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Overload:
    positional: tuple[str, ...]  # names that may be passed positionally (in order)
    keyword_only: tuple[str, ...]
    required: tuple[str, ...]
    var_kwargs: bool = False
    var_args: bool = False

    @property
    def all_names(self) -> set[str]:
        return set(self.positional) | set(self.keyword_only)


@dataclasses.dataclass(frozen=True)
class Signature:
    op_name: str
    overloads: tuple[Overload, ...]
    source: str  # "nanobind-doc" | "python" | "unknown"

    @property
    def accepted_names(self) -> set[str]:
        names: set[str] = set()
        for o in self.overloads:
            names |= o.all_names
        return names

    @property
    def max_positional(self) -> int:
        if any(o.var_args for o in self.overloads):
            return 10**6
        return max((len(o.positional) for o in self.overloads), default=0)

    @property
    def accepts_var_kwargs(self) -> bool:
        return any(o.var_kwargs for o in self.overloads)

    def validate(self, args: tuple, kwargs: dict) -> None:
        if self.source == "unknown":
            return
        if len(args) > self.max_positional:
            raise TypeError(
                f"{self.op_name}() takes at most {self.max_positional} positional arguments but {len(args)} were "
                f"given (the real ttnn signature makes the rest keyword-only)"
            )
        if self.accepts_var_kwargs:
            return
        accepted = self.accepted_names
        for k in kwargs:
            if k not in accepted:
                raise TypeError(
                    f"{self.op_name}() got an unexpected keyword argument '{k}' "
                    f"(the installed ttnn signature accepts: {', '.join(sorted(accepted))})"
                )
        # a keyword that duplicates a positional slot of every overload that can take that many positionals
        fitting = [o for o in self.overloads if len(args) <= len(o.positional)]
        if fitting and all(any(k in o.positional[: len(args)] for k in kwargs) for o in fitting):
            dup = next(k for k in kwargs if k in fitting[0].positional[: len(args)]) if fitting else None
            raise TypeError(f"{self.op_name}() got multiple values for argument '{dup}'")


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


_CALL_RE = re.compile(r"__call__\((.*)\)\s*->", re.S)


def _parse_param_list(body: str) -> Overload:
    positional, kwonly, required = [], [], []
    kw_mode = False
    var_kwargs = var_args = False
    for p in _split_top_level(body):
        if p == "self":
            continue
        if p == "*":
            kw_mode = True
            continue
        if p == "/":
            continue
        if p.startswith("**"):
            var_kwargs = True
            continue
        if p.startswith("*"):
            var_args = True
            kw_mode = True
            continue
        name = p.split(":", 1)[0].split("=", 1)[0].strip()
        has_default = "=" in p.split(":", 1)[-1] or ("=" in p and ":" not in p)
        (kwonly if kw_mode else positional).append(name)
        if not has_default:
            required.append(name)
    return Overload(tuple(positional), tuple(kwonly), tuple(required), var_kwargs, var_args)


def parse_call_doc(doc: str) -> list[Overload]:
    overloads = []
    for line in doc.splitlines():
        line = line.strip().strip("`")
        if not line.startswith("__call__("):
            # numbered overload lines look like "1. ``__call__(...)``"
            m = re.match(r"\d+\.\s+``(__call__\(.*)``$", line)
            if not m:
                continue
            line = m.group(1)
        m = _CALL_RE.search(line)
        if m:
            overloads.append(_parse_param_list(m.group(1)))
    # dedupe
    seen, out = set(), []
    for o in overloads:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out


def _python_overload(fn) -> Overload | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    positional, kwonly, required = [], [], []
    var_kwargs = var_args = False
    for name, prm in sig.parameters.items():
        if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
            positional.append(name)
        elif prm.kind == prm.KEYWORD_ONLY:
            kwonly.append(name)
        elif prm.kind == prm.VAR_KEYWORD:
            var_kwargs = True
        elif prm.kind == prm.VAR_POSITIONAL:
            var_args = True
        if prm.default is prm.empty and prm.kind not in (prm.VAR_KEYWORD, prm.VAR_POSITIONAL):
            required.append(name)
    return Overload(tuple(positional), tuple(kwonly), tuple(required), var_kwargs, var_args)


@functools.lru_cache(maxsize=None)
def _signature_cached(op_name: str, op_id: int, op: Any) -> Signature:
    fn = getattr(op, "function", op)
    doc = getattr(type(fn), "__call__", None).__doc__ if hasattr(type(fn), "__call__") else None
    if doc and "__call__(" in doc:
        overloads = parse_call_doc(doc)
        if overloads:
            return Signature(op_name, tuple(overloads), "nanobind-doc")
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        o = _python_overload(fn)
        if o is not None:
            return Signature(op_name, (o,), "python")
    # nanobind plain functions: first line of __doc__ is "name(params) -> ret" (possibly overloaded)
    doc = getattr(fn, "__doc__", None) or ""
    overloads = []
    for line in doc.splitlines():
        line = line.strip().strip("`")
        m = re.match(r"(?:\d+\.\s+``)?[A-Za-z_][\w]*\((.*)\)\s*->", line)
        if m:
            overloads.append(_parse_param_list(m.group(1).replace("\\*", "*")))
    if overloads:
        return Signature(op_name, tuple(dict.fromkeys(overloads)), "nanobind-doc")
    return Signature(op_name, (), "unknown")


def signature_of(op_name: str, op: Any) -> Signature:
    return _signature_cached(op_name, id(op), op)


# --------------------------------------------------------------------------------------------------
# dtype / layout tables
# --------------------------------------------------------------------------------------------------
_DTYPES = {"BFLOAT16", "FLOAT32", "BFLOAT8_B", "BFLOAT4_B", "UINT32", "INT32", "UINT16", "UINT8"}
_LAYOUTS = {"TILE", "ROW_MAJOR"}


@functools.lru_cache(maxsize=None)
def _table_cached(op_name: str, doc: str) -> dict[str, list[tuple[frozenset, frozenset]]]:
    """{tensor_arg_name: [(dtypes, layouts), ...]} from the op doc's RST ``list-table`` blocks.

    Format (ttnn 0.81.1)::

        .. list-table:: input_tensor
           * - dtype
             - layout
           * - BFLOAT16, FLOAT32, BFLOAT8_B
             - TILE

    Tables titled by a single identifier constrain that argument; untitled tables ("Supported dtypes and
    layouts") constrain the first tensor argument (key ``__first__``). Rows whose cells are not plain
    dtype / layout lists are skipped. Anything unparseable yields no constraint.
    """
    table: dict[str, list[tuple[frozenset, frozenset]]] = {}
    current = None
    pending_dtypes = None
    for raw in doc.splitlines():
        line = raw.strip()
        m = re.match(r"^\.\. list-table::\s*(.*)$", line)
        if m:
            title = m.group(1).strip()
            if not title:
                current = "__first__"  # untitled table: constrains the op's first (input) tensor
            else:
                current = title if re.fullmatch(r"[a-z_][a-z0-9_]*", title) else None
            pending_dtypes = None
            continue
        if current is None:
            continue
        if line.startswith("* - "):
            cell = re.sub(r"\(.*?\)", "", line[4:]).strip()
            items = {d.strip().upper() for d in cell.split(",") if d.strip()}
            pending_dtypes = items if items and items <= _DTYPES else None
            continue
        if line.startswith("- ") and pending_dtypes is not None:
            cell = re.sub(r"\(.*?\)", "", line[2:]).strip()
            items = {x.strip().upper() for x in cell.split(",") if x.strip()}
            if items and items <= _LAYOUTS:
                table.setdefault(current, []).append((frozenset(pending_dtypes), frozenset(items)))
            pending_dtypes = None
            continue
        if line and not line.startswith(":") and not line.startswith("*") and not line.startswith("-"):
            if not line.startswith(".."):
                current = None
    return table


def dtype_layout_table(op_name: str, op: Any) -> dict[str, list[tuple[frozenset, frozenset]]]:
    doc = getattr(op, "__doc__", None) or ""
    if "list-table::" not in doc:
        return {}
    return _table_cached(op_name, doc)


def bind_arguments(op_name: str, op: Any, args: tuple, kwargs: dict) -> dict:
    """Bind a call to the first overload of the real signature it fits; return {param_name: value}.

    An overload fits when the positional arguments fit its positional slots, every keyword is one of its
    names, and all its required parameters are supplied. Raises TypeError when no overload fits.
    """
    sig = signature_of(op_name, op)
    for o in sig.overloads:
        if len(args) > len(o.positional) and not o.var_args:
            continue
        names = o.all_names
        if any(k not in names for k in kwargs) and not o.var_kwargs:
            continue
        bound = dict(zip(o.positional, args))
        if any(k in bound for k in kwargs):
            continue
        bound.update(kwargs)
        if all(r in bound for r in o.required):
            return bound
    raise TypeError(f"{op_name}(): arguments match no overload of the installed ttnn signature")
