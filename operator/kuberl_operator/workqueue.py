"""The operator's work queue: which job reconciles when, apart from what a reconcile does.

Like client-go's workqueue and KubeRay's ``expectations`` package, the bookkeeping is a pure state
(``QueueState``: plain sets and dicts, the clock passed in) whose transitions are unit-tested on
their own; ``WorkQueue`` only wires it to asyncio.

- **One at a time, coalesced.** A job never reconciles twice at once. A trigger arriving while
  its job reconciles marks it to run once more afterwards; any further triggers until then merge
  into that one run (the reconcile reads the newest cached object, so nothing is lost).
- **Requeue timers.** A plan's ``requeue_after`` (restart backoff, TTL, a suspend's checkpoint
  wait) schedules one more reconcile; of two pending deadlines for a job the earlier wins.
- **Write tracking.** The job as our own last status write returned it: the watch may not have
  delivered it yet, and reconciling from the older cached copy would repeat transitions and events.
  When the watch does deliver it (the same resourceVersion), that echo triggers nothing.
- **Changes only.** An owned object's watch event triggers its job only if what the job's
  reconcile reads of the object (its index entry) changed: the reconcile is a function of those
  entries, the job and the clock, so an event that leaves the entry as it was would plan the same
  writes again. Most of KubeRay's and kubelet's updates touch nothing the operator reads.
- **Resync.** Every job is triggered every ``resync_seconds``, the safety net of a
  level-triggered controller.

kopf's indices hold what the watches saw (``handlers``). kopf's own timers and daemons do not
serve for the resync or the requeues (kopf 1.45): ``@kopf.timer`` and ``@kopf.daemon`` are
registered with ``requires_finalizer=True``, so kopf would patch a finalizer onto every job (one
more write per job, and deleting a job would then wait for the operator to remove it); each runs
one asyncio task per job for the job's whole life (1,000 sleeping tasks for 1,000 jobs, where
this queue keeps one timer handle per job that asked for one); and a timer's interval is fixed
per handler, where a plan asks for its own delay (the restart backoff, the TTL, a suspend's poll).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, str]  # (namespace, name) of an RLTrainingJob


def newer(cached: dict[str, Any], written: dict[str, Any] | None) -> dict[str, Any]:
    """The newer of two copies of one object. resourceVersion is opaque by contract, but the API
    server's are etcd revisions; anything not an integer falls back to the watch's copy."""
    if written is None or written["metadata"].get("uid") != cached["metadata"].get("uid"):
        return cached
    try:
        is_newer = int(written["metadata"]["resourceVersion"]) > int(cached["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return cached
    return written if is_newer else cached


@dataclass
class QueueState:
    """The queue's state; every method is a pure transition (times are the caller's clock)."""

    running: set[Key] = field(default_factory=set)
    again: set[Key] = field(default_factory=set)   # triggered while running: run once more
    due: dict[Key, float] = field(default_factory=dict)
    written: dict[Key, dict[str, Any]] = field(default_factory=dict)
    # Per job, (kind, uid) of each owned object -> its index entry when it last triggered the job;
    # kept by job so that a job's ``forget`` drops them all, a DELETED event missed in a watch gap
    # included.
    entries: dict[Key, dict[tuple[str, str], Any]] = field(default_factory=dict)

    def request(self, key: Key) -> bool:
        """A trigger for ``key``: True if the caller is to reconcile it now, False if it merged
        into the run in flight (which then runs once more)."""
        if key in self.running:
            self.again.add(key)
            return False
        self.running.add(key)
        return True

    def finished(self, key: Key) -> bool:
        """A reconcile of ``key`` ended: True if a trigger arrived meanwhile and it is to run again."""
        if key in self.again:
            self.again.discard(key)
            return True
        self.running.discard(key)
        return False

    def abandon(self, key: Key) -> None:
        """A reconcile of ``key`` was cancelled (the operator stops): nothing runs for it any more."""
        self.running.discard(key)
        self.again.discard(key)

    def schedule(self, key: Key, at: float, now: float) -> bool:
        """Ask for a reconcile of ``key`` at ``at``: True if that is a new deadline (the timer is to
        be (re)armed), False if an earlier one is still pending."""
        pending = self.due.get(key)
        if pending is not None and now < pending <= at:
            return False
        self.due[key] = at
        return True

    def fire(self, key: Key, at: float) -> bool:
        """The timer armed for ``at`` went off: True if it is still the deadline of ``key``."""
        if self.due.get(key) != at:
            return False
        del self.due[key]
        return True

    def record_write(self, key: Key, obj: dict[str, Any]) -> None:
        self.written[key] = obj

    def is_echo(self, key: Key, event: dict[str, Any]) -> bool:
        """``event`` (a watch event's copy of job ``key``) is our own last status write coming back:
        the reconcile that wrote it had already done everything that state asks for, so it needs
        no reconcile. Any other write (the user's, the driver's) has another resourceVersion."""
        written = self.written.get(key)
        if written is None:
            return False
        ours, theirs = written["metadata"], event.get("metadata") or {}
        return ours.get("uid") == theirs.get("uid") and ours.get("resourceVersion") == theirs.get("resourceVersion")

    def entry_changed(self, key: Key, obj: tuple[str, str], entry: Any, gone: bool = False) -> bool:
        """An owned object ``obj`` ((kind, uid)) of job ``key`` was seen with index ``entry``
        (``gone``: deleted): True if the job is to reconcile, which is when the entry differs from
        the last one that triggered (or the object went). A reconcile that failed retries on its
        own requeue."""
        seen = self.entries.setdefault(key, {})
        if gone:
            seen.pop(obj, None)
            if not seen:
                del self.entries[key]
            return True
        if obj in seen and seen[obj] == entry:
            return False
        seen[obj] = entry
        return True

    def latest(self, key: Key, cached: dict[str, Any]) -> dict[str, Any]:
        """The copy of job ``key`` to reconcile from: the cached one or our own newer write."""
        return newer(cached, self.written.get(key))

    def forget(self, key: Key) -> None:
        """``key`` is gone: drop its deadline, its written copy and its owned objects' entries."""
        self.due.pop(key, None)
        self.written.pop(key, None)
        self.entries.pop(key, None)


class WorkQueue:
    """``QueueState`` driven by the running asyncio loop.

    ``reconcile(key)`` reconciles one job and returns seconds until it wants another look, or None;
    ``keys()`` lists every job (for the resync).
    """

    def __init__(self, reconcile: Callable[[Key], Awaitable[float | None]], keys: Callable[[], Iterable[Key]],
                 resync_seconds: float) -> None:
        self.reconcile = reconcile
        self.keys = keys
        self.resync_seconds = resync_seconds
        self.state = QueueState()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        # The context the reconciles that no watch event started (requeue timers, the resync) run
        # in: kopf's (``adopt_context``, from a handler), whose ``kopf.event`` needs its context
        # variables; without them those reconciles' Events were lost (LookupError: settings_var).
        self.context: contextvars.Context | None = None

    def adopt_context(self) -> None:
        """Called from inside a kopf handler: later reconciles run in a copy of its context."""
        if self.context is None:
            self.context = contextvars.copy_context()

    def _spawn(self, key: Key) -> None:
        asyncio.get_running_loop().create_task(self.trigger(key), context=self.context and self.context.copy())

    async def trigger(self, key: Key) -> None:
        """Reconcile ``key`` now, or once more after the run in flight."""
        if not self.state.request(key):
            return
        again = True
        while again:
            try:
                requeue = await self.reconcile(key)
            except BaseException:
                self.state.abandon(key)
                raise
            if requeue is not None:
                self.requeue(key, requeue)
            again = self.state.finished(key)

    def requeue(self, key: Key, delay: float) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time() + delay
        if not self.state.schedule(key, at, loop.time()):
            return
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = loop.call_at(at, self._fire, key, at)

    def _fire(self, key: Key, at: float) -> None:
        if self.state.fire(key, at):
            self._timers.pop(key, None)
            self._spawn(key)

    def forget(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self.state.forget(key)

    async def resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.keys()):
                self._spawn(key)
