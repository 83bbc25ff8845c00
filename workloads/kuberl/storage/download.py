"""The parallel, verified, resumable download engine behind ``kuberl stage``.

At most ``workers`` requests are in flight at once, each streamed in ``STREAM_BLOCK``-sized
blocks written with ``os.pwrite`` straight into a preallocated temporary sibling
(``.<name>.kuberl-part``), so memory stays near ``workers * STREAM_BLOCK`` whatever the part size
(plus, per large file, ``_HASH_QUEUE_BLOCKS`` blocks waiting for its hashing thread and one
block read back for the hash).
A transient failure mid-range retries from the first byte not yet written. A file is renamed
into place only after its size (and the fastest checksum the store gives: ``checksums``) is
verified, then recorded in the journal, so a rerun after a kill re-downloads nothing that was
already verified.

A file's first request is a GET of the whole object (which is also how S3 hands out the object's
stored CRC); a large file stays one stream if that stream is fast (a store on loopback or the
same node, where more connections only add copying threads competing for the cores), else the
rest of it is fetched as parallel ranges of ``part_size``.

S3 ranges go through botocore's own (synchronous, urllib3) client in the worker threads, as
s3transfer and the AWS CLI do: s3fs funnels every byte of every concurrent request through one
asyncio thread, which on the profile of a 1 GiB pull was the bottleneck (8x slower than one
plain boto3 stream). Other filesystems (gs, local) go through fsspec one ``_FSSPEC_BLOCK`` range
request at a time.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import fnmatch
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fsspec

from kuberl.storage import checksums, filesystems
from kuberl.storage.checksums import Checksum, Hasher
from kuberl.storage.errors import StorageError, explain, with_retries
from kuberl.storage.manifest import FileRecord
from kuberl.storage.progress import Progress, log
from kuberl.storage.safepath import PART_SUFFIX, checked_relpath, target_path
from kuberl.api.uri import ParsedURI

# Written blocks waiting for a large file's hashing thread (_PartFile): room for the thread to
# be off its core ~1.5 ms at a loopback stream's 2.8 GB/s; a block beyond that is read back from
# the page cache instead (a copy at several GB/s in the hashing thread), so memory stays bounded.
_HASH_QUEUE_BLOCKS = 4
# What one worker holds in memory at a time: one streamed block of a range. Also the size of
# a hash's read-back from the page cache (_PartFile._hash_written), which happens when the
# hashing falls behind, as under load: an 8 MiB read-back showed as 8 MiB over this bound.
STREAM_BLOCK = 1 << 20
_FSSPEC_BLOCK = 8 << 20
# A large file's first GET asks for the whole object; once this many bytes have arrived, the
# stream goes on alone to the end unless it is slower than FAST_STREAM_BPS and its thread spent
# at least _WAITING_ON_NETWORK of the time asleep on the socket: then the rest is fetched as
# parallel ranges. Ranges pay where one connection is slower than the client can copy (S3
# serves ~100 MB/s per connection; a 20 ms RTT link gave 0.19 GB/s here). A faster stream means
# a near store (loopback, the same node), and a thread that ran or waited for a core most of
# the time is held back by the CPU, not the link: more copying threads would only share the
# cores (on 2 loaded cores one stream moved 1 GiB with 0.6 s of CPU, 124 ranges with 1.7).
_PROBE_BYTES = 32 << 20
FAST_STREAM_BPS = 400e6
_WAITING_ON_NETWORK = 0.5


@dataclass(frozen=True)
class RemoteFile:
    key: str            # the object's path inside its filesystem
    rel: str            # its checked '/'-separated path below the destination
    size: int
    etag: str | None    # identity of the content: S3 ETag, GCS generation, local mtime
    checksum: Checksum | None  # what the listing vouches for (S3 ETag MD5, GCS CRC32C), if any


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
        etag, checksum = identity(info)
        files.append(RemoteFile(key, rel, int(info["size"]), etag, checksum))
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
    """One file being downloaded in chunks (contiguous byte ranges); thread-safe.

    Chunk 0 starts at byte 0 with the whole-object GET; the chunks after it exist only once
    ``split`` has cut the rest of the file into ranges. The checksum follows the written prefix
    of the file as blocks land (each chunk streams in order, so every chunk's written bytes are
    a prefix of that chunk), fed the block just written when it is exactly next, else the bytes
    read back from the page cache up to the end of what the chunk at the hashed position has
    written.

    Who hashes: a file that starts as one large stream (``hash_thread``) is hashed by a thread of
    its own, handed each written block through a short queue, so receiving and hashing run on
    two cores (on an idle 16-core host, CRC32C at 5.4 GB/s in the receiving thread cost a
    loopback stream of ~2.8 GB/s a third of its speed). A block the queue has no room for is
    dropped and read back later, so the download never waits for the hash. Smaller files are
    hashed by whichever worker finds the hash idle: many of them run at once, which spreads the
    hashing over the workers already.
    """

    def __init__(self, remote: RemoteFile, target: Path, verify: bool, hash_thread: bool = False):
        self.remote = remote
        self.target = target
        self.part = target.with_name(f".{target.name}{PART_SUFFIX}")
        self.verify = verify
        self.checksum: Checksum | None = None  # what the hash is checked against, once chosen
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._starts = [0]                  # first byte of each chunk, ascending
        self._remaining = 1
        self._hasher: Hasher | None = None
        self._hash_lock = threading.Lock()
        self._hashed = 0                    # bytes [0, _hashed) are in the hash
        self._written_to: dict[int, int] = {}  # chunk start -> end of its written prefix
        self._want_thread = hash_thread
        self._queue: queue.Queue | None = None  # (start, block) for the hashing thread
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                   0o644)
                os.ftruncate(self._fd, self.remote.size)
            return self._fd

    def choose_checksum(self, offered: Checksum | None) -> None:
        """Pick the fastest of the listing's checksum and the one the first response
        ``offered``; called by chunk 0 before its first block, so before any byte is hashed."""
        if self.verify and self._hasher is None:
            self.checksum = checksums.best(self.remote.checksum, offered)
            if self.checksum is not None:
                self._hasher = Hasher(self.checksum.algorithm)
                if self._want_thread:
                    self._queue = queue.Queue(maxsize=_HASH_QUEUE_BLOCKS)
                    self._thread = threading.Thread(target=self._hash_queued, daemon=True,
                                                    name=f"kuberl-hash {self.remote.rel}")
                    self._thread.start()

    def split(self, starts: list[int]) -> None:
        """Add chunks beginning at ``starts`` (after chunk 0's end, ascending)."""
        with self._lock:
            self._starts.extend(starts)
            self._remaining += len(starts)

    def block_written(self, chunk_start: int, start: int, block: bytes) -> None:
        """Record that the chunk at ``chunk_start`` now holds its bytes up to
        ``start + len(block)``."""
        with self._lock:
            self._written_to[chunk_start] = start + len(block)
        if self._queue is not None:
            try:
                self._queue.put_nowait((start, block))
            except queue.Full:
                pass  # read back from the page cache by the thread's catch-up
        elif self._hasher is not None and self._hash_lock.acquire(blocking=False):
            try:
                self._hash_written(start, block)
            finally:
                self._hash_lock.release()

    def chunk_done(self) -> bool:
        """Count one chunk as complete; True when it was the last one."""
        with self._lock:
            self._remaining -= 1
            return self._remaining == 0

    def _hash_queued(self) -> None:
        # The hashing thread: a block exactly next goes into the hash as it is; one further on
        # (a later chunk's, or after a dropped one) first has the gap read back; one already
        # covered by a read-back is skipped. None (from ``_stop_thread``) ends it.
        try:
            while (item := self._queue.get()) is not None:
                start, block = item
                if start > self._hashed:
                    self._hash_written()
                if start == self._hashed:
                    self._hasher.update(block)
                    with self._lock:
                        self._hashed = start + len(block)
        except BaseException as exc:  # noqa: BLE001 - re-raised by digest() in the worker
            self._thread_error = exc
            while self._queue.get() is not None:
                pass  # drained until the stop, so that no put waits

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _hash_written(self, start: int = -1, block: bytes = b"") -> None:
        # Called with _hash_lock held, or by the hashing thread (then alone). Loops until the
        # chunk at the hashed position has nothing new; a block landing meanwhile in another
        # thread is picked up by the final digest().
        while True:
            with self._lock:
                position = self._hashed
                chunk = self._starts[bisect.bisect_right(self._starts, position) - 1]
                available = self._written_to.get(chunk, 0)
            if available <= position:
                return
            if start == position and start + len(block) <= available:
                self._hasher.update(block)
                position += len(block)
            else:
                end = min(available, position + STREAM_BLOCK)
                self._hasher.update(os.pread(self._fd, end - position, position))
                position = end
            with self._lock:
                self._hashed = position

    def digest(self) -> str | None:
        """The checksum of the whole file (call once every chunk is written), written like
        ``self.checksum.expected``; None when nothing is verified beyond the size."""
        if self._hasher is None:
            return None
        self._stop_thread()
        if self._thread_error is not None:
            raise self._thread_error
        with self._hash_lock:
            self._hash_written()
            return self._hasher.value()

    def close(self) -> int:
        with self._lock:
            size = os.fstat(self._fd).st_size
            os.close(self._fd)
            self._fd = None
            return size

    def abandon(self) -> None:
        """Close and delete the temporary file after a failure (no task is running any more)."""
        self._stop_thread()  # before the fd closes: the thread may be reading from it
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self.part.unlink(missing_ok=True)


@dataclass
class _Response:
    blocks: Iterator[bytes]
    etag: str | None = None          # the store's ETag of what it serves, where it sends one
    checksum: Checksum | None = None  # a whole-object checksum the response carries
    close: Callable[[], None] = lambda: None


class _RangeReader:
    """Streams bytes ``[start, end)`` of an object as blocks; ``end`` may pass the object's end
    (the response then stops at the object's last byte). ``whole``: the request is for the
    whole object (start 0), so it goes without a Range and may carry the object's checksum."""

    def open(self, key: str, start: int, end: int, whole: bool) -> _Response:
        raise NotImplementedError


class _BotocoreReader(_RangeReader):
    """GETs with a synchronous botocore client configured exactly like the s3fs one
    (endpoint, credentials, config), shared by the worker threads (botocore clients are
    thread-safe; one pooled connection per worker)."""

    def __init__(self, fs, workers: int):
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        # Checksums are verified here, over the whole file, whatever ranges it arrives in;
        # botocore's own response validation would run a second hash (and fails on stores
        # that send a whole-object checksum with a ranged response, as some emulators do).
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
        session.register_component("data_loader", filesystems.botocore_loader())
        self._client = session.create_client("s3", config=Config(**config),
                                             **{**kwargs, **fs.client_kwargs})
        # S3 returns an object's stored checksum only when asked; asking through the
        # ChecksumMode parameter would also make botocore validate it itself.
        self._client.meta.events.register("before-sign.s3.GetObject", _ask_for_checksum)

    def open(self, key: str, start: int, end: int, whole: bool) -> _Response:
        bucket, _, name = key.partition("/")
        ranged = {} if whole else {"Range": f"bytes={start}-{end - 1}"}
        response = self._client.get_object(Bucket=bucket, Key=name, **ranged)
        body = response["Body"]
        return _Response(body.iter_chunks(STREAM_BLOCK), response.get("ETag", "").strip('"'),
                         checksums.from_s3_response(response) if whole else None, body.close)


def _ask_for_checksum(request, **_) -> None:
    request.headers["x-amz-checksum-mode"] = "ENABLED"


class _FsspecReader(_RangeReader):
    """Any fsspec filesystem: one ``cat_file`` range request per ``_FSSPEC_BLOCK``."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self._fs = fs

    def open(self, key: str, start: int, end: int, whole: bool) -> _Response:
        return _Response(self._blocks(key, start, end))

    def _blocks(self, key: str, start: int, end: int) -> Iterator[bytes]:
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


def _busy_seconds() -> float | None:
    """Seconds the calling thread has run or waited for a core (Linux schedstat); the rest of
    its life it slept, here: on a socket. None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, runnable, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return (int(ran) + int(runnable)) / 1e9


@dataclass
class DownloadStats:
    files: int = 0
    bytes: int = 0


class _Tasks:
    """The worker pool and the futures of everything submitted to it, including tasks that
    running tasks add (the ranges of a file whose first stream turned out slow)."""

    def __init__(self, pool: cf.ThreadPoolExecutor):
        self._pool = pool
        self._lock = threading.Lock()
        self._futures: list[cf.Future] = []
        self._stopped = False

    def submit(self, fn: Callable, *args) -> None:
        with self._lock:
            if not self._stopped:
                self._futures.append(self._pool.submit(fn, *args))

    def wait(self) -> BaseException | None:
        """Wait until every task is done, or one failed: then cancel the rest and return its
        exception."""
        while True:
            with self._lock:
                current = list(self._futures)
            done, pending = cf.wait(current, return_when=cf.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                with self._lock:
                    self._stopped = True
                    pending = [f for f in self._futures if not f.done()]
                for f in pending:
                    f.cancel()
                cf.wait(pending)
                return failed[0].exception()
            with self._lock:
                if len(self._futures) == len(current):
                    return None


def download_files(fs: fsspec.AbstractFileSystem, files: list[RemoteFile], dst: Path, uri: str, *,
                   workers: int, part_size: int, verify: bool, attempts: int,
                   progress: Progress, on_verified: Callable[[FileRecord], None]) -> DownloadStats:
    """Download ``files`` into ``dst`` in parallel; each verified file goes to ``on_verified``.
    ``verify``: check the fastest checksum the store gives for each file (checksums.PREFERENCE),
    besides its size."""
    stats = DownloadStats()
    stats_lock = threading.Lock()
    reader = range_reader(fs, workers) if files else None

    def size_mismatch(remote: RemoteFile, detail: str) -> StorageError:
        return StorageError(f"{uri}: {remote.rel}: size mismatch: {detail}; the object is corrupt "
                            f"or changed during the download; rerun to fetch it again")

    def finish(job: _PartFile, got_size: int, got: str | None):
        remote = job.remote
        if got_size != remote.size:
            job.part.unlink(missing_ok=True)
            raise size_mismatch(remote, f"the listing says {remote.size} bytes but {got_size} "
                                        f"arrived")
        checksum = "size"
        if got is not None:
            name = job.checksum.algorithm.upper()
            if got != job.checksum.expected:
                job.part.unlink(missing_ok=True)
                hint = (" (Objects encrypted with SSE-KMS/SSE-C have ETags that are not MD5s: "
                        "stage them with --checksum size)" if name == "MD5" else "")
                raise StorageError(
                    f"{uri}: {remote.rel}: {name} mismatch: {job.checksum.vouched_by} says "
                    f"{job.checksum.expected}, the data hashes to {got}; the object is corrupt "
                    f"or changed during the download; rerun to fetch it again{hint}")
            checksum = job.checksum.algorithm
        os.replace(job.part, job.target)
        record = FileRecord(remote.rel, remote.size, remote.etag, checksum)
        on_verified(record)
        progress.add_file()
        with stats_lock:
            stats.files += 1
            stats.bytes += remote.size

    def changed(remote: RemoteFile, etag: str | None) -> None:
        # Every response must serve the content the listing named: a checksum sent with the
        # response would vouch for a replaced object as readily as for the listed one.
        if etag and remote.etag and etag != remote.etag:
            raise StorageError(f"{uri}: {remote.rel}: the object changed since it was listed "
                               f"(ETag {remote.etag}, now {etag}); rerun to fetch it again")

    def copy(job: _PartFile, chunk_start: int, end: int, tasks: _Tasks | None = None) -> None:
        """Bytes [chunk_start, end) of the file. Chunk 0 (``tasks`` given: a file larger than
        the probe) is the whole-object GET: once ``_PROBE_BYTES`` have arrived, it goes on to
        the end unless the stream is slow and waiting on the network (see ``_PROBE_BYTES``),
        then it stops at the end of its part and the rest is fetched as ranges."""
        remote = job.remote
        fd = job.fd()
        position = chunk_start
        started = time.perf_counter()
        busy_at_start = _busy_seconds()

        def attempt() -> None:
            nonlocal position, end, tasks
            if position == end:
                return  # every promised byte arrived before the connection failed
            # The request reaching the object's end asks for one byte more than the listing
            # promises, so an object that grew since the listing is caught as a size mismatch.
            response = reader.open(remote.key, position, remote.size + 1 if end == remote.size
                                   else end, whole=position == 0)
            try:
                changed(remote, response.etag)
                if position == 0:
                    job.choose_checksum(response.checksum)
                for block in response.blocks:
                    if position + len(block) > remote.size:
                        raise size_mismatch(remote, f"the listing says {remote.size} bytes but "
                                                    f"more arrived")
                    if position + len(block) > end:
                        block = block[:end - position]  # chunk 0, stopping at its probe
                    os.pwrite(fd, block, position)
                    job.block_written(chunk_start, position, block)
                    position += len(block)
                    progress.add_bytes(len(block))
                    if tasks is not None and position >= _PROBE_BYTES and end == remote.size:
                        elapsed = time.perf_counter() - started
                        rate = position / elapsed
                        busy = _busy_seconds()
                        waited = (1 - (busy - busy_at_start) / elapsed
                                  if busy is not None and busy_at_start is not None else 1)
                        if rate < FAST_STREAM_BPS and waited >= _WAITING_ON_NETWORK:
                            end = min(remote.size, max(position, part_size))
                            starts = list(range(end, remote.size, part_size))
                            job.split(starts)
                            for start in starts:
                                tasks.submit(copy, job, start, min(start + part_size, remote.size))
                        log.debug(f"{remote.rel}: first {position >> 20} MiB at {rate / 1e9:.2f} "
                                  f"GB/s, waiting on the network {waited:.0%} of the time: " +
                                  (f"the rest in {len(starts)} ranges" if end < remote.size
                                   else "one stream"))
                        tasks = None  # decided
                    if position >= end and end < remote.size:
                        return
            finally:
                response.close()

        # A retry resumes at ``position``: bytes already written are not fetched again, and
        # the chunk's written bytes stay a prefix of it, as the hash expects.
        with_retries(attempt, uri=f"{uri} ({remote.rel})", attempts=attempts, log=log.warning)
        if position != end:
            raise size_mismatch(remote, f"bytes {chunk_start}-{end} of a {remote.size}-byte "
                                        f"object returned {position - chunk_start} bytes")
        if job.chunk_done():
            got = job.digest()
            finish(job, job.close(), got)

    def empty_file(remote: RemoteFile) -> None:
        # An empty object needs no request: the listing already says it has no bytes.
        job = _PartFile(remote, checked_target(remote), verify)
        os.close(os.open(job.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644))
        job.choose_checksum(None)
        finish(job, 0, job.digest())

    checked_dirs: dict[str, Path] = {}

    def checked_target(remote: RemoteFile) -> Path:
        # target_path's check (the parent, resolved, stays inside dst) once per directory, not
        # once per file: resolving costs a few syscalls per path component, on the main thread,
        # before any download starts.
        parent_rel, _, name = remote.rel.rpartition("/")
        if parent_rel not in checked_dirs:
            checked_dirs[parent_rel] = target_path(dst, remote.rel, uri).parent
        return checked_dirs[parent_rel] / name

    jobs: list[_PartFile] = []
    try:
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kuberl-stage") as pool:
            tasks = _Tasks(pool)
            # Largest first: the long downloads start at once and small files fill the gaps.
            for remote in sorted(files, key=lambda f: f.size, reverse=True):
                if remote.size == 0:
                    tasks.submit(empty_file, remote)
                    continue
                large = remote.size > max(part_size, _PROBE_BYTES)
                job = _PartFile(remote, checked_target(remote), verify, hash_thread=large)
                jobs.append(job)
                if large:
                    tasks.submit(copy, job, 0, remote.size, tasks)
                else:
                    tasks.submit(copy, job, 0, remote.size)
            exc = tasks.wait()
            if exc is not None:
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

