"""Asynchronous rollouts (``algorithm.asyncRollout``, ``algorithm.maxStaleness``) in the real
Driver, with the real tokenizer and data: later steps' rollouts are generated beside the trainer's
steps, at most maxStaleness weight versions behind, the ratio is taken against the engines'
log-probs, and a resumed run trains on exactly what the uninterrupted one did.

Engines, trainer, weight sync, reward workers and the checkpoint manager are stand-ins: the real
ones are Ray actors and tasks (and the checkpoint manager a collective over trainer ranks), which
this unit test cannot start; tests/engine/driver/test_async_e2e.py runs them. The stand-in engines make
responses and log-probs that are a function of the sampling seed and of the weight version they
hold, as vLLM's seeded sampling is of (seed, weights), so a rollout from the wrong weights shows.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kuberl.common.samples import Sample
from kuberl.driver.loop import EXIT_PREEMPTED, Driver
from kuberl.driver.report import StatusReporter
from kuberl.job import plan as plans

STEPS = 3


class Engines:
    def __init__(self):
        self.version = 0
        self.calls: list[tuple[int, int, bool]] = []  # (seed, weight version, in the background)
        self.generating = threading.Event()
        self.trainer_saw_it = threading.Event()
        self.hold = True  # a background generation waits for a trainer step to see it

    def generate(self, prompts, n, *, seed, **kw):
        background = threading.current_thread() is not threading.main_thread()
        self.calls.append((seed, self.version, background))
        if background and self.hold:  # hold the generation open until the trainer has seen it under way
            self.generating.set()
            assert self.trainer_saw_it.wait(10), "the trainer never ran while this rollout was generated"
            self.trainer_saw_it.clear()
        out = []
        for p, prompt in enumerate(prompts):
            group = []
            for i in range(n):
                length = 2 + (seed + self.version + p + i) % 5
                group.append(Sample(prompt_ids=list(prompt), response_ids=[4 + (seed + k) % 20 for k in range(length)],
                                    response_logprobs=[-0.25 * (self.version + 1)] * length,
                                    weight_version=self.version))
            out.append(group)
        return out

    def replenish(self):  # the pool's step-boundary call: a stand-in never loses an engine
        return 0

    def take_counts(self):
        return {}


class Trainer:
    def __init__(self, engines: Engines):
        self.engines = engines
        self.driver: Driver | None = None
        self.batches = []
        self.overlapped: list[bool] = []

    def log_probs(self, batch):
        raise AssertionError("asyncRollout: the behaviour log-probs are the engines', not recomputed")

    def train_step(self, batch):
        # A rollout submitted to the driver's background thread and not finished: its generation
        # must be under way (or about to be) while this step trains.
        background = any(not f.done() for f in self.driver._rollouts.values())
        saw = background and self.engines.hold and self.engines.generating.wait(timeout=10)
        self.overlapped.append(saw)
        if saw:
            self.engines.generating.clear()
            self.engines.trainer_saw_it.set()
        self.batches.append([(s.response_ids, old, s.advantage, s.weight_version)
                             for s, old in zip(batch.samples, batch.old_logprobs, strict=True)])
        return {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "aux_loss": 0.0, "clip_frac": 0.0,
                "tis_ratio": 0.0, "tis_truncated_frac": 0.0,
                "tokens": 1.0, "grad_norm": 0.0, "lr": 0.0, "skipped": 0.0, "skipped_total": 0.0,
                "optimizer_steps": 1.0, "checkpoint_wait": 0.0}


class Sync:
    def __init__(self, engines: Engines):
        self.engines = engines

    def sync(self, version):
        self.engines.version = version

    def rebuild(self):  # the stand-in's engines never change
        return False


def rewards(inputs):
    """Stand-in for the reward workers: a function of the response, varied within groups."""
    return [float(x.response_tokens % 2) for x in inputs]


class Checkpoints:
    """Stand-in for CheckpointManager: keeps the driver's state as JSON, as driver.json does."""

    enabled = True

    def __init__(self, restored: dict | None = None, at: int | None = None):
        self.restored = restored
        self.at = at  # the step whose boundary is checkpointed, as checkpoint.intervalSteps would
        self.saved: dict[int, dict] = {}

    def due(self, step):
        return step == self.at

    def save(self, step, state):
        self.saved[step] = json.loads(json.dumps({**state, "step": step}))
        return 0.0

    def restore(self):
        return self.restored

    def wait(self):  # a preemption notice's commit: the stand-in's saves are done at once
        return None

    def close(self):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model and task, made once for the module's drivers."""
    from kuberl.driver.__main__ import embedded_job

    root = tmp_path_factory.mktemp("tiny")
    embedded_job(root)
    return root


