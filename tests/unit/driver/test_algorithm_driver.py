"""The driver's step under each algorithm: reward shaping, dynamic sampling's refill rounds and
advantages, on the real Driver with the real tokenizer and data.

Engines, trainer and reward workers are recording stand-ins (as in test_colocation.py): the real
ones are Ray actors and tasks, which the end-to-end tests run (tests/engine/driver/test_grpo_e2e.py,
test_reward_workers.py); what is under test here is what the driver asks of them and what it
hands the trainer, which needs fixed rewards per generation call."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl.common.samples import Sample
from kuberl.driver.checkpoints import CheckpointManager
from kuberl.driver.loop import Driver, refill_seed
from kuberl.driver.report import StatusReporter
from kuberl.job import plan as plans

RESPONSE = list(range(4, 18))  # 14 tokens: 2 into a 4-token overlong buffer before maxResponseLength 16


class Engines:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (prompts, seed)

    def generate(self, prompts, n, *, seed, **kw):
        self.calls.append((len(prompts), seed))
        return [[Sample(prompt_ids=list(p), response_ids=list(RESPONSE)) for _ in range(n)] for p in prompts]

    def replenish(self):  # the pool's step-boundary call: a stand-in never loses an engine
        return 0

    def take_counts(self):
        return {}


class Trainer:
    def __init__(self):
        self.batches = []

    def log_probs(self, batch):
        return [[-1.0] * len(s.response_ids) for s in batch.samples]

    def train_step(self, batch):
        self.batches.append(batch)
        return {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "aux_loss": 0.0, "clip_frac": 0.0,
                "tis_ratio": 0.0, "tis_truncated_frac": 0.0,
                "tokens": 1.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0, "skipped_total": 0.0,
                "optimizer_steps": 1.0, "checkpoint_wait": 0.0}


class Sync:
    def sync(self, version):
        return None

    def rebuild(self):  # the stand-in's engines never change
        return False


class Rewards:
    """One list of rewards per generation call, in order."""

    def __init__(self, *calls):
        self.calls = list(calls)

    def __call__(self, inputs):
        rewards = self.calls.pop(0)
        assert len(rewards) == len(inputs)
        return rewards


def _driver(tmp_path: Path, algorithm: dict, rewards: Rewards) -> tuple[Driver, Engines, Trainer]:
    from transformers import AutoTokenizer

    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp_path / "tiny")
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["algorithm"].update(klCoef=0.0, promptsPerStep=2, groupSize=2, microBatchSize=2, **algorithm)
    spec["checkpoint"] = {}
    job = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
    plan = plans.local(job, tmp_path / "work")
    engines, trainer = Engines(), Trainer()
    driver = Driver(job, plan, trainer=trainer, engines=engines, weight_sync=Sync(),
                        tokenizer=AutoTokenizer.from_pretrained(job.spec.model.uri), data_path=job.spec.data.uri,
                        checkpoints=CheckpointManager(plan.checkpoints, plan.resume, trainer=None),
                        reporter=StatusReporter())
    driver.reward_fn = rewards
    return driver, engines, trainer


def test_dapo_shapes_drops_equal_groups_and_refills(tmp_path):
    rewards = Rewards([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0])
    driver, engines, trainer = _driver(tmp_path, {"name": "dapo", "overlongBuffer": 4, "maxRefillRounds": 2}, rewards)
    result = driver.train_step(0)
    # Round 0: group 0 (1, 1) is dropped. 1 of 2 kept: round 1 asks for ceil(1 / 0.5) = 2 prompts
    # and keeps the first of them.
    assert engines.calls == [(2, 7 * 1_000_003 + 0), (2, refill_seed(7, 0, 1))]
    (batch,) = trainer.batches
    assert [s.group for s in batch.samples] == [0, 0, 1, 1]
    # Overlong shaping: 14 tokens, 2 into the 4-token buffer: -(14 - 12) / 4 = -0.5 on each reward.
    assert [s.reward for s in batch.samples] == pytest.approx([-0.5, 0.5, -0.5, 0.5])
    # Group-normalised: mean 0, unbiased std sqrt(0.5): -+0.5 / 0.7071.
    assert [s.advantage for s in batch.samples] == pytest.approx([-0.7071068, 0.7071068] * 2, rel=1e-5)
    m = result.metrics
    assert (m["groups_dropped"], m["refill_rounds"], m["groups_generated"], m["groups_padded"]) == (1, 1, 4, 0)
    assert m["reward_shaping"] == pytest.approx(-0.5)
    assert m["reward_mean"] == pytest.approx(0.75)  # the step's own prompts' task rewards: (1 + 1 + 0 + 1) / 4


def test_grpo_trains_every_group_once_generated_unshaped(tmp_path):
    rewards = Rewards([1.0, 1.0, 0.0, 1.0])
    driver, engines, trainer = _driver(tmp_path, {"name": "grpo"}, rewards)
    result = driver.train_step(0)
    assert engines.calls == [(2, 7 * 1_000_003 + 0)]
    (batch,) = trainer.batches
    assert [s.reward for s in batch.samples] == [1.0, 1.0, 0.0, 1.0]
    assert [s.advantage for s in batch.samples] == pytest.approx([0.0, 0.0, -0.7071068, 0.7071068], rel=1e-5, abs=1e-6)
    assert (result.metrics["groups_dropped"], result.metrics["reward_shaping"]) == (0, 0.0)


def test_rloo_and_dr_grpo_advantages_reach_the_trainer(tmp_path):
    for name, want in [("rloo", [0.0, 0.0, -1.0, 1.0]), ("dr-grpo", [0.0, 0.0, -0.5, 0.5])]:
        driver, _, trainer = _driver(tmp_path / name, {"name": name}, Rewards([1.0, 1.0, 0.0, 1.0]))
        driver.train_step(0)
        assert [s.advantage for s in trainer.batches[0].samples] == pytest.approx(want), name


def test_non_finite_advantages_stop_the_step_before_any_update(tmp_path):
    """Rewards are checked where they are made (finite, |r| <= 1e6); the stand-in here hands two
    1e308s straight to the driver, whose group mean overflows: GRPO's advantages are NaN. The step
    ends naming the step, the group and its prompt, and nothing reaches the trainer."""
    driver, _, trainer = _driver(tmp_path, {"name": "grpo"}, Rewards([1e308, 1e308, 0.0, 1.0]))
    with pytest.raises(FloatingPointError, match=r"^step 0: the grpo advantage of a sample of group 0 is nan "
                                                 r"\(prompt '.+', the group's rewards \[1e\+308, 1e\+308\]\); "
                                                 r"no update was made$"):
        driver.train_step(0)
    assert trainer.batches == []
