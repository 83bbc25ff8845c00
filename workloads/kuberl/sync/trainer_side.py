"""Functions the sync methods run on every trainer rank via ``TrainerGroup.execute``.

Each gets the trainer worker (``worker.model``: the FSDP2-wrapped HF model; ``worker.rank``;
``worker.device``). Module-level so they pickle by reference into the trainer actors; the sync
group lives in this module's registry because it must outlive a single ``execute`` call.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from kuberl.sync.buckets import Bucket, ParamMeta, pack, plan_buckets
from kuberl.sync.group import SyncGroup, node_ip, open_store
from kuberl.sync.params import full_bucket, iter_buckets, param_metas

_STORES: dict[str, object] = {}
_GROUPS: dict[str, SyncGroup] = {}
# ipc: buffers whose handles the engines hold; freed once the engines have loaded them.
_SHARED: dict[str, torch.Tensor] = {}


def metas(worker, wire_dtype: str) -> list[ParamMeta]:
    return param_metas(worker.model, getattr(torch, wire_dtype))


def open_sync_store(worker, key: str) -> tuple[str, int] | None:
    if worker.rank != 0:
        return None
    host = node_ip()
    store = open_store(host)
    _STORES[key] = store
    return host, store.port


def join_sync_group(worker, key: str, host: str, port: int, world_size: int, backend: str) -> None:
    if worker.rank != 0:
        return
    _GROUPS[key] = SyncGroup(host, port, 0, world_size, backend, store=_STORES.pop(key))


def leave_sync_group(worker, key: str) -> None:
    group = _GROUPS.pop(key, None)
    if group is not None:
        group.close()


def broadcast_weights(worker, key: str, meta_list: list[ParamMeta], bucket_bytes: int) -> int:
    """All ranks gather each bucket (FSDP2 collective); rank 0 packs and broadcasts it.

    Two bucket buffers alternate, so packing bucket i overlaps the broadcast of bucket i-1.
    """
    group = _GROUPS.get(key)
    if worker.rank == 0 and group is None:
        raise RuntimeError(f"weight sync group {key} was not set up on trainer rank 0")
    device = torch.device(worker.device) if group is not None and group.backend == "nccl" else torch.device("cpu")
    buckets = plan_buckets(meta_list, bucket_bytes)
    slots = [torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=device)
             for _ in range(min(2, len(buckets)))] if worker.rank == 0 else []
    pending: list = [None] * len(slots)
    sent = 0
    for i, (bucket, tensors) in enumerate(iter_buckets(worker.model, buckets, device)):
        if worker.rank != 0:
            continue
        slot = i % len(slots)
        if pending[slot] is not None:
            pending[slot].wait()  # the broadcast that last read this buffer is done
        buf = slots[slot][:bucket.nbytes]
        pending[slot] = group.broadcast_async(pack(bucket, tensors, buf), root=0)
        sent += sum(meta.nbytes for meta in bucket.metas)
    for work in pending:
        if work is not None:
            work.wait()
    return sent


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


def remove_snapshot(worker, directory: str) -> None:
    if worker.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def share_bucket(worker, key: str, bucket: Bucket) -> tuple[str, bytes]:
    """Every rank gathers the bucket onto its own GPU and returns (GPU uuid, CUDA IPC handle)."""
    from kuberl.sync.ipc import share

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
