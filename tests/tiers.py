"""The test tiers: each is a folder of tests/ named for what its tests may start, cheapest first.
pyproject's testpaths runs them in this order, so a plain `pytest` fails fast on cheap breakage.
Each tier's conftest.py marks its tests with the tier's name (`pytest -m unit`), and the session
prints how long each tier took (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "engine", "cluster", "e2e", "gpu")


def tier_of(path: Path | str) -> str | None:
    """The tier a test file lies in, or None outside every tier."""
    try:
        top = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


def tier_marker(conftest: str):
    """A tier conftest's ``pytest_collection_modifyitems``: marks every test under that conftest's
    folder with the folder's name. It runs before pytest's own -m selection (tryfirst)."""
    tier = Path(conftest).resolve().parent.name
    assert tier in TIERS, f"{conftest}: not a tier folder; tests/tiers.py lists {TIERS}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(items):
        for item in items:
            if tier_of(item.path) == tier:
                item.add_marker(tier)

    return pytest_collection_modifyitems
