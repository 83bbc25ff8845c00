"""The four launch configs from the peers' own repositories, translated (tests/unit/api/peer_configs):
each validates, renders, and keeps the knobs checked here with the source's values. What a
translation could not carry over is listed, with the reason, in its file's header. And the GSM8K
example's tracking Secret reaches the head only, its data is checked in the init containers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kuberl.api.validate import validate_manifest
from kuberl.api.contract import PLAN_FILE
from kuberl.job.plan import read as read_plan
from kuberl.job.render import render_manifest

CONFIGS = Path(__file__).parent / "peer_configs"
REPO = Path(__file__).resolve().parents[3]

# name -> (optimizer updates per step, what else must survive the translation)
EXPECTED = {
    "skyrl-gsm8k-qwen2.5-1.5b": (4, {"data.answerField": "reward_spec.ground_truth", "algorithm.epochs": 20,
                                     "validation.beforeTraining": True, "tracking.wandb.project": "gsm8k"}),
    "verl-dapo-qwen2.5-32b": (16, {"algorithm.name": "dapo", "algorithm.clipRatioHigh": 0.28,
                                   "algorithm.overlongBuffer": 4096, "algorithm.maxRefillRounds": 9,
                                   "algorithm.klCoef": 0.0,
                                   "validation.topP": 0.7, "validation.n": 1, "algorithm.epochs": 1, "data.overlongPrompts": "error",
                                   "rollout.engineArgs.enableChunkedPrefill": True, "trainer.cpuOffload": True}),
    "nemo-rl-grpo-qwen3-30b-a3b": (4, {"algorithm.logProbMicroBatchSize": 4, "algorithm.klClamp": 10.0,
                                       "trainer.replicas": 8, "rollout.gpuMemoryUtilization": 0.7,
                                       "algorithm.warmupSteps": 13,
                                       "trainer.moe.routerAuxLossCoef": 0.0, "trainer.moe.freezeRouter": True,
                                       "trainer.parallelism.expert": 8, "tracking.tensorboard.logDir": "/mnt/logs/tb",
                                       "rollout.maxTotalLength": 4096}),
    "skyrl-search-r1": (2, {"algorithm.stop": ["</search>", "</answer>"], "agent.environment": "search_r1.env:SearchEnv",
                            "agent.maxTurns": 4, "agent.maxTokensPerTurn": 500, "algorithm.maxGradNorm": 0.5,
                            "algorithm.warmupSteps": 94, "weightSync.method": "nccl",
                            "data.extraInfoField": "extra_info", "rollout.maxTotalLength": 4596,
                            "algorithm.tis.cap": 2.0, "validation.intervalSteps": 50,
                            "validation.beforeTraining": False}),
}


def _get(tree: dict, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_peer_config_keeps_its_knobs_and_renders(name):
    manifest = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    job = validate_manifest(manifest)
    algo = job.spec.algorithm
    updates, knobs = EXPECTED[name]
    assert algo.update_epochs * algo.prompts_per_step // (algo.mini_batch_size or algo.prompts_per_step) == updates
    resolved = job.model_dump(by_alias=True, mode="json")["spec"]
    for path, value in knobs.items():
        assert _get(resolved, path) == value, path
    kinds = {o["kind"] for o in render_manifest(manifest)}
    assert {"RayJob", "ConfigMap"} <= kinds


def test_every_peer_config_is_listed():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", ["verl-dapo-qwen2.5-32b", "nemo-rl-grpo-qwen3-30b-a3b", "skyrl-search-r1"])
def test_a_translation_says_what_differs_from_its_source(name):
    header = (CONFIGS / f"{name}.yaml").read_text().split("apiVersion:")[0]
    assert "What differs from the source, and why:" in header


def test_gsm8k_example_tracking_secret_validation_staging_and_data_check():
    manifest = yaml.safe_load((REPO / "examples" / "gsm8k-grpo.yaml").read_text())
    ray_job = next(o for o in render_manifest(manifest) if o["kind"] == "RayJob")
    cluster = ray_job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    (driver,) = head["containers"]
    assert {"secretRef": {"name": "wandb-api-key"}} in driver["envFrom"]
    for group in cluster["workerGroupSpecs"]:
        for container in group["template"]["spec"]["containers"] + group["template"]["spec"].get("initContainers", []):
            assert {"secretRef": {"name": "wandb-api-key"}} not in container.get("envFrom", [])
    init = {c["name"]: c for c in head["initContainers"]}
    assert init["stage-validation-data"]["args"][-2:] == ["s3://my-datasets/gsm8k/test.parquet", "/kuberl/validation-data"]
    assert init["check-data"]["args"] == ["check-data", "--config", "/etc/kuberl/job.yaml", "/kuberl/data"]
    assert init["check-validation-data"]["args"][-2:] == ["--validation", "/kuberl/validation-data"]
    names = list(init)
    assert names.index("stage-data") < names.index("check-data")
    config_map = next(o for o in render_manifest(manifest) if o["kind"] == "ConfigMap")
    assert read_plan(config_map["data"][PLAN_FILE]).paths.validation_data == "/kuberl/validation-data"
