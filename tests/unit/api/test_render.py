"""`kuberl render` output for every example validates against KubeRay v1.7.0's RayJob CRD schema and
the Kubernetes OpenAPI schemas, and carries the security and placement properties the design asks."""

from __future__ import annotations

import copy
import functools
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kuberl.api.validate import validate_manifest
from kuberl.cli import SUBCOMMANDS
from kuberl.cli import main as kuberl_main
from kuberl.job import plan as plans
from kuberl.job.render import render, render_manifest
from tests.harness.harness import kuberay_crds
from tests.unit.api.bad_manifests import minimal_manifest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
K8S_VERSION = "1.35.0"


def _load(text: str) -> Any:
    return yaml.load(text, Loader=plans.YAML_LOADER)


def _crd_schema(name: str) -> dict[str, Any]:
    crd = next(c for c in kuberay_crds() if c["metadata"]["name"] == name)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


@functools.cache
def _crd_validator(name: str) -> jsonschema.Draft7Validator:
    """One validator per CRD, its schema checked once (KubeRay's schemas are about 1 MB each)."""
    schema = _crd_schema(name)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would reject under kubectl's strict field validation."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                out += _unknown_fields(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _unknown_fields(sub, extra, f"{path}.{key}")
            elif props is not None:
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


@functools.cache
def _rendered_once(example: Path) -> list[dict[str, Any]]:
    return render_manifest(_load(example.read_text()))


def _rendered(example: Path) -> list[dict[str, Any]]:
    """The example's objects: rendered once per example for the whole file, a fresh copy each call."""
    return copy.deepcopy(_rendered_once(example))


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def _ray_resources(group: dict[str, Any]) -> dict[str, int]:
    """The custom resources a worker group's `ray start` gets, after bash has parsed the command
    line KubeRay builds from rayStartParams (`ray start --resources=<value>`)."""
    flag, = shlex.split(f"--resources={group['rayStartParams']['resources']}")
    return json.loads(flag.removeprefix("--resources="))


def _pods(ray_job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = ray_job["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return pods


def test_there_are_the_three_documented_examples():
    assert {p.name for p in EXAMPLES} >= {"grpo-tiny-cpu.yaml", "grpo-qwen3-moe.yaml", "grpo-colocated.yaml"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_ray_job_validates_against_kuberay_crd(example):
    ray_job = _by_kind(_rendered(example))["RayJob"]
    schema = _crd_schema("rayjobs.ray.io")
    _crd_validator("rayjobs.ray.io").validate(ray_job)
    assert _unknown_fields(ray_job, schema) == []
    cluster_schema = _crd_schema("rayclusters.ray.io")["properties"]["spec"]
    assert _unknown_fields(ray_job["spec"]["rayClusterSpec"], cluster_schema) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_core_objects_validate_against_kubernetes_openapi(example):
    for obj in _rendered(example):
        if obj["kind"] != "RayJob":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The pod templates inside the RayJob are core PodTemplateSpecs.
    for name, pod in _pods(_by_kind(_rendered(example))["RayJob"]).items():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                    "template": {"spec": pod}}
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_cli_render_prints_the_same_objects(example, capsys):
    assert kuberl_main(["render", "-f", str(example)]) == 0
    printed = list(yaml.load_all(capsys.readouterr().out, Loader=plans.YAML_LOADER))
    assert printed == _rendered(example)


def test_cli_render_reports_the_field_and_exits_non_zero(tmp_path, capsys):
    bad = minimal_manifest()
    bad["spec"]["rollout"] = {"gpusPerReplica": 3, "tensorParallelSize": 2}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert kuberl_main(["render", "-f", str(path)]) == 1
    err = capsys.readouterr().err
    assert "spec.rollout.tensorParallelSize" in err and "must divide" in err


def test_workload_identity_may_only_patch_its_own_status_and_read_its_own_job():
    objs = _by_kind(render_manifest(minimal_manifest("job-a")))
    assert objs["Role"]["rules"] == [{
        "apiGroups": ["kuberl.dev"], "resources": ["rltrainingjobs/status"],
        "resourceNames": ["job-a"], "verbs": ["patch"],
    }, {
        "apiGroups": ["kuberl.dev"], "resources": ["rltrainingjobs"],
        "resourceNames": ["job-a"], "verbs": ["get"],
    }]
    assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "job-a-workload",
                                               "namespace": "default"}]
    for pod in _pods(objs["RayJob"]).values():
        assert pod["serviceAccountName"] == "job-a-workload"


