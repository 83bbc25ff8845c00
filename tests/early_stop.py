"""pytest plugin: session fixtures that stop after the last test that uses them, not at the end of
the session. The tiers run in turn, and a tier's session fixtures would otherwise idle through
the tiers after it: in CI the engine tier's Ray (its GCS, raylet, log monitor and the engines
kept for the session) and the cluster tier's control plane (kube-apiserver, etcd, controller
manager) took several hundred seconds of the 2 cores while the e2e tier's pods ran.

A fixture registers its stop with ``stop_after_last_user(name, stop)``; ``stop`` must be
idempotent, since the fixture's own finalizer still runs at the end of the session. A session
fixture set up on a registered one registers too (``pool`` on ``ray_session``), so that it is not
left to stop after what it runs on."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_items: list[pytest.Item] = []
_stops: dict[str, tuple[pytest.Item, Callable[[], None]]] = {}


def last_user(items: list[pytest.Item], fixture: str) -> pytest.Item | None:
    """The last of ``items`` that uses ``fixture``, itself or through another fixture."""
    users = [item for item in items if fixture in getattr(item, "fixturenames", ())]
    return users[-1] if users else None


def stop_after_last_user(fixture: str, stop: Callable[[], None]) -> None:
    """Call ``stop`` once the session's last test that uses ``fixture`` is torn down."""
    last = last_user(_items, fixture)
    if last is not None:
        _stops[fixture] = (last, stop)


def pytest_collection_finish(session: pytest.Session) -> None:
    _items[:] = session.items


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    # Latest registered first: a fixture set up on another (the engines on the session's Ray)
    # stops before it, as pytest's own teardown would order them.
    for fixture, (last, stop) in reversed(list(_stops.items())):
        if last is item:
            del _stops[fixture]
            stop()
