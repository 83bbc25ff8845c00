"""The snapshot transport: trainer rank 0 writes a safetensors snapshot of the weights (one file per
bucket) and the engines load it.

The API calls it ``weightSync.method: checkpoint``, and that value stays: it is what users write,
and renaming it would break their manifests. The code says "snapshot" because "checkpoint" already
names the training checkpoints (``kuberl.train.checkpoint``, ``kuberl.storage.checkpoints``); a
snapshot is never restored from, only loaded by the engines once and removed. With
``trainer.lora`` the snapshot is the adapter alone, in peft's format (``write_adapter``), which
the engines load as a LoRA adapter (``RolloutEngine.update_adapter``).

Driver part: ``SnapshotWeightSync``. Sender part: ``write_snapshot``/``remove_snapshot`` on the
trainer ranks. Receiver part: ``SnapshotReceiver``, mixed into vLLM's workers by
``kuberl.sync.receiver``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from kuberl.sync.adapter import ADAPTER_WEIGHTS, lora_config, save_adapter, spec_adapter_options
from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.buckets import ParamMeta, plan_buckets
from kuberl.sync.params import iter_buckets


# --- driver ---------------------------------------------------------------------------------

def snapshot_root() -> Path:
    """Where weight snapshots go: $KUBERL_WEIGHT_SNAPSHOT_DIR, else /dev/shm (memory-backed)."""
    configured = os.environ.get("KUBERL_WEIGHT_SNAPSHOT_DIR")
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm / "kuberl-weights" if shm.is_dir() else Path(tempfile.gettempdir()) / "kuberl-weights"


class SnapshotWeightSync(WeightSync):
    """Trainer rank 0 writes a safetensors snapshot (one file per bucket); engines load it.

    The directory must be visible to the trainer and the engines: the same node, or a shared
    volume mounted at $KUBERL_WEIGHT_SNAPSHOT_DIR on both.
    """

    def __init__(self, spec, trainer_group, engine_pool, *, root: str | Path | None = None):
        super().__init__(spec, trainer_group, engine_pool)
        self.root = Path(root) if root is not None else snapshot_root()
        self.key = f"snapshot-{uuid.uuid4().hex[:8]}"

    def send(self, version: int) -> SyncStats:
        """Each engine loads the files on its own: one that dies while loading is dropped, and
        the others have loaded the whole version."""
        meta_list = self.metas
        start = time.perf_counter()
        directory = str(self.root / self.key / f"v{version:08d}")
        adapter = spec_adapter_options(self.spec)
        try:
            if adapter is not None:
                self.trainer_group.execute(write_adapter, directory, meta_list, self.bucket_bytes, adapter)
                loaded = self.engine_pool.each("update_adapter", "kuberl_adapter_bytes", (), version, directory)
            else:
                paths = self.trainer_group.execute(write_snapshot, directory, meta_list, self.bucket_bytes)[0]
                loaded = self.engine_pool.each("update_weights", "kuberl_load_files", (paths,), version)
        finally:
            self.trainer_group.execute(remove_snapshot, directory)
        return SyncStats(version, min(min(r) for r in loaded), time.perf_counter() - start)


# --- sender: on every trainer rank -----------------------------------------------------------

def write_snapshot(worker, directory: str, meta_list: list[ParamMeta], bucket_bytes: int) -> list[str]:
    """Rank 0 writes one safetensors file per bucket; renamed into place only when complete."""
    from safetensors.torch import save_file

    out = Path(directory)
    if worker.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (bucket, tensors) in enumerate(
            iter_buckets(worker.model, plan_buckets(meta_list, bucket_bytes), torch.device("cpu"))):
        if worker.rank != 0:
            continue
        path = out / f"bucket-{i:05d}.safetensors"
        partial = path.with_suffix(".partial")
        save_file({meta.name: t.contiguous() for meta, t in zip(bucket.metas, tensors)}, str(partial))
        os.replace(partial, path)
        paths.append(str(path))
    return paths


def write_adapter(worker, directory: str, meta_list: list[ParamMeta], bucket_bytes: int, options: dict) -> int:
    """trainer.lora: rank 0 writes the adapters (``meta_list`` is theirs alone) as one peft
    adapter directory; every rank joins the gathers. Returns the weights file's bytes (0 elsewhere)."""
    tensors = {}
    for bucket, bucket_tensors in iter_buckets(worker.model, plan_buckets(meta_list, bucket_bytes),
                                               torch.device("cpu")):
        if worker.rank == 0:
            tensors.update((meta.name, t) for meta, t in zip(bucket.metas, bucket_tensors))
    return save_adapter(directory, tensors, lora_config(**options)) if worker.rank == 0 else 0


def remove_snapshot(worker, directory: str) -> None:
    if worker.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


# --- receiver: in every vLLM worker ----------------------------------------------------------

class SnapshotReceiver:
    def kuberl_load_files(self, paths: list[str]) -> int:
        return self._kuberl_load(_from_files(paths))

    def kuberl_adapter_bytes(self, directory: str) -> int:
        """trainer.lora: the adapter the engine loads next from ``directory`` (its bytes)."""
        return (Path(directory) / ADAPTER_WEIGHTS).stat().st_size


def _from_files(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