def test_owner_references_when_the_job_has_a_uid():
    manifest = minimal_manifest("owned")
    manifest["metadata"].update(uid="0b5e1c52-6f2a-4d8e-9d55-1f1f0e2b9d11", namespace="team-a")
    for obj in render_manifest(manifest):
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["kuberl.dev/job"] == "owned"
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLTrainingJob", "name": "owned",
                       "uid": "0b5e1c52-6f2a-4d8e-9d55-1f1f0e2b9d11", "controller": True,
                       "blockOwnerDeletion": True}
    assert all("ownerReferences" not in o["metadata"] for o in render_manifest(minimal_manifest()))


def test_model_credentials_reach_only_init_containers():
    manifest = _load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    pods = _pods(_by_kind(render_manifest(manifest))["RayJob"])
    for role, pod in pods.items():
        stage = {c["name"]: c for c in pod["initContainers"]}
        assert stage["stage-model"]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        # A failed staging's error reaches status (the operator quotes the termination message).
        assert {c["terminationMessagePolicy"] for c in stage.values()} == {"FallbackToLogsOnError"}
        for container in pod["containers"]:
            secrets = [e["secretRef"]["name"] for e in container.get("envFrom", [])]
            # Checkpoint credentials on the trainers alone: each rank uploads its own shards.
            assert secrets == (["gcs-creds"] if role == "trainer" else []), role


def test_secrets_reach_only_the_containers_that_use_them():
    """Separate Secrets for model, data and checkpoints: each lands only where it is used."""
    manifest = _load((REPO / "examples" / "grpo-qwen3-moe.yaml").read_text())
    manifest["spec"]["model"]["credentials"] = {"name": "model-creds"}
    manifest["spec"]["data"]["credentials"] = {"name": "data-creds"}
    manifest["spec"]["checkpoint"]["credentials"] = {"name": "ckpt-creds"}
    seen = {}
    for role, pod in _pods(_by_kind(render_manifest(manifest))["RayJob"]).items():
        for c in pod["initContainers"] + pod["containers"]:
            seen[(role, c["name"])] = [e["secretRef"]["name"] for e in c.get("envFrom", [])]
    assert seen == {
        ("head", "stage-model"): ["model-creds"], ("head", "stage-data"): ["data-creds"],
        ("head", "check-data"): [], ("head", "ray-head"): [],
        ("trainer", "stage-model"): ["model-creds"], ("trainer", "ray-trainer"): ["ckpt-creds"],
        ("rollout", "stage-model"): ["model-creds"], ("rollout", "ray-rollout"): [],
    }


