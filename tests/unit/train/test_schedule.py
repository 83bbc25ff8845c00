"""The step schedule (kuberl.driver.schedule) driven by stand-in engines and a stand-in trainer.

The stand-ins replace the vLLM engines and the FSDP trainer ranks, which are Ray actors that this
unit test cannot start (tests/engine/driver/test_async_e2e.py runs the real ones). They keep only what
the schedule's guarantees are about: a rollout is a pure function of the step (its prompts and
sampling seed) and of the weights the engines hold, as vLLM's seeded sampling is; a training step
turns the trainer's weights and a rollout into new weights. Weights are hashes, so any difference
in what was trained on, in any order, shows in the final weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pytest

from kuberl.driver.schedule import Generate, Sync, Train, Wait, step_actions


def _hash(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Rollout:
    step: int
    version: int   # the weights that generated it
    tokens: str


@dataclass
class Run:
    """Executes the schedule's actions on the stand-ins and checks, as it goes, what the schedule
    promises: the engines never get weights while generating, one generation at a time, a step
    trains on a complete rollout of its own step."""

    total: int
    one_step_async: bool
    version: int = 0
    weights: str = "initial"
    held: Rollout | None = None
    trained: list[Rollout] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine_weights, self.engine_version = self.weights, self.version
        self.rollouts: dict[int, Rollout] = {self.held.step: self.held} if self.held else {}

    def step(self, n: int) -> None:
        assert n == self.version
        generating: set[int] = set()
        for action in step_actions(n, self.total, one_step_async=self.one_step_async, held=n in self.rollouts):
            if isinstance(action, Generate):
                assert not generating and action.version == self.engine_version
                self.rollouts[action.step] = Rollout(action.step, self.engine_version,
                                                     _hash(action.step, self.engine_weights))
                if action.overlap:
                    generating.add(action.step)
            elif isinstance(action, Train):
                rollout = self.rollouts.pop(action.step)
                assert action.step not in generating and rollout.step == action.step
                self.trained.append(rollout)
                self.weights, self.version = _hash(self.weights, rollout), self.version + 1
            elif isinstance(action, Wait):
                generating.remove(action.step)
            else:
                assert isinstance(action, Sync) and not generating and action.version == self.version
                self.engine_weights, self.engine_version = self.weights, action.version
        assert not generating  # a step boundary: nothing is being generated

    def checkpoint(self) -> tuple[int, str, Rollout | None]:
        """What a checkpoint at this boundary holds: step, trainer weights, the held rollout."""
        assert set(self.rollouts) <= {self.version}
        return self.version, self.weights, self.rollouts.get(self.version)


def test_the_synchronous_step():
    assert step_actions(0, 3, one_step_async=False, held=False) == [Generate(0, 0), Train(0), Sync(1)]
    assert step_actions(2, 3, one_step_async=False, held=False) == [Generate(2, 2), Train(2), Sync(3)]


def test_the_one_step_asynchronous_steps():
    assert step_actions(0, 3, one_step_async=True, held=False) == [
        Generate(0, 0), Generate(1, 0, overlap=True), Train(0), Wait(1), Sync(1)]
    assert step_actions(1, 3, one_step_async=True, held=True) == [
        Generate(2, 1, overlap=True), Train(1), Wait(2), Sync(2)]
    assert step_actions(2, 3, one_step_async=True, held=True) == [Train(2), Sync(3)]  # the last generates nothing


@pytest.mark.parametrize("one_step_async", [False, True])
def test_staleness_is_bounded_by_one_step(one_step_async):
    run = Run(total=6, one_step_async=one_step_async)
    for n in range(6):
        run.step(n)
    # The weights each step trained on: its own synchronous; the previous step's asynchronous,
    # except the first step, which has no earlier rollout.
    want = list(range(6)) if not one_step_async else [0, 0, 1, 2, 3, 4]
    assert [r.version for r in run.trained] == want
    assert [r.step for r in run.trained] == list(range(6))


@pytest.mark.parametrize("one_step_async", [False, True])
def test_a_resumed_run_repeats_the_uninterrupted_one(one_step_async):
    """The driver's choice: the checkpoint records the held rollout and the resumed run trains
    on it; what it generates later comes from weights the checkpoint has."""
    total = 7
    whole = Run(total=total, one_step_async=one_step_async)
    for n in range(total):
        whole.step(n)
    for stop in range(1, total):
        first = Run(total=total, one_step_async=one_step_async)
        for n in range(stop):
            first.step(n)
        step, weights, held = first.checkpoint()
        assert (held is not None) == one_step_async  # asynchronous: step `stop`'s rollout, from weights stop - 1
        resumed = Run(total=total, one_step_async=one_step_async, version=step, weights=weights, held=held)
        for n in range(step, total):
            resumed.step(n)
        assert first.trained + resumed.trained == whole.trained, stop
        assert resumed.weights == whole.weights


def test_regenerating_the_held_rollout_would_not_repeat_the_run():
    """Why the checkpoint records the held rollout: regenerated after a resume, it would come
    from the checkpoint's weights, not from the one-step-older ones the uninterrupted run used."""
    whole = Run(total=4, one_step_async=True)
    for n in range(4):
        whole.step(n)
    first = Run(total=4, one_step_async=True)
    first.step(0)
    first.step(1)
    step, weights, _ = first.checkpoint()
    regenerated = Run(total=4, one_step_async=True, version=step, weights=weights)
    for n in range(step, 4):
        regenerated.step(n)
    assert regenerated.trained[0].version == 2 != whole.trained[2].version == 1
    assert regenerated.weights != whole.weights


def test_a_step_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="step 3 is outside the run's 3 steps"):
        step_actions(3, 3, one_step_async=True, held=False)
