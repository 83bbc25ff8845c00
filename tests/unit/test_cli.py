"""The `kuberl` command's subcommands load through pkgutil.resolve_name, the one `module:attr`
loader the package uses (usercode and the storage table use it too)."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

from kuberl.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[2]


def test_every_subcommand_resolves_to_its_main():
    for name, (target, _) in SUBCOMMANDS.items():
        assert callable(pkgutil.resolve_name(target)), name


def test_no_hand_written_module_attr_loader_remains():
    """importlib.import_module + getattr, or splitting "module:attr" by hand, is what
    pkgutil.resolve_name already does (with its errors)."""
    pattern = re.compile(r"importlib\.import_module|\bimport_module\(|rpartition\(\s*[\"']:[\"']|__import__\(")
    offenders = [f"{path.relative_to(REPO)}:{n}"
                 for root in ("workloads/kuberl", "operator/kuberl_operator")
                 for path in sorted((REPO / root).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
