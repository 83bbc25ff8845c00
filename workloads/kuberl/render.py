"""RLTrainingJob -> the Kubernetes objects that run it. Pure: the operator and `kuberl render` call it.

One job becomes:
- a KubeRay ``ray.io/v1`` RayJob whose ``rayClusterSpec`` has a head group (runs the driver), a
  ``trainer`` worker group and, unless colocated, a ``rollout`` worker group;
- a ConfigMap with the resolved job (the same RLTrainingJob type, every default filled in), mounted
  at /etc/kuberl in every Ray container;
- a ServiceAccount, Role and RoleBinding whose only right is ``patch`` on this one job's status,
  so the workload can report progress and nothing else.
- a NetworkPolicy that lets only the job's own pods, KubeRay, the operators and Prometheus reach
  its Ray pods, the head included (``render_network_policy``).

Models, data and checkpoints reach each pod through init containers that run ``kuberl stage`` into a
pod-local volume; credentials Secrets are given to those init containers only (checkpoint
credentials also to the Ray containers, which upload checkpoints).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from kuberl import uri as uris
from kuberl.api import types as t
from kuberl.api.validate import validate_manifest

RAY_VERSION = "2.60.0"
CONFIG_DIR = "/etc/kuberl"
CONFIG_FILE = "job.yaml"
STAGE_DIR = "/kuberl"
PVC_ROOT = "/mnt/pvc"
MODEL_DIR = f"{STAGE_DIR}/model"
DATA_DIR = f"{STAGE_DIR}/data"
CHECKPOINT_DIR = f"{STAGE_DIR}/checkpoint"
METRICS_PORT = 9400
RAY_METRICS_PORT = 8080
RUN_AS_USER = 1000

# Annotations on the rendered job config that tell the driver about this attempt.
ATTEMPT_ANNOTATION = "kuberl.dev/attempt"
RESUME_ANNOTATION = "kuberl.dev/resume-from"

TRAINER_GROUP = "trainer"
ROLLOUT_GROUP = "rollout"


class RenderError(ValueError):
    """The job cannot be turned into Kubernetes objects; the message names the field."""


def labels(job: t.RLTrainingJob, role: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "kuberl",
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/managed-by": "kuberl-operator",
        "kuberl.dev/job": job.metadata.name,
    }
    if role:
        out["kuberl.dev/role"] = role
    return out


def ray_job_name(job: t.RLTrainingJob, attempt: int = 0) -> str:
    """Each restart gets a new RayJob so that the old one can be deleted without waiting for it."""
    return job.metadata.name if attempt == 0 else f"{job.metadata.name}-r{attempt}"


def config_map_name(job: t.RLTrainingJob) -> str:
    return f"{job.metadata.name}-config"


def workload_identity_name(job: t.RLTrainingJob) -> str:
    return f"{job.metadata.name}-workload"


def owner_reference(job: t.RLTrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": t.API_VERSION,
        "kind": t.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: t.RLTrainingJob, name: str, role: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": job.metadata.namespace, "labels": labels(job, role)}
    if job.metadata.uid:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# --- where each input lives inside a pod --------------------------------------------------------


def _local_path(uri: str, staged_dir: str) -> str:
    """The path a container reads ``uri`` from: a staged copy, a mounted PVC, or the path itself."""
    parsed = uris.parse(uri)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme == "pvc":
        return f"{PVC_ROOT}/{parsed.bucket}/{parsed.path}".rstrip("/")
    return staged_dir


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def _model_source(model: t.ModelSpec) -> str:
    """The stager's source: a Hugging Face revision travels in the URI (hf://org/name@revision)."""
    parsed = uris.parse(model.uri, "spec.model.uri")
    if parsed.scheme == "hf" and model.revision and not parsed.revision:
        return f"hf://{parsed.bucket}@{model.revision}"
    return model.uri


def _needs_stage(uri: str) -> bool:
    return uris.parse(uri).scheme in ("s3", "gs", "hf")


def _pvc_claims(job: t.RLTrainingJob, uris_in_pod: list[str]) -> list[str]:
    claims = []
    for u in uris_in_pod:
        parsed = uris.parse(u)
        if parsed.scheme == "pvc" and parsed.bucket not in claims:
            claims.append(parsed.bucket)
    return claims


def resume_source(job: t.RLTrainingJob, resume_from: str | None) -> str | None:
    """The checkpoint this attempt restores: the operator's choice, else what the spec asks."""
    if resume_from:
        return resume_from
    resume = job.spec.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return job.spec.checkpoint.uri
    return resume


