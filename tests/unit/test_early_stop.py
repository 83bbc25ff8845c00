"""tests/early_stop.py: a session fixture stops after the last test that uses it, and one set up on
another stops before it."""

from __future__ import annotations

from types import SimpleNamespace

from tests import early_stop
from tests.early_stop import last_user


def test_the_last_user_of_a_fixture_counts_fixtures_that_use_it():
    items = [SimpleNamespace(name="unit", fixturenames=["tmp_path"]),
             SimpleNamespace(name="cluster", fixturenames=["k8s_cluster"]),
             SimpleNamespace(name="queue", fixturenames=["kueue", "k8s_cluster"]),  # kueue's own
             SimpleNamespace(name="e2e", fixturenames=["real_cluster"])]
    assert last_user(items, "k8s_cluster").name == "queue"
    assert last_user(items[:1] + items[3:], "k8s_cluster") is None


def test_fixtures_stop_after_their_last_user_the_later_set_up_first(monkeypatch):
    items = [SimpleNamespace(fixturenames=["ray_session", "pool"]),
             SimpleNamespace(fixturenames=["ray_session", "pool"]),
             SimpleNamespace(fixturenames=["real_cluster"])]
    monkeypatch.setattr(early_stop, "_items", items)
    monkeypatch.setattr(early_stop, "_stops", {})
    stopped = []
    early_stop.stop_after_last_user("ray_session", lambda: stopped.append("ray"))
    early_stop.stop_after_last_user("pool", lambda: stopped.append("engines"))
    early_stop.stop_after_last_user("k8s_cluster", lambda: stopped.append("never used"))
    for item, nextitem in zip(items, items[1:] + [None]):
        teardown = early_stop.pytest_runtest_teardown(item, nextitem)
        next(teardown)  # the item's own teardown runs here
        next(teardown, None)
        assert stopped == ([] if item is items[0] else ["engines", "ray"])
