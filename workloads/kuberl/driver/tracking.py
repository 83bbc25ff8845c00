"""Experiment tracking (``spec.tracking``): every step's metrics to W&B, MLflow and/or
TensorBoard, through the library each tool ships; Prometheus (``kuberl.common.metrics``) is always on.

Each library is imported only when its tracker is configured, so a job without ``spec.tracking``
needs none of them (they come with the ``tracking`` extra). Offline modes need no server:
W&B ``mode: offline`` writes the run under its directory (``wandb sync`` uploads it later), an
MLflow ``trackingUri`` of ``file:/path`` is a local store, TensorBoard writes event files.
Credentials (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``...) come from the Secret the spec
names, which kuberl gives to the head pod's environment only; the libraries read them there.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping, Protocol

from kuberl.api.types import MlflowSpec, TensorboardSpec, TrackingSpec, WandbSpec

log = logging.getLogger("kuberl.train")


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Numbers only; a skipped step's NaN gradient norm is left out rather than plotted as a gap."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class WandbTracker:
    def __init__(self, spec: WandbSpec, run_name: str, run_id: str, config: dict[str, Any], work_dir: Path):
        import wandb

        directory = Path(spec.directory) if spec.directory else work_dir
        directory.mkdir(parents=True, exist_ok=True)
        # The id is the job's: a driver restarted from a checkpoint continues the same W&B run.
        self.run = wandb.init(project=spec.project, entity=spec.entity, group=spec.group, name=run_name,
                              id=run_id, resume="allow", mode=spec.mode, dir=str(directory), config=config)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, spec: MlflowSpec, run_name: str, config: dict[str, Any]):
        import mlflow

        self.mlflow = mlflow
        if spec.tracking_uri.startswith("file:"):
            # mlflow-skinny has no SQL store: its file store is the offline mode, which MLflow 3
            # keeps behind an explicit opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(spec.tracking_uri)
        mlflow.set_experiment(spec.experiment or run_name)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params(_flatten(config))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # MLflow metric names may hold "/" but not "@".
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in _finite(metrics).items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class TensorboardTracker:
    def __init__(self, spec: TensorboardSpec, run_name: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(Path(spec.log_dir) / run_name))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in _finite(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class Trackers:
    """Every configured tracker; a tracker that fails to log is reported once per call and never
    stops training (the metrics also go to Prometheus and the log)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            try:
                tracker.log(step, metrics)
            except Exception as exc:  # a tracking outage must not end a training run
                log.warning("%s: could not log step %d: %s", type(tracker).__name__, step, exc)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("%s: could not close: %s", type(tracker).__name__, exc)


class TrackingError(RuntimeError):
    """A configured tracker cannot start; the message names the spec field and the fix."""


def make_trackers(spec: TrackingSpec, *, run_name: str, run_id: str, config: dict[str, Any],
                  work_dir: Path) -> Trackers:
    """The trackers ``spec`` names, started now: a missing library or a bad setting fails the job
    at start, not after hours of training."""
    trackers: list[Tracker] = []
    builders = (("wandb", spec.wandb, lambda s: WandbTracker(s, run_name, run_id, config, work_dir / "wandb")),
                ("mlflow", spec.mlflow, lambda s: MlflowTracker(s, run_name, config)),
                ("tensorboard", spec.tensorboard, lambda s: TensorboardTracker(s, run_name)))
    for name, sub, build in builders:
        if sub is None:
            continue
        try:
            trackers.append(build(sub))
        except ImportError as exc:
            raise TrackingError(f"spec.tracking.{name}: the {name} library is not installed in the worker "
                                f"image ({exc}); install kuberl[tracking] or remove spec.tracking.{name}") from exc
    return Trackers(trackers)
