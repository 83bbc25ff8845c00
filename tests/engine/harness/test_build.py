"""`python -m tests.harness build`: needs no Go when warm, clear about the Go toolchain.

The old-Go case uses a small `go` script that reports go1.21: an old
toolchain cannot be installed on these machines (no toolchain downloads).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness.build import missing_components
from tests.harness.components import REQUIRED
from tests.harness.harness import REPO_ROOT


def _fake_go(directory, version: str, exit_code: int = 0):
    go = directory / "go"
    go.write_text(f"#!/bin/sh\necho {version}\nexit {exit_code}\n")
    go.chmod(0o755)
    return directory


def _build(env_update: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_update)
    return subprocess.run(
        [sys.executable, "-m", "tests.harness", "build"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(bool(missing_components()), reason="needs the components built (python -m tests.harness build)")
def test_warm_build_never_calls_go(tmp_path):
    # A `go` that fails if called: with every binary present the build must not need Go.
    path = _fake_go(tmp_path, "go must not be called", exit_code=1)
    result = _build({"PATH": f"{path}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert f"built 0 of {len(REQUIRED)} components" in result.stdout  # the optional (Kueue) are built on demand


def test_too_old_go_is_a_clear_error(tmp_path):
    path = _fake_go(tmp_path, "go1.21.0")
    result = _build({"PATH": f"{path}:{os.environ['PATH']}", "KUBERL_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1
    assert "Go 1.21" in result.stderr and "too old" in result.stderr and "need Go >= 1.26" in result.stderr
    assert not (tmp_path / "cache" / "bin").exists() or not any((tmp_path / "cache" / "bin").iterdir())
