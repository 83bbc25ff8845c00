"""Per-rank checkpoints against the real S3 server (moto on loopback) with a real trainer rank
(``tests.driver.one_rank``: gloo, FSDP2, AdamW): background write and upload while training goes
on, commit, keep-N pruning, restore straight from the URI (dcp and tar), what a run restores, a
re-written step withdrawn before anything of it is uploaded, and a SIGKILL during upload leaving
`latest` on the previous complete checkpoint."""

import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

from kuberl.plan import Checkpoints, Resume
from kuberl.storage import (StorageError, checkpoint_to_restore, commit_checkpoint, latest_checkpoint,
                            withdraw_from)
from kuberl.train import checkpoint as ckpt
from kuberl.train.checkpoint import RankCheckpointer, find_checkpoint
from tests.driver.one_rank import OneRank


def _spec(root, fmt="dcp", keep=2) -> Checkpoints:
    return Checkpoints(root=root, interval_steps=1, keep=keep, format=fmt, export_hugging_face=False, export_uri=None)


@pytest.fixture(scope="module")
def rank():
    return OneRank()


@pytest.mark.parametrize("fmt", ["dcp", "tar"])
def test_background_save_commit_prune_restore(s3, tmp_path, rank, fmt, monkeypatch):
    fs, bucket = s3
    root = f"s3://{bucket}/run-{fmt}"
    blocks = []
    real_copy = tarfile.copyfileobj

    def spy(src, dst, length=None, exception=OSError, bufsize=None):
        blocks.append(bufsize)
        return real_copy(src, dst, length, exception, bufsize)

    monkeypatch.setattr(tarfile, "copyfileobj", spy)
    saver = RankCheckpointer(rank, _spec(root, fmt), tmp_path / "scratch")
    rank.before_update = saver.fence
    try:
        saved = {}
        for step in (2, 4, 6):
            saved[step] = rank.values()
            saver.save(step)
            rank.step()  # training goes on; its optimizer step waits for the write (fence)
            files = saver.uploaded(step)
            assert saver.commit(step, files, {"weight_version": step}) == f"{root}/step-{step:09d}"
        assert latest_checkpoint(root) == f"{root}/step-000000006"
        fs.invalidate_cache()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run-{fmt}")) == [
            "latest", "step-000000004", "step-000000006"]
        names = {p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/run-{fmt}/step-000000006")}
        if fmt == "tar":
            assert names == {"trainer-rank0.tar", "driver.json", "COMPLETE"}
            assert blocks and all(b == ckpt.TAR_COPY_BUFSIZE for b in blocks)
        else:
            assert {".metadata", "__0_0.distcp", "trainer_rank0_of1.pt", "driver.json", "COMPLETE"} <= names
        assert not list((tmp_path / "scratch").rglob("*")), "local copies are removed once uploaded"

        assert rank.values() != saved[6]
        state = saver.load(f"{root}/step-000000006")
        assert state == {"weight_version": 6, "step": 6}
        assert rank.values() == saved[6]  # the state when save was called, not after the step
    finally:
        rank.before_update = lambda: None
        saver.close()


def test_what_a_run_restores(s3, tmp_path):
    fs, bucket = s3
    root, other = f"s3://{bucket}/resume-root", f"s3://{bucket}/resume-other"
    assert find_checkpoint(Resume(newest_under=root)) is None  # a first run
    assert find_checkpoint(Resume()) is None
    with pytest.raises(StorageError, match="no complete checkpoint there"):
        find_checkpoint(Resume(explicit=other))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "driver.json").write_text("{}")
    explicit = commit_checkpoint(tmp_path / "state", other, 10)
    assert find_checkpoint(Resume(explicit=explicit)) == explicit
    assert find_checkpoint(Resume(explicit=other)) == explicit
    # A restart: the job's own newest checkpoint first, the spec's explicit one until there is one.
    assert find_checkpoint(Resume(newest_under=root, explicit=explicit)) == explicit
    mine = commit_checkpoint(tmp_path / "state", root, 20)
    assert find_checkpoint(Resume(newest_under=root, explicit=explicit)) == mine
    fs.pipe_file(f"{bucket}/resume-other/step-000000030/driver.json", b"{}")  # an upload that died
    with pytest.raises(StorageError, match="no COMPLETE marker"):
        find_checkpoint(Resume(explicit=f"{other}/step-000000030"))


def test_a_rewritten_step_is_withdrawn_before_it_is_written(s3, tmp_path):
    """Resuming from step 10 of a root that also has step 20, then writing step 20 again: the old
    step 20 loses its COMPLETE before any new object lands, so a kill mid-upload leaves nothing
    that `latest`, restore or `stage --checkpoint` accept as step 20."""
    fs, bucket = s3
    root = f"s3://{bucket}/rewrite"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "shard").write_bytes(b"old" * 100)
    commit_checkpoint(tmp_path / "old", root, 10)
    commit_checkpoint(tmp_path / "old", root, 20)
    assert withdraw_from(root, 20) == [f"{root}/step-000000020"]
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/rewrite/step-000000020")
    # The new attempt uploads part of step 20, then dies.
    fs.pipe_file(f"{bucket}/rewrite/step-000000020/shard", b"new")
    assert latest_checkpoint(root) == f"{root}/step-000000010"
    assert checkpoint_to_restore(root) == f"{root}/step-000000010"
    with pytest.raises(StorageError, match="no COMPLETE marker"):
        checkpoint_to_restore(f"{root}/step-000000020")


KILLED_UPLOAD = textwrap.dedent("""
    import sys, time
    from kuberl.plan import Checkpoints
    from kuberl.train.checkpoint import RankCheckpointer
    from tests.driver.one_rank import OneRank

    spec = Checkpoints(root=sys.argv[1], interval_steps=1, keep=3, format="dcp", export_hugging_face=False,
                       export_uri=None)
    small = OneRank(layers=1, dim=32)
    saver = RankCheckpointer(small, spec, sys.argv[2])
    saver.save(1)
    saver.commit(1, saver.uploaded(1), {"weight_version": 1})
    print("first committed", flush=True)
    saver.worker = OneRank(layers=16, dim=1024)  # ~200 MB of state: an upload that takes a while
    saver.save(2)
    print("second uploading", flush=True)
    time.sleep(600)
""")


def test_kill_during_upload_leaves_latest_on_the_previous_checkpoint(s3, s3_env, tmp_path):
    fs, bucket = s3
    root = f"s3://{bucket}/killed"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_UPLOAD, root, str(tmp_path / "scratch")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **s3_env})
    try:
        assert proc.stdout.readline().strip() == "first committed"
        assert proc.stdout.readline().strip() == "second uploading"
        # Wait until part of the second checkpoint is on the server, then kill mid-upload.
        deadline = time.monotonic() + 120
        while not fs.glob(f"{bucket}/killed/step-000000002/**") and time.monotonic() < deadline:
            fs.invalidate_cache()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/killed/step-000000002/COMPLETE")
    assert fs.cat_file(f"{bucket}/killed/latest") == b"step-000000001"
    assert find_checkpoint(Resume(newest_under=root)) == f"{root}/step-000000001"
