"""The GDN/conv state commit mechanisms: the one registry of their names.

A speculative verify runs K+1 rows through every GDN layer, but only the state after the accepted row ``a`` may
survive the step. Attention KV needs no mechanism (rows past the accepted prefix are never attended and are
overwritten later); the GDN recurrent state and the conv window do. Three ways to get there:

    snapshot       copy live state, verify on live, restore + re-advance the accepted rows on partial acceptance
    shadow_commit  verify keeps the state after every row (slots / a device ring); commit points live at slot a
    recompute      verify on a scratch copy, commit re-runs the accepted rows on live

Each backend implements every mechanism as one small class (its buffers, pre-verify work, commit, abort and the
counters one step is expected to produce): ``speculative/reference_mechanisms.py`` for the torch reference,
``tt/spec/mechanisms.py`` for the TT backend. Both families are keyed by the names below; the command line
(``--commit``), the probes and the tests iterate over :data:`MECHANISMS`. A name is resolved to its object once,
when a backend is built (:func:`resolve`).

Import-light on purpose (no torch): the command line builds its ``--commit`` choices from here.
"""
from __future__ import annotations

from typing import Mapping, TypeVar

MECHANISMS = ("snapshot", "shadow_commit", "recompute")
DEFAULT_MECHANISM = "shadow_commit"  # zero state copies per step (docs/speculative.md)

M = TypeVar("M")


def check_mechanism(name: str) -> str:
    if name not in MECHANISMS:
        raise ValueError(f"unknown commit mechanism {name!r}; choose from {MECHANISMS}")
    return name


def resolve(family: Mapping[str, type[M]], mechanism: str | M) -> M:
    """A mechanism name (or an already built member of ``family``, e.g. a test's deliberately broken subclass)
    -> an instance of that family's class for it."""
    if not isinstance(mechanism, str):
        if not isinstance(mechanism, tuple(family.values())):
            raise TypeError(f"{type(mechanism).__name__} is not a commit mechanism of this backend "
                            f"({', '.join(c.__name__ for c in family.values())})")
        return mechanism
    return family[check_mechanism(mechanism)]()
