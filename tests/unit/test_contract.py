"""One contract module (kuberl.api.contract) holds the names the renderer, the operator and the pods
agree on: the operator takes them from it, never from the renderer, the renderer keeps no aliases
of them, and the objects it renders carry exactly them."""

from __future__ import annotations

import ast
from pathlib import Path

from kuberl.api import contract as c
from kuberl.job import plan as plans
from kuberl.api.validate import validate_manifest
from kuberl.job.render import render
from tests.unit.api.bad_manifests import minimal_manifest

REPO = Path(__file__).resolve().parents[2]
CONTRACT_NAMES = {name for name in vars(c) if not name.startswith("_") and name != "annotations"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_operator_imports_no_name_from_the_renderer():
    """The operator asks the renderer for objects (``render``) and nothing else; a label, an object
    name or a path it needs comes from kuberl.api.contract, and it writes none of them out itself."""
    from_render, literals = [], []
    for path in sorted((REPO / "operator/kuberl_operator").glob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "kuberl.job.render":
                from_render += [alias.name for alias in node.names]
            elif isinstance(node, ast.Import) and any(a.name == "kuberl.job.render" for a in node.names):
                from_render.append(f"{path.name}: import kuberl.job.render")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "kuberl.dev/" in node.value:
                literals.append(f"{path.name}:{node.lineno}")
    assert set(from_render) <= {"render"}, from_render
    # Docstrings may name a label; code may not spell one.
    docstrings = {f"{path.name}:{node.body[0].lineno}"
                  for path in (REPO / "operator/kuberl_operator").glob("*.py")
                  for node in ast.walk(_tree(path))
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    assert set(literals) <= docstrings, literals


def test_the_renderer_and_the_plan_define_no_contract_name_of_their_own():
    """No re-exported aliases (``STAGE_DIR = plans.STAGE_DIR``), no second definition, no RenderError:
    a manifest's problems are ManifestErrors naming the field."""
    for module in ("workloads/kuberl/job/render.py", "workloads/kuberl/job/plan.py", "workloads/kuberl/api/uri.py"):
        tree = _tree(REPO / module)
        defined = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                   if isinstance(target, ast.Name)}
        defined |= {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & CONTRACT_NAMES, (module, sorted(defined & CONTRACT_NAMES))
        assert "RenderError" not in defined


def test_the_rendered_objects_carry_the_contracts_names():
    manifest = minimal_manifest("named")
    manifest["metadata"]["namespace"] = "team"
    manifest["spec"]["checkpoint"] = {"uri": "pvc://ckpt/named"}
    job = validate_manifest(manifest)
    objects = render(job, attempt=2)
    by_kind = {o["kind"]: o for o in objects}
    assert {o["kind"]: o["metadata"]["name"] for o in objects} == {
        "ServiceAccount": c.workload_identity_name("named"), "Role": c.workload_identity_name("named"),
        "RoleBinding": c.workload_identity_name("named"), "ConfigMap": c.config_map_name("named"),
        "NetworkPolicy": c.network_policy_name("named"), "RayJob": c.ray_job_name("named", 2)}
    assert c.ray_job_name("named", 2) == "named-r2" and c.ray_job_name("named") == "named"
    for obj in objects:
        assert obj["metadata"]["labels"][c.JOB_LABEL] == "named"
        assert c.ROLE_LABEL in obj["metadata"]["labels"]
    ray_job, config_map = by_kind["RayJob"], by_kind["ConfigMap"]
    assert ray_job["metadata"]["annotations"] == {c.ATTEMPT_ANNOTATION: "2"}
    assert set(config_map["data"]) == {c.CONFIG_FILE, c.PLAN_FILE}
    assert c.CONFIG_PATH in ray_job["spec"]["entrypoint"]
    plan = plans.read(config_map["data"][c.PLAN_FILE])
    assert (plan.paths.model, plan.paths.data, plan.paths.scratch) == (c.MODEL_DIR, c.DATA_DIR, c.SCRATCH_DIR)
    cluster = ray_job["spec"]["rayClusterSpec"]
    pods = {c.HEAD_ROLE: cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}
    assert set(pods) == {c.HEAD_ROLE, c.TRAINER_GROUP, c.ROLLOUT_GROUP}
    for role, pod in pods.items():
        assert pod["metadata"]["labels"][c.ROLE_LABEL] == role
        container, = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        # Pods with the preemption-notice hook drain Ray at once on SIGTERM (the hook waited already).
        drain = {c.RAY_DRAIN_ENV: "0"} if role in (c.HEAD_ROLE, c.TRAINER_GROUP) else {}
        assert env == {c.JOB_NAME_ENV: "named", c.NAMESPACE_ENV: "team", c.ROLE_ENV: role,
                       c.METRICS_PORT_ENV: str(c.METRICS_PORT), c.PVC_ROOT_ENV: c.PVC_ROOT, **drain}
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {c.CONFIG_DIR, c.STAGE_DIR} <= mounts
        assert (f"{c.PVC_ROOT}/ckpt" in mounts) == (role == c.TRAINER_GROUP)
        assert pod["spec"]["serviceAccountName"] == c.workload_identity_name("named")
    assert pods[c.TRAINER_GROUP]["spec"]["containers"][0]["ports"][0]["containerPort"] == c.METRICS_PORT