def _driver(tiny: Path, tmp_path: Path, checkpoints: Checkpoints, **algorithm) -> Driver:
    from transformers import AutoTokenizer

    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tiny)
    spec = job.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec["algorithm"].update(klCoef=0.0, promptsPerStep=2, groupSize=2, microBatchSize=2,
                             **{"totalSteps": STEPS, "asyncRollout": True, **algorithm})
    spec["checkpoint"] = {}
    job = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
    plan = plans.local(job, tmp_path / "work")
    engines = Engines()
    driver = Driver(job, plan, trainer=Trainer(engines), engines=engines, weight_sync=Sync(engines),
                        tokenizer=AutoTokenizer.from_pretrained(job.spec.model.uri), data_path=job.spec.data.uri,
                        checkpoints=checkpoints, reporter=StatusReporter())
    driver.reward_fn = rewards
    driver.trainer.driver = driver
    return driver


def seed(step: int) -> int:
    return 7 * 1_000_003 + step  # the embedded job's seed 7


TWO_AHEAD = {"asyncRollout": False, "maxStaleness": 2}


def test_the_next_rollout_is_generated_while_the_trainer_steps(tiny, tmp_path):
    driver = _driver(tiny, tmp_path, Checkpoints())
    code, results = driver.run()
    assert code == 0
    engines, trainer = driver.engines, driver.trainer
    # Step 0 generates its own rollout first; every later rollout is generated in the background
    # with the weights one step behind the trainer, which receive new weights only between
    # two generations.
    assert engines.calls == [(seed(0), 0, False), (seed(1), 0, True), (seed(2), 1, True)]
    assert trainer.overlapped == [True, True, False]  # the last step has no next rollout
    assert [r.metrics["rollout_staleness"] for r in results] == [0.0, 1.0, 1.0]
    assert [r.metrics["rollout_staleness_mean"] for r in results] == [0.0, 1.0, 1.0]
    # The ratio's denominator: the log-probs the engines returned with the samples.
    for batch in trainer.batches:
        for _, old, _, version in batch:
            assert old == [-0.25 * (version + 1)] * len(old)


def test_two_steps_ahead_the_engines_get_weights_every_second_step(tiny, tmp_path):
    driver = _driver(tiny, tmp_path, Checkpoints(), totalSteps=5, **TWO_AHEAD)
    code, results = driver.run()
    assert code == 0
    engines, trainer = driver.engines, driver.trainer
    # Weights 0 generate steps 1 and 2 in the background, one after the other, beside steps 0 and
    # 1; the engines get weights 2 after step 1, which generate steps 3 and 4.
    assert engines.calls == [(seed(0), 0, False), (seed(1), 0, True), (seed(2), 0, True), (seed(3), 2, True),
                             (seed(4), 2, True)]
    assert trainer.overlapped == [True, True, True, True, False]
    # The steps that end at a sync point (and the last) report a weight sync, the others none.
    assert ["weight_sync_seconds" in r.metrics for r in results] == [False, True, False, True, True]
    assert [r.metrics["rollout_staleness"] for r in results] == [0.0, 1.0, 2.0, 1.0, 2.0]
    assert [r.metrics["rollout_staleness_mean"] for r in results] == [0.0, 1.0, 2.0, 1.0, 2.0]
    # Every sample records the weights it came from, and the ratio is against their log-probs.
    assert [{version for *_, version in batch} for batch in trainer.batches] == [{0}, {0}, {0}, {2}, {2}]
    for batch in trainer.batches:
        for _, old, _, version in batch:
            assert old == [-0.25 * (version + 1)] * len(old)


@pytest.mark.parametrize(("algorithm", "stop", "held"), [({}, 1, {1: 0}), (TWO_AHEAD, 1, {1: 0, 2: 0}),
                                                         (TWO_AHEAD, 2, {2: 0}), (TWO_AHEAD, 3, {3: 2, 4: 2})],
                         ids=["one-ahead", "two-ahead-mid-window", "two-ahead-at-sync", "two-ahead-later"])
