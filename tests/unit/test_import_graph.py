"""The import graph of workloads/kuberl and operator/kuberl_operator, read from the source (ast, no
imports run): folders import only the folders below them, no modules import each other in a
circle, and the package root holds only the package's entry points. Imports inside functions
count as much as those at the top of a module."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (REPO / "workloads", REPO / "operator")

# Which folders each folder may import (besides itself), the process it runs in after '#'.
# A folder missing here fails test_every_folder_has_a_layer: place it before it can be imported.
LAYERS: dict[str, set[str]] = {
    "kuberl.api": set(),                       # every process: the API types, the URI vocabulary, the names all agree on
    "kuberl.numa": set(),                      # trainer ranks and engines, in their pods
    "kuberl.common": {"kuberl.api"},           # vocabulary of more than one process
    "kuberl.storage": {"kuberl.api"},          # stager init containers; every process reading a URI
    "kuberl.sync": {"kuberl.api", "kuberl.common"},  # both ends of the weight sync
    "kuberl.job": {"kuberl.api", "kuberl.common"},   # operator and CLI build it; every process reads the plan
    "kuberl.train": {"kuberl.api", "kuberl.common", "kuberl.storage", "kuberl.numa", "kuberl.job",
                     "kuberl.sync"},           # the trainer rank
    "kuberl.rollout": {"kuberl.api", "kuberl.common", "kuberl.storage", "kuberl.numa", "kuberl.job",
                       "kuberl.sync"},         # engines; their pool and endpoint in the driver
    "kuberl.rollout.agents": {"kuberl.api", "kuberl.common", "kuberl.rollout"},  # episodes, in the driver
    "kuberl.driver": {"kuberl.api", "kuberl.common", "kuberl.storage", "kuberl.job", "kuberl.sync",
                      "kuberl.train", "kuberl.rollout", "kuberl.rollout.agents"},  # the driver process
    "kuberl.cli": {"kuberl.api", "kuberl.common", "kuberl.storage", "kuberl.job", "kuberl.driver",
                   "kuberl.rollout.agents"},   # the kuberl command
    "kuberl_operator": {"kuberl.api", "kuberl.common", "kuberl.job"},  # the operator's pod
}
# The package root: only what starts a process (today none but the package itself).
ROOT_ENTRY_POINTS = {"__init__.py", "__main__.py"}


def modules() -> dict[str, Path]:
    found = {}
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours ``name`` imports; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                         for alias in node.names)
    return {target for target in found if target in known and target != name}


def layer(name: str) -> str | None:
    """The folder of LAYERS ``name`` belongs to: the longest that contains it."""
    matches = [folder for folder in LAYERS if name == folder or name.startswith(folder + ".")]
    return max(matches, key=len, default=None)


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_folder_has_a_layer():
    unplaced = sorted(name for name in GRAPH if name != "kuberl" and layer(name) is None)
    assert not unplaced, f"place these modules' folders in LAYERS (and say which process runs them): {unplaced}"


def test_the_layers_run_one_way():
    graphlib.TopologicalSorter(LAYERS).prepare()  # raises CycleError naming the circle


def test_no_import_runs_upward():
    upward = [f"{source} imports {target}" for source, targets in sorted(GRAPH.items()) for target in sorted(targets)
              if layer(source) and layer(target) and layer(source) != layer(target)
              and layer(target) not in LAYERS[layer(source)]]
    assert not upward, "imports that run against LAYERS:\n" + "\n".join(upward)


def test_no_imports_run_in_a_circle():
    try:
        graphlib.TopologicalSorter(GRAPH).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"modules that import each other in a circle: {' -> '.join(exc.args[1])}")


def test_the_package_root_holds_only_entry_points():
    root = REPO / "workloads" / "kuberl"
    others = sorted(path.name for path in root.glob("*.py") if path.name not in ROOT_ENTRY_POINTS)
    assert not others, f"modules at the package root {root}: move them into the folder of the process that runs them: {others}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The graph reader itself: a function-level ``from`` import of a sibling module is an edge."""
    (tmp_path / "kuberl" / "train").mkdir(parents=True)
    module = tmp_path / "kuberl" / "train" / "worker.py"
    module.write_text("def f():\n    from kuberl.driver import loop\n")
    known = {"kuberl.train.worker": module, "kuberl.driver": tmp_path, "kuberl.driver.loop": tmp_path}
    assert imports("kuberl.train.worker", module, known) == {"kuberl.driver.loop"}
    assert layer("kuberl.driver.loop") not in LAYERS[layer("kuberl.train.worker")]
