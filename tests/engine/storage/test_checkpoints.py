"""Checkpoint layout helpers, identical on s3://, gs:// and local paths."""

import json

import pytest

from kuberl.storage import (StorageError, commit_checkpoint, latest_checkpoint, prune_checkpoints,
                            stage, upload_dir)


@pytest.fixture(params=["s3", "gs", "local"])
def root(request, tmp_path):
    """(checkpoint root URI, fsspec filesystem, root path inside it)."""
    if request.param == "s3":
        fs, bucket = request.getfixturevalue("s3")
        return f"s3://{bucket}/run/ckpt", fs, f"{bucket}/run/ckpt"
    if request.param == "gs":
        fs, bucket = request.getfixturevalue("gcs")
        return f"gs://{bucket}/run/ckpt", fs, f"{bucket}/run/ckpt"
    import fsspec

    path = tmp_path / "store" / "ckpt"
    return str(path), fsspec.filesystem("file"), str(path)


def make_local(tmp_path, step):
    local = tmp_path / f"local-{step}"
    (local / "model").mkdir(parents=True)
    (local / "model" / "weights.pt").write_bytes(b"w" * (100 + step))
    (local / "trainer_state.json").write_text(json.dumps({"step": step}))
    return local


def test_commit_latest_and_incomplete_dirs_ignored(root, tmp_path):
    uri, fs, path = root
    assert latest_checkpoint(uri) is None
    first = commit_checkpoint(make_local(tmp_path, 10), uri, 10)
    assert first == f"{uri}/step-000000010"
    assert latest_checkpoint(uri) == first
    manifest = json.loads(fs.cat_file(f"{path}/step-000000010/COMPLETE"))
    assert manifest["step"] == 10 and len(manifest["files"]) == 2
    # A newer upload that died before COMPLETE (and before latest moved) is ignored.
    upload_dir(make_local(tmp_path, 20), f"{uri}/step-000000020")
    assert latest_checkpoint(uri) == first
    # latest pointing at an incomplete dir (e.g. written by hand) falls back to the listing.
    fs.pipe_file(f"{path}/latest", b"step-000000020")
    assert latest_checkpoint(uri) == first
    # latest missing: the listing finds the newest complete one.
    second = commit_checkpoint(make_local(tmp_path, 30), uri, 30)
    fs.rm_file(f"{path}/latest")
    assert latest_checkpoint(uri) == second
    # The staged copy round-trips.
    result = stage(second, tmp_path / "restored")
    assert (tmp_path / "restored" / "model" / "weights.pt").read_bytes() == b"w" * 130
    assert result.files == 3  # two files plus COMPLETE


def test_prune_keeps_newest_complete_and_newer_incomplete(root, tmp_path):
    uri, fs, path = root
    for step in (1, 2, 3, 4):
        commit_checkpoint(make_local(tmp_path, step), uri, step)
    upload_dir(make_local(tmp_path, 5), f"{uri}/step-000000005")        # still uploading
    upload_dir(make_local(tmp_path, 0), f"{uri}/step-000000000")        # abandoned attempt
    removed = prune_checkpoints(uri, keep=2)
    assert sorted(removed) == [f"{uri}/step-00000000{s}" for s in (0, 1, 2)]
    left = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    assert left == ["latest", "step-000000003", "step-000000004", "step-000000005"]
    assert latest_checkpoint(uri) == f"{uri}/step-000000004"


def test_bad_step_and_keep(tmp_path):
    with pytest.raises(ValueError, match="step"):
        commit_checkpoint(make_local(tmp_path, 1), str(tmp_path / "c"), -1)
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(str(tmp_path / "c"), 0)


def test_stage_checkpoint_takes_the_newest_complete_or_nothing(root, tmp_path, capsys):
    """What the stage-checkpoint init container runs: ``kuberl stage --checkpoint ROOT DST``."""
    from kuberl.cli.stage import main as stage_main

    uri, fs, path = root
    assert stage_main(["--checkpoint", uri, str(tmp_path / "first-run")]) == 0
    assert "no complete checkpoint yet" in capsys.readouterr().out
    assert not (tmp_path / "first-run").exists()
    commit_checkpoint(make_local(tmp_path, 10), uri, 10)
    commit_checkpoint(make_local(tmp_path, 20), uri, 20)
    fs.makedirs(f"{path}/step-000000030/model", exist_ok=True)
    fs.pipe_file(f"{path}/step-000000030/model/weights.pt", b"half")  # an upload that died
    assert stage_main(["--checkpoint", uri, str(tmp_path / "newest")]) == 0
    assert json.loads((tmp_path / "newest" / "trainer_state.json").read_text()) == {"step": 20}
    assert stage_main(["--checkpoint", f"{uri}/step-000000010", str(tmp_path / "named")]) == 0
    assert json.loads((tmp_path / "named" / "trainer_state.json").read_text()) == {"step": 10}
    assert stage_main(["--checkpoint", f"{uri}/step-000000030", str(tmp_path / "torn")]) == 1
    assert "no COMPLETE marker" in capsys.readouterr().err


def test_staged_checkpoint_is_checked_against_the_crc32c_kuberl_recorded(root, tmp_path):
    uri, fs, path = root
    step = commit_checkpoint(make_local(tmp_path, 10), uri, 10)
    manifest = json.loads(fs.cat_file(f"{path}/step-000000010/COMPLETE"))
    assert all(f["crc32c"] for f in manifest["files"])
    stage(step, tmp_path / "good")
    staged = json.loads((tmp_path / "good" / ".complete").read_text())["files"]
    assert {f["path"]: f["checksum"] for f in staged}["model/weights.pt"] == "crc32c"
    # Same size, other bytes, after the commit (bit rot on a volume, an overwrite in a bucket):
    # the store's own identity and checksum follow the new bytes; the recorded CRC32C does not.
    fs.pipe_file(f"{path}/step-000000010/model/weights.pt", b"x" * 110)
    with pytest.raises(StorageError, match=r"model/weights.pt: CRC32C mismatch: its COMPLETE "
                                           r"\(recorded at upload\) says \S+, the data hashes to"):
        stage(step, tmp_path / "bad")
    assert not (tmp_path / "bad" / "model" / "weights.pt").exists()