def test_gpu_requests_groups_and_guaranteed_qos_for_numa():
    manifest = _load((REPO / "examples" / "grpo-qwen3-moe.yaml").read_text())
    ray_job = _by_kind(render_manifest(manifest))["RayJob"]
    groups = {g["groupName"]: g for g in ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert set(groups) == {"trainer", "rollout"}
    assert groups["trainer"]["replicas"] == 2
    assert _ray_resources(groups["rollout"]) == {"kuberl_rollout": 4}
    for group in groups.values():
        (container,) = group["template"]["spec"]["containers"]
        res = container["resources"]
        assert res["limits"]["nvidia.com/gpu"] == 8
        assert res["requests"] == res["limits"], "Guaranteed QoS needs requests == limits"


def test_head_and_trainer_pods_get_the_preemption_notice_hook_within_their_grace_period():
    """A deletion, drain or spot notice runs `kuberl preemption-notice` on the head and trainer pods
    (the driver checkpoints the step in flight), held at most the grace period less Ray's stop;
    the head's says it is the head (the driver begins no step after its commit), and each writes
    what it did to its container's log (the kubelet keeps a hook's output only when it fails);
    rollout pods have none (a lost engine costs no step)."""
    manifest = _load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())
    manifest["spec"].setdefault("scheduling", {})["terminationGracePeriodSeconds"] = 300
    pods = _pods(_by_kind(render_manifest(manifest))["RayJob"])
    for role in ("head", "trainer"):
        (container,) = pods[role]["containers"]
        assert pods[role]["terminationGracePeriodSeconds"] == 300
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command == ["kuberl", "preemption-notice", "--wait-seconds", "295", "--log", "/proc/1/fd/1",
                           *(["--head"] if role == "head" else [])]
        assert command[1] in SUBCOMMANDS  # a command the image's kuberl knows
        # Once the hook lets the pod go, Ray stops its processes at once instead of draining the
        # node for 30 s while the ranks run steps past the committed checkpoint.
        assert {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "0"} in container["env"]
    (rollout,) = pods["rollout"]["containers"]
    assert "lifecycle" not in rollout and "terminationGracePeriodSeconds" not in pods["rollout"]
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" not in {e["name"] for e in rollout["env"]}
    default = _pods(_by_kind(render_manifest(_load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())))
                    ["RayJob"])
    assert default["trainer"]["terminationGracePeriodSeconds"] == 120


def test_colocated_job_has_no_rollout_group():
    manifest = _load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    ray_job = _by_kind(render_manifest(manifest))["RayJob"]
    (group,) = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["groupName"] == "trainer"
    assert _ray_resources(group) == {"kuberl_trainer": 8, "kuberl_rollout": 8}


