"""The driver's end of the preemption notice: a pod of the job that is going (``kubectl delete
pod``, a node drain, a spot notice) tells the driver through its preStop hook (``kuberl
preemption-notice``, ``kuberl.cli.notice``), and the hook holds the pod until a checkpoint
covering the step in flight is committed.

The board is a named Ray actor on the driver's own node (the head), so it lives exactly as long as
the driver: a hook that finds no board, or whose board dies, knows at once that nobody will
checkpoint and lets the pod go. The driver reads the board once per step boundary (one small
actor call); a checkpoint is never taken mid-step, since a trainer mid-update has no consistent
state to save.
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kuberl.api.contract import NOTICE_ACTOR, RAY_NAMESPACE

log = logging.getLogger("kuberl.train")


@ray.remote(num_cpus=0, max_restarts=0)
class NoticeBoard:
    """What the going pods said and what the driver committed since. ``notice`` is the hook's;
    ``boundary`` and ``committed`` are the driver's."""

    def __init__(self, checkpoints: bool):
        self._checkpoints = checkpoints
        self._noticed: list[str] = []
        self._head = False  # the head among them
        self._step = 0  # steps completed at the last boundary
        self._in_flight = True  # a step runs after it (not while the driver holds)
        self._recovering = False  # the trainer group is being recovered: nothing more to checkpoint
        self._committed = -1  # the newest committed checkpoint's step

    def notice(self, pod: str, head: bool = False) -> int | None:
        """Pod ``pod`` (the head, the driver's own pod, if ``head``) is going: the step its hook
        waits to see committed (the step in flight, or the last one while the driver holds,
        already checkpointed), or None when the job has no checkpoint.uri (nothing to wait for)."""
        if not self._checkpoints:
            return None
        if not self._recovering:  # while it is, the hook is released at once (``released``)
            self._noticed.append(pod)
            self._head |= head
        return self._step + self._in_flight

    def released(self, step: int) -> str | None:
        """Why a hook waiting for checkpoint ``step`` may let its pod go now, or None to wait on."""
        if self._committed >= step:
            return f"checkpoint step {step} (the step in flight at the notice) is committed"
        if self._recovering:
            return ("the trainer group is being recovered, so nothing more is checkpointed: the newest "
                    f"checkpoint ({'none' if self._committed < 0 else f'step {self._committed}'}) is restored")
        return None

    def boundary(self, step: int, in_flight: bool) -> tuple[list[str], bool]:
        """The driver is at the boundary after ``step``, and runs the next step (``in_flight``) or
        holds: the pods noticed since the last boundary, and whether the head is among them."""
        self._step, self._in_flight = step, in_flight
        noticed, head, self._noticed, self._head = self._noticed, self._head, [], False
        return noticed, head

    def recovering(self, active: bool) -> None:
        self._recovering = active

    def committed(self, step: int) -> None:
        self._committed = max(self._committed, step)


class Notices:
    """The driver's handle on its board, started on the driver's node."""

    def __init__(self, checkpoints: bool):
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self._board = NoticeBoard.options(name=NOTICE_ACTOR, namespace=RAY_NAMESPACE,
                                          scheduling_strategy=here).remote(checkpoints)

    def take(self, step: int, in_flight: bool = True) -> tuple[list[str], bool]:
        """At the boundary after ``step``: the pods that gave notice since the last boundary, and
        whether the head (the driver's own pod: the attempt ends with it) is among them.
        ``in_flight`` False: the driver holds (for a suspend, or while its head goes) with step
        ``step`` checkpointed, so a pod going now has nothing to wait for."""
        if self._board is None:
            return [], False
        try:
            return tuple(ray.get(self._board.boundary.remote(step, in_flight)))
        except ray.exceptions.RayActorError as lost:
            # A helper, not the run: training goes on; a going pod's hook then finds no board
            # and lets its pod go at once (the recovery restores the newest checkpoint).
            log.warning("the preemption notice board is lost (%s): pods that go from now on are not "
                        "checkpointed first", str(lost).splitlines()[0] if str(lost) else type(lost).__name__)
            self._board = None
            return [], False

    def recovering(self, active: bool) -> None:
        """The trainer group is being recovered (``active``), or is back: while it is, the hooks
        of going pods have nothing more to wait for."""
        if self._board is not None:
            self._board.recovering.remote(active)

    def committed(self, step: int) -> None:
        """Checkpoint ``step`` is committed: the hooks waiting for it let their pods go."""
        if self._board is not None:
            self._board.committed.remote(step)
