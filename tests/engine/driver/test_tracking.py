"""Experiment trackers in their offline modes (no tracking server is reachable here): the files
W&B, MLflow and TensorBoard write hold every step's metrics, read back with each tool's own reader."""

from __future__ import annotations

import sys

import pytest

from kuberl.api.types import TrackingSpec
from kuberl.driver.tracking import TrackingError, Trackers, make_trackers

STEPS = [{"reward_mean": 0.1 * step, "clip_frac": 0.01 * step, "val/pass@4": 0.5, "grad_norm": float("nan")}
         for step in range(1, 4)]


def _log(spec: TrackingSpec, work_dir) -> None:
    trackers = make_trackers(spec, run_name="gsm8k-test", run_id="uid-1234", config={"algorithm": {"groupSize": 4}},
                             work_dir=work_dir)
    for step, metrics in enumerate(STEPS, 1):
        trackers.log(step, metrics)
    trackers.close()


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(TrackingSpec.model_validate({"tensorboard": {"logDir": str(tmp_path / "tb")}}), tmp_path)
    events = EventAccumulator(str(tmp_path / "tb" / "gsm8k-test"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "val/pass@4" in events.Tags()["scalars"]
    assert "grad_norm" not in events.Tags()["scalars"]  # NaN is left out


def test_run_name_names_the_run_in_the_trackers_instead_of_the_job(tmp_path):
    pytest.importorskip("tensorboard")
    spec = TrackingSpec.model_validate({"tensorboard": {"logDir": str(tmp_path / "tb")}, "runName": "exp-7.b"})
    assert TrackingSpec().run_name_of("my-job") == "my-job"
    trackers = make_trackers(spec, run_name=spec.run_name_of("my-job"), run_id="uid-1", config={}, work_dir=tmp_path)
    trackers.log(1, STEPS[0])
    trackers.close()
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["exp-7.b"]


def test_mlflow_file_store_holds_the_metrics(tmp_path):
    mlflow = pytest.importorskip("mlflow")

    uri = f"file:{tmp_path / 'mlruns'}"
    _log(TrackingSpec.model_validate({"mlflow": {"trackingUri": uri, "experiment": "peers"}}), tmp_path)
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("peers").experiment_id])
    assert run.info.run_name == "gsm8k-test" and run.data.params["algorithm.groupSize"] == "4"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert client.get_metric_history(run.info.run_id, "val/pass_at_4")[0].value == 0.5


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = TrackingSpec.model_validate({"wandb": {"project": "peers", "mode": "offline", "directory": str(tmp_path / "w")}})
    _log(spec, tmp_path)
    wandb.teardown()  # the W&B service writes the record log out when it stops (the driver's exit)
    (run_file,) = (tmp_path / "w" / "wandb").glob("offline-run-*/run-uid-1234.wandb")
    records = run_file.read_bytes()  # W&B's record log: history rows carry their keys and JSON values
    for key in (b"reward_mean", b"clip_frac", b"val/pass@4"):
        assert key in records


def test_a_tracker_without_its_library_fails_at_start_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    with pytest.raises(TrackingError, match=r"spec.tracking.mlflow: the mlflow library is not installed"):
        _log(TrackingSpec.model_validate({"mlflow": {"trackingUri": "file:/tmp/mlruns"}}), tmp_path)


def test_a_failing_tracker_never_stops_training(caplog):
    class Down:
        def log(self, step, metrics):
            raise ConnectionError("tracking server unreachable")

        def close(self):
            raise ConnectionError("still down")

    trackers = Trackers([Down()])
    trackers.log(1, {"reward_mean": 1.0})
    trackers.close()
    assert "could not log step 1: tracking server unreachable" in caplog.text
