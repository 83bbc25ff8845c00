"""kuberl.common.metrics: names, units and labels of the worker series, what record_step exports from the
driver's per-step dict, the exporter over HTTP, and `promtool check metrics` on its exposition."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from kuberl.common.metrics import LABELS, Identity, WorkerMetrics, record_step

IDENTITY = Identity(job="grpo", namespace="team-a", role="trainer", rank="3")
PREFIXES = ("kuberl_train_", "kuberl_rollout_", "kuberl_sync_", "kuberl_checkpoint_", "kuberl_stage_",
            "kuberl_recoveries", "kuberl_recovery_")
UNITLESS = {"kuberl_train_step", "kuberl_train_reward_mean", "kuberl_train_kl", "kuberl_train_loss",
            "kuberl_train_pg_loss", "kuberl_train_grad_norm", "kuberl_train_validation_reward"}

# One step dict as the driver builds it: the FSDP worker's train_step keys plus the driver's own.
DRIVER_STEP = {
    "loss": 0.42, "pg_loss": 0.40, "kl": 0.02, "entropy": 1.1, "aux_loss": 0.0, "clipped_tokens": 3.0, "tokens": 640,
    "grad_norm": 0.9, "lr": 1e-6, "skipped": 0.0, "skipped_total": 0.0, "optimizer_steps": 5.0,
    "reward_mean": 0.75, "reward_std": 0.2, "response_length": 12.5, "step_seconds": 1.25,
    "tokens_per_second": 512.0, "weight_sync_seconds": 0.05, "weight_sync_bytes": 4096, "step": 5, "mfu": 0.31,
    "clip_frac": 0.05, "generate_seconds": 0.75, "update_seconds": 0.25, "checkpoint_wait_seconds": 0.125,
    "engines_lost": 1.0, "engines_replaced": 0.0, "engines_live": 1.0,
    "trainer_recoveries": 1.0, "trainer_recovery_seconds": 14.0,
    "engine_replacements": 1.0, "engine_replacement_seconds": 40.0, "rollout_resizes": 1.0,
    "rollout_resize_seconds": 3.0,
}


@pytest.fixture
def registry():
    return CollectorRegistry()


def value(registry, name: str, **extra) -> float | None:
    return registry.get_sample_value(name, {**{k: getattr(IDENTITY, k) for k in LABELS}, **extra})


def test_import_does_not_load_prometheus_client():
    code = "import sys, kuberl.common.metrics; print('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_series_appear_with_the_first_record_of_their_kind(registry):
    metrics = WorkerMetrics(IDENTITY, registry)
    assert value(registry, "kuberl_train_steps_total") is None
    metrics.record_rollout(tokens=10, seconds=0.1)
    # A rollout process exports no training series (no zeros to drag a dashboard average down).
    assert value(registry, "kuberl_train_reward_mean") is None
    assert value(registry, "kuberl_train_skipped_steps_total") is None
    metrics.record_step({"step": 1, "reward_mean": 0.5, "weight_sync_seconds": 0.1})
    assert value(registry, "kuberl_train_skipped_steps_total") == 0
    assert value(registry, "kuberl_sync_bytes_total") == 0
    assert value(registry, "kuberl_train_mfu_ratio") is None   # the step reported no MFU
    assert value(registry, "kuberl_checkpoint_last_bytes") is None


def test_names_carry_units_and_every_series_the_four_labels(registry):
    metrics = WorkerMetrics(IDENTITY, registry)
    metrics.record_step(DRIVER_STEP)
    metrics.record_rollout(tokens=1, seconds=1.0)
    metrics.record_checkpoint(seconds=1.0, nbytes=1)
    metrics.record_stage(nbytes=1, seconds=1.0)
    metrics.record_validation({"val/reward": 0.5, "val/pass@4": 0.75, "val/response_length": 9.0})
    families = list(registry.collect())
    assert families
    for family in families:
        assert family.name.startswith(PREFIXES), family.name
        if family.type == "counter":
            assert family.name.endswith(("_bytes", "_seconds", "_tokens", "_steps", "_saves", "_recoveries")), family.name
        elif family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        elif family.name not in UNITLESS:
            assert family.name.endswith(("_seconds", "_bytes", "_ratio", "_per_second")), family.name
        assert family.samples, family.name
        for sample in family.samples:
            assert {k: sample.labels[k] for k in LABELS} == {"job": "grpo", "namespace": "team-a", "role": "trainer", "rank": "3"}


def test_record_step_exports_the_driver_dict(registry):
    metrics = WorkerMetrics(IDENTITY, registry)
    metrics.record_step(DRIVER_STEP)
    metrics.record_step({**DRIVER_STEP, "step": 6, "skipped": 1.0, "grad_norm": math.nan})
    assert value(registry, "kuberl_train_step") == 6
    assert value(registry, "kuberl_train_reward_mean") == 0.75
    assert value(registry, "kuberl_train_kl") == 0.02
    assert value(registry, "kuberl_train_loss") == 0.42
    assert value(registry, "kuberl_train_pg_loss") == 0.40
    assert value(registry, "kuberl_train_grad_norm") == 0.9   # the skipped step's NaN norm is not exported
    assert value(registry, "kuberl_train_tokens_per_second") == 512.0
    assert value(registry, "kuberl_train_mfu_ratio") == 0.31
    assert value(registry, "kuberl_train_steps_total") == 2
    assert value(registry, "kuberl_train_skipped_steps_total") == 1
    assert value(registry, "kuberl_train_step_duration_seconds_sum") == 2.5
    assert value(registry, "kuberl_sync_duration_seconds_count") == 2
    assert value(registry, "kuberl_sync_bytes_total") == 8192
    assert value(registry, "kuberl_train_phase_duration_seconds_sum", phase="generate") == 1.5
    assert value(registry, "kuberl_train_phase_duration_seconds_count", phase="update") == 2
    assert value(registry, "kuberl_train_phase_duration_seconds_sum", phase="checkpoint_wait") == 0.25
    assert value(registry, "kuberl_train_phase_duration_seconds_count", phase="sleep") is None  # not colocated
    assert value(registry, "kuberl_recoveries_total", kind="engine") == 2  # one engine lost in each step
    assert value(registry, "kuberl_recoveries_total", kind="trainer") == 2  # a new trainer group before each
    assert value(registry, "kuberl_recovery_duration_seconds_sum", kind="trainer") == 28.0
    assert value(registry, "kuberl_recoveries_total", kind="engine_replaced") == 2
    assert value(registry, "kuberl_recovery_duration_seconds_sum", kind="engine_replaced") == 80.0
    assert value(registry, "kuberl_recoveries_total", kind="resize") == 2
    assert value(registry, "kuberl_recovery_duration_seconds_count", kind="resize") == 2
    assert value(registry, "kuberl_recovery_duration_seconds_count", kind="engine") is None  # a loss has no duration


def test_rollout_checkpoint_and_stage_records(registry):
    metrics = WorkerMetrics(IDENTITY, registry)
    metrics.record_rollout(tokens=300, seconds=1.5)
    metrics.record_checkpoint(seconds=2.0, nbytes=1000)
    metrics.record_checkpoint(seconds=3.0, nbytes=500)
    metrics.record_stage(nbytes=10 << 20, seconds=4.0)
    assert value(registry, "kuberl_rollout_tokens_total") == 300
    assert value(registry, "kuberl_rollout_seconds_total") == 1.5
    assert value(registry, "kuberl_checkpoint_last_duration_seconds") == 3.0
    assert value(registry, "kuberl_checkpoint_last_bytes") == 500
    assert value(registry, "kuberl_checkpoint_bytes_total") == 1500
    assert value(registry, "kuberl_checkpoint_saves_total") == 2
    assert value(registry, "kuberl_stage_bytes_total") == 10 << 20


def test_record_without_exporter_is_a_no_op():
    record_step(DRIVER_STEP)  # a local run: nothing started, nothing raised


def test_first_process_of_a_pod_serves_its_port_the_others_record_nowhere():
    """Trainer ranks and engines of one pod share its metrics port: the first takes it."""
    code = ("import os, socket, kuberl.common.metrics as m\n"
            "os.environ.pop('KUBERL_METRICS_PORT', None)\n"
            "print(m.start_pod_exporter('trainer'))\n"  # a local run: no port, no exporter
            "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen()\n"
            "os.environ['KUBERL_METRICS_PORT'] = str(s.getsockname()[1])\n"
            "print(m.start_pod_exporter('trainer', 1))\n"
            "s.close()\n"
            "print(type(m.start_pod_exporter('trainer', 1)).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "None", "WorkerMetrics"]


def test_exporter_without_port_names_the_env_variable():
    code = ("import os, kuberl.common.metrics as m\nos.environ.pop('KUBERL_METRICS_PORT', None)\n"
            "try:\n m.start_exporter()\nexcept ValueError as e:\n print(e)\n"
            "os.environ['KUBERL_METRICS_PORT'] = 'ninety'\n"
            "try:\n m.start_exporter()\nexcept ValueError as e:\n print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "KUBERL_METRICS_PORT is unset" in out
    assert "KUBERL_METRICS_PORT='ninety' is not a port number" in out


def test_exporter_over_http_passes_promtool_lint(worker_feeds, prometheus_binaries):
    feed = worker_feeds("grpo", "team-a", "trainer", 1)
    text = feed.scrape()
    assert 'kuberl_train_steps_total{job="grpo",namespace="team-a",rank="1",role="trainer"}' in text
    _, promtool = prometheus_binaries
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_documented_scrape_configs_pass_promtool_and_match_the_pod_monitor(prometheus_binaries, tmp_path):
    """examples/prometheus/scrape-configs.yaml, for a Prometheus without the prometheus-operator
    CRDs, keeps the PodMonitor's pods and port (tests/e2e scrapes real pods with it)."""
    import yaml

    from tests.harness.harness import REPO_ROOT
    from tests.shared.prometheus import PrometheusServer

    jobs = yaml.safe_load((REPO_ROOT / "examples" / "prometheus" / "scrape-configs.yaml").read_text())
    PrometheusServer(*prometheus_binaries, tmp_path, jobs)  # asserts `promtool check config`
    workers = next(j for j in jobs if j["job_name"] == "kuberl-workers")
    keep = {r["source_labels"][0]: r["regex"] for r in workers["relabel_configs"] if r.get("action") == "keep"}
    assert workers["honor_labels"] is True
    assert keep == {"__meta_kubernetes_pod_label_app_kubernetes_io_name": "kuberl",
                    "__meta_kubernetes_pod_label_kuberl_dev_role": "head|trainer|rollout",
                    "__meta_kubernetes_pod_container_port_name": "kuberl-metrics"}
