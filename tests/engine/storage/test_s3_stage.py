"""kuberl stage against moto's S3 server on loopback, through the real s3fs code."""

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import google_crc32c
import pytest

from kuberl.api.uri import parse
from kuberl.cli.stage import main as stage_main
from kuberl.storage import StorageError, download, stage
from kuberl.storage.download import download_files, list_source
from kuberl.storage.filesystems import filesystem
from kuberl.storage.progress import Progress
from tests.shared.archives import tar_of

REPO = Path(__file__).resolve().parents[3]


def put_many(fs, bucket, prefix, n, size=64):
    fs.pipe({f"{bucket}/{prefix}/d{i % 10}/f{i:04d}.bin": (b"%06d" % i) * (size // 6)
             for i in range(n)})


def test_thousand_small_files_then_rerun_downloads_nothing(s3, tmp_path):
    fs, bucket = s3
    put_many(fs, bucket, "many", 1000)
    first = stage(f"s3://{bucket}/many", tmp_path)
    assert (first.files, first.downloaded_files, first.skipped_files) == (1000, 1000, 0)
    assert (tmp_path / "d7" / "f0997.bin").read_bytes() == (b"%06d" % 997) * 10
    second = stage(f"s3://{bucket}/many", tmp_path)
    assert (second.downloaded_files, second.skipped_files) == (0, 1000)


def test_one_gib_file_in_parallel_ranges(s3, tmp_path):
    fs, bucket = s3
    size = 1 << 30
    src = tmp_path / "big.bin"
    # Sparse but not uniform: a marker at every MiB catches any range written at the wrong offset.
    with open(src, "wb") as f:
        f.truncate(size)
        for offset in range(0, size, 1 << 20):
            f.seek(offset)
            f.write(offset.to_bytes(8, "little"))
    fs.put_file(str(src), f"{bucket}/ckpt/big.bin")
    result = stage(f"s3://{bucket}/ckpt", tmp_path / "dst", part_size=128 << 20, workers=4)
    assert result.downloaded_bytes == size
    got = tmp_path / "dst" / "big.bin"
    assert got.stat().st_size == size

    def digest(path):
        h = hashlib.md5()
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        return h.hexdigest()

    assert digest(got) == digest(src)


def test_object_changed_after_listing_is_refused(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/a.bin", b"a" * 100)
    fs.pipe_file(f"{bucket}/m/b.bin", b"b" * 100)
    uri = f"s3://{bucket}/m"
    parsed = parse(uri)
    s3fs_ = filesystem(parsed)
    files = list_source(s3fs_, parsed, f"{bucket}/m", uri)
    # The store now serves other bytes than the listing named (an overwritten object, same
    # size or not): the response's ETag differs from the listing's, whatever checksum the new
    # object carries for itself.
    fs.pipe_file(f"{bucket}/m/a.bin", b"a" * 99)
    fs.pipe_file(f"{bucket}/m/b.bin", b"c" * 100)
    for remote in files:
        with pytest.raises(StorageError, match=f"{remote.rel}: the object changed since it was "
                                               f"listed"):
            download_files(s3fs_, [remote], tmp_path, uri, workers=4, part_size=1024,
                           verify=True, attempts=1, progress=Progress("t", 0, 0),
                           on_verified=lambda r: None)
        assert not (tmp_path / remote.rel).exists()


def put_with_crc32c(bucket: str, key: str, data: bytes, crc32c: str | None = None) -> None:
    """PUT ``data`` storing ``crc32c`` (default: its true CRC32C) as the object's checksum.
    moto keeps a given checksum without checking it (real S3 would refuse a wrong one at
    upload), which stands in here for an object whose bytes went bad after it was stored."""
    import boto3

    value = crc32c or base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32C",
                                  ChecksumCRC32C=value)


@pytest.mark.parametrize("stream", ["one stream", "ranges"])
def test_crc32c_object_is_verified_with_crc32c(s3, tmp_path, monkeypatch, stream):
    fs, bucket = s3
    data = os.urandom(1 << 20)
    put_with_crc32c(bucket, "c/model.bin", data)
    fs.pipe_file(f"{bucket}/c/config.json", b"{}")  # the SDK's default: CRC32
    # After its first 256 KiB the first GET goes on alone, or leaves the rest to 6 ranges.
    monkeypatch.setattr(download, "_PROBE_BYTES", 256 << 10)
    if stream == "ranges":  # as if the stream were slow and waiting on the network
        monkeypatch.setattr(download, "FAST_STREAM_BPS", float("inf"))
        monkeypatch.setattr(download, "_WAITING_ON_NETWORK", float("-inf"))
    else:
        monkeypatch.setattr(download, "FAST_STREAM_BPS", 0)
    stage(f"s3://{bucket}/c", tmp_path, part_size=128 << 10, workers=4)
    assert (tmp_path / "model.bin").read_bytes() == data
    manifest = json.loads((tmp_path / ".complete").read_text())
    assert {f["path"]: f["checksum"] for f in manifest["files"]} == {"model.bin": "crc32c",
                                                                     "config.json": "crc32"}


@pytest.mark.parametrize("size", [1000, 1 << 20])
def test_object_not_matching_its_crc32c_fails_naming_both(s3, tmp_path, monkeypatch, size):
    fs, bucket = s3
    put_with_crc32c(bucket, "bad/model.bin", os.urandom(size), crc32c="AAAAAA==")
    monkeypatch.setattr(download, "_PROBE_BYTES", 256 << 10)
    # The large one in ranges: as if the stream were slow and waiting on the network.
    monkeypatch.setattr(download, "FAST_STREAM_BPS", float("inf"))
    monkeypatch.setattr(download, "_WAITING_ON_NETWORK", float("-inf"))
    uri = f"s3://{bucket}/bad"
    with pytest.raises(StorageError, match=rf"{uri}: model.bin: CRC32C mismatch: the store says "
                                           rf"AAAAAA==, the data hashes to \S+==; the object is "
                                           rf"corrupt .*; rerun"):
        stage(uri, tmp_path, part_size=128 << 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kuberl-stage.journal"]


def test_local_copy_corrupted_after_complete_is_fetched_again(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/a.bin", b"a" * 100)
    fs.pipe_file(f"{bucket}/m/b.bin", b"b" * 100)
    stage(f"s3://{bucket}/m", tmp_path)
    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    again = stage(f"s3://{bucket}/m", tmp_path)
    assert (again.downloaded_files, again.skipped_files) == (1, 1)
    assert (tmp_path / "a.bin").read_bytes() == b"a" * 100


@pytest.mark.parametrize("key", ["../escape.txt", "a/../../escape.txt", "a//b.txt", "./x"])
def test_keys_escaping_dst_are_refused(s3, tmp_path, key):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/ok.txt", b"ok")
    fs.pipe_file(f"{bucket}/m/{key}", b"evil")
    with pytest.raises(StorageError, match="refusing object key"):
        stage(f"s3://{bucket}/m", tmp_path / "dst")
    assert not (tmp_path / "escape.txt").exists()
    assert not (tmp_path / "dst" / "ok.txt").exists()  # refused before anything was written


def test_symlinked_subdir_leading_out_is_refused(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/sub/x.txt", b"x")
    (tmp_path / "dst").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "dst" / "sub").symlink_to(tmp_path / "outside")
    with pytest.raises(StorageError, match="symlink"):
        stage(f"s3://{bucket}/m", tmp_path / "dst")
    assert not (tmp_path / "outside" / "x.txt").exists()


def test_tar_checkpoint_is_unpacked(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/ckpt/step-000000010.tar",
                 tar_of({"model/weights.pt": b"w" * 300, "optim/state.pt": b"o" * 20}))
    result = stage(f"s3://{bucket}/ckpt/step-000000010.tar", tmp_path)
    assert (tmp_path / "model" / "weights.pt").read_bytes() == b"w" * 300
    assert result.files == 2 and result.bytes == 320
    assert not list(tmp_path.glob("*.tar")) and not list(tmp_path.glob(".untar*"))
    again = stage(f"s3://{bucket}/ckpt/step-000000010.tar", tmp_path)
    assert again.downloaded_files == 0 and again.skipped_files == 2


@pytest.mark.parametrize("members,links", [
    ({"../../evil.txt": b"x"}, {}),
    ({"ok.txt": b"x"}, {"link": "/etc"}),
    ({"ok.txt": b"x"}, {"link": "../../.."}),
])
def test_tar_slip_is_refused(s3, tmp_path, members, links):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/ckpt/evil.tar", tar_of(members, links))
    dst = tmp_path / "a" / "dst"
    with pytest.raises(StorageError, match="refusing archive member"):
        stage(f"s3://{bucket}/ckpt/evil.tar", dst)
    assert sorted(p.name for p in dst.iterdir()) == []
    assert not (tmp_path / "evil.txt").exists()


def test_tar_absolute_member_is_refused(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/ckpt/abs.tar", tar_of({"/tmp/kuberl-evil-abs.txt": b"x"}))
    with pytest.raises(StorageError, match="refusing archive member '/tmp/kuberl-evil-abs.txt'"):
        stage(f"s3://{bucket}/ckpt/abs.tar", tmp_path)
    assert not Path("/tmp/kuberl-evil-abs.txt").exists() and list(tmp_path.iterdir()) == []


def test_missing_bucket_names_the_uri(s3, tmp_path, capsys):
    uri = "s3://no-such-bucket-kuberl/models/x"
    with pytest.raises(StorageError, match="s3://no-such-bucket-kuberl/models/x: bucket "
                                           "'no-such-bucket-kuberl' does not exist"):
        stage(uri, tmp_path)
    assert stage_main([uri, str(tmp_path)]) == 1
    assert "no-such-bucket-kuberl" in capsys.readouterr().err


def test_missing_prefix_is_not_found(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/present/a", b"a")
    with pytest.raises(StorageError, match=f"s3://{bucket}/absent: not found"):
        stage(f"s3://{bucket}/absent", tmp_path)


def test_missing_credentials_are_a_clear_error(s3, tmp_path, monkeypatch, capsys):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/a", b"a")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = f"s3://{bucket}/m"
    with pytest.raises(StorageError, match=f"{uri}: no usable credentials.*AWS_ACCESS_KEY_ID"):
        stage(uri, tmp_path, attempts=2)
    assert stage_main([uri, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert uri in err and "AWS_SECRET_ACCESS_KEY" in err


def test_cli_bad_uri_exits_2(capsys, tmp_path):
    assert stage_main(["s3://BAD_bucket/x", str(tmp_path)]) == 2
    assert "bucket" in capsys.readouterr().err


def test_kill_mid_way_then_resume_downloads_nothing_verified(s3, s3_env, tmp_path):
    fs, bucket = s3
    put_many(fs, bucket, "resume", 600, size=6000)
    uri = f"s3://{bucket}/resume"
    dst = tmp_path / "dst"
    env = {**os.environ, **s3_env,
           "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kuberl.cli.stage", uri, str(dst), "--workers", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = dst / ".kuberl-stage.journal"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_text().count("\n") >= 53:  # the source line, then 50 records and a margin
            break
        assert proc.poll() is None, "the stager finished before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dst / ".complete").exists()
    header, *lines = journal.read_text().splitlines()
    assert json.loads(header) == {"source": uri}
    verified = [json.loads(line) for line in lines if line.endswith("}")]
    assert 50 <= len(verified) < 600
    mtimes = {v["path"]: (dst / v["path"]).stat().st_mtime_ns for v in verified}
    result = stage(uri, dst)
    assert result.skipped_files >= len(verified)
    assert result.downloaded_files == 600 - result.skipped_files
    for path, mtime in mtimes.items():
        assert (dst / path).stat().st_mtime_ns == mtime, f"{path} was downloaded again"
    assert not list(dst.rglob("*.kuberl-part"))
    assert not journal.exists() and (dst / ".complete").exists()
