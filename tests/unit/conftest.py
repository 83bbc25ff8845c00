"""Tier 1, `tests/unit`: pure and fast. In-process code only: no Ray, no vLLM, no cluster, no servers
in child processes (loopback servers in threads of this process are fine). Goal: the whole tier in
at most 60 s on a 2-core machine (docs/development.md)."""

import sys

import pytest

from tests.tiers import tier_marker
from tests.unit import triton_interpreter

pytest_collection_modifyitems = tier_marker(__file__)


def pytest_collection_finish(session):
    triton_interpreter.start_marked(session.items)


def pytest_sessionfinish(session):
    triton_interpreter.stop_all()


@pytest.fixture(autouse=True)
def _no_vllm_import():
    """Fail a unit test that imports vLLM: its import alone is 7 s of this tier's 60."""
    before = "vllm" in sys.modules
    yield
    if not before and "vllm" in sys.modules:
        pytest.fail("this unit test imported vLLM (about 7 s): import it where only a vLLM process "
                    "runs, or move the test to tests/engine", pytrace=False)
