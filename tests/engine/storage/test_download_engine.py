"""The transfer engine's own guarantees against moto on loopback: streamed ranges keep memory
bounded whatever the part size, a connection cut mid-range resumes at the first missing byte,
a killed run with a large file half-downloaded resumes cleanly, and errors are classified as
before (permanent: one clear message; transient: retried)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kuberl.api.uri import parse
from kuberl.storage import StorageError, download, stage
from kuberl.storage.download import STREAM_BLOCK, download_files, list_source
from kuberl.storage.filesystems import filesystem
from kuberl.storage.progress import Progress

REPO = Path(__file__).resolve().parents[3]


def pattern(size: int, seed: int) -> bytes:
    """Content where every 8-byte word differs, so a block written at a wrong offset shows."""
    words = (size + 7) // 8
    return b"".join((seed * 1_000_003 + i).to_bytes(8, "little") for i in range(words))[:size]


def _child_env(s3_env: dict[str, str]) -> dict[str, str]:
    """A child Python's environment: the loopback S3 server, and kuberl importable."""
    return {**os.environ, **s3_env,
            "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")])}


# A run's peak of Python allocations, traced in a process of its own: in the test's process
# tracemalloc would count every thread's, and a full session's (Ray's, the engines') are there.
PEAK_OF_A_STAGE = """
import sys, tracemalloc
from pathlib import Path
from kuberl.storage import stage
tracemalloc.start()
stage(sys.argv[1], Path(sys.argv[2]), workers=int(sys.argv[3]), part_size=int(sys.argv[4]))
print(tracemalloc.get_traced_memory()[1])
"""


def test_memory_stays_near_workers_times_stream_block(s3, s3_env, tmp_path):
    fs, bucket = s3
    size = 48 << 20
    fs.pipe_file(f"{bucket}/m/big.bin", pattern(size, 1))
    fs.pipe_file(f"{bucket}/tiny/x.bin", b"x")
    workers, part_size = 3, 16 << 20
    env = _child_env(s3_env)

    def peak_of(prefix: str) -> int:
        run = subprocess.run([sys.executable, "-c", PEAK_OF_A_STAGE, f"s3://{bucket}/{prefix}", str(tmp_path / prefix),
                              str(workers), str(part_size)], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout.split()[-1])

    # The fixed cost of a run (botocore's parsed service models, the clients) is the peak of
    # staging one byte; what the 48 MiB object adds on top is what the ranges hold.
    baseline = peak_of("tiny")
    extra = peak_of("m") - baseline
    assert (tmp_path / "m" / "big.bin").read_bytes() == pattern(size, 1)
    # Whole ranges held in memory would add workers x part_size (48 MiB); streamed ranges hold
    # a few blocks each (the block, http.client's read buffer), and the hash a few more (its
    # queue, a block read back when it fell behind), less than one part in all. Measured:
    # 3.9-6.9 MiB in 26 runs here; 14.9 MiB in 1 of 6 while a read-back took 8 MiB at once.
    assert extra < 4 * workers * STREAM_BLOCK < part_size, f"{extra / 2**20:.1f} MiB"


class CuttingProxy:
    """A TCP proxy to the S3 server on loopback that records the Range header of every request
    for ``key`` (None: no Range) and cuts the response to the first of them after ``cut_after``
    bytes: a real connection drop in the middle of a download, as a flaky network or load
    balancer does it."""

    def __init__(self, upstream: str, key: str, cut_after: int):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.key = key.encode()
        self.cut_after = cut_after
        self.ranges: list[str | None] = []
        self.body_bytes_before_cut: int | None = None  # of the cut response, after its headers
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket):
        upstream = socket.create_connection(self.upstream)
        cut_this = threading.Event()

        def requests_up():
            try:
                while data := client.recv(1 << 16):
                    lines = data.split(b"\r\n")
                    if lines[0].startswith(b"GET ") and self.key in lines[0]:
                        self.ranges.append(next((line.split(b"=", 1)[1].decode()
                                                 for line in lines
                                                 if line.lower().startswith(b"range:")), None))
                        if not self.cut.is_set():
                            self.cut.set()
                            cut_this.set()
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=requests_up, daemon=True).start()
        sent = 0
        head = b""  # the response's first bytes, until its headers' end is among them
        try:
            while data := upstream.recv(1 << 16):
                if b"\r\n\r\n" not in head:
                    head += data
                if cut_this.is_set() and sent + len(data) > self.cut_after:
                    client.sendall(data[:self.cut_after - sent])
                    self.body_bytes_before_cut = self.cut_after - (head.index(b"\r\n\r\n") + 4)
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            # shutdown, not close alone: the request thread's recv on `client` holds the socket
            # open, so close() alone sent no FIN and the client saw a stalled read until its
            # 60 s read timeout instead of a drop.
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self):
        self.listener.close()


