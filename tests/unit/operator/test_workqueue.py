"""The operator's work queue: its pure transitions, then the asyncio wiring against a test double
for the reconcile (no API server: what a reconcile does is tested in test_reconcile.py and
test_operator_cluster.py)."""

from __future__ import annotations

import asyncio

import pytest

from kuberl_operator.workqueue import QueueState, WorkQueue, newer

A, B = ("ns", "a"), ("ns", "b")


def obj(uid: str, version: str) -> dict:
    return {"metadata": {"uid": uid, "resourceVersion": version}}


# -- pure transitions --------------------------------------------------------------------------

def test_a_trigger_during_a_run_runs_it_once_more_and_further_ones_merge():
    q = QueueState()
    assert q.request(A) is True
    assert q.request(B) is True  # other jobs run alongside
    assert q.request(A) is False
    assert q.request(A) is False
    assert q.finished(A) is True  # once more, for both triggers
    assert q.finished(A) is False
    assert q.request(A) is True


def test_an_abandoned_run_leaves_nothing_behind():
    q = QueueState()
    q.request(A)
    q.request(A)
    q.abandon(A)
    assert q.request(A) is True and q.finished(A) is False


def test_the_earlier_of_two_pending_deadlines_wins():
    q = QueueState()
    assert q.schedule(A, at=10, now=0) is True
    assert q.schedule(A, at=20, now=1) is False
    assert q.schedule(A, at=5, now=1) is True
    assert q.fire(A, 10) is False  # the superseded timer does nothing
    assert q.fire(A, 5) is True
    assert q.schedule(A, at=30, now=6) is True  # fired: the next deadline is new


def test_a_deadline_already_past_is_replaced():
    q = QueueState()
    q.schedule(A, at=10, now=0)
    assert q.schedule(A, at=40, now=11) is True


def test_our_own_newer_status_write_is_reconciled_from():
    q = QueueState()
    cached = obj("u1", "7")
    assert q.latest(A, cached) is cached
    q.record_write(A, obj("u1", "9"))
    assert q.latest(A, cached)["metadata"]["resourceVersion"] == "9"
    q.forget(A)
    assert q.latest(A, cached) is cached


def test_only_the_echo_of_our_own_last_write_is_skipped():
    q = QueueState()
    assert not q.is_echo(A, obj("u1", "9"))          # nothing written yet
    q.record_write(A, obj("u1", "9"))
    assert q.is_echo(A, obj("u1", "9"))
    assert not q.is_echo(A, obj("u1", "10"))         # someone else's write after ours
    assert not q.is_echo(A, obj("u2", "9"))          # a job recreated under the same name
    assert not q.is_echo(B, obj("u1", "9"))
    q.forget(A)
    assert not q.is_echo(A, obj("u1", "9"))


def test_an_owned_object_triggers_only_when_its_entry_changed_or_it_went():
    q = QueueState()
    pod = ("pods", "u1")
    assert q.entry_changed(A, pod, {"phase": "Pending"})        # first seen (also after a restart)
    assert not q.entry_changed(A, pod, {"phase": "Pending"})    # an update of fields not indexed
    assert q.entry_changed(A, pod, {"phase": "Running"})
    assert not q.entry_changed(A, pod, {"phase": "Running"})
    assert q.entry_changed(A, ("rayjobs", "u1"), {"phase": "Running"})  # another kind, same uid
    assert q.entry_changed(A, pod, {"phase": "Running"}, gone=True)
    assert pod not in q.entries[A]
    assert q.entry_changed(A, pod, {"phase": "Running"})        # nothing kept of a deleted one


def test_a_forgotten_job_keeps_no_entry_of_its_owned_objects():
    q = QueueState()
    q.entry_changed(A, ("pods", "u1"), {"phase": "Running"})    # its DELETED event never comes
    q.entry_changed(A, ("rayjobs", "u2"), {"phase": "Running"})
    q.forget(A)
    assert A not in q.entries


@pytest.mark.parametrize("cached, written", [
    (obj("u1", "9"), obj("u1", "8")),     # the watch caught up
    (obj("u2", "1"), obj("u1", "9")),     # a job recreated under the same name
    (obj("u1", "7"), obj("u1", "x")),     # not an etcd revision
])
def test_the_watchs_copy_wins_unless_ours_is_provably_newer(cached, written):
    assert newer(cached, written) is cached


# -- asyncio wiring ------------------------------------------------------------------------------

class Reconciler:
    """Test double for the Controller's reconcile: records each run, holds it until released and
    returns the given requeue delay."""

    def __init__(self, requeue: float | None = None) -> None:
        self.requeue = requeue
        self.runs: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.active = 0
        self.most_active = 0

    async def __call__(self, key):
        self.runs.append(key)
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await self.release.wait()
        finally:
            self.active -= 1
        return self.requeue


def test_triggers_during_a_reconcile_coalesce_into_one_more_run():
    async def scenario():
        rec = Reconciler()
        queue = WorkQueue(rec, lambda: [A], resync_seconds=3600)
        rec.release.clear()
        first = asyncio.ensure_future(queue.trigger(A))
        await asyncio.sleep(0)
        await asyncio.gather(*(queue.trigger(A) for _ in range(5)))  # merged: return at once
        rec.release.set()
        await first
        return rec

    rec = asyncio.run(scenario())
    assert rec.runs == [A, A]
    assert rec.most_active == 1


def test_a_requeue_runs_the_job_again_after_its_delay():
    async def scenario():
        rec = Reconciler(requeue=0.05)
        queue = WorkQueue(rec, lambda: [A], resync_seconds=3600)
        await queue.trigger(A)
        rec.requeue = None
        await asyncio.sleep(0.3)
        return rec

    assert asyncio.run(scenario()).runs == [A, A]


def test_a_forgotten_job_is_not_requeued():
    async def scenario():
        rec = Reconciler(requeue=0.05)
        queue = WorkQueue(rec, lambda: [A], resync_seconds=3600)
        await queue.trigger(A)
        queue.forget(A)
        await asyncio.sleep(0.2)
        return rec

    assert asyncio.run(scenario()).runs == [A]


def test_the_resync_triggers_every_job():
    async def scenario():
        rec = Reconciler()
        queue = WorkQueue(rec, lambda: [A, B], resync_seconds=0.05)
        resync = asyncio.ensure_future(queue.resync_forever())
        while len(rec.runs) < 2:
            await asyncio.sleep(0.01)
        resync.cancel()
        return rec

    assert sorted(asyncio.run(scenario()).runs[:2]) == [A, B]


def test_timer_and_resync_reconciles_run_in_the_handlers_context():
    """kopf.event needs kopf's context variables: a reconcile started by a requeue timer or the
    resync (outside any handler) must still see them, or its Events are lost."""
    import contextvars

    settings = contextvars.ContextVar("settings")
    seen: list[str] = []

    async def reconcile(key):
        seen.append(settings.get("missing"))
        return 0.05 if len(seen) == 1 else None

    async def scenario():
        queue = WorkQueue(reconcile, lambda: [A], resync_seconds=0.05)

        async def handler():  # what kopf runs, with its variables set
            settings.set("kopf")
            queue.adopt_context()
            await queue.trigger(A)

        await asyncio.get_running_loop().create_task(handler(), context=contextvars.Context())
        resync = asyncio.get_running_loop().create_task(queue.resync_forever())  # outside any handler
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        resync.cancel()

    asyncio.run(scenario())
    assert seen[:3] == ["kopf", "kopf", "kopf"]  # the handler's run, the timer's, the resync's
