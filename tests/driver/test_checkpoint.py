"""CheckpointManager against the real S3 server (moto on loopback): background upload, atomic
commit, pruning, restore (dcp and tar formats), and a SIGKILL during upload leaving `latest` on
the previous complete checkpoint.

The trainer's part of a checkpoint is written by a callable; here it writes plain files, since
what is under test is the packaging, upload and commit, not the trainer's state (tests/train and
the end-to-end driver test cover that)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kuberl.api.types import CheckpointSpec
from kuberl.storage import StorageError, commit_checkpoint, latest_checkpoint
from kuberl.train.checkpoint import CheckpointManager


def _writer(payload: bytes):
    def save_trainer(path):
        os.makedirs(path)
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(payload)
        with open(os.path.join(path, ".metadata"), "w") as f:
            f.write("meta")
    return save_trainer


@pytest.mark.parametrize("fmt", ["dcp", "tar"])
def test_save_upload_prune_restore(s3, tmp_path, fmt):
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    committed = []
    spec = CheckpointSpec(uri=root, interval_steps=2, keep=2, format=fmt)
    manager = CheckpointManager(spec, tmp_path / "work", on_committed=lambda uri, step: committed.append((uri, step)))
    for step in (2, 4, 6):
        assert manager.due(step) and not manager.due(step + 1)
        manager.save(step, _writer(f"state-{step}".encode()), {"weight_version": step})
    manager.close()
    assert [s for _, s in committed] == [2, 4, 6]
    assert latest_checkpoint(root) == f"{root}/step-000000006"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run")) == ["latest", "step-000000004",
                                                                          "step-000000006"]
    assert not list((tmp_path / "work").glob("step-*")), "local copies are removed once committed"

    loaded = {}

    def load_trainer(path):
        loaded["payload"] = open(os.path.join(path, "__0_0.distcp"), "rb").read()

    restorer = CheckpointManager(spec, tmp_path / "work2")
    source = restorer.source(None)
    state = restorer.restore(source, load_trainer)
    assert state == {"weight_version": 6, "step": 6}
    assert loaded["payload"] == b"state-6"


def test_resume_choices(s3, tmp_path):
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    assert CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(None) is None  # nothing yet
    assert CheckpointManager(CheckpointSpec(uri=root, resume="never"), tmp_path).source(None) is None
    other = f"s3://{bucket}/other"
    with pytest.raises(StorageError, match="no complete checkpoint there"):
        CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(other)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "driver.json").write_text("{}")
    explicit = commit_checkpoint(tmp_path / "state", other, 10)
    assert CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(explicit) == explicit
    assert CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(other) == explicit
    fs.pipe_file(f"{bucket}/other/step-000000020/driver.json", b"{}")  # an upload that died
    with pytest.raises(StorageError, match="no COMPLETE marker"):
        CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(f"{other}/step-000000020")
    assert CheckpointManager(CheckpointSpec(uri=root), tmp_path).source(root) is None  # the root means auto
    assert CheckpointManager(CheckpointSpec(), tmp_path).source(None) is None


KILLED_UPLOAD = textwrap.dedent("""
    import os, sys, time
    from kuberl.api.types import CheckpointSpec
    from kuberl.train.checkpoint import CheckpointManager

    def writer(size):
        def save(path):
            os.makedirs(path)
            for i in range(8):
                with open(os.path.join(path, f"__{i}_0.distcp"), "wb") as f:
                    f.write(os.urandom(size // 8))
        return save

    manager = CheckpointManager(CheckpointSpec(uri=sys.argv[1], interval_steps=1), sys.argv[2])
    manager.save(1, writer(1 << 20), {"weight_version": 1})
    manager.wait()
    print("first committed", flush=True)
    manager.save(2, writer(256 << 20), {"weight_version": 2})
    print("second uploading", flush=True)
    time.sleep(600)
""")


def test_kill_during_upload_leaves_latest_on_the_previous_checkpoint(s3, s3_env, tmp_path):
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_UPLOAD, root, str(tmp_path / "work")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **s3_env})
    try:
        assert proc.stdout.readline().strip() == "first committed"
        assert proc.stdout.readline().strip() == "second uploading"
        # Wait until part of the second checkpoint is on the server, then kill mid-upload.
        deadline = time.monotonic() + 60
        while not fs.glob(f"{bucket}/run/step-000000002/**") and time.monotonic() < deadline:
            fs.invalidate_cache()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/run/step-000000002/COMPLETE")
    assert fs.cat_file(f"{bucket}/run/latest") == b"step-000000001"
    assert latest_checkpoint(root) == f"{root}/step-000000001"
    # A new run resumes from the complete one.
    state = CheckpointManager(CheckpointSpec(uri=root), tmp_path / "again").restore(
        latest_checkpoint(root), lambda path: None)
    assert json.dumps(state) == json.dumps({"weight_version": 1, "step": 1})
