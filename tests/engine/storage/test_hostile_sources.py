"""Hostile archives, checkpoints and claims against the real stager CLI (``kuberl stage`` as a
subprocess), real checkpoint restore, and moto's S3 server on loopback (docs/security.md)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from kuberl.storage import StorageError, commit_checkpoint, resolve, stage, verify_checkpoint
from kuberl.train.checkpoint import fetch_tar_parts, tar_name

REPO = Path(__file__).resolve().parents[3]
TIB = 1 << 40


def kuberl_stage(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``kuberl stage ARGS`` exactly as an init container runs it."""
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kuberl.cli", "stage", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def link_member(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def symlink_chain_tar() -> bytes:
    """The June 2025 tarfile bypass shape (CVE-2025-4517 family): a chain of symlinks whose
    targets the 'data' filter judged one at a time, then a file written through the chain."""
    chain = [link_member(f"{'d/' * i}l", "." if i else "d") for i in range(1, 6)]
    return tar_bytes(file_member("d/keep.txt", b"k"), *chain,
                     link_member("escape", "d/l/l/l/l/l/../../../../../../../outside"),
                     file_member("escape/pwned.txt", b"owned"))


def sparse_tar(declared: int) -> bytes:
    """One GNU sparse member ('S') whose map declares ``declared`` bytes in a 10 KiB archive."""
    info = tarfile.TarInfo("huge.bin")
    info.size = 512
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)                # first region: offset 0
    header[398:410] = tarfile.itn(512, 12, tarfile.GNU_FORMAT)              # ... 512 stored bytes
    header[483:495] = tarfile.itn(declared, 12, tarfile.GNU_FORMAT)         # real size
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    body = bytes(header) + b"s" * 512
    return body + b"\0" * (10 * 1024 - len(body))


@pytest.mark.parametrize("archive, words", [
    (symlink_chain_tar(), ["refusing archive member", "a link to"]),
    (tar_bytes(file_member("a.txt", b"a"), link_member("h", "/etc/passwd", tarfile.LNKTYPE)), ["'h'", "a link to"]),
    (tar_bytes(link_member("etc", "/etc")), ["'etc'", "a link to '/etc'"]),
    (sparse_tar(TIB), ["'huge.bin'", "a sparse file"]),
    (tar_bytes(file_member(".complete", b"{}")), ["'.complete'", "reserved"]),
    (tar_bytes(file_member(".untar.kuberl-part/x", b"x")), ["reserved"]),
    (tar_bytes(file_member(".kuberl-stage.journal", b"x")), ["reserved"]),
    (tar_bytes(file_member("/etc/cron.d/x", b"x")), ["'/etc/cron.d/x'", "outside the destination"]),
    (tar_bytes(file_member("a/../../x", b"x")), ["outside the destination"]),
    (tar_bytes(file_member("twice", b"1"), file_member("twice", b"2")), ["appears twice"]),
], ids=["symlink-chain", "hardlink", "symlink-dir", "sparse-1TiB", "complete", "untar-workdir", "journal",
        "absolute", "dotdot", "duplicate"])
def test_hostile_tar_is_refused_by_the_stager_cli(s3, s3_env, tmp_path, archive, words):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/ckpt/evil.tar", archive)
    dst = tmp_path / "work" / "dst"
    result = kuberl_stage(s3_env, f"s3://{bucket}/ckpt/evil.tar", str(dst))
    refused(result, f"s3://{bucket}/ckpt/evil.tar", *words)
    assert list(dst.iterdir()) == []  # nothing unpacked, no .complete
    assert not (tmp_path / "outside").exists() and not (tmp_path / "work" / "outside").exists()


def test_declared_size_beyond_the_archive_is_refused(s3, s3_env, tmp_path):
    whole = tar_bytes(file_member("model.bin", b"m" * 4096))
    header = bytearray(whole[:512])
    header[124:136] = tarfile.itn(TIB, 12, tarfile.GNU_FORMAT)
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/big.tar", bytes(header) + whole[512:])
    result = kuberl_stage(s3_env, f"s3://{bucket}/m/big.tar", str(tmp_path / "dst"))
    refused(result, "'model.bin'", f"declares {TIB} bytes")
    assert list((tmp_path / "dst").iterdir()) == []