def test_connection_cut_mid_range_resumes_at_the_first_missing_byte(s3, s3_env, tmp_path,
                                                                      monkeypatch, caplog):
    fs, bucket = s3
    size = 6 << 20
    fs.pipe_file(f"{bucket}/m/big.bin", pattern(size, 2))
    proxy = CuttingProxy(s3_env["AWS_ENDPOINT_URL_S3"], "/m/big.bin", cut_after=(1 << 20) + 4096)
    # The first GET (the whole object) hands the rest to ranges of 3 MiB after its first 1 MiB.
    monkeypatch.setattr(download, "_PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(download, "FAST_STREAM_BPS", float("inf"))
    monkeypatch.setattr(download, "_WAITING_ON_NETWORK", float("-inf"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    try:
        with caplog.at_level("WARNING", logger="kuberl.storage"):
            result = stage(f"s3://{bucket}/m", tmp_path / "dst", workers=2, part_size=3 << 20)
    finally:
        proxy.close()
    assert result.downloaded_bytes == size
    assert (tmp_path / "dst" / "big.bin").read_bytes() == pattern(size, 2)
    assert any("transient" in r.getMessage() for r in caplog.records)
    # The whole-object GET, cut in its second MiB, resumed as the range of its chunk (0-3 MiB)
    # from the first missing byte (the first the cut kept from the client), not from 0; and the
    # range 3-6 MiB (+ the growth probe byte).
    assert proxy.ranges[0] is None, proxy.ranges
    resumed = sorted(proxy.ranges[1:])
    first_missing = proxy.body_bytes_before_cut
    assert STREAM_BLOCK < first_missing < 3 << 20, first_missing
    assert resumed == [f"{first_missing}-{(3 << 20) - 1}", f"{3 << 20}-{size}"], proxy.ranges


def test_kill_mid_file_then_resume(s3, s3_env, tmp_path):
    fs, bucket = s3
    big = {"a-big.bin": pattern(12 << 20, 3), "b-big.bin": pattern(10 << 20, 4)}
    for name, data in big.items():
        fs.pipe_file(f"{bucket}/r/{name}", data)
    fs.pipe({f"{bucket}/r/small/f{i:03d}": b"%03d" % i for i in range(50)})
    uri = f"s3://{bucket}/r"
    dst = tmp_path / "dst"
    env = _child_env(s3_env)
    proc = subprocess.Popen([sys.executable, "-m", "kuberl.cli.stage", uri, str(dst), "--workers", "1",
                             "--part-size", "1MiB"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = dst / ".kuberl-stage.journal"
    second_part = dst / ".b-big.bin.kuberl-part"
    deadline = time.monotonic() + 120
    # Largest first: kill once the first big file is verified and the second is mid-way.
    while time.monotonic() < deadline:
        if journal.exists() and "a-big.bin" in journal.read_text() and second_part.exists():
            break
        assert proc.poll() is None, "the stager finished before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dst / ".complete").exists() and not (dst / "b-big.bin").exists()
    first_mtime = (dst / "a-big.bin").stat().st_mtime_ns

    result = stage(uri, dst, workers=4, part_size=1 << 20)
    assert result.skipped_files >= 1 and result.files == 52
    assert (dst / "a-big.bin").stat().st_mtime_ns == first_mtime, "a-big.bin was downloaded again"
    for name, data in big.items():
        assert (dst / name).read_bytes() == data
    assert not list(dst.rglob("*.kuberl-part"))
    manifest = json.loads((dst / ".complete").read_text())
    assert {f["path"]: f["checksum"] for f in manifest["files"]}["b-big.bin"] == "crc32"


def test_object_deleted_after_listing_is_not_found(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/gone.bin", b"g" * 5000)
    uri = f"s3://{bucket}/m"
    parsed = parse(uri)
    s3fs_ = filesystem(parsed)
    files = list_source(s3fs_, parsed, f"{bucket}/m", uri)
    fs.rm(f"{bucket}/m/gone.bin")
    with pytest.raises(StorageError, match=rf"^{uri}.*not found.*Check the bucket name"):
        download_files(s3fs_, files, tmp_path, uri, workers=2, part_size=1024, verify=True,
                       attempts=3, progress=Progress("t", 0, 0), on_verified=lambda r: None)
    assert not list(tmp_path.rglob("*.kuberl-part"))


def test_server_gone_after_listing_is_retried_then_reported(s3, s3_env, tmp_path, monkeypatch,
                                                            caplog):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/a.bin", b"a" * 100)
    uri = f"s3://{bucket}/m"
    parsed = parse(uri)
    # kuberl's own retries are under test, not botocore's: its client would try each request 5
    # times with backoff first (about 8 s per attempt of ours against a closed port).
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs_ = filesystem(parsed)
    files = list_source(s3fs_, parsed, f"{bucket}/m", uri)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    s3fs_.endpoint_url = dead  # the store vanishes between listing and download
    with caplog.at_level("WARNING", logger="kuberl.storage"), \
            pytest.raises(StorageError, match="still failing after 2 attempts"):
        download_files(s3fs_, files, tmp_path, uri, workers=2, part_size=1024, verify=True,
                       attempts=2, progress=Progress("t", 0, 0), on_verified=lambda r: None)
    assert any("transient" in r.getMessage() for r in caplog.records)
