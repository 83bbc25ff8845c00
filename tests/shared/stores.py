"""Real object stores on loopback for every tier that needs one (a pytest plugin, tests/conftest.py):
moto's standalone S3 server (a subprocess, as s3fs's own tests run it) and fake-gcs-server (built
from Go once, cached)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kuberl.common.ports import unclaimed_port

FAKE_GCS_VERSION = "v1.56.1"
FAKE_GCS_BIN = Path.home() / ".cache/kuberl/bin" / f"fake-gcs-server-{FAKE_GCS_VERSION}"


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server at {url} did not start in {timeout}s")


def start_moto() -> tuple[subprocess.Popen, str]:
    port = unclaimed_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(endpoint + "/", proc)
    return proc, endpoint


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's standalone S3 server on a free loopback port; yields its endpoint URL."""
    proc, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def s3_endpoint():
    with moto_server() as endpoint:
        yield endpoint


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
          "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The environment an init container gets from its Secret, pointing at the loopback server."""
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    return {**S3_ENV, "AWS_ENDPOINT_URL_S3": s3_endpoint}


@pytest.fixture
def s3(s3_env):
    """(s3fs filesystem, a fresh bucket name)."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_env["AWS_ENDPOINT_URL_S3"], skip_instance_cache=True)
    bucket = f"kuberl-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return fs, bucket


def _fake_gcs_binary() -> Path:
    if FAKE_GCS_BIN.exists():
        return FAKE_GCS_BIN
    go = shutil.which("go")
    if go is None:
        pytest.skip("fake-gcs-server is not built and Go is not installed to build it")
    FAKE_GCS_BIN.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=FAKE_GCS_BIN.parent) as gobin:
        subprocess.run(["nice", "-n", "10", go, "install",
                        f"github.com/fsouza/fake-gcs-server@{FAKE_GCS_VERSION}"],
                       env={**os.environ, "GOBIN": gobin}, check=True)
        # Build to a temporary name, then rename: a concurrent run never sees half a binary.
        os.replace(Path(gobin) / "fake-gcs-server", FAKE_GCS_BIN)
    return FAKE_GCS_BIN


@pytest.fixture(scope="session")
def gcs_endpoint():
    binary = _fake_gcs_binary()
    port = unclaimed_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
                             str(port), "-backend", "memory", "-public-host", f"127.0.0.1:{port}",
                             "-external-url", endpoint, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(endpoint + "/storage/v1/b", proc)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def gcs(gcs_endpoint, monkeypatch):
    """(gcsfs filesystem, a fresh bucket name) on the emulator."""
    import gcsfs.core

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    # The JSON-API class: the emulator does not serve the gRPC control plane (see filesystems.py).
    fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
    bucket = f"kuberl-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return fs, bucket