def test_checkpoints_are_never_staged_ranks_restore_from_the_uri():
    manifest = _load((REPO / "examples" / "grpo-qwen3-moe.yaml").read_text())
    for pod in _pods(_by_kind(render_manifest(manifest))["RayJob"]).values():
        assert {c["name"] for c in pod["initContainers"]} <= {"stage-model", "stage-data", "check-data"}
        assert not any("checkpoint" in m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"])


@pytest.mark.parametrize("resume,attempt,expected", [
    ("auto", 0, plans.Resume(newest_under="s3://my-checkpoints/grpo-qwen3-moe")),
    ("never", 0, plans.Resume()),
    ("never", 1, plans.Resume(newest_under="s3://my-checkpoints/grpo-qwen3-moe")),
    ("s3://old/run/step-000000100", 0, plans.Resume(explicit="s3://old/run/step-000000100")),
    ("s3://old/run/step-000000100", 2, plans.Resume(newest_under="s3://my-checkpoints/grpo-qwen3-moe",
                                                    explicit="s3://old/run/step-000000100")),
])
def test_what_an_attempt_restores_comes_from_the_spec(resume, attempt, expected):
    manifest = _load((REPO / "examples" / "grpo-qwen3-moe.yaml").read_text())
    manifest["spec"]["checkpoint"]["resume"] = resume
    objs = _by_kind(render_manifest(manifest, attempt=attempt))
    assert objs["RayJob"]["metadata"]["name"] == ("grpo-qwen3-moe" if attempt == 0 else f"grpo-qwen3-moe-r{attempt}")
    config = _load(objs["ConfigMap"]["data"]["job.yaml"])
    assert config["metadata"]["annotations"] == {"kuberl.dev/attempt": str(attempt)}
    plan = plans.read(objs["ConfigMap"]["data"]["plan.yaml"])
    assert plan.attempt == attempt and plan.resume == expected


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_config_map_holds_the_run_plan_the_ray_job_was_rendered_from(example):
    objs = _by_kind(_rendered(example))
    plan = plans.read(objs["ConfigMap"]["data"]["plan.yaml"])
    assert plan == plans.for_cluster(validate_manifest(_load(example.read_text())))
    cluster = objs["RayJob"]["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert 1 + sum(g["replicas"] for g in groups.values()) == plan.layout.expected_pods
    for name, group in groups.items():
        assert _ray_resources(group) == plan.layout.group_resources[name]
    # GPUs: what the trainer ranks and engines ask Ray for is exactly what the pods have.
    trainer_gpus = int(groups["trainer"]["rayStartParams"]["num-gpus"])
    engine_gpus = plan.layout.engines * plan.layout.gpus_per_engine
    assert plan.layout.ranks_per_pod * plan.layout.gpus_per_rank == trainer_gpus
    if plan.layout.colocated:
        assert engine_gpus == 0 and "rollout" not in groups
    else:
        assert engine_gpus == plan.layout.rollout_pods * int(groups["rollout"]["rayStartParams"]["num-gpus"])


def test_a_plan_written_before_the_process_layout_rename_still_reads():
    """A running job's ConfigMap may hold a plan.yaml that names the layout ``topology``: the
    operator reads it for status and restarts, so it must still load, as the same plan."""
    plan = plans.for_cluster(validate_manifest(minimal_manifest()))
    written = _load(plan.dump())
    assert "layout" in written and "topology" not in written
    written["topology"] = written.pop("layout")
    assert plans.read(yaml.safe_dump(written)) == plan


def test_the_plan_carries_the_trainer_mesh_and_an_older_plan_reads_as_plain_fsdp():
    """spec.trainer.parallelism.expert becomes the plan's (dp_shard, ep) mesh, which the ranks build
    as it is; a plan written before the field reads as every rank in one FSDP2 dimension."""
    manifest = minimal_manifest()
    manifest["spec"]["trainer"] = {"replicas": 2, "gpusPerReplica": 4, "parallelism": {"expert": 4}}
    plan = plans.for_cluster(validate_manifest(manifest))
    assert plan.layout.trainer_mesh == plans.TrainerMesh(dp_shard=2, ep=4)
    written = _load(plan.dump())
    del written["layout"]["trainer_mesh"]
    assert plans.read(yaml.safe_dump(written)).layout.trainer_mesh == plans.TrainerMesh(dp_shard=8, ep=1)


def test_the_plan_carries_the_engines_expert_parallel_size():
    """spec.rollout.expertParallel: each engine's experts split over its tensor-parallel GPUs (vLLM's
    EP size is the engine's TP size); the plan says so, and the engine's kwargs follow the plan."""
    from kuberl.rollout.engine import engine_kwargs

    manifest = minimal_manifest()
    manifest["spec"]["rollout"] = {"gpusPerReplica": 8, "tensorParallelSize": 4, "expertParallel": True}
    job = validate_manifest(manifest)
    layout = plans.for_cluster(job).layout
    assert (layout.engines, layout.tensor_parallel_size, layout.engine_expert_parallel) == (2, 4, 4)
    kwargs = engine_kwargs(job.spec, "m", "x", engine_index=0, on_cpu=False,
                           expert_parallel=layout.engine_expert_parallel)
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"]) == (4, True)
    manifest["spec"]["rollout"]["expertParallel"] = False
    job = validate_manifest(manifest)
    assert plans.for_cluster(job).layout.engine_expert_parallel == 1
    assert engine_kwargs(job.spec, "m", "x", engine_index=0, on_cpu=False)["enable_expert_parallel"] is False
    # A plan written before the field reads as no expert parallelism.
    written = _load(plans.for_cluster(job).dump())
    del written["layout"]["engine_expert_parallel"]
    assert plans.read(yaml.safe_dump(written)).layout.engine_expert_parallel == 1


def test_render_parses_each_uri_of_the_spec_once(monkeypatch):
    """The spec's URIs arrive typed (kuberl.api.uri.SpecURI): validating the manifest, then rendering
    every object and the run plan, twice, parses each once, however many containers, mounts and
    plan paths need it."""
    import kuberl.api.uri as uris

    manifest = minimal_manifest()
    manifest["spec"]["model"]["uri"] = "pvc://models/tiny"
    manifest["spec"]["validation"] = {"uri": "s3://datasets/test.jsonl"}
    manifest["spec"]["checkpoint"] = {"uri": "pvc://ckpt/run", "resume": "pvc://ckpt/other/step-000000001"}
    calls = []
    real = uris.parse
    monkeypatch.setattr(uris, "parse", lambda uri, field="uri": calls.append((uri, field)) or real(uri, field))
    job = validate_manifest(manifest)  # checks each URI (uri_errors): the one parse of each
    render(job, attempt=1)
    render(job, attempt=2)
    assert sorted(calls) == sorted([("pvc://models/tiny", "spec.model.uri"),
                                    ("s3://datasets/train.jsonl", "spec.data.uri"),
                                    ("s3://datasets/test.jsonl", "spec.validation.uri"),
                                    ("pvc://ckpt/run", "spec.checkpoint.uri"),
                                    ("pvc://ckpt/other/step-000000001", "spec.checkpoint.resume")])


def test_in_a_ray_job_ranks_and_engines_reserve_their_slot_not_a_cpu():
    """A pod that requests fewer CPUs than it runs processes still starts them all: Kubernetes
    accounts the pod's CPUs, Ray's CPUs there are left to reward workers."""
    manifest = minimal_manifest()
    manifest["spec"]["trainer"] = {"gpusPerReplica": 0, "processesPerReplica": 2, "resources": {"cpu": "1", "memory": "2Gi"}}
    plan = plans.for_cluster(validate_manifest(manifest))
    layout = plan.layout
    assert layout.slot_reservation(layout.trainer_resource) == {"num_cpus": 0, "resources": {layout.trainer_resource: 1}}
    # On a local Ray (kuberl train) no pod advertises slots: a logical CPU each.
    local = plans.local(validate_manifest(manifest), Path("/tmp/work")).layout
    assert local.slot_reservation(local.trainer_resource) == {"num_cpus": 1}
    ray_job = _by_kind(render(validate_manifest(manifest)))["RayJob"]
    trainer, = [g for g in ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"] if g["groupName"] == "trainer"]
    assert _ray_resources(trainer) == {layout.trainer_resource: 2}


def _source_files() -> str:
    files = [*(REPO / "workloads" / "kuberl").rglob("*.py"), *(REPO / "operator").rglob("*.py")]
    renderer = REPO / "workloads" / "kuberl" / "job" / "render.py"  # not cli/render.py: the CLI is a reader too
    return "\n".join(p.read_text() for p in files if p != renderer)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_container_env_var_is_read_by_some_code(example):
    """An environment variable the renderer sets and nothing reads is a promise nobody keeps."""
    source = _source_files()
    for pod in _pods(_by_kind(_rendered(example))["RayJob"]).values():
        for container in pod["initContainers"] + pod["containers"]:
            for var in container.get("env", []):
                assert f'"{var["name"]}"' in source, f"{container['name']} sets {var['name']}, which no code reads"


def test_model_revision_is_taken_by_the_stager_and_never_passed_for_a_staged_path():
    """spec.model.revision used to break every job at trainer start: the trainer passed it along
    with the staged directory, which resolve() refuses."""
    manifest = minimal_manifest("rev")
    manifest["spec"]["model"] = {"uri": "hf://Qwen/Qwen2.5-0.5B", "revision": "v1.1"}
    plan = plans.read(_by_kind(render_manifest(manifest))["ConfigMap"]["data"]["plan.yaml"])
    assert plan.paths.model == "/kuberl/model" and plan.paths.model_revision is None
    local = plans.local(validate_manifest(manifest), Path("/tmp/w"))
    assert local.paths.model == "hf://Qwen/Qwen2.5-0.5B" and local.paths.model_revision == "v1.1"


def test_pvc_checkpoint_root_is_writable_on_trainers_only():
    manifest = minimal_manifest("pvc-ckpt")
    manifest["spec"]["model"]["uri"] = "pvc://shared/models/tiny"
    manifest["spec"]["checkpoint"] = {"uri": "pvc://shared/ckpt"}
    for role, pod in _pods(_by_kind(render_manifest(manifest))["RayJob"]).items():
        (container,) = pod["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "pvc-shared")
        volume = next(v for v in pod["volumes"] if v["name"] == "pvc-shared")
        assert mount["readOnly"] == (role != "trainer")
        assert volume["persistentVolumeClaim"]["readOnly"] == (role != "trainer")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_config_map_holds_the_resolved_job_in_the_same_types(example):
    config_map = _by_kind(_rendered(example))["ConfigMap"]
    config = _load(config_map["data"]["job.yaml"])
    reloaded = validate_manifest(config)
    assert reloaded.spec == validate_manifest(_load(example.read_text())).spec


def test_pvc_and_local_models_are_mounted_not_staged():
    manifest = minimal_manifest("pvc-job")
    manifest["spec"]["model"]["uri"] = "pvc://models/qwen/7b"
    manifest["spec"]["data"]["uri"] = "/opt/data/train.jsonl"
    objs = _by_kind(render_manifest(manifest))
    plan = plans.read(objs["ConfigMap"]["data"]["plan.yaml"])
    assert plan.paths.model == "/mnt/pvc/models/qwen/7b" and plan.paths.data == "/opt/data/train.jsonl"
    for role, pod in _pods(objs["RayJob"]).items():
        assert not any(c["name"] == "stage-model" for c in pod["initContainers"])
        (container,) = pod["containers"]
        assert {"name": "pvc-models", "mountPath": "/mnt/pvc/models", "readOnly": True} in container["volumeMounts"]
        assert {"name": "pvc-models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} \
            in pod["volumes"]


def test_head_stages_the_model_without_weights_and_revision_travels_in_the_uri():
    manifest = minimal_manifest("hf-job")
    manifest["spec"]["model"] = {"uri": "Qwen/Qwen2.5-1.5B-Instruct", "revision": "v1.1"}
    pods = _pods(_by_kind(render_manifest(manifest))["RayJob"])
    head = {c["name"]: c["args"] for c in pods["head"]["initContainers"]}["stage-model"]
    trainer = {c["name"]: c["args"] for c in pods["trainer"]["initContainers"]}["stage-model"]
    assert trainer == ["stage", "--exclude", "*.py", "hf://Qwen/Qwen2.5-1.5B-Instruct@v1.1", "/kuberl/model"]
    assert head[:3] == ["stage", "--exclude", "*.safetensors"] and "*.bin" in head
    assert head[-2:] == ["hf://Qwen/Qwen2.5-1.5B-Instruct@v1.1", "/kuberl/model"]


def test_cpu_limit_none_leaves_the_cpu_limit_off_and_the_memory_limit_on():
    manifest = minimal_manifest()
    manifest["spec"]["head"] = {"resources": {"cpu": "250m", "memory": "3Gi", "cpuLimit": "none"}}
    pods = _pods(_by_kind(render(validate_manifest(manifest)))["RayJob"])
    head = pods["head"]["containers"][0]["resources"]
    assert head == {"requests": {"cpu": "250m", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    trainer = pods["trainer"]["containers"][0]["resources"]
    assert trainer["limits"]["cpu"] == trainer["requests"]["cpu"]  # the default: Guaranteed QoS


def test_a_config_map_reward_source_is_mounted_read_only_in_every_pod_and_the_plan_names_it():
    manifest = minimal_manifest("cm-code")
    manifest["spec"]["reward"] = {"function": "my_rewards:score",
                                  "source": {"configMap": {"name": "rewards", "key": "my_rewards.py"}}}
    objs = _by_kind(render_manifest(manifest))
    plan = plans.read(objs["ConfigMap"]["data"]["plan.yaml"])
    assert (plan.paths.reward_code, plan.paths.agent_code) == ("/kuberl/code/reward", None)
    mount = {"name": "code-reward", "mountPath": "/kuberl/code/reward", "readOnly": True}
    for role, pod in _pods(objs["RayJob"]).items():
        # Reward tasks run wherever Ray has CPUs: every pod has the code, read-only.
        assert mount in pod["containers"][0]["volumeMounts"], role
        # optional: a missing ConfigMap fails check-data naming it, not ContainerCreating forever.
        assert {"name": "code-reward", "configMap": {"name": "rewards", "optional": True}} in pod["volumes"]
        assert not any("code" in c["name"] and c["name"].startswith("stage") for c in pod["initContainers"])
    check = next(c for c in _pods(objs["RayJob"])["head"]["initContainers"] if c["name"] == "check-data")
    assert mount in check["volumeMounts"]


def test_a_uri_source_is_staged_with_its_digest_and_an_agent_source_reaches_the_head_only():
    digest = "ab" * 32
    manifest = minimal_manifest("uri-code")
    manifest["spec"]["data"]["credentials"] = {"name": "data-creds"}
    manifest["spec"]["agent"] = {"environment": "my_envs:Env",
                                 "source": {"uri": "pvc://code/envs.tar", "sha256": digest}}
    objs = _by_kind(render_manifest(manifest))
    plan = plans.read(objs["ConfigMap"]["data"]["plan.yaml"])
    assert (plan.paths.reward_code, plan.paths.agent_code) == (None, "/kuberl/code/agent")
    pods = _pods(objs["RayJob"])
    stager = {c["name"]: c for c in pods["head"]["initContainers"]}["stage-agent-code"]
    # Staged and checked whatever the scheme (a claim too), with the data's credentials, before check-data.
    assert stager["args"] == ["stage", "--sha256", digest, "--field", "spec.agent.source",
                              "pvc://code/envs.tar", "/kuberl/code/agent"]
    assert stager["envFrom"] == [{"secretRef": {"name": "data-creds"}}]
    assert {"name": "pvc-code", "mountPath": "/mnt/pvc/code", "readOnly": True} in stager["volumeMounts"]
    names = [c["name"] for c in pods["head"]["initContainers"]]
    assert names.index("stage-agent-code") < names.index("check-data")
    # The environment runs in the driver, on the head: no other pod fetches it.
    for role in ("trainer", "rollout"):
        assert not any(c["name"] == "stage-agent-code" for c in pods[role]["initContainers"]), role


def test_a_local_plan_carries_a_source_uri_to_fetch_and_no_directory_for_a_config_map(tmp_path):
    manifest = minimal_manifest("local-code")
    manifest["spec"]["reward"] = {"function": "m:f", "source": {"uri": "s3://code/m.py", "sha256": "0" * 64}}
    assert plans.local(validate_manifest(manifest), tmp_path).paths.reward_code == "s3://code/m.py"
    manifest["spec"]["reward"]["source"] = {"configMap": {"name": "rewards"}}
    assert plans.local(validate_manifest(manifest), tmp_path).paths.reward_code is None
    # With spec.agent the reward is not loaded, so its source is neither staged nor carried.
    manifest["spec"]["agent"] = {"environment": "e:Env"}
    assert plans.for_cluster(validate_manifest(manifest)).paths.reward_code is None
