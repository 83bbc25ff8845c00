"""kuberl stage against fake-gcs-server on loopback, through the real gcsfs code."""

import base64
import hashlib
import json

import pytest

from kuberl.storage import StorageError, stage


def test_nested_prefixes_empty_files_and_crc32c(gcs, tmp_path):
    fs, bucket = gcs
    objects = {"config.json": b'{"a": 1}', "w/deep/shard.bin": bytes(range(256)) * 400,
               "w/empty.bin": b""}
    for key, data in objects.items():
        fs.pipe_file(f"{bucket}/models/tiny/{key}", data)
    result = stage(f"gs://{bucket}/models/tiny", tmp_path, part_size=10_000)
    assert result.downloaded_files == 3
    for key, data in objects.items():
        assert (tmp_path / key).read_bytes() == data
    files = {f["path"]: f for f in json.loads((tmp_path / ".complete").read_text())["files"]}
    # gcs gives every object's crc32c: it is checked (rather than md5Hash) for each file.
    assert {f["checksum"] for f in files.values()} == {"crc32c"}
    assert stage(f"gs://{bucket}/models/tiny", tmp_path).skipped_files == 3


def test_missing_bucket(gcs, tmp_path):
    with pytest.raises(StorageError, match="gs://no-such-bucket-kuberl/x: bucket "
                                           "'no-such-bucket-kuberl' does not exist"):
        stage("gs://no-such-bucket-kuberl/x", tmp_path)


def test_dotdot_key_refused(gcs, tmp_path):
    fs, bucket = gcs
    fs.pipe_file(f"{bucket}/m/a/../../../escape", b"x")
    with pytest.raises(StorageError, match="refusing object key"):
        stage(f"gs://{bucket}/m", tmp_path / "dst")
    assert not (tmp_path / "escape").exists()
