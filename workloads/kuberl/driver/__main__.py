"""`python -m kuberl.driver --config job.yaml` (or `kuberl train`): the Ray driver.

The same command runs inside a KubeRay cluster (the RayJob's entrypoint, config and run plan from
the job's ConfigMap, model staged by init containers) and on a laptop (a local Ray and a local
run plan: every process fetches its inputs itself). Without --config it runs the embedded
default: a tiny model and a toy task made locally under ~/.cache/kuberl/.

A local run shows its progress (a bar on a terminal, a line per step elsewhere) and the checkpoint
events, and writes vLLM's, Ray's and its own log lines to <work-dir>/kuberl-train.log; -v shows
them on the console instead. Inside a RayJob (RAY_ADDRESS set) every line goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import yaml

from kuberl.api.types import CodeSource, RLTrainingJob
from kuberl.api.validate import ManifestError, validate_manifest
from kuberl.driver import progress
from kuberl.job import plan as plans

log = logging.getLogger("kuberl.train")
DEFAULT_HOME = Path(os.environ.get("KUBERL_CACHE", Path.home() / ".cache" / "kuberl"))
TINY_VERSION = "tiny-v2"
EMBEDDED_JOB = "embedded-tiny"
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def embedded_job(root: Path) -> RLTrainingJob:
    """A GRPO run on the tiny model and the repeat-letter task, made under ``root`` if missing."""
    from kuberl.driver import tiny

    model, data = root / "model", root / "data" / "repeat_letter.jsonl"
    if not (model / "config.json").exists():
        tiny.make_model(model)
    if not data.exists():
        tiny.make_data(data)
    return validate_manifest({
        "apiVersion": "kuberl.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": EMBEDDED_JOB},
        "spec": {
            "image": "local",
            "model": {"uri": str(model)},
            "data": {"uri": str(data)},
            "reward": {"builtin": "repeat_letter"},
            "algorithm": {"groupSize": 8, "promptsPerStep": 8, "microBatchSize": 16, "totalSteps": 40,
                          "learningRate": 3e-3, "klCoef": 0.0, "weightDecay": 0.0, "seed": 7},
            "trainer": {"gpusPerReplica": 0, "processesPerReplica": 2, "paramDtype": "float32",
                        "gradientCheckpointing": False},
            "rollout": {"gpusPerReplica": 0, "maxPromptLength": 64, "maxResponseLength": 16},
            "checkpoint": {"uri": str(root / "checkpoints"), "intervalSteps": 10, "keep": 2},
            "numa": {"policy": "none"},
        },
    })


def load_job(path: str) -> RLTrainingJob:
    try:
        return validate_manifest(yaml.safe_load(Path(path).read_text()))
    except OSError as exc:
        raise SystemExit(f"kuberl train: cannot read --config {path}: {exc.strerror}") from None
    except (yaml.YAMLError, ManifestError) as exc:
        raise SystemExit(f"kuberl train: {path}: {exc}") from None


def run(job: RLTrainingJob, plan: plans.RunPlan, *, max_steps: int | None = None,
        metrics_file: Path | None = None, display: progress.Display | None = None) -> int:
    """Train ``job``; with a ``display``, show its progress there (a local run's console)."""
    import ray
    from transformers import AutoTokenizer

    from kuberl.common.metrics import start_pod_exporter
    from kuberl.driver.checkpoints import CheckpointManager
    from kuberl.driver.loop import Driver, Preemption
    from kuberl.driver.notices import Notices
    from kuberl.driver.preflight import check_user_code
    from kuberl.driver.report import reporter_from_env, user_errors_reported
    from kuberl.driver.tracking import make_trackers
    from kuberl.rollout.pool import EnginePool
    from kuberl.storage import resolve
    from kuberl.common.reward_values import RewardError
    from kuberl.rollout.agents.environment import AgentError
    from kuberl.sync import make_weight_sync
    from kuberl.train.group import TrainerGroup

    spec = job.spec
    reporter = reporter_from_env() if display is None else progress.ConsoleReporter(display)
    with user_errors_reported(reporter, plan.attempt):
        # The job's own code first: a reward function or environment class that cannot be loaded
        # fails the job here, naming the field, before Ray, engines or trainers take any GPU time.
        # A source's directory in a pod; kuberl train fetches and verifies source.uri itself,
        # into the work dir beside the ranks' scratch.
        code = Path(plan.paths.scratch).parent / "code"
        reward_code = _fetched_code(plan.paths.reward_code, plans.reward_source(spec), code / "reward",
                                    "spec.reward.source", RewardError)
        agent_code = _fetched_code(plan.paths.agent_code, plans.agent_source(spec), code / "agent",
                                   "spec.agent.source", AgentError)
        check_user_code(spec, reward_code, agent_code)
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # inside a RayJob: the cluster kuberl render described
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # A local Ray. CPUs are logical here: every trainer rank and engine needs a slot even
            # on a 2-core laptop, where they take turns.
            # address="local": a new Ray of our own, never one some other program left running.
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, local_slots(plan)), include_dashboard=False,
                     logging_level=logging.WARNING)
    # After ray.init: Ray's core installs a SIGTERM handler that aborts the process; ours replaces it.
    preemption = Preemption()
    preemption.install()
    start_pod_exporter("head")
    with user_errors_reported(reporter, plan.attempt), contextlib.ExitStack() as stack:
        stack.callback(reporter.close)  # last: status shows no activity of a run that is over
        # In a pod these are staged or mounted paths (resolve passes them through); locally URIs.
        model_path = stack.enter_context(resolve(plan.paths.model, revision=plan.paths.model_revision,
                                                 trust_remote_code=spec.model.trust_remote_code))
        data_path = stack.enter_context(resolve(plan.paths.data))
        validation_path = (stack.enter_context(resolve(plan.paths.validation_data))
                           if plan.paths.validation_data else None)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=spec.model.trust_remote_code)
        trainer, engines = start_trainer_and_engines(spec, plan, stack, TrainerGroup, EnginePool)
        weight_sync = make_weight_sync(spec, trainer, engines)
        weight_sync.setup()
        # A going pod's preStop hook (kuberl.cli.notice) waits on this board for a commit.
        notices = Notices(checkpoints=plan.checkpoints.root is not None)

        def committed(uri: str, step: int) -> None:
            reporter.checkpoint(uri, step)
            notices.committed(step)

        checkpoints = CheckpointManager(plan.checkpoints, plan.resume, trainer, on_committed=committed,
                                        on_restored=reporter.resumed)
        trackers = make_trackers(spec.tracking, run_name=spec.tracking.run_name_of(job.metadata.name),
                                 run_id=job.metadata.uid or job.metadata.name,
                                 config=job.model_dump(mode="json", by_alias=True, exclude_none=True)["spec"],
                                 work_dir=Path(plan.paths.scratch))
        driver = Driver(job, plan, trainer=trainer, engines=engines, weight_sync=weight_sync, tokenizer=tokenizer,
                            data_path=data_path, checkpoints=checkpoints, reporter=reporter, preemption=preemption,
                            metrics_file=metrics_file, validation_path=validation_path, trackers=trackers,
                            exporter=lambda step: trainer.export_hugging_face(plan.checkpoints.export_uri_at(step)),
                            notices=notices, reward_code=reward_code, agent_code=agent_code)
        driver.restore()
        if display is not None:
            display.start(driver.step, driver.total_steps,
                          driver.total_steps if max_steps is None else min(driver.total_steps, driver.step + max_steps))
        code, _ = driver.run(max_steps)
        if code == 0 and plan.checkpoints.export_hugging_face and driver.step >= driver.total_steps:
            trainer.export_hugging_face(plan.checkpoints.export_uri)
        return code


