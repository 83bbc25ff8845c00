"""The parallel, verified, resumable download engine behind ``kuberl stage``.

Work is split into tasks of at most ``part_size`` bytes: a small file is one task, a large one
is one task per byte range written with ``os.pwrite`` into a preallocated temporary sibling
(``.<name>.kuberl-part``). At most ``workers`` tasks run at once, so memory stays below
``workers * part_size``. A file is renamed into place only after its size (and MD5 where the
store gives one) is verified, then recorded in the journal, so a rerun after a kill re-downloads
nothing that was already verified.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import fnmatch
import hashlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import fsspec

from kuberl.storage.errors import StorageError, explain, with_retries
from kuberl.storage.manifest import FileRecord
from kuberl.storage.progress import Progress, log
from kuberl.storage.safepath import PART_SUFFIX, checked_relpath, target_path
from kuberl.uri import ParsedURI

_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")
_HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteFile:
    key: str            # the object's path inside its filesystem
    rel: str            # its checked '/'-separated path below the destination
    size: int
    etag: str | None    # identity of the content: S3 ETag, GCS generation, local mtime
    md5: str | None     # hex MD5 the store vouches for, when it gives one


def _identity(info: dict, scheme: str) -> tuple[str | None, str | None]:
    """(etag, md5-hex) from an fsspec info dict."""
    if scheme == "s3":
        etag = str(info.get("ETag") or info.get("etag") or "").strip('"') or None
        # Multipart ETags ("<md5 of part md5s>-<n>") are not the MD5 of the content.
        return etag, etag if etag and _MD5_HEX.match(etag) else None
    if scheme == "gs":
        md5 = base64.b64decode(info["md5Hash"]).hex() if info.get("md5Hash") else None
        generation = info.get("generation")
        return (str(generation) if generation else info.get("etag")), md5
    return f"mtime:{info.get('mtime')}", None


def list_source(fs: fsspec.AbstractFileSystem, parsed: ParsedURI, root: str, uri: str, *,
                exclude: Sequence[str] = (), attempts: int = 5) -> list[RemoteFile]:
    """Every object below ``root`` (or ``root`` itself when it is one object), keys checked."""
    try:
        listing = with_retries(lambda: fs.find(root, detail=True, withdirs=False), uri=uri,
                               attempts=attempts, log=log.warning)
    except StorageError as exc:
        if parsed.is_cloud and isinstance(exc.__cause__, FileNotFoundError) \
                and not _bucket_exists(fs, parsed, uri, attempts):
            raise StorageError(f"{uri}: bucket {parsed.bucket!r} does not exist (or these "
                               f"credentials cannot see it); check the bucket name") from exc
        raise
    files = []
    for key, info in listing.items():
        if info.get("islink") and not parsed.is_cloud and os.path.isfile(key):
            # A local symlink to a file (a Hugging Face cache is built of them; pvc:// sources were
            # checked to link only within their claim): copy what it points at.
            info = {**info, "type": "file", "size": os.stat(key).st_size}
        if info.get("type") != "file" or key.endswith("/"):
            continue  # "folder" marker objects carry no data
        if key.rstrip("/") == root:
            rel = key.rsplit("/", 1)[-1]
        elif key.startswith(root + "/"):
            rel = key[len(root) + 1:]
        else:
            raise StorageError(f"{uri}: the store listed {key!r}, which is not below {root!r}")
        rel = checked_relpath(rel, uri)
        if any(fnmatch.fnmatch(rel, pattern) for pattern in exclude):
            continue
        etag, md5 = _identity(info, parsed.scheme)
        files.append(RemoteFile(key, rel, int(info["size"]), etag, md5))
    if not files:
        if parsed.is_cloud and not _bucket_exists(fs, parsed, uri, attempts):
            raise StorageError(f"{uri}: bucket {parsed.bucket!r} does not exist (or these "
                               f"credentials cannot see it); check the bucket name")
        raise StorageError(f"{uri}: not found: no objects at or below this path; check the path")
    return files


def _bucket_exists(fs: fsspec.AbstractFileSystem, parsed: ParsedURI, uri: str,
                   attempts: int) -> bool:
    return with_retries(lambda: fs.exists(parsed.bucket), uri=uri, attempts=attempts)


class _PartFile:
    """One file being downloaded in byte ranges; thread-safe."""

    def __init__(self, remote: RemoteFile, target: Path, n_chunks: int, want_md5: bool):
        self.remote = remote
        self.target = target
        self.part = target.with_name(f".{target.name}{PART_SUFFIX}")
        self.n_chunks = n_chunks
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._remaining = n_chunks
        self._hasher = hashlib.md5(usedforsecurity=False) if want_md5 else None
        self._hash_lock = threading.Lock()
        self._hashed = 0          # chunks [0, _hashed) are in the hash
        self._written: set[int] = set()

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                   0o644)
                os.ftruncate(self._fd, self.remote.size)
            return self._fd

    def chunk_written(self, index: int, part_size: int) -> bool:
        """Record chunk ``index`` as written; True when it was the last one."""
        with self._lock:
            self._written.add(index)
        if self._hasher is not None:
            self._advance_hash(part_size)
        with self._lock:
            self._remaining -= 1
            return self._remaining == 0

    def _advance_hash(self, part_size: int) -> None:
        # Hash chunks in order as they land, overlapping hashing with the other downloads; one
        # thread hashes at a time and rechecks after releasing so no finished chunk is missed.
        while True:
            if not self._hash_lock.acquire(blocking=False):
                return
            try:
                while True:
                    with self._lock:
                        if self._hashed not in self._written:
                            break
                        index = self._hashed
                    start = index * part_size
                    end = min(start + part_size, self.remote.size)
                    for offset in range(start, end, _HASH_BLOCK):
                        self._hasher.update(os.pread(self._fd, min(_HASH_BLOCK, end - offset),
                                                     offset))
                    with self._lock:
                        self._hashed += 1
            finally:
                self._hash_lock.release()
            with self._lock:
                if self._hashed not in self._written:
                    return

    def md5(self) -> str | None:
        return self._hasher.hexdigest() if self._hasher is not None else None

    def close(self) -> int:
        with self._lock:
            size = os.fstat(self._fd).st_size
            os.close(self._fd)
            self._fd = None
            return size

    def abandon(self) -> None:
        """Close and delete the temporary file after a failure (no task is running any more)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self.part.unlink(missing_ok=True)


