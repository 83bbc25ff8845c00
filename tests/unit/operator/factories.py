"""Objects shaped like what the API server and KubeRay return, for the pure-logic tests."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from kuberl.api.types import RLTrainingJobStatus
from kuberl.api.validate import validate_manifest
from kuberl.api.contract import ATTEMPT_ANNOTATION
from kuberl_operator.observed import Observed
from kuberl_operator.status import indexed_pod_status, indexed_ray_job_status

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
UID = "0b7d4c1e-0000-4000-8000-000000000001"


def job(name: str = "tiny", status: dict[str, Any] | None = None, generation: int = 1, **spec: Any):
    manifest = yaml.safe_load((EXAMPLES / "grpo-tiny-cpu.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": "ns", "uid": UID, "generation": generation}
    manifest["spec"].update(spec)
    validated = validate_manifest(manifest)
    if status is not None:
        validated = validated.model_copy(update={"status": RLTrainingJobStatus.model_validate(status)})
    return validated


def ray_job(name: str, attempt: int = 0, deployment: str = "", job_status: str = "", suspend: bool = False,
            **status: Any) -> dict[str, Any]:
    """A RayJob as the operator's RayJob index holds it (``indexed_ray_job_status``)."""
    st = {"jobDeploymentStatus": deployment, "jobStatus": job_status, **status}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": "ns", "annotations": {ATTEMPT_ANNOTATION: str(attempt)},
                         "ownerReferences": [{"uid": UID}]},
            "spec": {"suspend": suspend}, "status": indexed_ray_job_status({k: v for k, v in st.items() if v})}


def pod(name: str, phase: str = "Running", init: list[dict[str, Any]] | None = None,
        conditions: list[dict[str, Any]] | None = None, containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A pod as the operator's pod index holds it (``indexed_pod_status``), not as the API serves it."""
    return {"metadata": {"name": name, "labels": {"ray.io/cluster": "tiny-abc"}},
            "status": indexed_pod_status({"phase": phase, "initContainerStatuses": init or [],
                                          "containerStatuses": containers or [], "conditions": conditions or []})}


def ray_cluster(state: str = "ready") -> dict[str, Any]:
    return {"metadata": {"name": "tiny-abc"}, "status": {"state": state} if state else {}}


def observed(*ray_jobs: dict[str, Any], config_map: dict[str, Any] | None = None, **kw: Any) -> Observed:
    return Observed(ray_jobs={rj["metadata"]["name"]: rj for rj in ray_jobs}, config_map=config_map, **kw)
