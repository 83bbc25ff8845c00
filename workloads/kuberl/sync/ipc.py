"""The ipc transport: colocated trainer and engine share GPU buffers through CUDA IPC handles,
without copying them over the network.

Driver part: ``IpcWeightSync``. Sender part: ``share_bucket``/``release_shared`` (and ``share``)
on the trainer ranks. Receiver part: ``IpcReceiver`` (and ``open_handle``), mixed into vLLM's
workers by ``kuberl.sync.receiver``. The handle carries the sender's CUDA device index; the
receiver substitutes its own, because each process numbers the GPUs it sees from 0
(CUDA_VISIBLE_DEVICES differs between them).
"""

from __future__ import annotations

import pickle
import time
import uuid
from collections.abc import Iterator

import torch

from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.buckets import Bucket, from_wire, pack, plan_buckets, to_wire, unpack
from kuberl.sync.params import full_bucket

# Buffers whose handles the engines hold; freed once the engines have loaded them.
_SHARED: dict[str, torch.Tensor] = {}

# Position of the device index in the argument tuple of torch's CUDA tensor rebuild function.
_DEVICE_ARG = 6


def share(buf: torch.Tensor) -> bytes:
    """A handle to the CUDA tensor ``buf`` (which the caller keeps alive), pickled to bytes:
    vLLM's RPC serializer passes bytes through but not the rebuild function inside the handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.device.type != "cuda":
        raise ValueError("weightSync.method ipc shares CUDA memory; the trainer's tensors are on "
                         f"{buf.device} (use nccl or checkpoint without GPUs)")
    return pickle.dumps(reduce_tensor(buf))


def open_handle(handle: bytes, device: torch.device) -> torch.Tensor:
    # Only ever a handle made by ``share`` in this job's own trainer process.
    rebuild, args = pickle.loads(handle)
    args = list(args)
    args[_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild(*args)


# --- driver ---------------------------------------------------------------------------------

class IpcWeightSync(WeightSync):
    """Colocated: each trainer rank gathers a bucket on its GPU and hands the engine worker on
    the same GPU a CUDA IPC handle to it; nothing crosses the network."""

    def __init__(self, spec, trainer_group, engine_pool):
        super().__init__(spec, trainer_group, engine_pool)
        self.key = f"ipc-{uuid.uuid4().hex[:8]}"

    def send(self, version: int) -> SyncStats:
        """Each engine loads from the handles on its own: one that dies while loading is dropped,
        and the others have loaded the whole version."""
        meta_list = self.metas
        start = time.perf_counter()
        try:
            # Every bucket stays shared until the engines have loaded them all: the trainer GPUs
            # briefly hold one extra copy of the weights (in the engine's dtype).
            handles = [dict(self.trainer_group.execute(share_bucket, f"{self.key}-{i}", bucket))
                       for i, bucket in enumerate(plan_buckets(meta_list, self.bucket_bytes))]
            loaded = self.engine_pool.each("update_weights", "kuberl_load_ipc",
                                           (handles, to_wire(meta_list), self.bucket_bytes), version)
        finally:
            self.trainer_group.execute(release_shared, f"{self.key}-")
        return SyncStats(version, min(min(r) for r in loaded), time.perf_counter() - start)


# --- sender: on every trainer rank -----------------------------------------------------------

def share_bucket(worker, key: str, bucket: Bucket) -> tuple[str, bytes]:
    """Every rank gathers the bucket onto its own GPU and returns (GPU uuid, CUDA IPC handle)."""
    device = torch.device(worker.device)
    tensors = full_bucket(worker.model, bucket, device)
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    pack(bucket, tensors, buf)
    torch.cuda.synchronize(device)
    _SHARED[key] = buf
    return str(torch.cuda.get_device_properties(device).uuid), share(buf)


def release_shared(worker, prefix: str) -> None:
    """Drop the shared buffers whose keys start with ``prefix``."""
    for key in [k for k in _SHARED if k.startswith(prefix)]:
        del _SHARED[key]


# --- receiver: in every vLLM worker ----------------------------------------------------------

class IpcReceiver:
    def kuberl_load_ipc(self, handles: list[dict[str, bytes]], metas: list, bucket_bytes: int) -> int:
        """``handles[i]`` maps GPU uuid -> handle of bucket i gathered on that GPU."""
        uuid = self.kuberl_device_uuid()
        missing = [i for i, per_gpu in enumerate(handles) if uuid not in per_gpu]
        if missing:
            raise RuntimeError(f"no trainer rank shares GPU {uuid} with this engine worker "
                               f"(trainer GPUs: {sorted(handles[missing[0]])}); ipc needs rollout.colocate")
        buckets = plan_buckets(from_wire(metas), bucket_bytes)
        return self._kuberl_load(_from_ipc(buckets, [h[uuid] for h in handles], self._kuberl_device()))


def _from_ipc(buckets, handles: list[bytes], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket, handle in zip(buckets, handles):
        yield from unpack(bucket, open_handle(handle, device))

