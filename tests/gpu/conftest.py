"""Tier 5, `tests/gpu`: everything here needs a CUDA GPU: skipped elsewhere (CI, laptops), run on the GPU
machine."""

from __future__ import annotations

import pytest

from tests.tiers import tier_of


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if tier_of(item.path) == "gpu"]
    for item in mine:
        item.add_marker("gpu")
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in mine:
        item.add_marker(skip)
