"""Which rollouts the engines generate, which one the trainer trains on, and when the engines get
new weights, for a staleness bound ``k`` (``spec.algorithm.maxStaleness``; ``asyncRollout`` is
``k = 1``, neither is ``k = 0``, synchronous).

Pure: ``step_actions`` lists what one step does and the driver (``Driver.train_step``) does
it. Weight version ``v`` is the model after ``v`` training steps (0: the initial one); the
trainer holds version ``n`` when step ``n`` starts and ``n + 1`` when it ends.

The engines get new weights only at *sync points* (``syncs_at``): every step synchronous and with
``k = 1``; with ``k >= 2`` every ``k`` steps, and besides at the run's end and where the driver
needs the engines on the trainer's weights (validation). Between two sync points ``s < s'`` the
engines hold ``s`` and generate, one after another in the background, the rollouts of steps
``s + 1 .. s'`` (each the moment the engines hold ``s``: all of them are submitted at step ``s``),
while the trainer trains steps ``s .. s' - 1`` on the rollouts it holds. So the rollout of step
``m`` comes from the last sync point before it, at most ``k`` versions old, and a trainer step
waits only for its own rollout; the engines and the trainer meet once per ``k`` steps, at the sync,
which waits for every rollout generated with the old weights (the longest response of ``k``
rollouts, where ``k = 1`` waits for one rollout's every step).

Synchronous, step ``n``::

    Generate(n, version=n)       the engines generate step n's rollout with weights n
    Train(n)                     the trainer updates n -> n + 1 on it
    Sync(n + 1)                  the engines get weights n + 1

``k = 1``, step ``n`` (step ``n``'s rollout was generated during step ``n - 1``)::

    Generate(n + 1, version=n, overlap=True)    in the background, with weights n
    Train(n)                                    meanwhile; step n's rollout came from weights n - 1
    Wait(n + 1)                                 step n + 1's rollout is complete
    Sync(n + 1)                                 only now the engines get weights n + 1

``k = 2``, steps ``n`` (a sync point) and ``n + 1``::

    Generate(n + 1, version=n, overlap=True)    in the background, with weights n,
    Generate(n + 2, version=n, overlap=True)    one after the other
    Train(n)                                    on step n's rollout, from weights n - 2
    Train(n + 1)                                on step n + 1's, from weights n, once it is complete
    Wait(n + 2)
    Sync(n + 2)

Partial rollouts are kept, never aborted: no request is in flight when weights change (the sync
waits, and the engine's own update pauses vLLM in ``wait`` mode), so every sample comes from one
weight version, whole, with that policy's log-probs. The importance ratio of a step is therefore
taken against the log-probs the engines returned with the samples (the behaviour policy's); the
trainer's weights are already ahead of them (with ``algorithm.tis``: against the trainer's own,
the truncated weight correcting from the engines' to those). Aborting and continuing a request
under new weights would shorten the sync's wait for the longest response, but the point where a
response changes weights would be whenever the sync happened to come: a run could not repeat
itself, nor a resumed run the uninterrupted one.

The first step of a run (or of a resumed run whose checkpoint holds no rollout) generates its
own rollout first, with its own weights; the last step generates nothing. At a step boundary
rollouts of later steps may be held, generated (or, ``k >= 2``, still generating) with weights
older than the trainer's, which a checkpoint of that step no longer has, so a resumed run could not
regenerate them: the checkpoint waits for them and records them all (``Driver.save``), and the
resumed run trains on them (``held``); its engines generate nothing until the next sync point,
as in the uninterrupted run. Everything generated later comes from weights the checkpoint has,
at the same sync points, with sampling seeds that are a function of (seed, step), so the resumed
run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection


@dataclass(frozen=True)
class Generate:
    """Generate ``step``'s rollout on the engines, which hold weights ``version``; ``overlap``: in
    the background, beside the trainer (else now, nothing else running)."""

    step: int
    version: int
    overlap: bool = False


@dataclass(frozen=True)
class Train:
    """Train on ``step``'s rollout (waiting for it if it is still generating): the trainer's
    weights go from ``step`` to ``step + 1``."""

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


def _never(version: int) -> bool:
    return False


def syncs_at(version: int, total_steps: int, max_staleness: int, fresh: Callable[[int], bool] = _never) -> bool:
    """Whether the engines get weights ``version`` (at the end of step ``version - 1``): every step
    for ``max_staleness`` 0 or 1; else every ``max_staleness`` steps, at the run's end, and where
    ``fresh`` says the engines must hold the trainer's weights (validation after that step)."""
    return max_staleness <= 1 or version % max_staleness == 0 or version >= total_steps or fresh(version)


def step_actions(step: int, total_steps: int, *, max_staleness: int, held: Collection[int], engines: int,
                 fresh: Callable[[int], bool] = _never) -> list[Action]:
    """What step ``step`` of ``total_steps`` does. ``held``: the steps whose rollouts are generated
    already (or being generated: submitted in an earlier step, or restored from a checkpoint), so
    not generated again; ``engines``: the weight version the engines hold; ``fresh``: as for
    ``syncs_at``."""
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside the run's {total_steps} steps")
    if not 0 <= engines <= step:
        raise ValueError(f"the engines hold weights {engines}, not one of the trainer's 0..{step} at step {step}")
    actions: list[Action] = [] if step in held else [Generate(step, version=engines)]
    # The steps whose rollouts come from the engines' weights: up to the next sync point.
    ahead = []
    if max_staleness:
        until = next(v for v in range(engines + 1, engines + max_staleness + 1)
                     if syncs_at(v, total_steps, max_staleness, fresh))
        ahead = list(range(step + 1, min(until, total_steps - 1) + 1))
    actions += [Generate(m, version=engines, overlap=True) for m in ahead if m not in held]
    actions.append(Train(step))
    if syncs_at(step + 1, total_steps, max_staleness, fresh):
        actions += [Wait(m) for m in ahead]
        actions.append(Sync(step + 1))
    return actions
