"""Outside Kubernetes the driver's reporter only logs; its patches of the real API server:
tests/cluster/driver/test_report.py."""

from kuberl.driver.report import StatusReporter, reporter_from_env


def test_outside_kubernetes_the_reporter_only_logs(tmp_path):
    assert type(reporter_from_env({}, tmp_path)) is StatusReporter
    assert type(reporter_from_env({"KUBERL_JOB_NAME": "x", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path)) \
        is StatusReporter  # no token mounted