# --- containers ------------------------------------------------------------------------------


def _resources(res: t.Resources, gpus: int = 0) -> dict[str, Any]:
    # requests == limits: Guaranteed QoS, which the kubelet's CPU and topology managers need to
    # give GPU pods whole CPUs on the GPU's NUMA node.
    amounts: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _env_from(secret: t.SecretRef | None) -> list[dict[str, Any]]:
    return [{"secretRef": {"name": secret.name}}] if secret else []


def _stage_container(job: t.RLTrainingJob, name: str, src: str, dst: str, secret: t.SecretRef | None,
                     res: t.Resources, extra_args: list[str]) -> dict[str, Any]:
    args = ["stage", *extra_args, src, dst]
    return {
        "name": name,
        "image": job.spec.image,
        "imagePullPolicy": job.spec.image_pull_policy,
        "command": ["kuberl"],
        "args": args,
        "envFrom": _env_from(secret),
        "env": [{"name": "KUBERL_PVC_ROOT", "value": PVC_ROOT}],
        # The init container gets the pod's whole budget: the pod's request is the max of init and
        # main containers, so this costs nothing and speeds up parallel downloads.
        "resources": _resources(res),
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "kuberl-stage", "mountPath": STAGE_DIR}],
    }


def _init_containers(job: t.RLTrainingJob, role: str, res: t.Resources, resume: str | None) -> list[dict[str, Any]]:
    spec = job.spec
    out = []
    if _needs_stage(spec.model.uri):
        # The driver needs the tokenizer and config, not the weights.
        extra = [arg for glob in WEIGHT_FILES for arg in ("--exclude", glob)] if role == "head" else []
        extra += [] if spec.model.trust_remote_code else [a for g in t.REMOTE_CODE_GLOBS for a in ("--exclude", g)]
        out.append(_stage_container(job, "stage-model", _model_source(spec.model), MODEL_DIR,
                                    spec.model.credentials, res, extra))
    if role == "head" and _needs_stage(spec.data.uri):
        out.append(_stage_container(job, "stage-data", spec.data.uri, DATA_DIR, spec.data.credentials, res, []))
    if role != "head" and resume and uris.parse(resume).scheme in ("s3", "gs"):
        # "--checkpoint": SRC is a checkpoint root or one checkpoint; stage the newest complete one,
        # or nothing on a first run.
        out.append(_stage_container(job, "stage-checkpoint", resume, CHECKPOINT_DIR,
                                    spec.checkpoint.credentials, res, ["--checkpoint"]))
    for c in out:
        for m in _pvc_mounts(job, [spec.model.uri, spec.data.uri]):
            c["volumeMounts"].append(m)
    return out


def _pvc_mounts(job: t.RLTrainingJob, uri_list: list[str]) -> list[dict[str, Any]]:
    return [{"name": f"pvc-{claim}", "mountPath": f"{PVC_ROOT}/{claim}", "readOnly": True}
            for claim in _pvc_claims(job, uri_list)]


