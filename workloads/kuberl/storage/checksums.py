"""The whole-object checksums staging verifies, fastest first, and their incremental hashers.

- ``crc32c``: GCS keeps one for every object; S3 for objects uploaded with it (a full-object
  one: a multipart upload's composite ``<crc>-<parts>`` is a checksum of the parts' checksums
  and cannot be computed from the stream, so it is not used). google_crc32c (C) runs at about
  5 GB/s on one core, here and on the GPU machine's host (1 MiB blocks), and releases the GIL,
  so a hashing thread runs beside the download's (download._PartFile).
- ``crc32``: S3 objects the AWS SDKs uploaded with their default checksum; zlib, ~2.7 GB/s.
- ``md5``: S3 single-part ETags, GCS ``md5Hash``; ~0.5-0.9 GB/s on one core, so only where
  nothing else exists.

Besides the store's own, a checkpoint's ``COMPLETE`` lists the CRC32C kuberl computed from each
local file at upload (``upload_dir``), which staging prefers: it checks the bytes end to end,
also for multipart objects and local or pvc:// checkpoints, which carry no usable checksum.

S3's CRC64NVME (its default for objects uploaded without a checksum) needs awscrt, which this
environment lacks: such objects are verified by their MD5 ETag where they have one, else by size.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zlib
from dataclasses import dataclass

import google_crc32c

# Preference when a store offers several for one object.
PREFERENCE = ("crc32c", "crc32", "md5")


@dataclass(frozen=True)
class Checksum:
    algorithm: str   # one of PREFERENCE
    expected: str    # as the store writes it: base64 of the big-endian CRC, hex for MD5
    vouched_by: str = "the store"  # who gave ``expected``, for error messages


class Hasher:
    """An incremental hasher whose ``value()`` is written like the store's ``expected``."""

    def __init__(self, algorithm: str):
        if algorithm not in PREFERENCE:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}; one of {PREFERENCE}")
        self.algorithm = algorithm
        self._crc = 0
        if algorithm == "crc32c":
            self._state = google_crc32c.Checksum()
        elif algorithm == "md5":
            self._state = hashlib.md5(usedforsecurity=False)

    def update(self, data: bytes) -> None:
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._state.update(data)

    def value(self) -> str:
        if self.algorithm == "crc32":
            return base64.b64encode(self._crc.to_bytes(4, "big")).decode()
        if self.algorithm == "crc32c":
            return base64.b64encode(self._state.digest()).decode()
        return self._state.hexdigest()


def crc32c_of_bytes(data: bytes) -> str:
    """The CRC32C of ``data``, written like ``Checksum.expected``."""
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


def crc32c_of_file(path: str | os.PathLike, block: int = 8 << 20) -> str:
    """The CRC32C of a local file, written like ``Checksum.expected``."""
    hasher = Hasher("crc32c")
    with open(path, "rb") as f:
        while data := f.read(block):
            hasher.update(data)
    return hasher.value()


def best(*candidates: Checksum | None) -> Checksum | None:
    """The fastest of ``candidates`` to verify (None where none is given)."""
    given = [c for c in candidates if c is not None]
    return min(given, key=lambda c: PREFERENCE.index(c.algorithm), default=None)


def from_s3_response(response: dict) -> Checksum | None:
    """The full-object checksum a GetObject/HeadObject response (asked with
    ``x-amz-checksum-mode: ENABLED``) carries that can be verified from the whole stream."""
    if response.get("ChecksumType") == "COMPOSITE":
        return None
    for algorithm, field in (("crc32c", "ChecksumCRC32C"), ("crc32", "ChecksumCRC32")):
        value = response.get(field)
        if value and "-" not in value:  # "<crc>-<parts>": a composite multipart checksum
            return Checksum(algorithm, value)
    return None
