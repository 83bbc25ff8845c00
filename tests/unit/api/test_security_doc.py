"""docs/security.md's credential matrix and per-job Role, read from the doc's own tables, against
what `kuberl render` produces for a job that names every Secret."""

from __future__ import annotations

import re
from pathlib import Path

from kuberl.job.render import render_manifest
from tests.unit.api.bad_manifests import minimal_manifest

DOC = Path(__file__).resolve().parents[3] / "docs" / "security.md"
# Every spec field that names a Secret; the rendered Secret is named after its field.
SECRET_FIELDS = ("spec.model.credentials", "spec.data.credentials", "spec.checkpoint.credentials",
                 "spec.tracking.wandb.credentials", "spec.tracking.mlflow.credentials")


def _secret(field: str) -> dict[str, str]:
    return {"name": field.replace(".", "-")}


def every_secret_job() -> dict:
    job = minimal_manifest("every-secret")
    spec = job["spec"]
    spec["model"]["credentials"] = _secret("spec.model.credentials")
    spec["data"]["credentials"] = _secret("spec.data.credentials")
    spec["validation"] = {"uri": "s3://datasets/validation.jsonl"}
    spec["checkpoint"] = {"uri": "s3://checkpoints/run", "credentials": _secret("spec.checkpoint.credentials")}
    spec["tracking"] = {
        "wandb": {"project": "p", "credentials": _secret("spec.tracking.wandb.credentials")},
        "mlflow": {"trackingUri": "https://mlflow.example", "credentials": _secret("spec.tracking.mlflow.credentials")},
    }
    spec["rollout"] = {"gpusPerReplica": 1}  # engines in a group of their own, as the doc's table has them
    # Code from URIs, not the image: the reward's reaches every pod, the environment's the head.
    # (An agent's rewards replace spec.reward, so the two come from two jobs' worth of fields.)
    spec["reward"] = {"function": "my_rewards:score", "source": {"uri": "s3://code/r.py", "sha256": "0" * 64}}
    return job


def every_secret_agent_job() -> dict:
    job = every_secret_job()
    job["spec"]["agent"] = {"environment": "my_envs:Env", "source": {"uri": "s3://code/e.tar", "sha256": "0" * 64}}
    return job


def _table(heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table under ``heading`` in docs/security.md."""
    text = DOC.read_text()
    section = text[text.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            if not re.fullmatch(r"\|[-| ]+\|", line):  # not the header's underline
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[1:]  # the header row


def _pods(objects: list[dict]) -> dict[str, dict]:
    ray_job = next(o for o in objects if o["kind"] == "RayJob")
    cluster = ray_job["spec"]["rayClusterSpec"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: group["template"]["spec"] for name, group in groups.items()}


def test_the_docs_credential_matrix_is_what_render_produces():
    documented = {}
    for container, groups, secrets in _table("### Which container gets which Secret"):
        name = re.match(r"`([\w-]+)`", container).group(1)
        for group in (g.strip() for g in groups.split(",")):
            documented[(group, name)] = set(re.findall(r"`(spec\.[\w.]+)`", secrets))

    rendered = {}
    pods = [*_pods(render_manifest(every_secret_job())).items(), *_pods(render_manifest(every_secret_agent_job())).items()]
    for group, pod in pods:
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert not any("valueFrom" in e for e in container.get("env", [])), container["name"]
            assert not any(m["name"].startswith("secret") for m in container.get("volumeMounts", []))
            rendered[(group, container["name"])] = {e["secretRef"]["name"].replace("-", ".")
                                                    for e in container.get("envFrom", [])}
        assert not any("secret" in v for v in pod["volumes"]), group
    assert documented == rendered
    assert {s for secrets in rendered.values() for s in secrets} == set(SECRET_FIELDS)


def test_the_docs_per_job_role_is_what_render_produces():
    job = every_secret_job()
    objects = render_manifest(job)
    role = next(o for o in objects if o["kind"] == "Role")
    rendered = {(rule["resources"][0], verb) for rule in role["rules"] for verb in rule["verbs"]}
    assert all(rule["resourceNames"] == [job["metadata"]["name"]] and rule["apiGroups"] == ["kuberl.dev"]
               and len(rule["resources"]) == 1 for rule in role["rules"])
    documented = {(re.match(r"`(.+)`", resource).group(1), verb)
                  for resource, verbs, _why in _table("### The per-job identity")
                  for verb in re.findall(r"`(\w+)`", verbs)}
    assert documented == rendered
    # Every Ray pod runs as that identity, its token mounted in every container.
    for group, pod in _pods(objects).items():
        assert pod["serviceAccountName"] == role["metadata"]["name"], group
        assert pod.get("automountServiceAccountToken") is not False, group
