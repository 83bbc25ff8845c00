"""The nccl transport (gloo on CPU): trainer rank 0 broadcasts size-bounded buckets to every
engine worker over a process group of their own.

Driver part: ``NcclWeightSync``. Sender part: the functions each trainer rank runs through
``TrainerGroup.execute`` (the sync group lives in this module's registry: it must outlive one
call). Receiver part: ``NcclReceiver``, mixed into vLLM's workers by ``kuberl.sync.receiver``.
Ray is imported where used: the sender and receiver also run where Ray is not installed (the GPU
benchmark machine).
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator

import torch

from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.buckets import ParamMeta, from_wire, pack, plan_buckets, to_wire, unpack
from kuberl.sync.group import SyncGroup, node_ip, open_store
from kuberl.sync.params import iter_buckets

_STORES: dict[str, object] = {}
_GROUPS: dict[str, SyncGroup] = {}
# How often the driver, waiting for the engines to receive a sync, looks whether the senders failed.
SENDER_POLL_S = 1.0


# --- driver ---------------------------------------------------------------------------------

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

    def setup(self) -> None:
        super().setup()
        info = self.engine_info
        import ray

        world_size = 1 + sum(info.tp_sizes)
        host, port = self.trainer_group.execute(open_sync_store, self.key)[0]
        first_ranks = [1 + sum(info.tp_sizes[:i]) for i in range(len(info.tp_sizes))]
        joins = [engine.rpc.remote("kuberl_join_group", host, port, first, world_size, self.backend)
                 for engine, first in zip(self.engine_pool.engines, first_ranks)]
        self.trainer_group.execute(join_sync_group, self.key, host, port, world_size,
                                   self.backend)
        ray.get(joins)

    def sync(self, version: int) -> SyncStats:
        meta_list = self.metas
        import ray

        start = time.perf_counter()
        receives = [engine.update_weights.remote("kuberl_receive", (to_wire(meta_list), self.bucket_bytes),
                                                 version)
                    for engine in self.engine_pool.engines]
        # The trainers send from a thread so that an engine failing to receive surfaces here at
        # once (the senders then stop at the group's timeout) instead of blocking the driver; and
        # the senders failing (a trainer rank lost mid-sync) surfaces at once too: the engines
        # would wait for the next bucket until the group's timeout.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sending = pool.submit(self.trainer_group.execute, broadcast_weights, self.key,
                                  meta_list, self.bucket_bytes)
            pending = receives
            while pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=SENDER_POLL_S)
                if sending.done() and sending.exception() is not None:
                    raise sending.exception()
            received = ray.get(receives)
            sending.result()
        return SyncStats(version, min(min(r) for r in received), time.perf_counter() - start)

    def close(self) -> None:
        self.leave_engines()
        self.trainer_group.execute(leave_sync_group, self.key)

    def leave_engines(self) -> None:
        import ray

        ray.get([engine.rpc.remote("kuberl_leave_group") for engine in self.engine_pool.engines])


# --- sender: on every trainer rank -----------------------------------------------------------

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


# --- receiver: in every vLLM worker ----------------------------------------------------------

class NcclReceiver:
    def kuberl_join_group(self, host: str, port: int, first_rank: int, world_size: int,
                          backend: str) -> int:
        # vLLM's worker rank inside its engine (0 .. tp-1) offsets the engine's first sync rank.
        rank = first_rank + int(getattr(self, "rank", 0))
        self._kuberl_group = SyncGroup(host, port, rank, world_size, backend)
        return rank

    def kuberl_receive(self, metas: list, bucket_bytes: int) -> int:
        group: SyncGroup = self._kuberl_group
        device = self._kuberl_device() if group.backend == "nccl" else torch.device("cpu")
        return self._kuberl_load(_received(group, plan_buckets(from_wire(metas), bucket_bytes), device))

    def kuberl_leave_group(self) -> None:
        group = getattr(self, "_kuberl_group", None)
        if group is not None:
            group.close()
            self._kuberl_group = None


def _received(group: SyncGroup, buckets, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of each bucket as it arrives; bucket i+1 is already in flight while the loader
    consumes bucket i. A fresh buffer per bucket (cheap with the caching allocator): the loader
    may hold views until a layer's last tensor arrives, so buffers are never reused under it."""
    pending = None
    for bucket in buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        work = group.broadcast_async(buf, root=0)
        if pending is not None:
            yield from _finish(*pending)
        pending = (bucket, buf, work)
    if pending is not None:
        yield from _finish(*pending)


def _finish(bucket, buf: torch.Tensor, work) -> list[tuple[str, torch.Tensor]]:
    work.wait()
    return unpack(bucket, buf)

