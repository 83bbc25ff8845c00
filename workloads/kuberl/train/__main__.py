"""`python -m kuberl.train --config job.yaml` (or `kuberl train`): the Ray driver.

The same command runs inside a KubeRay cluster (the RayJob's entrypoint, config from the job's
ConfigMap, model staged by init containers) and on a laptop (a local Ray). Without --config it
runs the embedded default: a tiny model and a toy task made locally under ~/.cache/kuberl/.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import yaml

from kuberl.api.types import RLTrainingJob
from kuberl.api.validate import ManifestError, validate_manifest
from kuberl.render import RESUME_ANNOTATION

log = logging.getLogger("kuberl.train")
DEFAULT_HOME = Path(os.environ.get("KUBERL_CACHE", Path.home() / ".cache" / "kuberl"))
TINY_VERSION = "tiny-v2"


def embedded_job(root: Path) -> RLTrainingJob:
    """A GRPO run on the tiny model and the repeat-letter task, made under ``root`` if missing."""
    from kuberl import tiny

    model, data = root / "model", root / "data" / "repeat_letter.jsonl"
    if not (model / "config.json").exists():
        tiny.make_model(model)
    if not data.exists():
        tiny.make_data(data)
    return validate_manifest({
        "apiVersion": "kuberl.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "embedded-tiny"},
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


@contextlib.contextmanager
def local_input(env_var: str, uri: str, **resolve_kw):
    """Inside a kuberl pod the init containers already staged the input (its path is in
    ``env_var``); elsewhere fetch it here, into a temp dir removed afterwards."""
    staged = os.environ.get(env_var)
    if staged and Path(staged).exists():
        yield staged
        return
    from kuberl.storage import resolve

    with resolve(uri, **resolve_kw) as path:
        yield str(path)


def run(job: RLTrainingJob, work_dir: Path, *, max_steps: int | None = None, resume_from: str | None = None,
        metrics_file: Path | None = None) -> int:
    import ray
    from transformers import AutoTokenizer

    from kuberl.metrics import start_pod_exporter
    from kuberl.rollout.pool import EnginePool
    from kuberl.sync import make_weight_sync
    from kuberl.train.checkpoint import CheckpointManager
    from kuberl.train.driver import GRPODriver, Preemption
    from kuberl.train.export import export_hugging_face
    from kuberl.train.group import TrainerGroup
    from kuberl.train.report import reporter_from_env
    from kuberl.train.tracking import make_trackers

    spec = job.spec
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # inside a RayJob: the cluster kuberl render described
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # A local Ray. CPUs are logical here: every trainer rank and engine needs a slot even
            # on a 2-core laptop, where they take turns.
            # address="local": a new Ray of our own, never one some other program left running.
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, local_slots(spec)), include_dashboard=False,
                     logging_level=logging.WARNING)
    # After ray.init: Ray's core installs a SIGTERM handler that aborts the process; ours replaces it.
    preemption = Preemption()
    preemption.install()
    reporter = reporter_from_env()
    start_pod_exporter("head")
    work_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        model_path = stack.enter_context(local_input(
            "KUBERL_MODEL_PATH", spec.model.uri, revision=spec.model.revision,
            trust_remote_code=spec.model.trust_remote_code))
        data_path = stack.enter_context(local_input("KUBERL_DATA_PATH", spec.data.uri))
        validation_path = (stack.enter_context(local_input("KUBERL_VALIDATION_DATA_PATH", spec.validation.uri))
                           if spec.validation is not None else None)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=spec.model.trust_remote_code)
        trainer = TrainerGroup(spec, model_path)
        stack.callback(trainer.shutdown)
        # The original URI stays the served model name: users and logs see what they asked for.
        engines = EnginePool(spec, model_path, served_model_name=spec.model.uri)
        stack.callback(engines.shutdown)
        weight_sync = make_weight_sync(spec, trainer, engines)
        weight_sync.setup()
        checkpoints = CheckpointManager(spec.checkpoint, work_dir / "checkpoints", on_committed=reporter.checkpoint)
        trackers = make_trackers(spec.tracking, run_name=job.metadata.name,
                                 run_id=job.metadata.uid or job.metadata.name,
                                 config=job.model_dump(mode="json", by_alias=True, exclude_none=True)["spec"],
                                 work_dir=work_dir)

        def export_at(step: int) -> None:
            export_hugging_face(trainer, model_path, spec, work_dir / f"hf-step-{step}", name=f"hf-step-{step}")

        driver = GRPODriver(job, trainer=trainer, engines=engines, weight_sync=weight_sync, tokenizer=tokenizer,
                            data_path=data_path, checkpoints=checkpoints, reporter=reporter, preemption=preemption,
                            metrics_file=metrics_file, validation_path=validation_path, trackers=trackers,
                            exporter=export_at)
        driver.restore(resume_from or job.metadata.annotations.get(RESUME_ANNOTATION))
        code, _ = driver.run(max_steps)
        if code == 0 and spec.checkpoint.export_hugging_face and driver.step >= driver.total_steps:
            export_hugging_face(trainer, model_path, spec, work_dir / "hf-export")
        return code


def local_slots(spec) -> int:
    """Ray CPU slots a local run needs: trainer ranks, engines, and one to spare."""
    trainer = spec.trainer.replicas * (spec.trainer.gpus_per_replica or spec.trainer.processes_per_replica)
    engines = 0 if spec.rollout.colocate else spec.rollout.replicas * max(
        1, spec.rollout.gpus_per_replica // spec.rollout.tensor_parallel_size)
    return trainer + engines + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kuberl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="RLTrainingJob manifest (default: the embedded tiny job)")
    parser.add_argument("--work-dir", type=Path, help="local scratch for checkpoints before upload "
                        "(default: ~/.cache/kuberl/runs/<job>)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (the run can be resumed)")
    parser.add_argument("--resume-from", help="checkpoint URI to restore (default: spec.checkpoint.resume)")
    parser.add_argument("--metrics-file", type=Path, help="append one JSON line of metrics per step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    job = load_job(args.config) if args.config else embedded_job(DEFAULT_HOME / TINY_VERSION)
    work_dir = args.work_dir or DEFAULT_HOME / "runs" / job.metadata.name
    return run(job, work_dir, max_steps=args.max_steps, resume_from=args.resume_from,
               metrics_file=args.metrics_file)


if __name__ == "__main__":
    sys.exit(main())
