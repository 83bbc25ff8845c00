"""``kuberl check-data --config JOB PATH``: load a staged data file exactly as the driver will.

Run right after the data is staged (in the init container), so a bad file fails before the Ray
cluster starts, with a message naming the file, the row and the field. Exit status 0 when every
row is usable, 1 otherwise (the message says why), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from kuberl.api.validate import ManifestError, validate_manifest
from kuberl.common.reward_values import RewardError
from kuberl.driver.data import DataError, load_for_spec
from kuberl.driver.preflight import check_user_code
from kuberl.job import plan as plans
from kuberl.rollout.agents.environment import AgentError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kuberl check-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the RLTrainingJob manifest (its spec.data fields)")
    parser.add_argument("path", help="the staged data file or directory")
    parser.add_argument("--validation", action="store_true",
                        help="PATH is spec.validation's file (same field names, other messages)")
    args = parser.parse_args(argv)
    try:
        job = validate_manifest(yaml.safe_load(Path(args.config).read_text()))
    except (OSError, yaml.YAMLError, ManifestError) as exc:
        print(f"kuberl check-data: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    if not args.validation:
        # The head pod's first container with the worker image: the code the job names is loaded
        # here too, so a missing module fails before Ray, engines or trainers start.
        try:
            paths = plans.load(job, Path(args.config), Path.cwd()).paths
            check_user_code(job.spec, paths.reward_code, paths.agent_code)
        except (RewardError, AgentError) as exc:
            print(f"kuberl check-data: {exc}", file=sys.stderr)
            return 1
    section = "spec.validation" if args.validation else "spec.data"
    # The loader's warnings (rows without an answer, ...) are part of the report.
    logging.basicConfig(level=logging.WARNING, format="kuberl check-data: warning: %(message)s", stream=sys.stderr)
    try:
        prompts = load_for_spec(args.path, job.spec, spec_field=section)
    except DataError as exc:
        print(f"kuberl check-data: {exc}", file=sys.stderr)
        return 1
    print(f"{args.path}: {len(prompts)} prompts usable for {section}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
