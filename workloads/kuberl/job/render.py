"""RLTrainingJob -> the Kubernetes objects that run it. Pure: the operator and `kuberl render` call it.

One job becomes:
- a KubeRay ``ray.io/v1`` RayJob whose ``rayClusterSpec`` has a head group (runs the driver), a
  ``trainer`` worker group and, unless colocated, a ``rollout`` worker group;
- a ConfigMap with the resolved job (the same RLTrainingJob type, every default filled in) and
  the run plan (``kuberl.job.plan``: process layout, in-pod paths, checkpoint targets, resume source),
  mounted at /etc/kuberl in every Ray container;
- a ServiceAccount, Role and RoleBinding whose only right is ``patch`` on this one job's status,
  so the workload can report progress and nothing else.
- a NetworkPolicy that lets only the job's own pods, KubeRay, the operators and Prometheus reach
  its Ray pods, the head included (``render_network_policy``).

Models and data reach each pod through init containers that run ``kuberl stage`` into a
pod-local volume; their credentials Secrets are given to those init containers only. The
checkpoint Secret goes to the trainer containers alone: each trainer rank uploads its own shards
and restores straight from the checkpoint URI.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from kuberl.job import plan as plans
from kuberl.api import types as t
from kuberl.api.validate import ManifestError, pod_errors, validate_manifest
from kuberl.api.contract import (ATTEMPT_ANNOTATION, CONFIG_DIR, CONFIG_FILE, CONFIG_PATH, DATA_DIR, HEAD_ROLE,
                             JOB_LABEL, JOB_NAME_ENV, METRICS_PORT, METRICS_PORT_ENV, MODEL_DIR, NAMESPACE_ENV,
                             NOTICE_COMMAND, NOTICE_LOG, NOTICE_STOP_MARGIN_SECONDS, RAY_DRAIN_ENV,
                             PEER_NAMESPACE_LABEL, PLAN_FILE, PVC_ROOT, PVC_ROOT_ENV, RAY_DASHBOARD_PORT,
                             RAY_METRICS_PORT, REWARD_CODE_DIR, AGENT_CODE_DIR, ROLE_ENV, ROLLOUT_GROUP, RUN_AS_USER, STAGE_DIR, TRAINER_GROUP,
                             VALIDATION_DATA_DIR, config_map_name, labels, network_policy_name, ray_job_name,
                             workload_identity_name)
from kuberl.api.uri import SpecURI

RAY_VERSION = "2.60.0"


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
    meta: dict[str, Any] = {"name": name, "namespace": job.metadata.namespace,
                            "labels": labels(job.metadata.name, role)}
    if job.metadata.uid:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# --- where each input lives inside a pod --------------------------------------------------------


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def _model_source(model: t.ModelSpec) -> str:
    """The stager's source: a Hugging Face revision travels in the URI (hf://org/name@revision)."""
    parsed = model.uri.parsed
    if parsed.info.hub and model.revision and not parsed.revision:
        return parsed.with_revision(model.revision)
    return model.uri


def _needs_stage(uri: SpecURI) -> bool:
    return uri.parsed.info.staged


def _pvc_claims(uris_in_pod: list[SpecURI]) -> list[str]:
    claims = []
    for uri in uris_in_pod:
        parsed = uri.parsed
        if parsed.info.mounted and parsed.bucket not in claims:
            claims.append(parsed.bucket)
    return claims


def _code_sources(job: t.RLTrainingJob, role: str) -> list[tuple[str, t.CodeSource, str]]:
    """(name, source, in-pod directory) of each code source a pod of ``role`` loads: the reward
    function in every pod (its Ray tasks run wherever CPUs are free, the driver checks it on the
    head), the environment on the head, where the driver runs the episodes."""
    out = []
    if (source := plans.reward_source(job.spec)) is not None:
        out.append(("reward", source, REWARD_CODE_DIR))
    if role in (HEAD_ROLE, "stager") and (source := plans.agent_source(job.spec)) is not None:
        out.append(("agent", source, AGENT_CODE_DIR))
    return out


def _code_mounts(job: t.RLTrainingJob, role: str) -> list[dict[str, Any]]:
    """ConfigMap sources, read-only at their directory (URI sources are in the stage volume)."""
    return [{"name": f"code-{name}", "mountPath": path, "readOnly": True}
            for name, source, path in _code_sources(job, role) if source.config_map is not None]


