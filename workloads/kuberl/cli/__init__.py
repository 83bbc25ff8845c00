"""`kuberl` command line: one entry point, subcommands imported only when used (the stager image
must not import torch to copy files)."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "render": ("kuberl.cli.render", "print the Kubernetes objects for an RLTrainingJob manifest"),
    "crd": ("kuberl.api.crd", "print the RLTrainingJob CustomResourceDefinition"),
    "stage": ("kuberl.cli.stage", "copy a model, data set or checkpoint to a local directory"),
    "train": ("kuberl.driver.__main__", "run training (the Ray driver)"),
    "check-data": ("kuberl.cli.check_data", "check a staged data file against the job's spec.data"),
}


def usage() -> str:
    lines = ["usage: kuberl <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"kuberl: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:])