def test_a_plain_checkpoint_tar_still_unpacks(s3, s3_env, tmp_path):
    buf = io.BytesIO()
    src = tmp_path / "src" / "trainer"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "__0_0.distcp").write_bytes(b"w" * 5000)
    (src / ".metadata").write_bytes(b"m")
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname="trainer")
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/c/trainer.tar", buf.getvalue())
    result = kuberl_stage(s3_env, f"s3://{bucket}/c/trainer.tar", str(tmp_path / "dst"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dst" / "trainer" / "sub" / "__0_0.distcp").read_bytes() == b"w" * 5000
    files = json.loads((tmp_path / "dst" / ".complete").read_text())["files"]
    assert sorted(f["path"] for f in files) == ["trainer/.metadata", "trainer/sub/__0_0.distcp"]


def _tar_checkpoint(local: Path, archive: bytes) -> Path:
    local.mkdir(parents=True)
    (local / tar_name(0)).write_bytes(archive)
    (local / "driver.json").write_text(json.dumps({"step": 7, "weight_version": 7}))
    return local


@pytest.mark.parametrize("archive, words", [
    (symlink_chain_tar(), "a link to"),
    (sparse_tar(TIB), "a sparse file"),
])
def test_restore_of_a_hostile_tar_checkpoint_fails_and_writes_nothing_outside(s3, tmp_path, archive, words):
    """What a trainer rank's restore of a ``format: tar`` checkpoint runs (RankCheckpointer.load):
    each rank's tar unpacked into a directory of its own by the stager's one extraction."""
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    uri = commit_checkpoint(_tar_checkpoint(tmp_path / "local", archive), root, 7)
    verify_checkpoint(uri)  # an intact checkpoint whose tar is hostile: the extraction refuses it
    with pytest.raises(StorageError, match=words):
        fetch_tar_parts(uri, 1, tmp_path / "work" / "restore")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "work" / "outside").exists()


# --- checkpoints are staged only as COMPLETE lists them --------------------------------------------


def _commit(tmp_path: Path, root: str, step: int, files: dict[str, bytes]) -> None:
    local = tmp_path / f"local-{step}"
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    commit_checkpoint(local, root, step)


def test_checkpoint_changed_after_complete_is_refused(s3, s3_env, tmp_path):
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    _commit(tmp_path, root, 5, {"trainer/shard-0": b"a" * 100, "driver.json": b"{}"})
    step = f"{bucket}/run/step-000000005"
    # A later attempt rewriting step 5 died after one shard: a new size, and a shard COMPLETE never listed.
    fs.pipe_file(f"{step}/trainer/shard-0", b"b" * 150)
    fs.pipe_file(f"{step}/trainer/shard-1", b"b" * 150)
    result = kuberl_stage(s3_env, "--checkpoint", root, str(tmp_path / "dst"))
    refused(result, "do not match its COMPLETE manifest", "trainer/shard-0 has 150 bytes",
            "trainer/shard-1 is not in it")
    assert not (tmp_path / "dst" / ".complete").exists()
    # A trainer rank's restore reads the step in place: it verifies the same way first.
    with pytest.raises(StorageError, match="do not match its COMPLETE manifest"):
        verify_checkpoint(f"{root}/step-000000005")


def test_checkpoint_missing_a_listed_file_is_refused(s3, s3_env, tmp_path):
    fs, bucket = s3
    root = f"s3://{bucket}/run"
    _commit(tmp_path, root, 5, {"trainer/shard-0": b"a" * 10, "trainer/shard-1": b"a" * 10})
    fs.rm_file(f"{bucket}/run/step-000000005/trainer/shard-1")
    refused(kuberl_stage(s3_env, "--checkpoint", f"{root}/step-000000005", str(tmp_path / "dst")),
            "trainer/shard-1 is missing")


def test_interrupted_restage_of_another_source_keeps_no_complete(s3, s3_env, tmp_path):
    """Stage A, then kill a stage of B (same names and sizes, other bytes) into the same directory:
    no .complete may survive to vouch for the mix, and restaging A fetches A's bytes again."""
    fs, bucket = s3
    names = [f"d{i % 10}/f{i:04d}.bin" for i in range(600)]
    fs.pipe({f"{bucket}/a/{n}": b"A" * 6000 for n in names})
    fs.pipe({f"{bucket}/b/{n}": b"B" * 6000 for n in names})
    dst = tmp_path / "dst"
    assert kuberl_stage(s3_env, f"s3://{bucket}/a", str(dst)).returncode == 0
    assert json.loads((dst / ".complete").read_text())["source"] == f"s3://{bucket}/a"

    env = {**os.environ, **s3_env,
           "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "stage", f"s3://{bucket}/b", str(dst),
                             "--workers", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = dst / ".kuberl-stage.journal"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_text().count("\n") >= 30:
            break
        assert proc.poll() is None, "the stager finished before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dst / ".complete").exists()
    mixed = sum((dst / n).read_bytes()[:1] == b"B" for n in names)
    assert 0 < mixed < len(names)

    again = stage(f"s3://{bucket}/a", dst)
    assert again.downloaded_files >= mixed
    assert all((dst / n).read_bytes() == b"A" * 6000 for n in names)


# --- pvc:// sources stay inside their claim ------------------------------------------------------


@pytest.fixture
def claim(tmp_path, monkeypatch):
    """pvc://models mounted at $KUBERL_PVC_ROOT/models, a secret beside it outside the claim."""
    root = tmp_path / "pvc"
    model = root / "models" / "m"
    (model / "blobs").mkdir(parents=True)
    (model / "blobs" / "abc").write_bytes(b"weights")
    (model / "model.safetensors").symlink_to("blobs/abc")  # inside the claim: a Hugging Face cache does this
    (tmp_path / "secret").write_text("token")
    monkeypatch.setenv("KUBERL_PVC_ROOT", str(root))
    return model


def test_pvc_symlinks_inside_the_claim_are_staged(claim, tmp_path):
    result = kuberl_stage({"KUBERL_PVC_ROOT": str(claim.parents[1])}, "pvc://models/m", str(tmp_path / "dst"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dst" / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("link, uri", [
    ("config.json", "pvc://models/m"),                # a file in the source links out
    ("sub", "pvc://models/m"),                        # a directory in the source links out
    ("single.bin", "pvc://models/m/single.bin"),      # the source is one symlinked file
])
def test_pvc_symlink_out_of_the_claim_is_refused(claim, tmp_path, link, uri):
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "secret").write_text("token")
    (claim / link).symlink_to(tmp_path / ("outdir" if link == "sub" else "secret"))
    dst = tmp_path / "dst"
    result = kuberl_stage({"KUBERL_PVC_ROOT": str(claim.parents[1])}, uri, str(dst))
    refused(result, "leading out of claim 'models'")
    assert not dst.exists() or not any(p.read_bytes() == b"token" for p in dst.rglob("*") if p.is_file())
    with pytest.raises(StorageError, match="leading out of claim"):
        with resolve(uri):
            pass


# --- plain local sources stay inside themselves ----------------------------------------------------


@pytest.fixture
def local_model(tmp_path, monkeypatch):
    """A model at a plain path (in the image or on a volume mounted there), a secret beside it."""
    monkeypatch.setenv("KUBERL_PVC_ROOT", str(tmp_path / "pvc"))  # no claim mount above the source
    model = tmp_path / "models" / "m"
    (model / "blobs").mkdir(parents=True)
    (model / "blobs" / "abc").write_bytes(b"weights")
    (model / "model.safetensors").symlink_to("blobs/abc")  # a link within the source
    (tmp_path / "secret").write_text("token")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "secret").write_text("token")
    return model


