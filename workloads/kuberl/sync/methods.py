"""The three weight-sync methods: nccl (gloo on CPU), checkpoint, ipc.

Ray is imported where used: the transport modules also run where Ray is not installed (the GPU
benchmark machine).
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
import uuid
from pathlib import Path

from kuberl.sync import trainer_side
from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.buckets import plan_buckets, to_wire


class _EngineInfo:
    def __init__(self, engine_pool):
        import ray

        infos = ray.get([engine.sync_info.remote() for engine in engine_pool.engines])
        dtypes = {info["dtype"] for info in infos}
        if len(dtypes) != 1:
            raise RuntimeError(f"rollout engines disagree on the model dtype: {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.tp_sizes = [info["tensor_parallel_size"] for info in infos]


class NcclWeightSync(WeightSync):
    """Trainer rank 0 broadcasts size-bounded buckets to every engine worker.

    The group spans trainer rank 0 (sync rank 0) and each engine's tensor-parallel workers
    (ranks 1..). NCCL when the trainer has GPUs, gloo on CPU. All trainer ranks join the FSDP2
    gathers; only rank 0 sends.
    """

    def __init__(self, spec, trainer_group, engine_pool, *, backend: str | None = None):
        super().__init__(spec, trainer_group, engine_pool)
        self.backend = backend or ("nccl" if spec.trainer.gpus_per_replica > 0 else "gloo")
        self.key = f"nccl-{uuid.uuid4().hex[:8]}"
        self.metas = None

    def setup(self) -> None:
        info = _EngineInfo(self.engine_pool)
        self.metas = self.trainer_group.execute(trainer_side.metas, info.dtype)[0]
        import ray

        world_size = 1 + sum(info.tp_sizes)
        host, port = self.trainer_group.execute(trainer_side.open_sync_store, self.key)[0]
        first_ranks = [1 + sum(info.tp_sizes[:i]) for i in range(len(info.tp_sizes))]
        joins = [engine.rpc.remote("kuberl_join_group", host, port, first, world_size, self.backend)
                 for engine, first in zip(self.engine_pool.engines, first_ranks)]
        self.trainer_group.execute(trainer_side.join_sync_group, self.key, host, port, world_size,
                                   self.backend)
        ray.get(joins)

    def sync(self, version: int) -> SyncStats:
        if self.metas is None:
            raise RuntimeError("NcclWeightSync.setup() must run before sync()")
        import ray

        start = time.perf_counter()
        receives = [engine.update_weights.remote("kuberl_receive", (to_wire(self.metas), self.bucket_bytes),
                                                 version)
                    for engine in self.engine_pool.engines]
        # The trainers send from a thread so that an engine failing to receive surfaces here at
        # once (the senders then stop at the group's timeout) instead of blocking the driver.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sending = pool.submit(self.trainer_group.execute, trainer_side.broadcast_weights, self.key,
                                  self.metas, self.bucket_bytes)
            received = ray.get(receives)
            sending.result()
        return SyncStats(version, min(min(r) for r in received), time.perf_counter() - start)

    def close(self) -> None:
        import ray

        ray.get([engine.rpc.remote("kuberl_leave_group") for engine in self.engine_pool.engines])
        self.trainer_group.execute(trainer_side.leave_sync_group, self.key)


def snapshot_root() -> Path:
    """Where weight snapshots go: $KUBERL_WEIGHT_SNAPSHOT_DIR, else /dev/shm (memory-backed)."""
    configured = os.environ.get("KUBERL_WEIGHT_SNAPSHOT_DIR")
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm / "kuberl-weights" if shm.is_dir() else Path(tempfile.gettempdir()) / "kuberl-weights"


class CheckpointWeightSync(WeightSync):
    """Trainer rank 0 writes a safetensors snapshot (one file per bucket); engines load it.

    The directory must be visible to the trainer and the engines: the same node, or a shared
    volume mounted at $KUBERL_WEIGHT_SNAPSHOT_DIR on both.
    """

    def __init__(self, spec, trainer_group, engine_pool, *, root: str | Path | None = None):
        super().__init__(spec, trainer_group, engine_pool)
        self.root = Path(root) if root is not None else snapshot_root()
        self.key = f"snapshot-{uuid.uuid4().hex[:8]}"
        self.metas = None

    def setup(self) -> None:
        info = _EngineInfo(self.engine_pool)
        self.metas = self.trainer_group.execute(trainer_side.metas, info.dtype)[0]

    def sync(self, version: int) -> SyncStats:
        if self.metas is None:
            raise RuntimeError("CheckpointWeightSync.setup() must run before sync()")
        import ray

        start = time.perf_counter()
        directory = str(self.root / self.key / f"v{version:08d}")
        try:
            paths = self.trainer_group.execute(trainer_side.write_snapshot, directory, self.metas,
                                               self.bucket_bytes)[0]
            loaded = ray.get([engine.update_weights.remote("kuberl_load_files", (paths,), version)
                              for engine in self.engine_pool.engines])
        finally:
            self.trainer_group.execute(trainer_side.remove_snapshot, directory)
        return SyncStats(version, min(min(r) for r in loaded), time.perf_counter() - start)


class IpcWeightSync(WeightSync):
    """Colocated: each trainer rank gathers a bucket on its GPU and hands the engine worker on
    the same GPU a CUDA IPC handle to it; nothing crosses the network."""

    def __init__(self, spec, trainer_group, engine_pool):
        super().__init__(spec, trainer_group, engine_pool)
        self.key = f"ipc-{uuid.uuid4().hex[:8]}"
        self.metas = None

    def setup(self) -> None:
        info = _EngineInfo(self.engine_pool)
        self.metas = self.trainer_group.execute(trainer_side.metas, info.dtype)[0]

    def sync(self, version: int) -> SyncStats:
        if self.metas is None:
            raise RuntimeError("IpcWeightSync.setup() must run before sync()")
        import ray

        engines = self.engine_pool.engines
        start = time.perf_counter()
        try:
            # Every bucket stays shared until the engines have loaded them all: the trainer GPUs
            # briefly hold one extra copy of the weights (in the engine's dtype).
            handles = [dict(self.trainer_group.execute(trainer_side.share_bucket, f"{self.key}-{i}", bucket))
                       for i, bucket in enumerate(plan_buckets(self.metas, self.bucket_bytes))]
            loaded = ray.get([engine.update_weights.remote(
                "kuberl_load_ipc", (handles, to_wire(self.metas), self.bucket_bytes), version)
                for engine in engines])
        finally:
            self.trainer_group.execute(trainer_side.release_shared, f"{self.key}-")
        return SyncStats(version, min(min(r) for r in loaded), time.perf_counter() - start)


METHODS = {"nccl": NcclWeightSync, "checkpoint": CheckpointWeightSync, "ipc": IpcWeightSync}


def make_weight_sync(spec, trainer_group, engine_pool) -> WeightSync:
    method = spec.weight_sync.method
    if method not in METHODS:
        raise ValueError(f"weightSync.method: unknown method {method!r}; use one of {sorted(METHODS)}")
    return METHODS[method](spec, trainer_group, engine_pool)
