"""next_action: restarts with backoff and resume, suspend, refused spec changes, TTL, idempotence."""

from __future__ import annotations

from datetime import timedelta

import yaml

from kuberl.job import plan as plans
from kuberl.api.contract import ATTEMPT_ANNOTATION, CONFIG_FILE, PLAN_FILE
from kuberl.job.render import render
from kuberl_operator.reconcile import Settings, backoff_seconds, current_attempt, desired_objects, next_action
from tests.unit.operator.factories import NOW, job, observed, pod, ray_cluster, ray_job

SETTINGS = Settings(restart_backoff_seconds=10, restart_backoff_max_seconds=60)
CHECKPOINT = {"lastCheckpoint": {"uri": "s3://bucket/ckpt/step-10", "step": 10, "time": "2026-01-01T11:50:00Z"}}
ROOT = "s3://bucket/ckpt"


def config_map_of(j):
    return render(j)[3]


def test_new_job_creates_identity_config_and_rayjob_in_order():
    plan = next_action(job(), observed(), NOW, SETTINGS)
    assert [o["kind"] for o in plan.apply] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "RayJob"]
    assert plan.apply[-1]["metadata"]["name"] == "tiny"
    assert plan.status["phase"] == "Pending" and not plan.delete_ray_jobs
    # Same observation, same plan: running it twice creates the same names, nothing more.
    assert next_action(job(), observed(), NOW, SETTINGS).apply == plan.apply


def test_a_reconcile_builds_the_run_plan_once(monkeypatch):
    """Creating an attempt renders its ConfigMap and RayJob and computes its status from one plan."""
    built = []
    for_cluster = plans.for_cluster
    monkeypatch.setattr(plans, "for_cluster", lambda *a, **kw: built.append(a) or for_cluster(*a, **kw))
    plan = next_action(job(), observed(), NOW, SETTINGS)
    assert len(built) == 1
    assert plans.read(plan.apply[3]["data"][PLAN_FILE]) == for_cluster(job(), 0)


def test_existing_rayjob_is_adopted_not_recreated():
    plan = next_action(job(), observed(ray_job("tiny", deployment="Running")), NOW, SETTINGS)
    assert plan.apply == [] and plan.delete_ray_jobs == []


def test_failure_waits_for_backoff_then_restarts_from_last_checkpoint():
    failed = ray_job("tiny", deployment="Failed", job_status="FAILED", reason="AppFailed",
                     endTime="2026-01-01T11:59:55Z")
    j = job(status=CHECKPOINT, checkpoint={"uri": ROOT})
    waiting = next_action(j, observed(failed), NOW, SETTINGS)
    assert waiting.apply == [] and waiting.requeue_after == 5.0
    assert waiting.status["phase"] == "Starting"

    plan = next_action(j, observed(failed), NOW + timedelta(seconds=6), SETTINGS)
    assert plan.status["restarts"] == 1
    rayjob = plan.apply[-1]
    assert rayjob["metadata"]["name"] == "tiny-r1" and rayjob["metadata"]["annotations"][ATTEMPT_ANNOTATION] == "1"
    config = yaml.safe_load(plan.apply[3]["data"][CONFIG_FILE])
    assert config["metadata"]["annotations"][ATTEMPT_ANNOTATION] == "1"
    run_plan = plans.read(plan.apply[3]["data"][PLAN_FILE])
    assert run_plan.attempt == 1 and run_plan.resume == plans.Resume(newest_under=ROOT)
    assert plan.delete_ray_jobs == ["tiny"]
    assert any(e.reason == "Restarting" for e in plan.events)


def test_backoff_doubles_and_is_capped():
    assert [backoff_seconds(SETTINGS, n) for n in range(5)] == [10, 20, 40, 60, 60]


def test_no_restart_left_is_failed_and_nothing_is_created():
    failed = ray_job("tiny-r2", attempt=2, deployment="Failed", reason="AppFailed", endTime="2026-01-01T11:00:00Z")
    plan = next_action(job(backoffLimit=2, status={"restarts": 2}), observed(failed), NOW, SETTINGS)
    assert plan.status["phase"] == "Failed" and plan.apply == []
    assert any(e.reason == "Failed" and e.type == "Warning" for e in plan.events)


