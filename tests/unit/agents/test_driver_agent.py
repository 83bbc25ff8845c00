"""The driver's step with ``spec.agent``: episodes through the real endpoint (in process, on
loopback) reach the trainer as samples masked to the model's tokens, with the episodes' rewards.

Engine and trainer are stand-ins, as in tests/unit/driver/test_algorithm_driver.py: the real ones are
Ray actors, which tests/engine/driver/test_agent_e2e.py runs; the engine is the scripted one of
tests/unit/agents/stand_in.py, whose replies are known, so what the trainer gets can be checked token
by token."""

from __future__ import annotations

import pytest

from kuberl.driver.checkpoints import CheckpointManager
from kuberl.driver.loop import Driver
from kuberl.driver.report import StatusReporter
from kuberl.job import plan as plans
from kuberl.rollout.server import BackgroundServer, make_app
from tests.unit.agents.stand_in import MODEL, Pool, ScriptedEngine
from tests.unit.driver.test_algorithm_driver import Sync, Trainer


class Engines:
    """The pool's ``serve``: the real endpoint over the scripted engine."""

    served_model_name = MODEL

    def __init__(self, spec, tokenizer):
        self.engine = ScriptedEngine(tokenizer)
        self.pool = Pool(spec, self.engine)
        self.server = None

    def serve(self, tokenizer, host="127.0.0.1", port=0, episodes=None):
        self.server = BackgroundServer(make_app(self.pool, tokenizer, episodes), host, port)
        self.server.start()
        return self.server.url

    def generate(self, *args, **kwargs):
        raise AssertionError("agent steps sample through the endpoint, not EnginePool.generate")

    def replenish(self):  # the pool's step-boundary call: a stand-in never loses an engine
        return 0

    def take_counts(self):
        return {}


@pytest.fixture
def driver(tmp_path):
    from transformers import AutoTokenizer

    from kuberl.driver import tiny
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp_path / "tiny")
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["data"]["uri"] = str(tiny.make_calculator_data(tmp_path / "calculator.jsonl", n=16))
    spec["agent"] = {"environment": "kuberl.rollout.agents.calculator:Calculator", "maxTokensPerTurn": 8}
    spec["algorithm"].update(promptsPerStep=2, groupSize=2, microBatchSize=2)
    spec["rollout"].update(maxPromptLength=48, maxResponseLength=64)
    spec["checkpoint"] = {}
    job = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
    plan = plans.local(job, tmp_path / "work")
    tokenizer = AutoTokenizer.from_pretrained(job.spec.model.uri)
    engines, trainer = Engines(job.spec, tokenizer), Trainer()
    driver = Driver(job, plan, trainer=trainer, engines=engines, weight_sync=Sync(), tokenizer=tokenizer,
                        data_path=job.spec.data.uri,
                        checkpoints=CheckpointManager(plan.checkpoints, plan.resume, trainer=None),
                        reporter=StatusReporter())
    yield driver, engines, trainer, tokenizer
    engines.server.stop()


def test_an_agent_step_trains_on_the_model_tokens_of_each_episode(driver):
    driver, engines, trainer, tokenizer = driver
    result = driver.train_step(0)
    (batch,) = trainer.batches
    assert [s.group for s in batch.samples] == [0, 0, 1, 1]
    assert [s.reward for s in batch.samples] == pytest.approx([1.0] * 4)  # the scripted policy solves it
    for sample in batch.samples:
        tool = [t for t, m in zip(sample.response_ids, sample.loss_mask) if not m]
        observation = f"\n<|im_start|>user\ncalculator: {sample.metadata['answer']}<|im_end|>\n<|im_start|>assistant\n"
        assert tool == tokenizer.encode(observation, add_special_tokens=False)
    model_tokens = sum(sum(s.loss_mask) for s in batch.samples)
    m = result.metrics
    assert m["agent_model_tokens"] == model_tokens and m["agent_turns"] == 2.0
    assert m["agent_tool_tokens"] == sum(len(s.response_ids) for s in batch.samples) - model_tokens > 0
    assert m["reward_mean"] == pytest.approx(1.0)
    # The run's sampling, a seed per episode turn derived from the step's.
    assert {r["temperature"] for r in engines.engine.requests} == {driver.spec.algorithm.temperature}
    assert len({r["seed"] for r in engines.engine.requests}) == 8