@dataclass
class DownloadStats:
    files: int = 0
    bytes: int = 0


def download_files(fs: fsspec.AbstractFileSystem, files: list[RemoteFile], dst: Path, uri: str, *,
                   workers: int, part_size: int, verify_md5: bool, attempts: int,
                   progress: Progress, on_verified: Callable[[FileRecord], None]) -> DownloadStats:
    """Download ``files`` into ``dst`` in parallel; each verified file goes to ``on_verified``."""
    stats = DownloadStats()
    stats_lock = threading.Lock()

    def fetch(remote: RemoteFile, start: int | None, end: int | None) -> bytes:
        return with_retries(lambda: fs.cat_file(remote.key, start=start, end=end),
                            uri=f"{uri} ({remote.rel})", attempts=attempts, log=log.warning)

    def finish(remote: RemoteFile, part: Path, target: Path, got_size: int, got_md5: str | None):
        if got_size != remote.size:
            part.unlink(missing_ok=True)
            raise StorageError(f"{uri}: {remote.rel}: size mismatch: the listing says {remote.size} "
                               f"bytes but {got_size} arrived; the object is corrupt or changed "
                               f"during the download; rerun to fetch it again")
        checksum = "size"
        if remote.md5 is not None and got_md5 is not None:
            if got_md5 != remote.md5:
                part.unlink(missing_ok=True)
                raise StorageError(
                    f"{uri}: {remote.rel}: MD5 mismatch: the store says {remote.md5}, the data "
                    f"hashes to {got_md5}; the object is corrupt or changed during the download. "
                    f"(Objects encrypted with SSE-KMS/SSE-C have ETags that are not MD5s: stage "
                    f"them with --checksum size)")
            checksum = "md5"
        os.replace(part, target)
        record = FileRecord(remote.rel, remote.size, remote.etag, checksum)
        on_verified(record)
        progress.add_file()
        with stats_lock:
            stats.files += 1
            stats.bytes += remote.size

    def whole_file(remote: RemoteFile) -> None:
        target = target_path(dst, remote.rel, uri)
        part = target.with_name(f".{target.name}{PART_SUFFIX}")
        # An empty object needs no request: the listing already says it has no bytes.
        data = fetch(remote, None, None) if remote.size else b""
        with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644),
                  "wb") as out:
            out.write(data)
        progress.add_bytes(len(data))
        want = verify_md5 and remote.md5 is not None
        got_md5 = hashlib.md5(data, usedforsecurity=False).hexdigest() if want else None
        finish(remote, part, target, len(data), got_md5)

    def ranged_chunk(job: _PartFile, index: int) -> None:
        size = job.remote.size
        start = index * part_size
        end = min(start + part_size, size)
        # The last range asks for one byte more than the listing promises, so an object that
        # grew since the listing arrives one byte long and is caught as a size mismatch.
        ask_end = end + 1 if end == size else end
        data = fetch(job.remote, start, ask_end)
        if len(data) != end - start:
            raise StorageError(
                f"{uri}: {job.remote.rel}: size mismatch: bytes {start}-{end} of a "
                f"{size}-byte object returned {len(data)} bytes; the object is corrupt or changed "
                f"during the download; rerun to fetch it again")
        os.pwrite(job.fd(), data, start)
        progress.add_bytes(len(data))
        del data
        if job.chunk_written(index, part_size):
            got_md5 = job.md5()
            finish(job.remote, job.part, job.target, job.close(), got_md5)

    tasks: list[tuple[Callable, tuple]] = []
    jobs: list[_PartFile] = []
    # Largest first: the long ranged downloads start at once and small files fill the gaps.
    for remote in sorted(files, key=lambda f: f.size, reverse=True):
        if remote.size <= part_size:
            tasks.append((whole_file, (remote,)))
            continue
        target = target_path(dst, remote.rel, uri)
        n_chunks = -(-remote.size // part_size)
        job = _PartFile(remote, target, n_chunks, verify_md5 and remote.md5 is not None)
        jobs.append(job)
        tasks.extend((ranged_chunk, (job, i)) for i in range(n_chunks))

    try:
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kuberl-stage") as pool:
            futures = [pool.submit(fn, *args) for fn, args in tasks]
            done, pending = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in pending:
                    f.cancel()
                cf.wait(pending)
                exc = failed[0].exception()
                raise explain(exc, uri) from exc
    finally:
        for job in jobs:
            job.abandon()
    return stats


def remove_stale_parts(dst: Path) -> None:
    """Delete temporary siblings a killed run left behind."""
    for part in dst.rglob(f".*{PART_SUFFIX}"):
        if part.is_file() or part.is_symlink():
            part.unlink()


def already_verified(files: list[RemoteFile], dst: Path, verified: dict[str, FileRecord]
                     ) -> tuple[list[RemoteFile], list[FileRecord]]:
    """Split ``files`` into those still to download and the records of those already in place
    (same size and store identity as ``verified`` records, and the file on disk has that size)."""
    todo, kept = [], []
    for remote in files:
        record = verified.get(remote.rel)
        if record is not None and record.size == remote.size and record.etag == remote.etag:
            on_disk = dst.joinpath(*remote.rel.split("/"))
            try:
                st = on_disk.lstat()
            except FileNotFoundError:
                st = None
            if st is not None and os.path.isfile(on_disk) and not on_disk.is_symlink() \
                    and st.st_size == remote.size:
                kept.append(record)
                continue
        todo.append(remote)
    return todo, kept