def test_an_input_error_the_driver_reported_fails_the_job_without_a_restart():
    """A reward function that raises fails again on restart: the job fails at once, naming it."""
    error = {"attempt": 0, "reason": "RewardFunctionFailed", "time": "2026-01-01T11:59:50Z",
             "message": "spec.reward.function failed: TypeError('the JSON object must be str, not list')"}
    failed = ray_job("tiny", deployment="Failed", job_status="FAILED", reason="AppFailed",
                     endTime="2026-01-01T11:59:55Z")
    plan = next_action(job(status={"workloadError": error}), observed(failed), NOW + timedelta(hours=1), SETTINGS)
    assert plan.apply == [] and plan.status["restarts"] == 0
    assert plan.status["phase"] == "Failed"
    cond = {c["type"]: c for c in plan.status["conditions"]}["Failed"]
    assert cond["status"] == "True" and cond["reason"] == "RewardFunctionFailed"
    assert "TypeError('the JSON object must be str, not list')" in cond["message"]
    # An earlier attempt's report says nothing about this attempt: it restarts as usual.
    failed_r1 = ray_job("tiny-r1", attempt=1, deployment="Failed", job_status="FAILED", endTime="2026-01-01T11:00:00Z")
    plan = next_action(job(status={"workloadError": error, "restarts": 1}), observed(failed_r1), NOW, SETTINGS)
    assert plan.status["restarts"] == 2 and plan.apply


def test_stale_status_never_deletes_the_running_attempt():
    # The cached status still says restarts=0 but tiny-r1 exists: the attempt is 1, tiny (0) is stale.
    old = ray_job("tiny", deployment="Failed")
    new = ray_job("tiny-r1", attempt=1, deployment="Running")
    obs = observed(old, new)
    assert current_attempt(job(), obs) == 1
    plan = next_action(job(), obs, NOW, SETTINGS)
    assert plan.delete_ray_jobs == ["tiny"] and plan.apply == [] and plan.status["restarts"] == 1


def test_suspend_and_resume_patch_the_rayjob():
    plan = next_action(job(suspend=True), observed(ray_job("tiny", deployment="Running")), NOW, SETTINGS)
    assert plan.suspend == ("tiny", True)
    plan = next_action(job(), observed(ray_job("tiny", deployment="Suspended", suspend=True)), NOW, SETTINGS)
    assert plan.suspend == ("tiny", False)
    created = next_action(job(suspend=True), observed(), NOW, SETTINGS)
    assert created.apply[-1]["spec"]["suspend"] is True


def test_suspend_waits_for_the_drivers_checkpoint_of_its_last_step_then_takes_the_cluster():
    """KubeRay deletes a suspended RayJob's cluster without stopping the Ray job: the operator
    waits until the driver (which reads spec.suspend after each step) holds with its last step
    checkpointed."""
    running = ray_job("tiny", deployment="Running")
    progress = {"progress": {"step": 13, "totalSteps": 20}}
    held = {"progress": {"step": 13, "totalSteps": 20, "heldForSuspend": True}}
    checkpointed_13 = {"lastCheckpoint": {**CHECKPOINT["lastCheckpoint"], "step": 13}}

    def plan_for(status):
        return next_action(job(suspend=True, checkpoint={"uri": ROOT}, status=status), observed(running), NOW,
                           SETTINGS)

    def waiting_for(plan):
        assert plan.suspend is None and plan.requeue_after == SETTINGS.suspend_poll_seconds
        cond = {c["type"]: c for c in plan.status["conditions"]}["Suspended"]
        assert cond["reason"] == "Checkpointing"
        return cond["message"]

    # The driver holds, its checkpoint of step 13 still uploading.
    assert "checkpoint step 13" in waiting_for(plan_for({**CHECKPOINT, **held}))
    # Step 13 checkpointed (at its interval) but the driver does not hold: the suspend came
    # mid-step, and step 14 is still training. Taking the cluster now would lose it.
    assert "end the step in flight" in waiting_for(plan_for({**checkpointed_13, **progress}))
    # Held, and the checkpoint of step 13 is in: the cluster may go.
    assert plan_for({**checkpointed_13, **held}).suspend == ("tiny", True)
    # No driver answer within the timeout: suspended anyway.
    waited = {**CHECKPOINT, **progress, "conditions": [
        {"type": "Suspended", "status": "True", "reason": "Checkpointing", "message": "",
         "lastTransitionTime": "2026-01-01T11:00:00Z"}]}
    assert plan_for(waited).suspend == ("tiny", True)
    # Nothing to wait for without a checkpoint.uri.
    plan = next_action(job(suspend=True, status={**CHECKPOINT, **progress}), observed(running), NOW, SETTINGS)
    assert plan.suspend == ("tiny", True)


