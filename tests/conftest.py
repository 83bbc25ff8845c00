"""What every tier shares: the fixtures of tests/shared and the harness (plugins, so that a fixture
one tier defines reaches the others), the session's Ray, and the time each tier took."""

import importlib.util
import os
import time
from collections import defaultdict

import pytest

from tests.tiers import TIERS, tier_of

# The object stores need only the standard library. The cluster harness, the Helm and Prometheus
# fixtures need the `test` extra (cryptography for its certificates); the GPU machine has only
# torch and transformers and runs tests/gpu without it.
pytest_plugins = ["tests.early_stop", "tests.shared.stores"] + (
    ["tests.harness.plugin", "tests.shared.helm", "tests.shared.metrics"]
    if importlib.util.find_spec("cryptography") else [])


@pytest.fixture(scope="session")
def ray_s3_endpoint():
    """moto's S3 server that every Ray worker of the session reaches through AWS_ENDPOINT_URL_S3."""
    from tests.shared.stores import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def ray_session(ray_s3_endpoint):
    """One local Ray for the whole session: ``ray.init`` may run once per process, and the vLLM
    engine actors (about a minute to start) outlive any one test module."""
    ray = pytest.importorskip("ray")
    from tests.early_stop import stop_after_last_user
    from tests.shared.stores import S3_ENV

    if ray.is_initialized():
        pytest.fail("Ray is already running in this process: an earlier test used Ray tasks without the "
                    "ray_session fixture (ray.remote starts a private Ray); give that test ray_session")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Logical CPUs, as `kuberl train` gives a local Ray: session-wide engines, trainer ranks and
    # reward workers each hold one while they live, and take turns on the real cores.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**S3_ENV, "AWS_ENDPOINT_URL_S3": ray_s3_endpoint}})
    stop_after_last_user("ray_session", ray.shutdown)  # and the engines kept for the session with it
    yield ray_s3_endpoint
    ray.shutdown()


_tier_seconds: dict[str, float] = defaultdict(float)
_tier_tests: dict[str, int] = defaultdict(int)
_file_seconds: dict[str, float] = defaultdict(float)
# How many of the costliest test files the summary names: what holds CI's time.
SLOWEST_FILES = 15


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """Each test's wall time (setup, call, teardown: session fixtures count in the tier that starts them)."""
    start = time.monotonic()
    yield
    tier = tier_of(item.path) or "other"
    seconds = time.monotonic() - start
    _tier_seconds[tier] += seconds
    _tier_tests[tier] += 1
    _file_seconds[item.nodeid.split("::")[0]] += seconds


def pytest_terminal_summary(terminalreporter):
    """Where a run's time went, tier by tier, for CI's log (pyproject's --durations names the tests)."""
    if not _tier_tests:
        return
    terminalreporter.section("time per tier")
    for tier in [*TIERS, "other"]:
        if _tier_tests.get(tier):
            terminalreporter.write_line(f"{tier:8s} {_tier_seconds[tier]:8.1f} s  {_tier_tests[tier]:5d} tests")
    terminalreporter.section(f"the {SLOWEST_FILES} costliest test files (setup, calls and teardown)")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