def _pod_env(job: t.RLTrainingJob, role: str, resume: str | None) -> list[dict[str, Any]]:
    spec = job.spec
    env = [
        {"name": "KUBERL_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "KUBERL_JOB_NAME", "value": job.metadata.name},
        {"name": "KUBERL_NAMESPACE", "value": job.metadata.namespace},
        {"name": "KUBERL_ROLE", "value": role},
        {"name": "KUBERL_MODEL_PATH", "value": _local_path(spec.model.uri, MODEL_DIR)},
        {"name": "KUBERL_NUMA_POLICY", "value": spec.numa.policy},
        {"name": "KUBERL_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "KUBERL_PVC_ROOT", "value": PVC_ROOT},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if role == "head":
        env.append({"name": "KUBERL_DATA_PATH", "value": _local_path(spec.data.uri, DATA_DIR)})
    elif resume:
        env.append({"name": "KUBERL_CHECKPOINT_PATH",
                    "value": CHECKPOINT_DIR if _needs_stage(resume) else _local_path(resume, CHECKPOINT_DIR)})
    return env


def _pod_template(job: t.RLTrainingJob, role: str, res: t.Resources, gpus: int, resume: str | None) -> dict[str, Any]:
    spec = job.spec
    ports = [{"name": "kuberl-metrics", "containerPort": METRICS_PORT},
             {"name": "metrics", "containerPort": RAY_METRICS_PORT}]
    if role == "head":
        ports += [{"name": "gcs-server", "containerPort": 6379},
                  {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}]
    mounts = [
        {"name": "kuberl-stage", "mountPath": STAGE_DIR},
        {"name": "kuberl-config", "mountPath": CONFIG_DIR, "readOnly": True},
        # NCCL and Ray's object store need a large /dev/shm; the container default is 64 MiB.
        {"name": "dshm", "mountPath": "/dev/shm"},
        *_pvc_mounts(job, [spec.model.uri, spec.data.uri, *( [resume] if resume else [])]),
    ]
    container = {
        "name": f"ray-{role}",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "env": _pod_env(job, role, resume),
        "envFrom": _env_from(spec.checkpoint.credentials),
        "ports": ports,
        "resources": _resources(res, gpus),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    claims = _pvc_claims(job, [spec.model.uri, spec.data.uri, *([resume] if resume else [])])
    volumes = [
        {"name": "kuberl-stage", "emptyDir": {}},
        {"name": "kuberl-config", "configMap": {"name": config_map_name(job)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *({"name": f"pvc-{c}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}} for c in claims),
    ]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": workload_identity_name(job),
        "initContainers": _init_containers(job, role, res, resume),
        "containers": [container],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER},
    }
    sched = spec.scheduling
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [tol.model_dump(by_alias=True, exclude_none=True) for tol in sched.tolerations]
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    return {"metadata": {"labels": labels(job, role)}, "spec": pod_spec}


def _cpu_count(quantity: str) -> str:
    """Ray's --num-cpus from a Kubernetes CPU quantity (whole CPUs, at least 1)."""
    if quantity.endswith("m"):
        return str(max(1, int(quantity[:-1]) // 1000))
    return str(max(1, int(float(quantity))))


def _worker_group(job: t.RLTrainingJob, group: str, replicas: int, res: t.Resources, gpus: int,
                  slots: int, resume: str | None) -> dict[str, Any]:
    return {
        "groupName": group,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {
            "num-cpus": _cpu_count(res.cpu),
            "num-gpus": str(gpus),
            # A custom resource per process slot places trainer and engine actors on their own group.
            "resources": json.dumps({f"kuberl_{group}": slots}),
            "metrics-export-port": str(RAY_METRICS_PORT),
        },
        "template": _pod_template(job, group, res, gpus, resume),
    }


def render_ray_job(job: t.RLTrainingJob, *, resume_from: str | None = None, attempt: int = 0) -> dict[str, Any]:
    spec = job.spec
    resume = resume_source(job, resume_from)
    trainer_slots = spec.trainer.gpus_per_replica or spec.trainer.processes_per_replica
    if spec.rollout.colocate:
        # Engines share the trainer's GPUs: one engine slot per tensor-parallel group on each pod.
        trainer_slots_engines = spec.trainer.gpus_per_replica // spec.rollout.tensor_parallel_size
        trainer_group = _worker_group(job, TRAINER_GROUP, spec.trainer.replicas, spec.trainer.resources,
                                      spec.trainer.gpus_per_replica, trainer_slots, resume)
        trainer_group["rayStartParams"]["resources"] = json.dumps(
            {f"kuberl_{TRAINER_GROUP}": trainer_slots, f"kuberl_{ROLLOUT_GROUP}": trainer_slots_engines})
        groups = [trainer_group]
    else:
        engine_slots = max(1, spec.rollout.gpus_per_replica // spec.rollout.tensor_parallel_size)
        groups = [
            _worker_group(job, TRAINER_GROUP, spec.trainer.replicas, spec.trainer.resources,
                          spec.trainer.gpus_per_replica, trainer_slots, resume),
            _worker_group(job, ROLLOUT_GROUP, spec.rollout.replicas, spec.rollout.resources,
                          spec.rollout.gpus_per_replica, engine_slots, None),
        ]
    head = {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            # No actors on the head: it runs the driver only.
            "num-cpus": "0",
            "num-gpus": "0",
            "metrics-export-port": str(RAY_METRICS_PORT),
        },
        "template": _pod_template(job, "head", spec.head.resources, 0, resume),
    }
    metadata = _metadata(job, ray_job_name(job, attempt), "rayjob")
    metadata["annotations"] = {ATTEMPT_ANNOTATION: str(attempt)}
    if spec.scheduling.queue_name:
        metadata["labels"]["kueue.x-k8s.io/queue-name"] = spec.scheduling.queue_name
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata,
        "spec": {
            "entrypoint": f"python -m kuberl.train --config {CONFIG_DIR}/{CONFIG_FILE}",
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            # kuberl restarts from checkpoints itself (spec.backoffLimit), with a fresh RayJob.
            "backoffLimit": 0,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": head,
                "workerGroupSpecs": groups,
            },
        },
    }


def resolved_config(job: t.RLTrainingJob, *, resume_from: str | None = None, attempt: int = 0) -> dict[str, Any]:
    """The job as the driver reads it: the same type, every default filled in, status left out."""
    annotations = {ATTEMPT_ANNOTATION: str(attempt)}
    resume = resume_source(job, resume_from)
    if resume:
        annotations[RESUME_ANNOTATION] = resume
    return {
        "apiVersion": t.API_VERSION,
        "kind": t.KIND,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace, "annotations": annotations},
        "spec": job.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def render_config_map(job: t.RLTrainingJob, *, resume_from: str | None = None, attempt: int = 0) -> dict[str, Any]:
    config = resolved_config(job, resume_from=resume_from, attempt=attempt)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job), "config"),
        "data": {CONFIG_FILE: yaml.safe_dump(config, sort_keys=False)},
    }


def render_workload_identity(job: t.RLTrainingJob) -> list[dict[str, Any]]:
    name = workload_identity_name(job)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(job, name, "workload")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(job, name, "workload"),
            "rules": [{
                "apiGroups": [t.GROUP],
                "resources": [f"{t.PLURAL}/status"],
                "resourceNames": [job.metadata.name],
                "verbs": ["patch"],
            }],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(job, name, "workload"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.metadata.namespace}],
        },
    ]


