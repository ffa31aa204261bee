"""The suite's scheduling hint (tests/conftest.py): every file it starts first exists, so a renamed file cannot
silently drop out of the list and leave the slowest file to the end of a two-worker run."""
from pathlib import Path

from conftest import SLOWEST_FILES_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_the_slowest_files_listed_first_exist():
    missing = [f for f in SLOWEST_FILES_FIRST if not (ROOT / f).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FILES_FIRST names files that do not exist: {missing}"
    assert len(set(SLOWEST_FILES_FIRST)) == len(SLOWEST_FILES_FIRST)
