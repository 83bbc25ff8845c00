import hashlib
import json

from kuberl.storage import stage


def test_nested_prefixes_and_empty_files(s3, tmp_path):
    fs, bucket = s3
    objects = {"config.json": b'{"a": 1}', "weights/shard-00001.safetensors": b"x" * 1000,
               "weights/deep/er/empty.bin": b"", "tokenizer/tok.json": b"t"}
    for key, data in objects.items():
        fs.pipe_file(f"{bucket}/models/tiny/{key}", data)
    fs.pipe_file(f"{bucket}/models/tiny2/not-this.json", b"other prefix")
    result = stage(f"s3://{bucket}/models/tiny", tmp_path / "dst")
    assert result.files == 4 and result.downloaded_files == 4
    for key, data in objects.items():
        assert (tmp_path / "dst" / key).read_bytes() == data
    assert not (tmp_path / "dst" / "not-this.json").exists()
    manifest = json.loads((tmp_path / "dst" / ".complete").read_text())
    by_path = {f["path"]: f for f in manifest["files"]}
    assert by_path["config.json"]["etag"] == hashlib.md5(b'{"a": 1}').hexdigest()
    # The SDK stores a CRC32 with every upload by default; it is checked instead of the MD5.
    assert by_path["config.json"]["checksum"] == "crc32"
    assert by_path["weights/deep/er/empty.bin"]["size"] == 0


def test_progress_log_lines_when_not_a_terminal(s3, tmp_path, caplog):
    import io
    import logging

    fs, bucket = s3
    fs.pipe({f"{bucket}/p/f{i}": b"z" * 1000 for i in range(20)})
    with caplog.at_level(logging.INFO, logger="kuberl.storage"):
        stage(f"s3://{bucket}/p", tmp_path, progress_stream=io.StringIO(), log_interval_s=0)
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert lines and "/20 files" in lines[-1] and "19.5 KiB / 19.5 KiB (100%)" in lines[-1]