def render(job: t.RLTrainingJob, *, resume_from: str | None = None, attempt: int = 0) -> list[dict[str, Any]]:
    """Every object for ``job``, in the order to apply them (identity and config before the RayJob)."""
    return [
        *render_workload_identity(job),
        render_config_map(job, resume_from=resume_from, attempt=attempt),
        render_network_policy(job, attempt),
        render_ray_job(job, resume_from=resume_from, attempt=attempt),
    ]


def render_manifest(manifest: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """Validate a manifest as the API server would, then render it."""
    return render(validate_manifest(manifest), **kw)


# --- network access to the Ray head ------------------------------------------------------------

# Namespaces an administrator labelled to say "the Ray-job infrastructure runs here" (KubeRay's
# operator, kuberl's operator, Prometheus). Namespaces are cluster-scoped: a tenant who may create
# pods, and so label them as anything, may not label a namespace.
PEER_NAMESPACE_LABEL = "kuberl.dev/ray-head-peers"
RAY_DASHBOARD_PORT = 8265


def render_network_policy(job: t.RLTrainingJob, attempt: int = 0) -> dict[str, Any]:
    """A NetworkPolicy admitting to this job's Ray pods, the head first of all, only: the job's own
    pods (any port: GCS, raylets, object transfer); KubeRay's submitter pod of the current attempt
    and the operators (KubeRay's polls the job API) to the dashboard / job-submission port, which
    only the head serves; Prometheus to the metrics ports. Whatever reaches a Ray port can run
    code next to the job's Secrets, so nothing else may."""
    trusted = {"matchLabels": {PEER_NAMESPACE_LABEL: "true"}}
    dashboard = [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, f"{job.metadata.name}-ray", "network"),
        "spec": {
            "podSelector": {"matchLabels": {"kuberl.dev/job": job.metadata.name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"kuberl.dev/job": job.metadata.name}}}]},
                {"from": [
                    # KubeRay submits through a Job named after the RayJob; the Job controller labels its pod.
                    {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": ray_job_name(job, attempt)}}},
                    # KubeRay's operator as its Helm chart (kuberay-operator) or kustomize config (kuberay) labels it.
                    {"namespaceSelector": trusted,
                     "podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                                           "values": ["kuberay-operator", "kuberay"]}]}},
                    {"namespaceSelector": trusted,
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberl",
                                                     "app.kubernetes.io/component": "operator"}}},
                 ], "ports": dashboard},
                {"from": [{"namespaceSelector": trusted,
                           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                 "ports": [{"protocol": "TCP", "port": METRICS_PORT}, {"protocol": "TCP", "port": RAY_METRICS_PORT}]},
            ],
        },
    }
