"""Colocation in the driver loop: engines sleep once the step's rollout is done, while the trainer
ranks compute log-probs and step, and wake before the weight sync and the next rollout.

The trainer group, engine pool and weight sync here are recording stand-ins: what releases GPU
memory is vLLM's sleep mode, which exists only on GPUs (vLLM's CPU worker logs and ignores it,
tests/rollout/test_engine.py), and no GPU machine here has vLLM. What is under test is the order
the driver keeps, on the real GRPODriver with the real tokenizer, data and rewards (the reward
workers are Ray tasks: the tests share the session's Ray, `ray_session`)."""

from __future__ import annotations

from pathlib import Path

from kuberl import plan as plans
from kuberl.samples import Sample
from kuberl.train.checkpoint import CheckpointManager
from kuberl.train.driver import GRPODriver
from kuberl.train.report import StatusReporter


class Calls(list):
    def record(self, name, result=None):
        self.append(name)
        return result


class Engines:
    def __init__(self, calls: Calls):
        self.calls = calls

    def generate(self, prompts, n, **kw):
        self.calls.record("generate")
        return [[Sample(prompt_ids=list(p), response_ids=[5, 6], response_logprobs=[-1.0, -1.0]) for _ in range(n)]
                for p in prompts]

    def sleep(self):
        self.calls.record("sleep")

    def wake_up(self):
        self.calls.record("wake_up")


class Trainer:
    def __init__(self, calls: Calls):
        self.calls = calls

    def log_probs(self, batch):
        return self.calls.record("log_probs", [[-1.0, -1.0] for _ in batch.samples])

    def train_step(self, batch):
        # The metrics a TrainerWorker update returns (kuberl.train.updates merges them).
        return self.calls.record("train_step", {
            "loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "aux_loss": 0.0, "clip_frac": 0.0,
            "tokens": 1.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0, "skipped_total": 0.0,
            "optimizer_steps": 1.0})


class Sync:
    def __init__(self, calls: Calls):
        self.calls = calls

    def sync(self, version):
        self.calls.record("sync")


def _driver(tmp_path: Path, colocate: bool, calls: Calls) -> GRPODriver:
    from transformers import AutoTokenizer

    from kuberl.train.__main__ import embedded_job

    job = embedded_job(tmp_path / "tiny")
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["algorithm"].update(klCoef=0.0, promptsPerStep=2, groupSize=2, microBatchSize=2)
    if colocate:
        spec["trainer"].update(gpusPerReplica=1)
        spec["rollout"].update(colocate=True)
    spec["checkpoint"] = {}
    job = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
    plan = plans.local(job, tmp_path / "work")
    return GRPODriver(job, plan, trainer=Trainer(calls), engines=Engines(calls), weight_sync=Sync(calls),
                      tokenizer=AutoTokenizer.from_pretrained(job.spec.model.uri), data_path=job.spec.data.uri,
                      checkpoints=CheckpointManager(plan.checkpoints, plan.resume, trainer=None),
                      reporter=StatusReporter())


def test_colocated_engines_sleep_while_the_trainer_steps(ray_session, tmp_path):
    calls = Calls()
    driver = _driver(tmp_path, colocate=True, calls=calls)
    driver.train_step(0)
    driver.train_step(1)
    assert calls == ["generate", "sleep", "log_probs", "train_step", "wake_up", "sync"] * 2


def test_engines_on_their_own_gpus_never_sleep(ray_session, tmp_path):
    calls = Calls()
    _driver(tmp_path, colocate=False, calls=calls).train_step(0)
    assert calls == ["generate", "log_probs", "train_step", "sync"]


def test_colocated_engines_get_the_gpus_of_trainer_ranks_on_one_node():
    """GPU accounting: colocated engines ask Ray for no GPU; each takes tensorParallelSize GPUs
    that trainer ranks of one node hold, so every GPU is counted once."""
    import pytest

    from kuberl.rollout.pool import colocated_devices

    slots = [("n1", "0"), ("n2", "0"), ("n1", "1"), ("n2", "1"), ("n1", "2"), ("n1", "3")]
    assert colocated_devices(slots, 2) == [("n1", ["0", "1"]), ("n1", ["2", "3"]), ("n2", ["0", "1"])]
    assert colocated_devices(slots, 1)[:2] == [("n1", ["0"]), ("n1", ["1"])]
    with pytest.raises(ValueError, match="not a multiple"):
        colocated_devices(slots[:3], 2)
