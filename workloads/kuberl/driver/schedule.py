"""Which rollout the engines generate, which one the trainer trains on, and when the engines get
new weights: the synchronous step and the one-step asynchronous one (``spec.algorithm.asyncRollout``).

Pure: ``step_actions`` lists what one step does and the driver (``Driver.train_step``) does
it. Weight version ``v`` is the model after ``v`` training steps (0: the initial one); the
trainer holds version ``n`` when step ``n`` starts, and the engines receive ``n + 1`` at its end.

Synchronous, step ``n``::

    Generate(n, version=n)       the engines generate step n's rollout with weights n
    Train(n)                     the trainer updates n -> n + 1 on it
    Sync(n + 1)                  the engines get weights n + 1

One-step asynchronous, step ``n`` (step ``n``'s rollout was generated during step ``n - 1``)::

    Generate(n + 1, version=n, overlap=True)    in the background, with weights n
    Train(n)                                    meanwhile; step n's rollout came from weights n - 1
    Wait(n + 1)                                 step n + 1's rollout is complete
    Sync(n + 1)                                 only now the engines get weights n + 1

So the rollout step ``n`` trains on came from weights ``n - 1``: one step stale, never more,
because the engines receive new weights only between two generations (the weight sync at the
step boundary, after step ``n``'s update and before step ``n + 2``'s generation starts). The
importance ratio is therefore taken against the log-probs the engines returned with the samples
(the behaviour policy's), not against log-probs the trainer recomputes: its weights are already
one step ahead of them. The first step of a run (or of a resumed run whose checkpoint holds no
rollout) generates its own rollout first, with its own weights; the last step generates nothing.

At a step boundary nothing is being generated: under the asynchronous schedule the engines have
finished step ``n + 1``'s rollout, which is held, not yet trained on. It came from weights ``n``,
which a checkpoint of step ``n + 1`` no longer has, so a resumed run could not regenerate it:
the checkpoint records it (``Driver.save``), and the resumed run trains on it (``held``).
Everything generated later comes from weights the checkpoint has, with sampling seeds that are a
function of (seed, step), so the resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Generate:
    """Generate ``step``'s rollout on the engines, which hold weights ``version``; ``overlap``: in
    the background, beside the trainer (else now, nothing else running)."""

    step: int
    version: int
    overlap: bool = False


@dataclass(frozen=True)
class Train:
    """Train on ``step``'s rollout: the trainer's weights go from ``step`` to ``step + 1``."""

    step: int


@dataclass(frozen=True)
class Wait:
    """Wait until ``step``'s rollout, generated in the background, is complete."""

    step: int


@dataclass(frozen=True)
class Sync:
    """Send weights ``version`` to the engines (none is generating)."""

    version: int


Action = Generate | Train | Wait | Sync


def step_actions(step: int, total_steps: int, *, one_step_async: bool, held: bool) -> list[Action]:
    """What step ``step`` of ``total_steps`` does. ``held``: its rollout is already generated
    (during the previous step, or restored from a checkpoint), so it is not generated again."""
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside the run's {total_steps} steps")
    actions: list[Action] = [] if held else [Generate(step, version=step)]
    ahead = one_step_async and step + 1 < total_steps
    if ahead:
        actions.append(Generate(step + 1, version=step, overlap=True))
    actions.append(Train(step))
    if ahead:
        actions.append(Wait(step + 1))
    actions.append(Sync(step + 1))
    return actions
