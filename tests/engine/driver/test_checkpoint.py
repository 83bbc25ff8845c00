"""Per-rank checkpoints against the real S3 server (moto on loopback) with a real trainer rank
(``tests.engine.driver.one_rank``: gloo, FSDP2, AdamW): background write and upload while training goes
on, commit, keep-N pruning, restore straight from the URI (dcp and tar), what a run restores, a
re-written step withdrawn before anything of it is uploaded, and a SIGKILL during upload leaving
`latest` on the previous complete checkpoint."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

from kuberl.job.plan import Checkpoints, Resume
from kuberl.storage import (StorageError, checkpoint_to_restore, commit_checkpoint, latest_checkpoint,
                            verify_checkpoint, withdraw_from)
from kuberl.train import checkpoint as ckpt
from kuberl.train.checkpoint import RankCheckpointer, find_checkpoint
from tests.engine.driver.one_rank import OneRank


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
        rank.before_update = lambda: 0.0
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
    from kuberl.job.plan import Checkpoints
    from kuberl.train.checkpoint import RankCheckpointer
    from tests.engine.driver.one_rank import OneRank

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


# --- restore unpickles nothing it cannot vouch for (kuberl.train.dcp_read) ------------------------


class Planted:
    """What an attacker plants: unpickling it creates ``marker`` (pickling it runs nothing)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _save_and_commit(saver, step):
    saver.save(step)
    return saver.commit(step, saver.uploaded(step), {"weight_version": step})


def _replace_and_recommit(fs, uri, rel, data):
    """Replace ``rel`` of a committed step and rewrite its COMPLETE to match, as whoever may write
    the bucket can: restore's listing check passes, so only what it unpickles can stop it."""
    key = uri.removeprefix("s3://")
    fs.pipe_file(f"{key}/{rel}", data)
    manifest = json.loads(fs.cat_file(f"{key}/COMPLETE"))
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry.update(size=len(data), etag=None, checksum="size")
    fs.pipe_file(f"{key}/COMPLETE", json.dumps(manifest).encode())
    fs.invalidate_cache()
    verify_checkpoint(uri)


def _relocated_metadata(genuine: bytes) -> bytes:
    """The genuine metadata with every shard read from outside the step's directory."""
    metadata = pickle.loads(genuine)
    for info in metadata.storage_data.values():
        info.relative_path = "../../step-000000002/trainer/__0_0.distcp"
    return pickle.dumps(metadata)


@pytest.mark.parametrize("plant, words", [
    (lambda genuine, marker: pickle.dumps(Planted(marker)), "refusing to unpickle it: it names builtins.exec"),
    (lambda genuine, marker: _relocated_metadata(genuine), "names the file '../../step-000000002"),
])
def test_restore_refuses_a_planted_metadata_before_unpickling_it(s3, tmp_path, rank, plant, words):
    """dcp itself would pickle.load ``trainer/.metadata`` in every rank: restore refuses it,
    naming the file, and nothing of it runs; the genuine file put back restores exactly."""
    fs, bucket = s3
    root, marker = f"s3://{bucket}/planted-metadata", tmp_path / "planted-ran"
    saver = RankCheckpointer(rank, _spec(root), tmp_path / "scratch")
    try:
        uri = _save_and_commit(saver, 4)
        saved = rank.values()
        rank.step()
        genuine = fs.cat_file(f"{uri.removeprefix('s3://')}/trainer/.metadata")
        _replace_and_recommit(fs, uri, "trainer/.metadata", plant(genuine, marker))
        with pytest.raises(StorageError) as refused:
            saver.load(uri)
        assert f"{uri}/trainer/.metadata: " in str(refused.value) and words in str(refused.value)
        assert "delete this checkpoint" in str(refused.value)
        assert not marker.exists()
        assert rank.values() != saved  # nothing was loaded

        _replace_and_recommit(fs, uri, "trainer/.metadata", genuine)
        assert saver.load(uri) == {"weight_version": 4, "step": 4}
        assert rank.values() == saved
    finally:
        saver.close()


@pytest.mark.parametrize("where", ["shard value", "rank state"])
def test_restore_refuses_planted_values_in_shards_and_rank_state(s3, tmp_path, rank, where, monkeypatch):
    """A shard's non-tensor values (dcp's default planner: torch.load(weights_only=False)) and each
    rank's ``.pt`` are unpickled weights-only: a planted object is refused, naming the file."""
    fs, bucket = s3
    root, marker = f"s3://{bucket}/planted-{where.replace(' ', '-')}", tmp_path / "planted-ran"
    real_state = rank.checkpoint_state

    def planted_state():
        state, extra = real_state()
        if where == "shard value":
            state["optim"]["param_groups"][0]["lr"] = Planted(marker)
        else:
            extra["scheduler"] = Planted(marker)
        return state, extra

    saver = RankCheckpointer(rank, _spec(root), tmp_path / "scratch")
    try:
        monkeypatch.setattr(rank, "checkpoint_state", planted_state)
        uri = _save_and_commit(saver, 6)  # the attacker's checkpoint, otherwise as kuberl writes it
        monkeypatch.setattr(rank, "checkpoint_state", real_state)
        with pytest.raises(StorageError) as refused:
            saver.load(uri)
        named = (f"{uri}/trainer/__0_0.distcp (optim.param_groups.0.lr)" if where == "shard value"
                 else f"{uri}/trainer/trainer_rank0_of1.pt")
        assert f"{named}: refusing to unpickle" in str(refused.value), str(refused.value)
        assert re.search(r"it names (builtins\.)?exec, which", str(refused.value))
        assert "weights_only=False" not in str(refused.value)  # torch's own advice, never to follow here
        assert not marker.exists()
    finally:
        saver.close()


class _EnumByName:
    """What Python 3.11.13+ (the images') writes for an enum member in a .metadata."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_metadata_may_name_enum_members_by_getattr_and_nothing_else():
    """The in-pods e2e restored a 2-rank checkpoint whose .metadata named builtins.getattr (the
    memory-format enum, pickled by name); the allow-list refused it until getattr was allowed for
    the members of allowed enums, and only for them."""
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from kuberl.storage.errors import StorageError
    from kuberl.train.dcp_read import _MetadataUnpickler, load_metadata

    import io

    member = _EnumByName(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(member, protocol=4))).load() is \
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    with pytest.raises(StorageError, match=r"getattr\(Metadata, '__init__'\)"):
        load_metadata(pickle.dumps(_EnumByName(Metadata, "__init__"), protocol=4), "s3://b/step/.metadata")