def _code_volumes(job: t.RLTrainingJob, role: str) -> list[dict[str, Any]]:
    # optional: a missing ConfigMap (or key) must not hold the pod in ContainerCreating forever; the
    # empty directory fails the head's check-data instead, naming the ConfigMap and the key.
    return [{"name": f"code-{name}", "configMap": {"name": source.config_map.name, "optional": True}}
            for name, source, _ in _code_sources(job, role) if source.config_map is not None]


# --- containers ------------------------------------------------------------------------------


def _resources(res: t.Resources, gpus: int = 0) -> dict[str, Any]:
    # requests == limits by default: Guaranteed QoS, which the kubelet's CPU and topology managers
    # need to give GPU pods whole CPUs on the GPU's NUMA node.
    amounts: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    limits = {k: v for k, v in amounts.items() if not (k == "cpu" and res.cpu_limit == "none")}
    return {"requests": dict(amounts), "limits": limits}


def _security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _env_from(secret: t.SecretRef | None) -> list[dict[str, Any]]:
    return [{"secretRef": {"name": secret.name}}] if secret else []


def _tracking_env_from(tracking: t.TrackingSpec) -> list[dict[str, Any]]:
    """The trackers' Secrets (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN...): for the head only, where
    the driver logs; no other container needs them."""
    secrets = [sub.credentials for sub in (tracking.wandb, tracking.mlflow) if sub is not None and sub.credentials]
    return [entry for secret in secrets for entry in _env_from(secret)]


# A failed init container's last log lines become its termination message, which the operator
# quotes in status: the error the stager or the data check printed, not just "Error".
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"


