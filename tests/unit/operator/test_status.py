"""compute_status: phases and conditions a person can act on, from observed objects only."""

from __future__ import annotations

from datetime import timedelta

from kuberl.job import plan as plans
from kuberl_operator.status import compute_status, status_changed
from tests.unit.operator.factories import NOW, job, pod, ray_cluster, ray_job


def status_of(j, *args, **kw):
    """compute_status with the job's own run plan, as the operator reads it from the ConfigMap."""
    return compute_status(j, plans.for_cluster(j, kw.get("attempt", 0)), *args, **kw)


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_no_rayjob_yet_is_pending():
    status = status_of(job(), None, None, [], NOW)
    assert status["phase"] == "Pending"
    assert status["rayJobName"] == "tiny" and status["restarts"] == 0 and status["observedGeneration"] == 1
    assert conditions(status)["ClusterReady"]["status"] == "False"
    assert "progress" not in status and "lastCheckpoint" not in status


def test_failed_init_container_names_the_container_and_the_cause():
    failing = pod("tiny-abc-trainer-x", phase="Pending", init=[{
        "name": "stage-model",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                     "message": "s3://bucket/x: NoSuchBucket"}}}])
    status = status_of(job(), ray_job("tiny", deployment="Initializing"), ray_cluster(""), [failing], NOW)
    staged = conditions(status)["Staged"]
    assert status["phase"] == "Staging"
    assert staged["status"] == "False" and staged["reason"] == "StageFailed"
    assert "init container stage-model failed" in staged["message"]
    assert "s3://bucket/x: NoSuchBucket" in staged["message"]


def test_running_rayjob_with_ready_cluster_is_running():
    pods = [pod("h"), pod("t"), pod("r")]
    rj = ray_job("tiny", deployment="Running", jobId="tiny-xyz", rayClusterName="tiny-abc",
                 dashboardURL="tiny-abc-head-svc.ns.svc.cluster.local:8265", startTime="2026-01-01T11:59:00Z")
    status = status_of(job(), rj, ray_cluster("ready"), pods, NOW)
    cond = conditions(status)
    assert status["phase"] == "Running"
    assert cond["Running"]["status"] == cond["ClusterReady"]["status"] == cond["Staged"]["status"] == "True"
    assert status["rayClusterName"] == "tiny-abc"
    assert status["dashboardURL"] == "http://tiny-abc-head-svc.ns.svc.cluster.local:8265"
    assert status["startTime"] == "2026-01-01T11:59:00Z"