def start_trainer_and_engines(spec, plan: plans.RunPlan, stack: contextlib.ExitStack, trainer_group, engine_pool):
    """The trainer group and the engine pool (``kuberl.train.group.TrainerGroup`` and
    ``kuberl.rollout.pool.EnginePool``), started; each one's shutdown is on ``stack`` as soon as
    it exists, so a failure of the other stops it."""
    # The original URI stays the served model name: users and logs see what they asked for.
    served_model_name = str(spec.model.uri)
    if plan.layout.colocated:  # the engines run on the trainer ranks' GPUs: the ranks first
        trainer = trainer_group(spec, plan)
        stack.callback(trainer.shutdown)
        engines = engine_pool(spec, plan, served_model_name=served_model_name, gpu_slots=trainer.gpu_slots)
        stack.callback(engines.shutdown)
        return trainer, engines
    # An engine's start (vLLM's imports, the model, the KV cache, CUDA graphs) is the longest of
    # a run's: the trainer ranks start beside it, not after it.
    engines = engine_pool(spec, plan, served_model_name=served_model_name, wait=False)
    stack.callback(engines.shutdown)
    trainer = trainer_group(spec, plan)
    stack.callback(trainer.shutdown)
    engines.wait_ready()
    return trainer, engines


def _fetched_code(path: str | None, source: CodeSource | None, work: Path, field: str,
                  error: type[Exception]) -> str | None:
    """``kuberl.storage.code.code_dir``, a source that cannot be fetched or does not match its
    digest failing as the job's own code does (``error``, reported to status)."""
    from kuberl.storage import StorageError
    from kuberl.storage.code import code_dir

    try:
        return code_dir(path, source, work, field=field)
    except StorageError as exc:
        raise error(str(exc)) from None


