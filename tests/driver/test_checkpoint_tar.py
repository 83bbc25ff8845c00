"""format: tar packs the trainer directory in 1 MiB blocks (tarfile's 16 KiB default made packing a
2.5 GB checkpoint about 3x slower, inside the training stall; bench/checkpoint.py), and the
archive still round-trips byte for byte through a checkpoint root that is a local path."""

import os
import tarfile

from kuberl.api.types import CheckpointSpec
from kuberl.train import checkpoint as ckpt
from kuberl.train.checkpoint import CheckpointManager


def test_tar_packs_in_large_blocks_and_round_trips(tmp_path, monkeypatch):
    payload = os.urandom(3 * ckpt.TAR_COPY_BUFSIZE + 12345)  # several blocks and a partial one
    blocks = []
    real_copy = tarfile.copyfileobj

    def spy(src, dst, length=None, exception=OSError, bufsize=None):
        blocks.append(bufsize)
        return real_copy(src, dst, length, exception, bufsize)

    monkeypatch.setattr(tarfile, "copyfileobj", spy)

    def save_trainer(path):
        os.makedirs(path)
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(payload)

    spec = CheckpointSpec(uri=str(tmp_path / "root"), format="tar")
    manager = CheckpointManager(spec, tmp_path / "work")
    manager.save(3, save_trainer, {"weight_version": 3})
    uri = manager.wait()
    manager.close()
    assert blocks and all(b == ckpt.TAR_COPY_BUFSIZE for b in blocks)
    committed = tmp_path / "root" / "step-000000003"
    assert uri.rstrip("/").endswith("step-000000003")
    assert (committed / ckpt.TRAINER_TAR).is_file() and not (committed / ckpt.TRAINER_DIR).exists()

    loaded = {}

    def load_trainer(path):
        loaded["payload"] = open(os.path.join(path, "__0_0.distcp"), "rb").read()

    restorer = CheckpointManager(spec, tmp_path / "work2")
    state = restorer.restore(restorer.source(None), load_trainer)
    assert state == {"weight_version": 3, "step": 3}
    assert loaded["payload"] == payload