def _workload(active: bool = True, **conditions: tuple[str, str, str]) -> dict:
    """A Kueue Workload as the operator's index keeps it: conditions type -> (status, reason, message)."""
    return {"metadata": {"name": "rayjob-tiny-1a2b3"}, "spec": {"active": active},
            "status": {"conditions": [{"type": k, "status": s, "reason": r, "message": m}
                                      for k, (s, r, m) in conditions.items()]}}


QUEUED = {"QuotaReserved": ("False", "Pending", "couldn't assign flavors to pod set head: insufficient unused quota "
                                                "for nvidia.com/gpu in flavor gpu, 1 more needed")}
ADMITTED = {"QuotaReserved": ("True", "QuotaReserved", "Quota reserved in ClusterQueue team"),
            "Admitted": ("True", "Admitted", "The workload is admitted")}


def test_a_queued_job_is_created_suspended_waits_pending_and_kueue_owns_its_suspend_flag():
    """spec.scheduling.queueName: the RayJob is created suspended; while Kueue holds it the job is
    Pending (not failed) with an Admitted=False condition in Kueue's words, and the operator never
    unsuspends it (Kueue admits by unsuspending); admitted, it runs as any job."""
    queued_job = job(scheduling={"queueName": "team"})
    created = next_action(queued_job, observed(), NOW, SETTINGS)
    assert created.apply[-1]["spec"]["suspend"] is True
    assert created.apply[-1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"

    held = ray_job("tiny", deployment="Suspended", suspend=True)
    plan = next_action(queued_job, observed(held, workload=_workload(**QUEUED)), NOW, SETTINGS)
    assert plan.suspend is None and plan.workload_active is None
    assert plan.status["phase"] == "Pending"
    admitted = {c["type"]: c for c in plan.status["conditions"]}["Admitted"]
    assert admitted["status"] == "False" and admitted["reason"] == "Pending"
    assert "LocalQueue team" in admitted["message"] and "1 more needed" in admitted["message"]
    # Before Kueue made its Workload the condition says what to check.
    none_yet = next_action(queued_job, observed(held), NOW, SETTINGS)
    assert {c["type"]: c for c in none_yet.status["conditions"]}["Admitted"]["reason"] == "NoWorkload"

    running = next_action(queued_job, observed(ray_job("tiny", deployment="Running"), workload=_workload(**ADMITTED)),
                          NOW, SETTINGS)
    assert running.status["phase"] == "Running" and running.suspend is None
    assert {c["type"]: c for c in running.status["conditions"]}["Admitted"]["status"] == "True"


def test_kueue_eviction_is_a_suspension_not_a_failure():
    """Preempted by Kueue: the RayJob is suspended by Kueue (KubeRay deletes the cluster); the job
    is Pending until admitted again, when it resumes from its newest checkpoint; no restart is spent."""
    evicted = _workload(**ADMITTED, Evicted=("True", "Preempted", "Preempted to accommodate a workload (UID: x)"))
    evicted["status"]["conditions"][1]["status"] = "False"
    plan = next_action(job(scheduling={"queueName": "team"}, status=CHECKPOINT),
                       observed(ray_job("tiny", deployment="Suspending", suspend=True), workload=evicted), NOW, SETTINGS)
    assert plan.status["phase"] == "Pending" and plan.suspend is None and plan.apply == []
    admitted = {c["type"]: c for c in plan.status["conditions"]}["Admitted"]
    assert admitted["reason"] == "EvictedPreempted" and "newest checkpoint" in admitted["message"]
    assert plan.status.get("restarts", 0) == 0


def test_suspend_and_resume_of_a_queued_job_go_through_the_workload():
    """Kueue would unsuspend a RayJob whose Workload is admitted: with a queue, spec.suspend
    deactivates the Workload (after the driver's checkpoint, as without a queue) and a resume
    activates it again."""
    held = {"progress": {"step": 13, "totalSteps": 20, "heldForSuspend": True},
            "lastCheckpoint": {**CHECKPOINT["lastCheckpoint"], "step": 13}}
    running = ray_job("tiny", deployment="Running")
    waiting = next_action(job(suspend=True, scheduling={"queueName": "team"}, checkpoint={"uri": ROOT},
                              status={"progress": {"step": 13, "totalSteps": 20}}),
                          observed(running, workload=_workload(**ADMITTED)), NOW, SETTINGS)
    assert waiting.workload_active is None and waiting.suspend is None
    suspend = next_action(job(suspend=True, scheduling={"queueName": "team"}, checkpoint={"uri": ROOT}, status=held),
                          observed(running, workload=_workload(**ADMITTED)), NOW, SETTINGS)
    assert suspend.workload_active == ("rayjob-tiny-1a2b3", False) and suspend.suspend is None
    resume = next_action(job(scheduling={"queueName": "team"}),
                         observed(ray_job("tiny", deployment="Suspended", suspend=True),
                                  workload=_workload(active=False, **QUEUED)), NOW, SETTINGS)
    assert resume.workload_active == ("rayjob-tiny-1a2b3", True) and resume.suspend is None


def test_suspended_failed_job_is_not_restarted():
    failed = ray_job("tiny", deployment="Failed", endTime="2026-01-01T11:00:00Z")
    plan = next_action(job(suspend=True), observed(failed), NOW, SETTINGS)
    assert plan.apply == [] and plan.status["phase"] == "Suspended"


def test_immutable_change_is_refused_and_mutable_ones_apply():
    running = job()
    obs = observed(ray_job("tiny", deployment="Running"), config_map=config_map_of(running))
    changed = job(model={"uri": "s3://other/model"}, backoffLimit=5, ttlSecondsAfterFinished=60)
    plan = next_action(changed, obs, NOW, SETTINGS)
    refused = {c["type"]: c for c in plan.status["conditions"]}["SpecChangeRefused"]
    assert refused["status"] == "True" and "spec.model" in refused["message"]
    assert "backoffLimit" not in refused["message"] and "ttlSecondsAfterFinished" not in refused["message"]
    assert any(e.reason == "SpecChangeRefused" for e in plan.events)
    # A restart renders the spec in effect, not the refused one.
    objects = desired_objects(changed, obs, attempt=1)
    config = yaml.safe_load(objects[3]["data"][CONFIG_FILE])
    assert config["spec"]["model"]["uri"] == running.spec.model.uri
    assert config["spec"]["backoffLimit"] == 5


def test_ttl_deletes_the_job_after_it_finished():
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:59:00Z"}
    early = next_action(job(ttlSecondsAfterFinished=120, status=done), observed(), NOW, SETTINGS)
    assert not early.delete_job and early.requeue_after == 60.0
    late = next_action(job(ttlSecondsAfterFinished=30, status=done), observed(), NOW, SETTINGS)
    assert late.delete_job


def test_a_finished_job_is_still_charged_for_the_pods_kubernetes_has_not_removed_yet():
    """KubeRay deletes the cluster after the job finished: its pods run (and hold GPUs) until then."""
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:59:00Z"}
    usage = {"uid": "u1", "role": "trainer", "gpus": 2.0, "cpus": 1.0, "start": "2026-01-01T11:00:00Z", "end": None,
             "deleting": True}
    plan = next_action(job(status=done), observed(usages=[usage]), NOW, SETTINGS)
    assert plan.status["phase"] == "Succeeded" and plan.status["cost"]["roles"]["trainer"]["gpuSeconds"] == 2 * 3600
    assert "cost" not in next_action(job(status=done), observed(), NOW, SETTINGS).status, "no pod ran: no cost"


def test_status_written_by_the_workload_never_steers_the_restart():
    """status.lastCheckpoint is patched by the job's own ServiceAccount: a restart must not mount,
    stage or restore what it names, and a value nothing can parse must not wedge restarts."""
    failed = ray_job("tiny", deployment="Failed", job_status="FAILED", reason="AppFailed",
                     endTime="2026-01-01T11:00:00Z")
    for uri in ("pvc://someone-elses-claim/secrets", "s3://other-bucket/x/step-000000001", "not a uri at all"):
        hostile = {"lastCheckpoint": {"uri": uri, "step": 1, "time": "2026-01-01T10:00:00Z"}}
        plan = next_action(job(status=hostile, checkpoint={"uri": ROOT}), observed(failed), NOW, SETTINGS)
        assert [o["kind"] for o in plan.apply][-1] == "RayJob", uri
        rendered = yaml.safe_dump(plan.apply)
        assert "someone-elses-claim" not in rendered and "other-bucket" not in rendered and "not a uri" not in rendered
        run_plan = plans.read(plan.apply[3]["data"][PLAN_FILE])
        assert run_plan.resume == plans.Resume(newest_under=ROOT)


def test_rollout_replicas_resize_live_scale_down_deletes_only_pods_without_a_live_engine():
    """spec.rollout.replicas applies to the running attempt: up at once, down once the driver
    names the pods its live engines run in; other rollout pods go (never the head: KubeRay
    deletes any pod named)."""
    running = job()

    def rollout(**fields):
        return {**running.spec.rollout.model_dump(mode="json", by_alias=True, exclude_none=True), **fields}

    cluster = {**ray_cluster(), "spec": {"workerGroupSpecs": [{"groupName": "trainer", "replicas": 1},
                                                             {"groupName": "rollout", "replicas": 1}]}}

    def rollout_pod(name, group="rollout"):
        p = pod(name)
        p["metadata"]["labels"]["kuberl.dev/role"] = group
        return p

    pods = [rollout_pod("tiny-abc-rollout-a"), rollout_pod("tiny-abc-rollout-b"), rollout_pod("tiny-abc-head", "head")]
    obs = observed(ray_job("tiny", deployment="Running"), config_map=config_map_of(running), ray_cluster=cluster,
                   pods=pods)
    up = next_action(job(rollout=rollout(replicas=2)), obs, NOW, SETTINGS)
    name, patch = up.scale_cluster
    assert name == "tiny-abc" and {(p["path"], str(p["value"])) for p in patch} >= {
        ("/spec/workerGroupSpecs/1/replicas", "2"), ("/spec/workerGroupSpecs/1/maxReplicas", "2")}
    assert not any(c["status"] == "True" for c in up.status["conditions"] if c["type"] == "SpecChangeRefused")
    # The spec in effect takes the new replicas (a restart runs with them); its plan too.
    [config] = up.apply
    assert yaml.safe_load(config["data"][CONFIG_FILE])["spec"]["rollout"]["replicas"] == 2
    assert plans.read(config["data"][PLAN_FILE]).layout.rollout_pods == 2
    assert any(e.reason == "Resizing" for e in up.events)

    cluster["spec"]["workerGroupSpecs"][1]["replicas"] = 2
    down = job(rollout=rollout(replicas=1))
    assert next_action(down, obs, NOW, SETTINGS).scale_cluster is None  # the driver has not retired one yet
    stale = {"rollout": {"attempt": 0, "replicas": 2, "enginePods": ["tiny-abc-rollout-a", "tiny-abc-rollout-b"]}}
    assert next_action(job(rollout=rollout(replicas=1), status=stale), obs, NOW, SETTINGS).scale_cluster is None
    older = {"rollout": {"attempt": 1, "replicas": 1, "enginePods": []}}  # another attempt's driver
    assert next_action(job(rollout=rollout(replicas=1), status=older), obs, NOW, SETTINGS).scale_cluster is None
    retired = {"rollout": {"attempt": 0, "replicas": 1, "enginePods": ["tiny-abc-rollout-b"]}}
    _, patch = next_action(job(rollout=rollout(replicas=1), status=retired), obs, NOW, SETTINGS).scale_cluster
    assert patch[-1]["value"] == {"workersToDelete": ["tiny-abc-rollout-a"]}
    assert patch[0] == {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "rollout"}
    # Other fields of rollout stay immutable.
    refused = next_action(job(rollout=rollout(replicas=2, maxResponseLength=8)), obs, NOW, SETTINGS)
    assert "spec.rollout" in {c["type"]: c for c in refused.status["conditions"]}["SpecChangeRefused"]["message"]


def _resizing(replicas: int, group_replicas: int, state: str = "ready", **status):
    """A running job whose spec.rollout.replicas is ``replicas`` while its RayCluster's rollout group
    (and the spec in effect) has ``group_replicas``."""
    running = job(rollout={"replicas": group_replicas})
    cluster = {**ray_cluster(state), "spec": {"workerGroupSpecs": [{"groupName": "trainer", "replicas": 1},
                                                                   {"groupName": "rollout", "replicas": group_replicas}]}}
    obs = observed(ray_job("tiny", deployment="Running"), config_map=config_map_of(running), ray_cluster=cluster)
    return job(rollout={"replicas": replicas}, status=status or None), obs


def test_a_scale_down_the_driver_never_reports_ends_in_a_condition_naming_the_cause():
    """The operator lowers the rollout group only after the driver reports the engines it retired;
    a driver that never does (stuck in a step, or gone) must not leave the job at the larger size
    with nothing said: past Settings.scale_down_timeout_seconds the RolloutScaled condition names
    the cause and what to do, with one Warning event."""
    bound = SETTINGS.scale_down_timeout_seconds
    down, obs = _resizing(1, 2)
    waiting = next_action(down, obs, NOW, SETTINGS)
    assert waiting.scale_cluster is None and waiting.requeue_after == bound  # looked at again at the bound
    scaled = {c["type"]: c for c in waiting.status["conditions"]}["RolloutScaled"]
    assert (scaled["status"], scaled["reason"]) == ("False", "WaitingForDriver")

    # Later, no report yet: the wait began when the condition turned False.
    later = NOW + timedelta(seconds=bound - 100)
    down, obs = _resizing(1, 2, conditions=waiting.status["conditions"])
    assert next_action(down, obs, later, SETTINGS).requeue_after == 100

    stuck_at = NOW + timedelta(seconds=bound + 1)
    stuck = next_action(down, obs, stuck_at, SETTINGS)
    scaled = {c["type"]: c for c in stuck.status["conditions"]}["RolloutScaled"]
    assert (scaled["status"], scaled["reason"]) == ("False", "DriverNotReporting")
    assert scaled["lastTransitionTime"] == waiting.status["conditions"][-1]["lastTransitionTime"]
    assert "spec.rollout.replicas 2 -> 1" in scaled["message"] and "status.rollout is empty" in scaled["message"]
    assert "set spec.rollout.replicas back to 2" in scaled["message"]
    assert [e.type for e in stuck.events if e.reason == "DriverNotReporting"] == ["Warning"]
    assert stuck.scale_cluster is None  # still no pod deleted that may hold the only live engine
    # Said once: the next reconcile posts no second event.
    down, obs = _resizing(1, 2, conditions=stuck.status["conditions"])
    assert not [e for e in next_action(down, obs, stuck_at, SETTINGS).events if e.reason == "DriverNotReporting"]

    # The driver reports at last: the group is lowered and the condition clears.
    retired = {"attempt": 0, "replicas": 1, "enginePods": []}
    down, obs = _resizing(1, 2, conditions=stuck.status["conditions"], rollout=retired)
    done = next_action(down, obs, stuck_at, SETTINGS)
    assert done.scale_cluster is not None
    scaled = {c["type"]: c for c in done.status["conditions"]}["RolloutScaled"]
    assert (scaled["status"], scaled["reason"]) == ("True", "NoScaleDownPending")


def test_status_after_a_resize_describes_the_plan_just_rendered():
    """The reconcile that writes the new replicas into the spec in effect computes the status from
    the plan it writes, not from the ConfigMap's plan it replaces (one rollout pod more here)."""
    up, obs = _resizing(2, 1, state="")
    plan = next_action(up, obs, NOW, SETTINGS)
    [config] = plan.apply
    written = plans.read(config["data"][PLAN_FILE])
    assert written.layout.rollout_pods == 2
    ready = {c["type"]: c for c in plan.status["conditions"]}["ClusterReady"]
    assert f"0/{written.layout.expected_pods} pods running" in ready["message"]


def test_each_new_recovery_the_driver_counted_is_one_event():
    running = observed(ray_job("tiny", deployment="Running"))
    counted = {"recoveries": {"trainer": {"count": 2, "lastSeconds": 36.5}, "engineLost": {"count": 1}}}
    plan = next_action(job(status=counted), running, NOW, SETTINGS)
    assert {e.reason: e.message for e in plan.events if e.reason in ("TrainerRecovered", "EngineLost")} == {
        "TrainerRecovered": "a trainer rank was lost; a new trainer group restored the newest checkpoint in the "
                            "same Ray cluster (2 new, 2 in all; the last took 36.5 s)",
        "EngineLost": "a rollout engine was lost; its requests went to the engines left (1 new, 1 in all)"}
    assert plan.status["recoveryEvents"] == {"trainer": 2, "engineLost": 1}
    # Posted: nothing again; one more trainer recovery: one event.
    posted = {**counted, "recoveryEvents": plan.status["recoveryEvents"]}
    assert not [e for e in next_action(job(status=posted), running, NOW, SETTINGS).events if e.reason == "TrainerRecovered"]
    posted["recoveries"]["trainer"]["count"] = 3
    again = next_action(job(status=posted), running, NOW, SETTINGS)
    assert [e.message.split("(")[1] for e in again.events if e.reason == "TrainerRecovered"] == ["1 new, 3 in all; the last took 36.5 s)"]
