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
    promises: the engines never get weights while a rollout is out, a step trains on a complete
    rollout of its own step, from weights at most ``k`` versions older than the trainer's."""

    total: int
    k: int  # maxStaleness
    version: int = 0
    weights: str = "initial"
    held: dict[int, Rollout] = field(default_factory=dict)
    fresh: frozenset[int] = frozenset()  # versions the engines must hold after their step (validation)
    trained: list[Rollout] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine_weights, self.engine_version = self.weights, self.version
        self.rollouts: dict[int, Rollout] = dict(self.held)
        self.generating: set[int] = set()  # out in the background, possibly across step boundaries

    def step(self, n: int) -> None:
        assert n == self.version
        for action in step_actions(n, self.total, max_staleness=self.k, held=set(self.rollouts),
                                   engines=self.engine_version, fresh=self.fresh.__contains__):
            if isinstance(action, Generate):
                assert action.version == self.engine_version and action.step not in self.rollouts
                self.rollouts[action.step] = Rollout(action.step, self.engine_version,
                                                     _hash(action.step, self.engine_weights))
                if action.overlap:
                    self.generating.add(action.step)
            elif isinstance(action, Train):
                rollout = self.rollouts.pop(action.step)
                self.generating.discard(action.step)  # the driver waits for it
                assert rollout.step == action.step and 0 <= self.version - rollout.version <= self.k
                self.trained.append(rollout)
                self.weights, self.version = _hash(self.weights, rollout), self.version + 1
            elif isinstance(action, Wait):
                self.generating.discard(action.step)
            else:
                assert isinstance(action, Sync) and not self.generating and action.version == self.version
                self.engine_weights, self.engine_version = self.weights, action.version

    def checkpoint(self) -> tuple[int, str, dict[int, Rollout]]:
        """What a checkpoint at this boundary holds: step, trainer weights, the held rollouts
        (the driver waits for those still generating)."""
        self.generating.clear()
        assert all(step >= self.version for step in self.rollouts)
        return self.version, self.weights, dict(self.rollouts)


def test_the_synchronous_step():
    assert step_actions(0, 3, max_staleness=0, held=set(), engines=0) == [Generate(0, 0), Train(0), Sync(1)]
    assert step_actions(2, 3, max_staleness=0, held=set(), engines=2) == [Generate(2, 2), Train(2), Sync(3)]


def test_the_one_step_asynchronous_steps():
    assert step_actions(0, 3, max_staleness=1, held=set(), engines=0) == [
        Generate(0, 0), Generate(1, 0, overlap=True), Train(0), Wait(1), Sync(1)]
    assert step_actions(1, 3, max_staleness=1, held={1}, engines=1) == [
        Generate(2, 1, overlap=True), Train(1), Wait(2), Sync(2)]
    assert step_actions(2, 3, max_staleness=1, held={2}, engines=2) == [Train(2), Sync(3)]  # the last generates nothing


def test_two_steps_ahead_syncs_every_second_step():
    assert step_actions(0, 6, max_staleness=2, held=set(), engines=0) == [
        Generate(0, 0), Generate(1, 0, overlap=True), Generate(2, 0, overlap=True), Train(0)]
    assert step_actions(1, 6, max_staleness=2, held={1, 2}, engines=0) == [Train(1), Wait(2), Sync(2)]
    assert step_actions(2, 6, max_staleness=2, held={2}, engines=2) == [
        Generate(3, 2, overlap=True), Generate(4, 2, overlap=True), Train(2)]
    # Validation after step 4 needs the engines on weights 4: a sync there too.
    assert step_actions(3, 6, max_staleness=3, held={3, 4, 5}, engines=3, fresh={4}.__contains__) == [
        Train(3), Wait(4), Sync(4)]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_staleness_is_bounded_by_k(k):
    run = Run(total=7, k=k)
    for n in range(7):
        run.step(n)
    # The weights each step trained on: its own synchronous; else the last sync point's before
    # it (every k steps), except the first step, which has no earlier rollout.
    want = {0: [0, 1, 2, 3, 4, 5, 6], 1: [0, 0, 1, 2, 3, 4, 5], 2: [0, 0, 0, 2, 2, 4, 4],
            3: [0, 0, 0, 0, 3, 3, 3]}[k]
    assert [r.version for r in run.trained] == want
    assert [r.step for r in run.trained] == list(range(7))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("fresh", [frozenset(), frozenset({2, 5})])
def test_a_resumed_run_repeats_the_uninterrupted_one(k, fresh):
    """The driver's choice: the checkpoint records the held rollouts and the resumed run trains
    on them; what it generates later comes from weights the checkpoint has, at the same sync
    points. From every boundary, with and without syncs for validation between the regular ones."""
    total = 8
    whole = Run(total=total, k=k, fresh=fresh)
    for n in range(total):
        whole.step(n)
    for stop in range(1, total):
        first = Run(total=total, k=k, fresh=fresh)
        for n in range(stop):
            first.step(n)
        step, weights, held = first.checkpoint()
        assert bool(held) == (k > 0)  # asynchronous: step `stop`'s rollout (and more), from older weights
        resumed = Run(total=total, k=k, version=step, weights=weights, held=held, fresh=fresh)
        for n in range(step, total):
            resumed.step(n)
        assert first.trained + resumed.trained == whole.trained, stop
        assert resumed.weights == whole.weights


@pytest.mark.parametrize("k", [1, 2])
def test_regenerating_the_held_rollouts_would_not_repeat_the_run(k):
    """Why the checkpoint records the held rollouts: regenerated after a resume, they would come
    from the checkpoint's weights, not from the older ones the uninterrupted run used."""
    whole = Run(total=4, k=k)
    for n in range(4):
        whole.step(n)
    first = Run(total=4, k=k)
    first.step(0)
    first.step(1)
    step, weights, _ = first.checkpoint()
    regenerated = Run(total=4, k=k, version=step, weights=weights)
    for n in range(step, 4):
        regenerated.step(n)
    assert regenerated.trained[0].version == 2 != whole.trained[2].version
    assert regenerated.weights != whole.weights


def test_a_step_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="step 3 is outside the run's 3 steps"):
        step_actions(3, 3, max_staleness=1, held=set(), engines=3)
