"""fsspec filesystems for parsed URIs, configured only from the environment.

Credentials and endpoints come from the variables an init container gets from a Secret
(AWS_*, AWS_ENDPOINT_URL[_S3], GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST), never from
the job spec, so a spec cannot point a worker at someone else's credentials.
"""

from __future__ import annotations

import base64
import functools
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec

from kuberl.api.contract import PVC_ROOT, PVC_ROOT_ENV
from kuberl.storage.checksums import Checksum
from kuberl.storage.errors import StorageError
from kuberl.api.uri import ParsedURI


def pvc_root() -> Path:
    """Where pvc://<claim>/... volumes are mounted (env ``KUBERL_PVC_ROOT`` overrides)."""
    return Path(os.environ.get(PVC_ROOT_ENV, PVC_ROOT))


def local_path(parsed: ParsedURI) -> Path:
    """The on-disk path of a ``file`` or ``pvc`` URI."""
    on_disk = parsed.on_disk(str(pvc_root()))
    if on_disk is None:
        raise ValueError(f"{parsed.original!r} is not a local or pvc:// path")
    return Path(on_disk)


@dataclass(frozen=True)
class Boundary:
    """The directory a local source's entries must resolve within, how messages name it, and the fix."""

    root: str
    name: str
    fix: str


def boundary(source: Path) -> Boundary:
    """Where the symlinks of local source ``source`` may lead:

    - below the pvc:// mount root (a ``pvc://`` URI, or the path a pod reads a claim at): anywhere
      in that claim;
    - in a Hugging Face cache snapshot (``.../models--org--name/snapshots/<rev>...``): anywhere in
      that repo's cache directory, whose ``blobs/`` the snapshot's files link to;
    - else within the source itself. Its last component is not followed: a source that is itself a
      symlink names another place than the one its writer was trusted with.
    """
    source = Path(os.path.abspath(source))
    mount = pvc_root()
    if source.is_relative_to(mount) and source != mount:
        claim = source.relative_to(mount).parts[0]
        return Boundary(os.path.realpath(mount / claim), f"claim {claim!r}",
                        "a pvc:// source may only link within its claim")
    parts = source.parts
    for i in range(1, len(parts) - 1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--")):
            return Boundary(os.path.realpath(Path(*parts[:i])), f"the Hugging Face cache {parts[i - 1]!r}",
                            "a cache snapshot may only link within its repo's cache directory")
    return Boundary(os.path.join(os.path.realpath(source.parent), source.name), "the source",
                    "a local source may only link within itself: name the place it points at instead, "
                    "or copy the files in (cp -rL)")


def check_containment(source: Path, uri: str) -> None:
    """Refuse local source ``source`` (a path or a ``pvc://`` mount) if any entry of it resolves,
    through symlinks, outside its ``boundary``.

    Symlinks are allowed (a Hugging Face cache is built of them), but none may lead out: whoever can
    write the source must not make a pod read the pod's own files (its ServiceAccount token,
    /proc/self/environ with a Secret's variables, other mounts). Symlinked directories are checked,
    never descended into.
    """
    allowed = boundary(source)
    entries = [source] + [Path(d) / name for d, dirs, files in os.walk(source) for name in dirs + files]
    for entry in entries:
        real = os.path.realpath(entry)
        if os.path.commonpath([allowed.root, real]) != allowed.root:
            raise StorageError(f"{uri}: refusing {entry}: it is a symlink (or lies below one) leading out of "
                               f"{allowed.name} to {real}; {allowed.fix}")


@dataclass(frozen=True)
class Store:
    """How one scheme's bytes are reached through fsspec (``SchemeInfo.store`` names it)."""

    # A fresh filesystem allowing ``max_connections`` concurrent requests.
    open: Callable[[int], fsspec.AbstractFileSystem]
    # (etag, checksum) from an fsspec info dict: what identifies an object's content, and the
    # checksum its listing vouches for, when it gives one.
    identity: Callable[[dict], tuple[str | None, Checksum | None]]


@functools.cache
def botocore_loader():
    """The process's one botocore data loader: parsing botocore's S3 model and endpoint rules
    costs about 0.15 s of CPU, paid once per process instead of once per client."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def _s3(max_connections: int) -> fsspec.AbstractFileSystem:
    import aiobotocore.session
    import s3fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    # A fresh session (credentials as the environment has them now) with the cached models:
    # listing a 1 GiB object took 0.1-0.3 s here with models parsed again per filesystem.
    session = aiobotocore.session.get_session()
    session.register_component("data_loader", botocore_loader())
    return s3fs.S3FileSystem(
        endpoint_url=endpoint or None,
        skip_instance_cache=True,
        session=session,
        # One HTTP connection per concurrent request; botocore's default pool is 10.
        config_kwargs={"max_pool_connections": max_connections},
    )


_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


def _s3_identity(info: dict) -> tuple[str | None, Checksum | None]:
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"') or None
    # Multipart ETags ("<md5 of part md5s>-<n>") are not the MD5 of the content. A listing
    # carries no CRC: the download's first GET asks for the object's own (download.py).
    return etag, Checksum("md5", etag) if etag and _MD5_HEX.match(etag) else None


def _gcs(max_connections: int) -> fsspec.AbstractFileSystem:
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


def _gcs_identity(info: dict) -> tuple[str | None, Checksum | None]:
    # GCS stores a CRC32C of every object (composite objects included); md5Hash only for
    # objects uploaded in one piece. CRC32C hashes at ~20 GB/s, MD5 at ~0.5 GB/s.
    if info.get("crc32c"):
        checksum = Checksum("crc32c", info["crc32c"])
    elif info.get("md5Hash"):
        checksum = Checksum("md5", base64.b64decode(info["md5Hash"]).hex())
    else:
        checksum = None
    generation = info.get("generation")
    return (str(generation) if generation else info.get("etag")), checksum


def _local(max_connections: int) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("file", skip_instance_cache=True)


def _local_identity(info: dict) -> tuple[str | None, Checksum | None]:
    return f"mtime:{info.get('mtime')}", None


S3 = Store(_s3, _s3_identity)
GCS = Store(_gcs, _gcs_identity)
LOCAL = Store(_local, _local_identity)


def store(parsed: ParsedURI) -> Store:
    """The fsspec access of ``parsed``'s scheme."""
    if parsed.info.store is None:
        raise ValueError(f"{parsed.original!r}: no object-store filesystem for scheme {parsed.scheme!r}")
    return pkgutil.resolve_name(parsed.info.store)


def filesystem(parsed: ParsedURI, *, max_connections: int = 32) -> fsspec.AbstractFileSystem:
    """A fresh fsspec filesystem for ``parsed`` (never fsspec's instance cache: tests and
    long-lived workers change the environment between calls)."""
    return store(parsed).open(max_connections)


def root_path(parsed: ParsedURI) -> str:
    """The path of the URI's root inside its filesystem."""
    if parsed.is_cloud:
        return f"{parsed.bucket}/{parsed.path}".rstrip("/")
    return str(local_path(parsed))
