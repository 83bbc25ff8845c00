"""Tar archives made in memory for staging tests."""

from __future__ import annotations

import io
import tarfile


def tar_of(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    """An uncompressed tar of ``members`` (name -> bytes), then symlinks ``links`` (name -> target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue()
