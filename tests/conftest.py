import importlib.util
import os

import pytest

# The cluster harness needs the `test` extra (cryptography for its certificates); the GPU machine
# has only torch and transformers and runs tests/gpu without it.
pytest_plugins = ["tests.cluster.plugin"] if importlib.util.find_spec("cryptography") else []


@pytest.fixture(scope="session")
def ray_s3_endpoint():
    """moto's S3 server that every Ray worker of the session reaches through AWS_ENDPOINT_URL_S3."""
    from tests.storage.conftest import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def ray_session(ray_s3_endpoint):
    """One local Ray for the whole session: ``ray.init`` may run once per process, and the vLLM
    engine actors (about a minute to start) outlive any one test module."""
    ray = pytest.importorskip("ray")
    from tests.storage.conftest import S3_ENV

    if ray.is_initialized():
        pytest.fail("Ray is already running in this process: an earlier test used Ray tasks without the "
                    "ray_session fixture (ray.remote starts a private Ray); give that test ray_session")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Logical CPUs, as `kuberl train` gives a local Ray: session-wide engines, trainer ranks and
    # reward workers each hold one while they live, and take turns on the real cores.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**S3_ENV, "AWS_ENDPOINT_URL_S3": ray_s3_endpoint}})
    yield ray_s3_endpoint
    ray.shutdown()