def test_unschedulable_pod_is_reported():
    stuck = pod("tiny-abc-trainer-x", phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    status = status_of(job(), ray_job("tiny", deployment="Initializing"), ray_cluster(""), [stuck], NOW)
    assert "Insufficient nvidia.com/gpu" in conditions(status)["ClusterReady"]["message"]


def test_failed_without_restarts_left_is_failed_with_kuberay_reason():
    rj = ray_job("tiny-r3", attempt=3, deployment="Failed", job_status="FAILED", reason="AppFailed",
                 message="exit code 1", endTime="2026-01-01T11:58:00Z")
    status = status_of(job(backoffLimit=3), rj, None, [], NOW, attempt=3)
    failed = conditions(status)["Failed"]
    assert status["phase"] == "Failed" and failed["status"] == "True"
    assert failed["reason"] == "BackoffLimitExceeded" and "AppFailed: exit code 1" in failed["message"]
    assert status["completionTime"] == "2026-01-01T11:58:00Z"


def test_waiting_for_restart_says_when():
    rj = ray_job("tiny", deployment="Failed", reason="AppFailed")
    status = status_of(job(), rj, None, [], NOW, restart_in=7.2)
    assert status["phase"] == "Starting"
    running = conditions(status)["Running"]
    assert running["reason"] == "Restarting" and "restart 1 of 3" in running["message"] and "in 7 s" in running["message"]


def test_suspend_reports_suspending_then_suspended():
    suspending = status_of(job(suspend=True), ray_job("tiny", deployment="Suspending", suspend=True), None, [], NOW)
    assert suspending["phase"] == "Suspended"
    assert conditions(suspending)["Suspended"]["reason"] == "Suspending"
    suspended = status_of(job(suspend=True), ray_job("tiny", deployment="Suspended", suspend=True), None, [], NOW)
    assert conditions(suspended)["Suspended"]["reason"] == "Suspended"


def test_succeeded_is_final_and_kept():
    rj = ray_job("tiny", deployment="Complete", job_status="SUCCEEDED", endTime="2026-01-01T11:00:00Z")
    done = status_of(job(), rj, None, [], NOW)
    assert done["phase"] == "Succeeded" and conditions(done)["Succeeded"]["status"] == "True"
    # Later observations (the RayJob deleted, say) do not change a finished job.
    again = status_of(job(status=done), None, None, [], NOW + timedelta(hours=1))
    assert again["phase"] == "Succeeded" and again["completionTime"] == done["completionTime"]


def test_transition_time_moves_only_when_status_changes():
    first = status_of(job(), None, None, [], NOW)
    later = NOW + timedelta(minutes=5)
    same = status_of(job(status=first), None, None, [], later)
    assert conditions(same)["ClusterReady"]["lastTransitionTime"] == conditions(first)["ClusterReady"]["lastTransitionTime"]
    assert not status_changed(first, same)
    running = status_of(job(status=first), ray_job("tiny", deployment="Running", rayClusterName="tiny-abc"),
                             ray_cluster("ready"), [pod("h")], later)
    assert conditions(running)["ClusterReady"]["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_workload_fields_are_never_written():
    workload = {"progress": {"step": 7, "totalSteps": 20, "reward": 0.5},
                "lastCheckpoint": {"uri": "s3://b/ckpt/step-5", "step": 5, "time": "2026-01-01T11:50:00Z"}}
    status = status_of(job(status=workload), ray_job("tiny", deployment="Running"), ray_cluster(), [pod("h")], NOW)
    assert "progress" not in status and "lastCheckpoint" not in status
    assert conditions(status)["Checkpointed"]["status"] == "True"
    assert "step 5 at s3://b/ckpt/step-5" in conditions(status)["Checkpointed"]["message"]


def test_expected_pods_come_from_the_run_plan():
    colocated = job(rollout={"colocate": True, "gpusPerReplica": 0}, trainer={"replicas": 2, "gpusPerReplica": 2},
                    weightSync={"method": "nccl"})
    status = status_of(colocated, ray_job("tiny", deployment="Initializing"), ray_cluster(""), [], NOW)
    assert "0/3 pods running" in status["message"]  # head + 2 trainer pods, no rollout pods


def test_a_container_kubelet_cannot_start_names_the_secret_or_image():
    no_secret = pod("tiny-abc-head-x", phase="Pending", init=[{
        "name": "stage-model",
        "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s3" not found'}}}])
    status = status_of(job(), ray_job("tiny", deployment="Initializing"), ray_cluster(""), [no_secret], NOW)
    cond = conditions(status)
    assert status["phase"] == "Starting"
    assert status["message"] == ('container stage-model in pod tiny-abc-head-x cannot start: '
                                 'CreateContainerConfigError: secret "s3" not found')
    assert cond["ClusterReady"]["reason"] == "ContainerConfigError" and cond["ClusterReady"]["message"] == status["message"]
    assert cond["Staged"]["status"] == "False"

    no_image = pod("tiny-abc-trainer-x", phase="Pending", containers=[{
        "name": "ray-trainer", "state": {"waiting": {
            "reason": "ErrImageNeverPull",
            "message": 'Container image "ghcr.io/kuberl/worker-cpu:nope" is not present with pull policy of Never'}}}])
    status = status_of(job(), ray_job("tiny", deployment="Initializing"), ray_cluster(""), [no_image], NOW)
    assert conditions(status)["ClusterReady"]["reason"] == "ImageUnavailable"
    assert 'ghcr.io/kuberl/worker-cpu:nope" is not present' in status["message"]


def test_a_failed_ray_jobs_20000_characters_of_log_become_one_line_and_its_last_error():
    """KubeRay quotes the driver's log in status.message; the operator repeats only what failed."""
    from kuberl_operator.observed import FAILURE_REASON_CHARS, failure_reason

    log = ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
           + "    work.wait()\n" * 2000
           + "RuntimeError: [pair.cc:553] Connection closed by peer [10.244.0.18]:50072. 🏖️\n"
           + "\x1b[36m(RolloutEngine pid=116)\x1b[0m Traceback (most recent call last):\n"
           + "\x1b[36m(RolloutEngine pid=116)\x1b[0m ValueError: ignored in __del__\n")
    reason = failure_reason(ray_job("tiny", deployment="Failed", job_status="FAILED", message=log))
    assert reason == ("FAILED: Job entrypoint command failed with exit code 1; last error: RuntimeError: "
                      "[pair.cc:553] Connection closed by peer [10.244.0.18]:50072. 🏖️")
    assert len(failure_reason(ray_job("t", job_status="FAILED", message="x" * 5000))) <= FAILURE_REASON_CHARS + 8


def test_the_pod_index_keeps_a_waiting_containers_reason_and_drops_the_rest():
    """The index once dropped every main container's status, so a secret or image that only the
    ray container needs never reached the job's condition."""
    from kuberl_operator.status import indexed_pod_status

    served = {"phase": "Pending", "hostIP": "10.0.0.1", "containerStatuses": [
        {"name": "ray-worker", "image": "kuberl/worker:x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}},
        {"name": "sidecar", "ready": True, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}
    assert indexed_pod_status(served) == {"phase": "Pending", "containerStatuses": [
        {"name": "ray-worker",
         "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}}]}
