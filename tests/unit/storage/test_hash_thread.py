"""A large file's checksum is computed by a thread of its own (``download._PartFile``): whatever
order the blocks land in and however many the thread's queue drops, the hash covers exactly the
file's bytes, in order; a failure in that thread reaches the worker that asks for the digest.

The blocks are written straight into the part file as the download's workers write them; the
network is not needed for what this checks (the engine tests stage real objects through it)."""

from __future__ import annotations

import os
import threading

import pytest

from kuberl.storage import download
from kuberl.storage.checksums import Checksum, Hasher, crc32c_of_bytes
from kuberl.storage.download import RemoteFile, _PartFile

BLOCK = 64 << 10


class GatedHasher(Hasher):
    """A CRC32C hasher whose first update waits for ``gate``, so a test can fill the hashing
    thread's queue while that thread is busy (the only way to make it drop blocks on cue);
    ``fail`` makes every update raise instead; ``sizes`` records each update's length."""

    gate = threading.Event()
    fail = False
    sizes: list[int] = []

    def update(self, data: bytes) -> None:
        self.sizes.append(len(data))
        self.gate.wait(timeout=30)
        if self.fail:
            raise OSError("hashing failed")
        super().update(data)


@pytest.fixture
def gated(monkeypatch):
    GatedHasher.gate = threading.Event()
    GatedHasher.fail = False
    GatedHasher.sizes = []
    monkeypatch.setattr(download, "Hasher", GatedHasher)
    monkeypatch.setattr(download, "_HASH_QUEUE_BLOCKS", 1)
    return GatedHasher


def part_file(tmp_path, data: bytes) -> _PartFile:
    remote = RemoteFile("bucket/big.bin", "big.bin", len(data), None,
                        Checksum("crc32c", crc32c_of_bytes(data)))
    job = _PartFile(remote, tmp_path / "big.bin", verify=True, hash_thread=True)
    job.fd()
    job.choose_checksum(None)
    return job


def write(job: _PartFile, data: bytes, chunk_start: int, start: int, end: int) -> None:
    for offset in range(start, end, BLOCK):
        block = data[offset:min(offset + BLOCK, end)]
        os.pwrite(job.fd(), block, offset)
        job.block_written(chunk_start, offset, block)


def test_one_stream_with_blocks_dropped_is_hashed_in_order(tmp_path, gated):
    data = os.urandom(16 * BLOCK + 123)
    job = part_file(tmp_path, data)
    # The thread holds the first block at the gate; its one-slot queue takes one more; the
    # rest of the first half is dropped and must be read back from the file.
    write(job, data, 0, 0, 8 * BLOCK)
    gated.gate.set()
    write(job, data, 0, 8 * BLOCK, len(data))
    assert job.digest() == job.checksum.expected
    job.close()


def test_a_read_back_holds_one_stream_block_at_a_time(tmp_path, gated):
    # However far behind the hash fell (as under load: the CI's 8 MiB read-backs showed as 8 MiB
    # over the staging memory bound), what it reads back from the file it reads a block at a time.
    data = os.urandom(3 * download.STREAM_BLOCK + 123)
    job = part_file(tmp_path, data)
    write(job, data, 0, 0, len(data))  # all but the first two blocks dropped
    gated.gate.set()
    assert job.digest() == job.checksum.expected
    job.close()
    assert sum(GatedHasher.sizes) == len(data) and max(GatedHasher.sizes) == download.STREAM_BLOCK


def test_ranges_landing_out_of_order_are_hashed_in_order(tmp_path, gated):
    gated.gate.set()
    data = os.urandom(12 * BLOCK)
    job = part_file(tmp_path, data)
    job.split([4 * BLOCK, 8 * BLOCK])
    write(job, data, 8 * BLOCK, 8 * BLOCK, 12 * BLOCK)  # the last range first
    write(job, data, 0, 0, 2 * BLOCK)
    write(job, data, 4 * BLOCK, 4 * BLOCK, 8 * BLOCK)
    write(job, data, 0, 2 * BLOCK, 4 * BLOCK)
    assert job.digest() == job.checksum.expected
    job.close()


def test_a_failure_in_the_hashing_thread_reaches_the_digest(tmp_path, gated):
    gated.fail = True
    gated.gate.set()
    data = os.urandom(4 * BLOCK)
    job = part_file(tmp_path, data)
    write(job, data, 0, 0, len(data))
    with pytest.raises(OSError, match="hashing failed"):
        job.digest()
    job.abandon()
    assert not job.part.exists()