def test_local_symlinks_within_the_source_are_staged(local_model, tmp_path):
    result = kuberl_stage({"KUBERL_PVC_ROOT": str(tmp_path / "pvc")}, str(local_model), str(tmp_path / "dst"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dst" / "model.safetensors").read_bytes() == b"weights"
    with resolve(str(local_model)) as path:
        assert path == str(local_model)


@pytest.mark.parametrize("link, target", [
    ("config.json", "/etc/passwd"),     # an absolute link to the pod's own files
    ("tokenizer.json", "../../secret"),  # a relative one climbing out
    ("sub", "../../outdir"),             # a directory leading out
], ids=["absolute", "dotdot", "directory"])
def test_local_symlink_out_of_the_source_is_refused(local_model, tmp_path, link, target):
    (local_model / link).symlink_to(target)
    dst = tmp_path / "dst"
    result = kuberl_stage({"KUBERL_PVC_ROOT": str(tmp_path / "pvc")}, str(local_model), str(dst))
    refused(result, f"refusing {local_model / link}", "leading out of the source")
    assert not dst.exists() or not any(p.read_bytes() in (b"token", Path("/etc/passwd").read_bytes())
                                       for p in dst.rglob("*") if p.is_file())
    with pytest.raises(StorageError, match=f"refusing {local_model / link}: .* leading out of the source"):
        with resolve(str(local_model)):
            pass


def test_local_source_that_is_itself_a_symlink_is_refused(local_model, tmp_path):
    (tmp_path / "models" / "current").symlink_to(tmp_path / "outdir")
    with pytest.raises(StorageError, match="current: it is a symlink .* name the place it points at"):
        with resolve(str(tmp_path / "models" / "current")):
            pass


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(tmp_path, monkeypatch):
    """What `huggingface-cli download` leaves in HF_HOME: a snapshot of links into ../../blobs."""
    monkeypatch.setenv("KUBERL_PVC_ROOT", str(tmp_path / "pvc"))
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "e3b0").write_text("{}")
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/e3b0")
    with resolve(str(snapshot)) as path:
        assert (Path(path) / "config.json").read_text() == "{}"
    (tmp_path / "secret").write_text("token")
    (snapshot / "tokenizer.json").symlink_to("../../../../secret")
    with pytest.raises(StorageError, match="leading out of the Hugging Face cache 'models--org--tiny'"):
        with resolve(str(snapshot)):
            pass


def test_a_claim_read_at_its_mount_path_keeps_the_claim_rule(claim, tmp_path):
    """In a pod the driver and check-data get a pvc:// source as its mount path: the same rule."""
    (claim.parent / "shared.txt").write_text("in the claim")
    (claim / "shared.txt").symlink_to("../shared.txt")  # out of the source, within the claim
    with resolve(str(claim)):
        pass
    (claim / "config.json").symlink_to(tmp_path / "secret")
    with pytest.raises(StorageError, match="leading out of claim 'models'"):
        with resolve(str(claim)):
            pass


def test_local_checkpoint_with_a_planted_symlink_is_refused(tmp_path, monkeypatch):
    """A checkpoint root on a mounted path (checkpoint.uri: /ckpt): restore reads the step in
    place after verify_checkpoint, and `kuberl stage --checkpoint` copies it; neither may follow
    a link planted in the step out of it."""
    monkeypatch.setenv("KUBERL_PVC_ROOT", str(tmp_path / "pvc"))
    root = str(tmp_path / "ckpt")
    _commit(tmp_path, root, 5, {"trainer/__0_0.distcp": b"a" * 5, "driver.json": b"{}"})
    (tmp_path / "secret").write_text("token")
    shard = tmp_path / "ckpt" / "step-000000005" / "trainer" / "__0_0.distcp"
    shard.unlink()
    shard.symlink_to(tmp_path / "secret")  # "token": the size COMPLETE lists
    with pytest.raises(StorageError, match="__0_0.distcp: it is a symlink .* leading out of the source"):
        verify_checkpoint(f"{root}/step-000000005")
    dst = tmp_path / "dst"
    refused(kuberl_stage({"KUBERL_PVC_ROOT": str(tmp_path / "pvc")}, "--checkpoint", root, str(dst)),
            "__0_0.distcp", "leading out of the source")
    assert not dst.exists() or not any(p.read_bytes() == b"token" for p in dst.rglob("*") if p.is_file())