def local_slots(plan: plans.RunPlan) -> int:
    """Ray CPU slots a local run needs: trainer ranks, engines with their own slot, one to spare."""
    layout = plan.layout
    return layout.world_size + (0 if layout.colocated else layout.engines) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kuberl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="RLTrainingJob manifest (default: the embedded tiny job)")
    parser.add_argument("--work-dir", type=Path, help="local scratch (each trainer rank writes its "
                        "checkpoint shards below it before uploading them; default: ~/.cache/kuberl/runs/<job>)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (the run can be resumed)")
    parser.add_argument("--metrics-file", type=Path, help="append one JSON line of metrics per step")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every log line (vLLM's, Ray's, the driver's) on the console instead of the log file")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Inside a RayJob (RAY_ADDRESS set) the logs stay on stdout: KubeRay keeps them as the pod's
    # logs, and the operator and tests/e2e read the "step N/M k=v" lines there.
    mode = progress.console_mode(verbose=args.verbose, in_ray_job=bool(os.environ.get("RAY_ADDRESS")),
                                 is_tty=sys.stdout.isatty())
    job = load_job(args.config) if args.config else None  # the embedded job is made below: its output is logged
    name = job.metadata.name if job else EMBEDDED_JOB
    work_dir = args.work_dir or DEFAULT_HOME / "runs" / name
    if mode == progress.LOGS:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        return _train(args, job, work_dir)
    log_path = work_dir / progress.LOG_FILE
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's copies of its workers' lines: no color codes in a file
    with progress.logs_to_file(log_path) as console:
        display = progress.Display(console, bar=mode == progress.BAR)
        print(f"kuberl train {name}: vLLM, Ray and driver logs go to {log_path} (-v shows them here)",
              file=console, flush=True)
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # to stderr: the log file now
        logging.getLogger().addHandler(progress.ConsoleHandler(display))
        try:
            return _train(args, job, work_dir, display)
        finally:
            display.close()
            # Now, not at exit: what Ray's shutdown prints still goes to the log file.
            ray = sys.modules.get("ray")  # imported by run(), if it got that far
            if ray is not None and ray.is_initialized():
                ray.shutdown()


def _train(args: argparse.Namespace, job: RLTrainingJob | None, work_dir: Path,
           display: progress.Display | None = None) -> int:
    job = job or embedded_job(DEFAULT_HOME / TINY_VERSION)
    plan = plans.load(job, Path(args.config) if args.config else None, work_dir)
    return run(job, plan, max_steps=args.max_steps, metrics_file=args.metrics_file, display=display)


if __name__ == "__main__":
    sys.exit(main())
