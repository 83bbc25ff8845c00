"""Outside Kubernetes the driver's reporter only logs; its patches of the real API server:
tests/cluster/driver/test_report.py."""

from kuberl.driver.report import StatusReporter, gpu_busy, reporter_from_env


def test_outside_kubernetes_the_reporter_only_logs(tmp_path):
    assert type(reporter_from_env({}, tmp_path)) is StatusReporter
    assert type(reporter_from_env({"KUBERL_JOB_NAME": "x", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path)) \
        is StatusReporter  # no token mounted


def test_gpu_busy_is_each_roles_share_of_the_step_capped_for_an_overlapped_rollout():
    step = {"step_seconds": 4.0, "logprobs_seconds": 0.5, "update_seconds": 1.5, "generate_seconds": 1.0}
    assert gpu_busy(step) == {"trainer": 0.5, "rollout": 0.25}
    # asyncRollout: the generate that fed this step ran beside the previous one, longer than this step.
    assert gpu_busy({**step, "generate_seconds": 6.0})["rollout"] == 1.0
    assert gpu_busy({"step_seconds": 0.0}) == {} and gpu_busy({}) == {}
