"""Triton kernels checked by Triton's interpreter on CPU tensors. ``TRITON_INTERPRET=1`` must be
set before Triton is imported, so each check is a script run by a child interpreter, which spends
about 4 of its 5 s importing torch and Triton. The tier's pytest runs on one core, so
tests/unit/conftest.py starts every collected check when collection ends, on the machine's other
core, and each test waits only for its own child's result (``result``).

A test opts in with ``@pytest.mark.triton_interpreter(SCRIPT)``; the script prints ``ok`` when
every assertion in it held."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
TIMEOUT_S = 600
_children: dict[str, subprocess.Popen] = {}


def start(script: str) -> None:
    """Start ``script`` in a child interpreter under Triton's interpreter, unless it runs already."""
    if script not in _children:
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(WORKLOADS), os.environ.get("PYTHONPATH", "")])}
        _children[script] = subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def start_marked(items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("triton_interpreter")
        if marker is not None:
            start(marker.args[0])


def result(script: str) -> None:
    """Wait for ``script``'s child (started now if collection did not) and fail unless it printed ``ok``."""
    start(script)
    child = _children.pop(script)
    try:
        out, err = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"Triton's interpreter ran the check for over {TIMEOUT_S} s")
    assert child.returncode == 0 and out.strip() == "ok", err[-3000:]


def stop_all() -> None:
    """Kill the children whose tests did not run (deselected, or the session ended early)."""
    for child in _children.values():
        child.kill()
        child.communicate()
    _children.clear()
