"""Small helpers shared by the cluster tests."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from tests.harness.harness import Cluster


def wait_for(what: str, probe: Callable[[], Any], cluster: Cluster, timeout: float = 60, interval: float = 0.25) -> Any:
    """Poll `probe()` until it returns something truthy (returned); fail with `what` after `timeout`.

    Checks on every round that no component died, so a crash reads as a crash
    rather than as a timeout.
    """
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        cluster.check_alive()
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def get_json(cluster: Cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def pod_phases(cluster: Cluster, namespace: str, selector: str) -> dict[str, str]:
    pods = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return {p["metadata"]["name"]: p.get("status", {}).get("phase", "") for p in pods}


def apply(cluster: Cluster, obj: dict | list[dict], *extra: str) -> str:
    """`kubectl apply` objects given as dicts; returns kubectl's stdout."""
    items = obj if isinstance(obj, list) else [obj]
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    return cluster.kubectl("apply", "-f", "-", *extra, input=body).stdout