def _check_data_container(job: t.RLTrainingJob, name: str, path: str, res: t.Resources,
                          validation: bool) -> dict[str, Any]:
    """Loads the staged data as the driver will: a bad row fails here, before Ray starts."""
    return {
        "name": name,
        "image": job.spec.image,
        "imagePullPolicy": job.spec.image_pull_policy,
        "command": ["kuberl"],
        "args": ["check-data", "--config", CONFIG_PATH, *(["--validation"] if validation else []),
                 path],
        "resources": _resources(res),
        "securityContext": _security_context(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "volumeMounts": [{"name": "kuberl-stage", "mountPath": STAGE_DIR},
                         {"name": "kuberl-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         *_code_mounts(job, HEAD_ROLE)],
    }


def _stage_container(job: t.RLTrainingJob, name: str, src: str, dst: str, secret: t.SecretRef | None,
                     res: t.Resources, extra_args: list[str]) -> dict[str, Any]:
    args = ["stage", *extra_args, str(src), dst]  # a plain str: YAML's safe dumper refuses SpecURI
    return {
        "name": name,
        "image": job.spec.image,
        "imagePullPolicy": job.spec.image_pull_policy,
        "command": ["kuberl"],
        "args": args,
        "envFrom": _env_from(secret),
        "env": [{"name": PVC_ROOT_ENV, "value": PVC_ROOT}],
        # The init container gets the pod's whole budget: the pod's request is the max of init and
        # main containers, so this costs nothing and speeds up parallel downloads.
        "resources": _resources(res),
        "securityContext": _security_context(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "volumeMounts": [{"name": "kuberl-stage", "mountPath": STAGE_DIR}],
    }


def _init_containers(job: t.RLTrainingJob, role: str, res: t.Resources, plan: plans.RunPlan) -> list[dict[str, Any]]:
    spec = job.spec
    out = []
    if _needs_stage(spec.model.uri):
        # The driver needs the tokenizer and config, not the weights.
        extra = [arg for glob in WEIGHT_FILES for arg in ("--exclude", glob)] if role == HEAD_ROLE else []
        extra += [] if spec.model.trust_remote_code else [a for g in t.REMOTE_CODE_GLOBS for a in ("--exclude", g)]
        out.append(_stage_container(job, "stage-model", _model_source(spec.model), MODEL_DIR,
                                    spec.model.credentials, res, extra))
    if role == HEAD_ROLE and _needs_stage(spec.data.uri):
        out.append(_stage_container(job, "stage-data", spec.data.uri, DATA_DIR, spec.data.credentials, res, []))
    if role == HEAD_ROLE and spec.validation is not None and _needs_stage(spec.validation.uri):
        out.append(_stage_container(job, "stage-validation-data", spec.validation.uri, VALIDATION_DATA_DIR,
                                    spec.data.credentials, res, []))
    for name, source, path in _code_sources(job, role):
        if source.uri is not None:  # fetched and checked against its digest whatever the scheme
            out.append(_stage_container(job, f"stage-{name}-code", source.uri, path, spec.data.credentials, res,
                                        ["--sha256", source.sha256, "--field", f"spec.{name}.source"]))
    if role == HEAD_ROLE:
        out.append(_check_data_container(job, "check-data", plan.paths.data, res, False))
        if plan.paths.validation_data is not None:
            out.append(_check_data_container(job, "check-validation-data", plan.paths.validation_data, res, True))
    for c in out:
        for m in _pvc_mounts(_read_claims(job, "stager"), []):
            c["volumeMounts"].append(m)
    return out


def _read_claims(job: t.RLTrainingJob, role: str, plan: plans.RunPlan | None = None) -> list[str]:
    """Claims a container of ``role`` reads: model and data (head, stagers), model (workers),
    and a checkpoint the spec names to resume from (trainers)."""
    spec = job.spec
    read = [spec.model.uri]
    if role in (HEAD_ROLE, "stager"):
        read.append(spec.data.uri)
        if spec.validation is not None:
            read.append(spec.validation.uri)
    if role == "stager":
        read += [source.uri for _, source, _ in _code_sources(job, role) if source.uri is not None]
    if role == TRAINER_GROUP and plan is not None and plan.resume.explicit:
        read.append(spec.checkpoint.resume)  # the plan's explicit resume (kuberl.job.plan.resume), parsed
    return _pvc_claims(read)


def _write_claims(job: t.RLTrainingJob, role: str) -> list[str]:
    """The checkpoint root's claim (the plan's checkpoints.root), written by the trainer ranks only."""
    root = job.spec.checkpoint.uri
    return _pvc_claims([root]) if role == TRAINER_GROUP and root else []


def _pvc_mounts(read: list[str], write: list[str]) -> list[dict[str, Any]]:
    return [{"name": f"pvc-{claim}", "mountPath": f"{PVC_ROOT}/{claim}", "readOnly": claim not in write}
            for claim in dict.fromkeys([*read, *write])]


def _pod_env(job: t.RLTrainingJob, role: str) -> list[dict[str, Any]]:
    # Each is read by kuberl code (tests/unit/api/test_render.py checks): metrics labels and port,
    # the pvc:// mount root. Everything else a process needs is in the run plan.
    return [
        {"name": JOB_NAME_ENV, "value": job.metadata.name},
        {"name": NAMESPACE_ENV, "value": job.metadata.namespace},
        {"name": ROLE_ENV, "value": role},
        {"name": METRICS_PORT_ENV, "value": str(METRICS_PORT)},
        {"name": PVC_ROOT_ENV, "value": PVC_ROOT},
    ]


def _pod_template(job: t.RLTrainingJob, role: str, res: t.Resources, gpus: int, plan: plans.RunPlan) -> dict[str, Any]:
    spec = job.spec
    ports = [{"name": "kuberl-metrics", "containerPort": METRICS_PORT},
             {"name": "metrics", "containerPort": RAY_METRICS_PORT}]
    if role == HEAD_ROLE:
        ports += [{"name": "gcs-server", "containerPort": 6379},
                  {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}]
    mounts = [
        {"name": "kuberl-stage", "mountPath": STAGE_DIR},
        {"name": "kuberl-config", "mountPath": CONFIG_DIR, "readOnly": True},
        # NCCL and Ray's object store need a large /dev/shm; the container default is 64 MiB.
        {"name": "dshm", "mountPath": "/dev/shm"},
        *_pvc_mounts(_read_claims(job, role, plan), _write_claims(job, role)),
        *_code_mounts(job, role),
    ]
    container = {
        "name": f"ray-{role}",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "env": _pod_env(job, role),
        # Only the trainer ranks touch checkpoints (upload, commit, restore); only the driver on
        # the head logs to experiment trackers.
        "envFrom": (_env_from(spec.checkpoint.credentials if role == TRAINER_GROUP else None)
                    + (_tracking_env_from(spec.tracking) if role == HEAD_ROLE else [])),
        "ports": ports,
        "resources": _resources(res, gpus),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    notice = role in (HEAD_ROLE, TRAINER_GROUP)
    if notice:
        container["lifecycle"] = _notice_hook(spec.scheduling.termination_grace_period_seconds, role == HEAD_ROLE)
        container["env"].append({"name": RAY_DRAIN_ENV, "value": "0"})
    writes = _write_claims(job, role)
    claims = dict.fromkeys([*_read_claims(job, "stager"), *_read_claims(job, role, plan), *writes])
    volumes = [
        {"name": "kuberl-stage", "emptyDir": {}},
        {"name": "kuberl-config", "configMap": {"name": config_map_name(job.metadata.name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *({"name": f"pvc-{c}", "persistentVolumeClaim": {"claimName": c, "readOnly": c not in writes}}
          for c in claims),
        *_code_volumes(job, role),
    ]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": workload_identity_name(job.metadata.name),
        "initContainers": _init_containers(job, role, res, plan),
        "containers": [container],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER},
    }
    sched = spec.scheduling
    if notice:
        pod_spec["terminationGracePeriodSeconds"] = sched.termination_grace_period_seconds
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [tol.model_dump(by_alias=True, exclude_none=True) for tol in sched.tolerations]
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    return {"metadata": {"labels": labels(job.metadata.name, role)}, "spec": pod_spec}


def _notice_hook(grace_seconds: int, head: bool) -> dict[str, Any]:
    """The preStop hook of the head and trainer pods (``kuberl.cli.notice``): the driver checkpoints
    the step in flight and the hook holds the pod, within its grace period, until that checkpoint
    is committed; the head's says it is the head (the driver then begins no next step). Rollout
    pods have none: a lost engine costs no step (its prompts go to the others), so a checkpoint
    would only slow the run."""
    wait = grace_seconds - NOTICE_STOP_MARGIN_SECONDS
    return {"preStop": {"exec": {"command": [*NOTICE_COMMAND, "--wait-seconds", str(wait), "--log", NOTICE_LOG,
                                             *(["--head"] if head else [])]}}}


def ray_start_resources(resources: dict[str, int]) -> str:
    """rayStartParams.resources as KubeRay wants it: it pastes each value into a bash command line
    (`ray start --resources=<value>`), so the JSON goes in single quotes, as KubeRay's own code
    writes it. Bare JSON would reach Ray split at its spaces and stripped of its double quotes."""
    return f"'{json.dumps(resources)}'"


# The suffixes of a Kubernetes quantity (t.QUANTITY_PATTERN) and what they multiply by.
QUANTITY_SUFFIXES = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                     "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _cpu_count(quantity: str) -> str:
    """Ray's --num-cpus from a Kubernetes CPU quantity (whole CPUs, at least 1): any quantity the
    schema accepts (500m, 2, 1.5, .5, 1k)."""
    number = quantity.rstrip("kMGTPEim")
    return str(max(1, int(float(number) * QUANTITY_SUFFIXES[quantity[len(number):]])))


def _worker_group(job: t.RLTrainingJob, group: str, replicas: int, res: t.Resources, gpus: int,
                  plan: plans.RunPlan) -> dict[str, Any]:
    return {
        "groupName": group,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {
            "num-cpus": _cpu_count(res.cpu),
            "num-gpus": str(gpus),
            # A custom resource per process slot places trainer and engine actors on their own
            # group (colocated: engine slots on the trainer pods); counts from the run plan.
            "resources": ray_start_resources(plan.layout.group_resources[group]),
            "metrics-export-port": str(RAY_METRICS_PORT),
        },
        "template": _pod_template(job, group, res, gpus, plan),
    }


def render_ray_job(job: t.RLTrainingJob, *, attempt: int = 0, plan: plans.RunPlan | None = None) -> dict[str, Any]:
    spec = job.spec
    plan = plan or plans.for_cluster(job, attempt)
    layout = plan.layout
    groups = [_worker_group(job, TRAINER_GROUP, layout.trainer_pods, spec.trainer.resources,
                            spec.trainer.gpus_per_replica, plan)]
    if layout.rollout_pods:
        groups.append(_worker_group(job, ROLLOUT_GROUP, layout.rollout_pods, spec.rollout.resources,
                                    spec.rollout.gpus_per_replica, plan))
    head = {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            # No actors on the head: it runs the driver only.
            "num-cpus": "0",
            "num-gpus": "0",
            "metrics-export-port": str(RAY_METRICS_PORT),
        },
        "template": _pod_template(job, HEAD_ROLE, spec.head.resources, 0, plan),
    }
    metadata = _metadata(job, ray_job_name(job.metadata.name, attempt), "rayjob")
    metadata["annotations"] = {ATTEMPT_ANNOTATION: str(attempt)}
    if spec.scheduling.queue_name:
        metadata["labels"]["kueue.x-k8s.io/queue-name"] = spec.scheduling.queue_name
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata,
        "spec": {
            "entrypoint": f"python -m kuberl.driver --config {CONFIG_PATH}",
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


def resolved_config(job: t.RLTrainingJob, *, attempt: int = 0) -> dict[str, Any]:
    """The job as the driver reads it: the same type, every default filled in, status left out."""
    annotations = {ATTEMPT_ANNOTATION: str(attempt)}
    return {
        "apiVersion": t.API_VERSION,
        "kind": t.KIND,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace, "annotations": annotations},
        "spec": job.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def render_config_map(job: t.RLTrainingJob, *, attempt: int = 0, plan: plans.RunPlan | None = None) -> dict[str, Any]:
    config = resolved_config(job, attempt=attempt)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job.metadata.name), "config"),
        "data": {CONFIG_FILE: yaml.dump(config, Dumper=plans.YAML_DUMPER, sort_keys=False),
                 PLAN_FILE: (plan or plans.for_cluster(job, attempt)).dump()},
    }


def render_workload_identity(job: t.RLTrainingJob) -> list[dict[str, Any]]:
    name = workload_identity_name(job.metadata.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(job, name, "workload")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(job, name, "workload"),
            # The driver reports progress to its own job's status, and reads its own job's
            # spec.suspend to checkpoint before a suspend; nothing else, no other job.
            "rules": [{
                "apiGroups": [t.GROUP],
                "resources": [f"{t.PLURAL}/status"],
                "resourceNames": [job.metadata.name],
                "verbs": ["patch"],
            }, {
                "apiGroups": [t.GROUP],
                "resources": [t.PLURAL],
                "resourceNames": [job.metadata.name],
                "verbs": ["get"],
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


def render(job: t.RLTrainingJob, *, attempt: int = 0, plan: plans.RunPlan | None = None) -> list[dict[str, Any]]:
    """Every object for ``job``, in the order to apply them (identity and config before the RayJob).
    What an attempt restores comes from the spec alone (``kuberl.job.plan.resume``). ``plan``:
    ``plans.for_cluster(job, attempt)`` when the caller has built it already; built here once
    otherwise, for the ConfigMap and the RayJob alike."""
    errors = pod_errors(job)
    if errors:
        raise ManifestError(errors)
    if plan is None:
        plan = plans.for_cluster(job, attempt)
    elif plan.attempt != attempt:
        raise ValueError(f"the run plan is attempt {plan.attempt}'s, not attempt {attempt}'s")
    return [
        *render_workload_identity(job),
        render_config_map(job, attempt=attempt, plan=plan),
        render_network_policy(job, attempt),
        render_ray_job(job, attempt=attempt, plan=plan),
    ]


def render_manifest(manifest: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """Validate a manifest as the API server would, then render it."""
    return render(validate_manifest(manifest), **kw)


# --- network access to the Ray head ------------------------------------------------------------


def render_network_policy(job: t.RLTrainingJob, attempt: int = 0) -> dict[str, Any]:
    """A NetworkPolicy admitting to this job's Ray pods, the head first of all, only: the job's own
    pods (any port: GCS, raylets, object transfer); KubeRay's submitter pod of the current attempt
    and the operators (KubeRay's polls the job API) to the dashboard / job-submission port, which
    only the head serves; Prometheus to the metrics ports. Whatever reaches a Ray port can run
    code next to the job's Secrets, so nothing else may."""
    # Namespaces are cluster-scoped: a tenant who may create pods, and so label them as anything,
    # may not label a namespace (PEER_NAMESPACE_LABEL).
    trusted = {"matchLabels": {PEER_NAMESPACE_LABEL: "true"}}
    dashboard = [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, network_policy_name(job.metadata.name), "network"),
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: job.metadata.name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {JOB_LABEL: job.metadata.name}}}]},
                {"from": [
                    # KubeRay submits through a Job named after the RayJob; the Job controller labels its pod.
                    {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": ray_job_name(job.metadata.name, attempt)}}},
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
