"""`kuberl` command line: one entry point, subcommands imported only when used (the stager image
must not import torch to copy files)."""

from __future__ import annotations

import pkgutil
import sys

# command -> (its ``module:function``, for pkgutil.resolve_name; the help line)
SUBCOMMANDS = {
    "render": ("kuberl.cli.render:main", "print the Kubernetes objects for an RLTrainingJob manifest"),
    "crd": ("kuberl.api.crd:main", "print the RLTrainingJob CustomResourceDefinition"),
    "stage": ("kuberl.cli.stage:main", "copy a model, data set or checkpoint to a local directory"),
    "train": ("kuberl.driver.__main__:main", "run training (the Ray driver)"),
    "check-data": ("kuberl.cli.check_data:main", "check a staged data file against the job's spec.data"),
    "preemption-notice": ("kuberl.cli.notice:main", "a pod's preStop hook: have the driver checkpoint, then go"),
}


def usage() -> str:
    lines = ["usage: kuberl <command> [args]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"kuberl: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return pkgutil.resolve_name(SUBCOMMANDS[argv[0]][0])(argv[1:])
