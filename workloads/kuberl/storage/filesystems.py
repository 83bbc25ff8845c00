"""fsspec filesystems for parsed URIs, configured only from the environment.

Credentials and endpoints come from the variables an init container gets from a Secret
(AWS_*, AWS_ENDPOINT_URL[_S3], GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST), never from
the job spec, so a spec cannot point a worker at someone else's credentials.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec

from kuberl.storage.errors import StorageError
from kuberl.uri import ParsedURI

DEFAULT_PVC_ROOT = "/mnt/pvc"


def pvc_root() -> Path:
    """Where pvc://<claim>/... volumes are mounted (env ``KUBERL_PVC_ROOT`` overrides)."""
    return Path(os.environ.get("KUBERL_PVC_ROOT", DEFAULT_PVC_ROOT))


def local_path(parsed: ParsedURI) -> Path:
    """The on-disk path of a ``file`` or ``pvc`` URI."""
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "pvc":
        return pvc_root() / parsed.bucket / parsed.path
    raise ValueError(f"{parsed.original!r} is not a local or pvc:// path")


def check_claim_containment(parsed: ParsedURI) -> None:
    """Refuse a ``pvc://`` source any entry of which resolves (through symlinks) outside its claim.

    A claim may hold symlinks (a Hugging Face cache is built of them), but none may lead out of
    it: whoever can write to the claim must not make a pod read the pod's own files (its
    ServiceAccount token, /proc/self/environ with a Secret's variables, other mounts). Symlinked
    directories are checked, never descended into.
    """
    claim = os.path.realpath(pvc_root() / parsed.bucket)
    source = local_path(parsed)
    entries = [source] + [Path(d) / name for d, dirs, files in os.walk(source) for name in dirs + files]
    for entry in entries:
        real = os.path.realpath(entry)
        if os.path.commonpath([claim, real]) != claim:
            raise StorageError(f"{parsed.original}: refusing {entry}: it is a symlink (or lies below one) "
                               f"leading out of claim {parsed.bucket!r} to {real}; a pvc:// source may "
                               f"only link within its claim")


def filesystem(parsed: ParsedURI, *, max_connections: int = 32) -> fsspec.AbstractFileSystem:
    """A fresh fsspec filesystem for ``parsed`` (never fsspec's instance cache: tests and
    long-lived workers change the environment between calls)."""
    if parsed.scheme == "s3":
        import s3fs

        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return s3fs.S3FileSystem(
            endpoint_url=endpoint or None,
            skip_instance_cache=True,
            # One HTTP connection per concurrent request; botocore's default pool is 10.
            config_kwargs={"max_pool_connections": max_connections},
        )
    if parsed.scheme == "gs":
        import gcsfs
        import gcsfs.core

        emulator = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            token = os.environ["GOOGLE_APPLICATION_CREDENTIALS"]
        elif emulator:
            token = "anon"  # emulators take no credentials
        else:
            token = None  # gcsfs default chain: workload identity / metadata server
        # gcsfs's default class asks the Storage Control gRPC API for each bucket's layout, which
        # emulators do not serve (every call would wait out a 60 s gRPC timeout); against an
        # emulator use the plain JSON-API class.
        cls = gcsfs.core.GCSFileSystem if emulator else gcsfs.GCSFileSystem
        return cls(token=token, skip_instance_cache=True)
    if parsed.scheme in ("file", "pvc"):
        return fsspec.filesystem("file", skip_instance_cache=True)
    raise ValueError(f"{parsed.original!r}: no object-store filesystem for scheme {parsed.scheme!r}")


def root_path(parsed: ParsedURI) -> str:
    """The path of the URI's root inside its filesystem."""
    if parsed.is_cloud:
        return f"{parsed.bucket}/{parsed.path}".rstrip("/")
    return str(local_path(parsed))
