"""The parallel, verified, resumable download engine behind ``kuberl stage``.

Work is split into byte ranges of at most ``part_size``: a small file is one range, a large one
many. At most ``workers`` ranges are in flight at once, each streamed in ``STREAM_BLOCK``-sized
blocks written with ``os.pwrite`` straight into a preallocated temporary sibling
(``.<name>.kuberl-part``), so memory stays near ``workers * STREAM_BLOCK`` whatever the part size.
A transient failure mid-range retries from the first byte not yet written. A file is renamed
into place only after its size (and MD5 where the store gives one) is verified, then recorded in
the journal, so a rerun after a kill re-downloads nothing that was already verified.

S3 ranges go through botocore's own (synchronous, urllib3) client in the worker threads, as
s3transfer and the AWS CLI do: s3fs funnels every byte of every concurrent request through one
asyncio thread, which on the profile of a 1 GiB pull was the bottleneck (8x slower than one
plain boto3 stream). Other filesystems (gs, local) go through fsspec one ``_FSSPEC_BLOCK`` range
request at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fsspec

from kuberl.storage import filesystems
from kuberl.storage.errors import StorageError, explain, with_retries
from kuberl.storage.manifest import FileRecord
from kuberl.storage.progress import Progress, log
from kuberl.storage.safepath import PART_SUFFIX, checked_relpath, target_path
from kuberl.api.uri import ParsedURI

_HASH_BLOCK = 8 << 20
# What one worker holds in memory at a time: one streamed block of a range.
STREAM_BLOCK = 1 << 20
_FSSPEC_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteFile:
    key: str            # the object's path inside its filesystem
    rel: str            # its checked '/'-separated path below the destination
    size: int
    etag: str | None    # identity of the content: S3 ETag, GCS generation, local mtime
    md5: str | None     # hex MD5 the store vouches for, when it gives one


def list_source(fs: fsspec.AbstractFileSystem, parsed: ParsedURI, root: str, uri: str, *,
                exclude: Sequence[str] = (), attempts: int = 5) -> list[RemoteFile]:
    """Every object below ``root`` (or ``root`` itself when it is one object), keys checked; a
    local source (a path or pvc://) only if none of its symlinks leads out of it
    (``filesystems.check_containment``)."""
    if not parsed.is_cloud:
        filesystems.check_containment(Path(root), uri)
    try:
        listing = with_retries(lambda: fs.find(root, detail=True, withdirs=False), uri=uri,
                               attempts=attempts, log=log.warning)
    except StorageError as exc:
        if parsed.is_cloud and isinstance(exc.__cause__, FileNotFoundError) \
                and not _bucket_exists(fs, parsed, uri, attempts):
            raise StorageError(f"{uri}: bucket {parsed.bucket!r} does not exist (or these "
                               f"credentials cannot see it); check the bucket name") from exc
        raise
    identity = filesystems.store(parsed).identity
    files = []
    for key, info in listing.items():
        if info.get("islink") and not parsed.is_cloud and os.path.isfile(key):
            # A local symlink to a file (a Hugging Face cache is built of them; checked above to
            # link only within the source): copy what it points at.
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
        etag, md5 = identity(info)
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
    """One file being downloaded in byte ranges; thread-safe.

    The MD5 follows the written prefix of the file as blocks land (each range streams in order,
    so every chunk's written bytes are a prefix of that chunk): whichever worker finds the hash
    idle feeds it the bytes from the hashed position up to the end of what its chunk has
    written, from the block in hand when it is exactly next, else read back from the page
    cache. Hashing thus overlaps the download instead of starting after it.
    """

    def __init__(self, remote: RemoteFile, target: Path, part_size: int, want_md5: bool):
        self.remote = remote
        self.target = target
        self.part = target.with_name(f".{target.name}{PART_SUFFIX}")
        self.part_size = part_size
        self.n_chunks = -(-remote.size // part_size)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._remaining = self.n_chunks
        self._hasher = hashlib.md5(usedforsecurity=False) if want_md5 else None
        self._hash_lock = threading.Lock()
        self._hashed = 0                    # bytes [0, _hashed) are in the hash
        self._written_to: dict[int, int] = {}  # chunk index -> end of its written prefix

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                   0o644)
                os.ftruncate(self._fd, self.remote.size)
            return self._fd

    def block_written(self, index: int, start: int, block: bytes) -> None:
        """Record that chunk ``index`` now holds its bytes up to ``start + len(block)``."""
        with self._lock:
            self._written_to[index] = start + len(block)
        if self._hasher is not None and self._hash_lock.acquire(blocking=False):
            try:
                self._hash_written(start, block)
            finally:
                self._hash_lock.release()

    def chunk_done(self) -> bool:
        """Count one chunk as complete; True when it was the last one."""
        with self._lock:
            self._remaining -= 1
            return self._remaining == 0

    def _hash_written(self, start: int = -1, block: bytes = b"") -> None:
        # Called with _hash_lock held. Loops until the chunk at the hashed position has nothing
        # new; a block landing meanwhile in another thread is picked up by the final md5().
        while True:
            with self._lock:
                position = self._hashed
                available = self._written_to.get(position // self.part_size, 0)
            if available <= position:
                return
            if start == position and start + len(block) <= available:
                self._hasher.update(block)
                position += len(block)
            else:
                end = min(available, position + _HASH_BLOCK)
                self._hasher.update(os.pread(self._fd, end - position, position))
                position = end
            with self._lock:
                self._hashed = position

    def md5(self) -> str | None:
        """The MD5 of the whole file (call once every chunk is written)."""
        if self._hasher is None:
            return None
        with self._hash_lock:
            self._hash_written()
            return self._hasher.hexdigest()

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


class _RangeReader:
    """Streams bytes ``[start, end)`` of an object as blocks; ``end`` may pass the object's end
    (the response then stops at the object's last byte)."""

    def blocks(self, key: str, start: int, end: int) -> Iterator[bytes]:
        raise NotImplementedError


class _BotocoreReader(_RangeReader):
    """Ranged GETs with a synchronous botocore client configured exactly like the s3fs one
    (endpoint, credentials, config), shared by the worker threads (botocore clients are
    thread-safe; one pooled connection per worker)."""

    def __init__(self, fs, workers: int):
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        # Stores that send a whole-object checksum with a ranged response (some S3 emulators)
        # would fail botocore's response validation; sizes and MD5 are verified here instead.
        config = {"response_checksum_validation": "when_required", **fs.config_kwargs,
                  "max_pool_connections": workers}
        kwargs = {"endpoint_url": fs.endpoint_url, "aws_access_key_id": fs.key,
                  "aws_secret_access_key": fs.secret, "aws_session_token": fs.token}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if fs.anon:
            config["signature_version"] = UNSIGNED
            kwargs = {k: v for k, v in kwargs.items() if k == "endpoint_url"}
        # A fresh session (credentials come from the environment as it is now) with the
        # process's one data loader: parsing botocore's S3 model and endpoint rules costs about
        # 0.15 s of CPU, paid once per process instead of once per stage() call.
        session = botocore.session.get_session()
        session.register_component("data_loader", _botocore_loader())
        self._client = session.create_client("s3", config=Config(**config),
                                             **{**kwargs, **fs.client_kwargs})

    def blocks(self, key: str, start: int, end: int) -> Iterator[bytes]:
        bucket, _, name = key.partition("/")
        body = self._client.get_object(Bucket=bucket, Key=name,
                                       Range=f"bytes={start}-{end - 1}")["Body"]
        try:
            yield from body.iter_chunks(STREAM_BLOCK)
        finally:
            body.close()


@functools.cache
def _botocore_loader():
    import botocore.loaders

    return botocore.loaders.create_loader()


class _FsspecReader(_RangeReader):
    """Any fsspec filesystem: one ``cat_file`` range request per ``_FSSPEC_BLOCK``."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self._fs = fs

    def blocks(self, key: str, start: int, end: int) -> Iterator[bytes]:
        for offset in range(start, end, _FSSPEC_BLOCK):
            block = self._fs.cat_file(key, start=offset, end=min(offset + _FSSPEC_BLOCK, end))
            yield block
            if offset + len(block) < min(offset + _FSSPEC_BLOCK, end):
                return  # the object ended early; the caller sees the short count


def range_reader(fs: fsspec.AbstractFileSystem, workers: int) -> _RangeReader:
    """The fastest reader for ``fs``: botocore threads for S3, fsspec for everything else."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    if "s3" in protocols:
        return _BotocoreReader(fs, workers)
    return _FsspecReader(fs)


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
    reader = range_reader(fs, workers) if files else None

    def size_mismatch(remote: RemoteFile, detail: str) -> StorageError:
        return StorageError(f"{uri}: {remote.rel}: size mismatch: {detail}; the object is corrupt "
                            f"or changed during the download; rerun to fetch it again")

    def finish(remote: RemoteFile, part: Path, target: Path, got_size: int, got_md5: str | None):
        if got_size != remote.size:
            part.unlink(missing_ok=True)
            raise size_mismatch(remote, f"the listing says {remote.size} bytes but {got_size} "
                                        f"arrived")
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

    def copy_range(job: _PartFile, index: int) -> None:
        remote = job.remote
        start = index * part_size
        end = min(start + part_size, remote.size)
        # The last range asks for one byte more than the listing promises, so an object that
        # grew since the listing arrives one byte long and is caught as a size mismatch.
        ask_end = end + 1 if end == remote.size else end
        fd = job.fd()
        position = start

        def attempt() -> None:
            nonlocal position
            if position == end:
                return  # every promised byte arrived before the connection failed
            for block in reader.blocks(remote.key, position, ask_end):
                if position + len(block) > end:
                    raise size_mismatch(remote, f"the listing says {remote.size} bytes but more "
                                                f"arrived")
                os.pwrite(fd, block, position)
                job.block_written(index, position, block)
                position += len(block)
                progress.add_bytes(len(block))

        # A retry resumes at ``position``: bytes already written are not fetched again, and
        # the chunk's written bytes stay a prefix of it, as the hash expects.
        with_retries(attempt, uri=f"{uri} ({remote.rel})", attempts=attempts, log=log.warning)
        if position != end:
            raise size_mismatch(remote, f"bytes {start}-{end} of a {remote.size}-byte object "
                                        f"returned {position - start} bytes")
        if job.chunk_done():
            got_md5 = job.md5()
            finish(remote, job.part, job.target, job.close(), got_md5)

    def empty_file(remote: RemoteFile) -> None:
        # An empty object needs no request: the listing already says it has no bytes.
        target = checked_target(remote)
        part = target.with_name(f".{target.name}{PART_SUFFIX}")
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644))
        want = verify_md5 and remote.md5 is not None
        finish(remote, part, target, 0, hashlib.md5(b"").hexdigest() if want else None)

    checked_dirs: dict[str, Path] = {}

    def checked_target(remote: RemoteFile) -> Path:
        # target_path's check (the parent, resolved, stays inside dst) once per directory, not
        # once per file: resolving costs a few syscalls per path component, on the main thread,
        # before any download starts.
        parent_rel, _, name = remote.rel.rpartition("/")
        if parent_rel not in checked_dirs:
            checked_dirs[parent_rel] = target_path(dst, remote.rel, uri).parent
        return checked_dirs[parent_rel] / name

    tasks: list[tuple[Callable, tuple]] = []
    jobs: list[_PartFile] = []
    # Largest first: the long ranged downloads start at once and small files fill the gaps.
    for remote in sorted(files, key=lambda f: f.size, reverse=True):
        if remote.size == 0:
            tasks.append((empty_file, (remote,)))
            continue
        job = _PartFile(remote, checked_target(remote), part_size,
                        verify_md5 and remote.md5 is not None)
        jobs.append(job)
        tasks.extend((copy_range, (job, i)) for i in range(job.n_chunks))

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