def test_a_resumed_run_trains_on_what_the_uninterrupted_run_did(tiny, tmp_path, algorithm, stop, held):
    whole = _driver(tiny, tmp_path / "whole", Checkpoints(), totalSteps=5, **algorithm)
    whole.run()

    # Checkpointed at the boundary of step `stop`, where a rollout may still be generating
    # (maxStaleness 2, mid-window): the save waits for it.
    first = _driver(tiny, tmp_path / "first", Checkpoints(at=stop), totalSteps=5, **algorithm)
    first.engines.hold = False
    first.run(max_steps=stop)
    # Every rollout not yet trained on is held, with the weights that generated it.
    state = first.checkpoints.saved[stop]
    assert {int(step): {s["weight_version"] for s in rollout["samples"]}
            for step, rollout in state["rollouts"].items()} == {step: {version} for step, version in held.items()}

    resumed = _driver(tiny, tmp_path / "resumed", Checkpoints(restored=state), totalSteps=5, **algorithm)
    resumed.restore()
    resumed.engines.hold = False  # the generations of a resumed run's first step need not overlap one
    resumed.run()
    # The held rollouts are not generated again; the rest as in the uninterrupted run.
    assert resumed.engines.calls == [call for call in whole.engines.calls if call[0] >= seed(max(held) + 1)]
    assert first.trainer.batches + resumed.trainer.batches == whole.trainer.batches


def test_a_checkpoint_written_before_max_staleness_restores_its_rollout(tiny, tmp_path):
    """Its driver state holds the one held rollout as ``rollout``: nothing saved is lost."""
    first = _driver(tiny, tmp_path / "first", Checkpoints())
    first.run(max_steps=1)
    first.save()
    state = first.checkpoints.saved[1]
    old = {**{k: v for k, v in state.items() if k != "rollouts"}, "rollout": state["rollouts"]["1"]}
    resumed = _driver(tiny, tmp_path / "resumed", Checkpoints(restored=old))
    resumed.restore()
    assert set(resumed._rollouts) == {1}
    resumed.run()
    assert resumed.engines.calls == [(seed(2), 1, True)]


def test_sigterm_checkpoints_the_held_rollout(tiny, tmp_path):
    driver = _driver(tiny, tmp_path, Checkpoints())
    driver.preemption.requested = True  # what SIGTERM sets
    code, results = driver.run()
    assert (code, len(results)) == (EXIT_PREEMPTED, 1)
    held = driver.checkpoints.saved[1]["rollouts"]["1"]
    assert [s["weight_version"] for s in held["samples"]] == [0] * 4
    assert held["task_rewards"] and set(held["metrics"]) >= {"groups_generated", "groups_dropped"}


def test_without_the_held_rollout_a_resume_would_train_on_newer_weights(tiny, tmp_path):
    """Why the checkpoint records it: regenerated, step 1's rollout comes from weights 1."""
    whole = _driver(tiny, tmp_path / "whole", Checkpoints())
    whole.run()
    first = _driver(tiny, tmp_path / "first", Checkpoints())
    first.run(max_steps=1)
    first.save()
    state = {k: v for k, v in first.checkpoints.saved[1].items() if k != "rollouts"}
    resumed = _driver(tiny, tmp_path / "resumed", Checkpoints(restored=state))
    resumed.restore()
    resumed.run()
    assert resumed.engines.calls[0] == (seed(1), 1, False)
    assert resumed.trainer.batches[0] != whole.trainer.batches[1]


@pytest.mark.parametrize(("algorithm", "field"), [({}, "asyncRollout"), (TWO_AHEAD, "maxStaleness")],
                         ids=["one-ahead", "two-ahead"])
def test_samples_without_engine_logprobs_are_refused(tiny, tmp_path, algorithm, field):
    driver = _driver(tiny, tmp_path, Checkpoints(), **algorithm)
    generate = driver.engines.generate

    def without_logprobs(*args, **kw):
        groups = generate(*args, **kw)
        for group in groups:
            for sample in group:
                sample.response_logprobs = None
        return groups

    driver.engines.generate = without_logprobs
    driver.engines.hold = False  # no trainer step will run to release the background rollouts
    with pytest.raises(ValueError, match=f"algorithm.{field}: samples .* came without the engines' log-probs"):
        driver.train_step(0)


@pytest.mark.parametrize("algorithm", [{}, TWO_AHEAD], ids=["one-ahead", "two-ahead"])
def test_with_tis_the_ratio_is_against_the_trainers_logprobs_and_the_engines_weigh_it(tiny, tmp_path, algorithm):
    # algorithm.tis asynchronous: the PPO ratio is taken against the trainer's own log-probs (its
    # weights now, up to maxStaleness steps ahead of the rollout's) and the truncated importance
    # weight carries the engines' (the samples keep them) to those: decoupled PPO.
    driver = _driver(tiny, tmp_path, Checkpoints(), tis={"cap": 2.0}, **algorithm)
    driver.trainer.log_probs = lambda batch: [[-9.0] * len(s.response_ids) for s in batch.samples]
    code, _ = driver.run()
    assert code == 0
    for batch in driver.trainer.batches:
        for _, old, _, _ in batch:
            assert old == [-9.0] * len(old)
