"""A stored job the operator cannot render (a URI with '..' from before the CEL rule) ends Failed
with a condition and one event naming the field; a finished job is never judged again."""

from __future__ import annotations

from kuberl.api import types as t
from kuberl.api.validate import validate_manifest
from kuberl_operator.invalid import REASON, checked_plan, failed_plan, job_problems
from kuberl_operator.reconcile import Settings
from kuberl_operator.status import FINISHED_PHASES
from tests.unit.operator.factories import NOW, job, observed


def stored(**model) -> t.RLTrainingJob:
    """A job as an older CRD stored it: the schema's patterns held, the newer CEL rules did not run."""
    good = job()
    manifest = good.model_dump(mode="json", by_alias=True, exclude_none=True)
    manifest["spec"]["model"].update(model)
    return t.RLTrainingJob.model_validate(manifest)


def test_dot_segments_fail_the_job_naming_the_field():
    bad = stored(uri="s3://models/tiny/../../other-team/model")
    problems = job_problems(bad)
    assert problems and problems[0].startswith("spec.model.uri:")
    plan = failed_plan(bad, problems, NOW)
    assert plan.status["phase"] == "Failed" and plan.status["completionTime"] == "2026-01-01T12:00:00Z"
    failed, = [c for c in plan.status["conditions"] if c["type"] == "Failed"]
    assert (failed["status"], failed["reason"]) == ("True", REASON)
    assert "spec.model.uri" in failed["message"] and "delete and recreate" in failed["message"]
    event, = plan.events
    assert (event.type, event.reason) == ("Warning", REASON) and "spec.model.uri" in event.message
    assert not plan.apply and not plan.delete_ray_jobs and plan.requeue_after is None
    t.RLTrainingJobStatus.model_validate(plan.status)  # a status the CRD accepts


def test_bad_revision_fails_the_job_naming_the_field():
    bad = stored(uri="hf://org/model", revision="../../../../tmp/x")
    assert [p.split(":")[0] for p in job_problems(bad)] == ["spec.model.revision"]


def test_valid_and_finished_jobs_have_no_problems():
    assert job_problems(job()) == []
    assert job_problems(validate_manifest({**job().model_dump(mode="json", by_alias=True, exclude_none=True)})) == []
    for phase in FINISHED_PHASES:
        finished = stored(uri="s3://models/../x").model_copy(
            update={"status": t.RLTrainingJobStatus(phase=phase)})
        assert job_problems(finished) == []


def test_checked_plan_fails_invalid_jobs_without_observing_and_plans_valid_ones():
    def never():
        raise AssertionError("an invalid job is not observed or rendered")

    bad = checked_plan(stored(uri="s3://models/../x"), never, NOW, Settings())
    assert bad.status["phase"] == "Failed" and [e.reason for e in bad.events] == [REASON]
    good = checked_plan(job(), observed, NOW, Settings())
    assert good.status["phase"] == "Pending" and good.apply


def test_a_job_failed_for_its_spec_is_left_alone_on_every_later_reconcile():
    """The resync after the failure reconciles the same stored spec: nothing renders it again,
    so there is no second event and no status change."""
    bad = stored(uri="s3://models/../x")
    first = checked_plan(bad, observed, NOW, Settings())
    failed = bad.model_copy(update={"status": t.RLTrainingJobStatus.model_validate(first.status)})
    again = checked_plan(failed, observed, NOW, Settings())
    assert again.events == [] and not again.apply and not again.delete_ray_jobs
    assert again.status["phase"] == "Failed" and again.status["message"] == first.status["message"]


def test_wandb_online_without_a_secret_fails_the_job_up_front_naming_the_field():
    """What only a pod needs (kuberl.api.validate.pod_errors) is judged with the other problems,
    before anything is observed or rendered, not left to the renderer to raise."""
    manifest = job().model_dump(mode="json", by_alias=True, exclude_none=True)
    manifest["spec"]["tracking"] = {"wandb": {"project": "p", "mode": "online"}}
    bad = t.RLTrainingJob.model_validate(manifest)

    def never():
        raise AssertionError("an invalid job is not observed or rendered")

    plan = checked_plan(bad, never, NOW, Settings())
    assert plan.status["phase"] == "Failed"
    assert plan.status["message"].startswith("the job cannot run as written: spec.tracking.wandb.credentials:")
