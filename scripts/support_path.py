"""Puts the checkout's tests/ folder on sys.path, so that a script imports the test-support package ``support``
(tests/support/: checkpoint makers, the vLLM call recorder and replay, the soak oracle, ...) the way pytest does
(pyproject.toml's ``pythonpath``). The wheel does not ship test support; scripts run from a source checkout.

A script imports this module first (``import support_path  # noqa: F401``): scripts/ is on sys.path when a script
runs (``python scripts/NAME.py``), and ``support.scripts.load_script`` adds it when a test loads one."""
from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
