"""The driver's side of checkpoints: when to save, and the commit that follows every rank's
upload. The ranks write, upload, commit and restore (``kuberl.train.checkpoint``).
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from kuberl.job.plan import Checkpoints, Resume

log = logging.getLogger("kuberl.train")


class CheckpointManager:
    """The driver's side: when to save, and the commit that follows every rank's upload.

    ``trainer`` is the ``TrainerGroup`` (``save_checkpoint``, ``checkpoint_uploaded``,
    ``commit_checkpoint``, ``find_checkpoint``, ``load_checkpoint``)."""

    def __init__(self, checkpoints: Checkpoints, resume: Resume, trainer: Any,
                 on_committed: Callable[[str, int], None] = lambda uri, step: None,
                 on_restored: Callable[[str, int], None] = lambda uri, step: None):
        self.spec = checkpoints
        self.resume = resume
        self.trainer = trainer
        self.on_committed = on_committed
        self.on_restored = on_restored
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._pending: Future | None = None

    @property
    def enabled(self) -> bool:
        return self.spec.root is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.spec.interval_steps == 0

    def save(self, step: int, driver_state: dict[str, Any]) -> float:
        """Start checkpoint ``step`` on every rank; commit it in the background once all are
        durable. Returns the stall training saw."""
        self.wait()  # one checkpoint in flight at a time; also surfaces the previous one's error
        stall = self.trainer.save_checkpoint(step)
        self._pending = self._committer.submit(self._commit, step, copy.deepcopy(driver_state))
        return stall

    def _commit(self, step: int, driver_state: dict) -> str:
        files = self.trainer.checkpoint_uploaded(step)
        uri = self.trainer.commit_checkpoint(step, files, driver_state)
        self.on_committed(uri, step)
        return uri

    def wait(self) -> str | None:
        """Block until the pending checkpoint is committed; re-raise its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending else None

    def settle(self) -> None:
        """A trainer rank was lost: wait for the commit under way, which completes if every rank
        had uploaded its shards (a checkpoint like any other) and otherwise fails with the lost
        rank (``TrainerLost``, at once): logged and dropped, never raised later."""
        pending, self._pending = self._pending, None
        error = pending.exception() if pending is not None else None
        if error is not None:
            log.warning("the checkpoint commit under way when the trainer group was lost did not finish (%s): "
                        "the newest complete checkpoint is restored", error)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._committer.shutdown(wait=True)

    def restore(self) -> dict[str, Any] | None:
        """Restore what the plan says into every rank; the driver's state, or None (fresh run)."""
        source = self.trainer.find_checkpoint(self.resume)
        if source is None:
            return None
        state = self.trainer.load_checkpoint(source)
        self.on_restored(source, state["step"])
        return state
