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

from kuberl.sync.adapter import lora_config, save_adapter, spec_adapter_options
from kuberl.sync.base import EnginesLostInSync, SyncStats, WeightSync
from kuberl.sync.buckets import ParamMeta, from_wire, pack, plan_buckets, to_wire, unpack
from kuberl.sync.group import SyncAborted, SyncGroup, node_ip, open_store, raise_abort
from kuberl.sync.params import iter_buckets

_STORES: dict[str, object] = {}
_GROUPS: dict[str, SyncGroup] = {}
# How often the driver, waiting for the engines to receive a sync, looks whether the senders failed.
SENDER_POLL_S = 1.0
# After a member of the sync failed, how long the others may take to leave the group. Members
# abort within ABORT_POLL_S (kuberl.sync.group) of the flag, and Ray reports a dead actor within
# seconds; this bounds only a member stuck elsewhere (an engine not running its RPCs, a lost node
# Ray has not yet declared dead): such an engine is killed and dropped like a lost one.
ABORT_GRACE_S = 30.0


# --- driver ---------------------------------------------------------------------------------

class NcclWeightSync(WeightSync):
    """Trainer rank 0 broadcasts size-bounded buckets to every engine worker.

    The group spans trainer rank 0 (sync rank 0) and each engine's tensor-parallel workers
    (ranks 1..). NCCL when the trainer has GPUs, gloo on CPU. All trainer ranks join the FSDP2
    gathers; only rank 0 sends. An engine lost mid-sync leaves the others in a broken collective:
    the group is aborted on every member (``SyncGroup.wait``), and ``EnginesLostInSync`` has
    ``WeightSync.sync`` rebuild it for the engines left and send them the whole version again.
    """

    def __init__(self, spec, trainer_group, engine_pool, *, backend: str | None = None):
        super().__init__(spec, trainer_group, engine_pool)
        self.backend = backend or sync_backend(spec)
        self.key = f"nccl-{uuid.uuid4().hex[:8]}"
        self.store_address: tuple[str, int] | None = None  # the group's store (trainer rank 0)

    def setup(self) -> None:
        super().setup()
        info = self.engine_info
        import ray

        world_size = 1 + sum(info.tp_sizes)
        host, port = self.store_address = self.trainer_group.execute(open_sync_store, self.key)[0]
        first_ranks = [1 + sum(info.tp_sizes[:i]) for i in range(len(info.tp_sizes))]
        joins = [engine.rpc.remote("kuberl_join_group", host, port, first, world_size, self.backend)
                 for engine, first in zip(self.engine_pool.engines, first_ranks)]
        self.trainer_group.execute(join_sync_group, self.key, host, port, world_size,
                                   self.backend)
        ray.get(joins)

    def send(self, version: int) -> SyncStats:
        meta_list = self.metas
        import ray

        start = time.perf_counter()
        adapter = spec_adapter_options(self.spec)
        # trainer.lora: the same broadcast carries the adapters alone (``meta_list`` is theirs);
        # each engine's workers write them into a directory of the engine's, which it loads.
        calls = {(engine.update_adapter.remote("kuberl_receive_adapter",
                                               (to_wire(meta_list), self.bucket_bytes, adapter), version)
                  if adapter is not None else
                  engine.update_weights.remote("kuberl_receive", (to_wire(meta_list), self.bucket_bytes),
                                               version)): engine
                 for engine in self.engine_pool.engines}
        # The trainers send from a thread, so that a failure on either side (an engine lost, a
        # trainer rank lost) is seen here at once: the driver then raises the group's abort flag
        # and every member leaves the collective instead of waiting for the dead one.
        executor = concurrent.futures.ThreadPoolExecutor(1)
        sending = executor.submit(self.trainer_group.execute, broadcast_weights, self.key,
                                  meta_list, self.bucket_bytes)
        executor.shutdown(wait=False)
        received, lost, failed = [], [], []
        pending, deadline = list(calls), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=SENDER_POLL_S)
            for ref in ready:
                try:
                    received.append(ray.get(ref))
                except ray.exceptions.RayActorError as err:
                    self.engine_pool.drop(calls[ref], err)
                    lost.append(calls[ref])
                except ray.exceptions.RayError as err:
                    failed.append(err)
            sender_error = sending.exception() if sending.done() else None
            if deadline is None and (lost or failed or sender_error is not None):
                raise_abort(*self.store_address, f"a member failed during the sync of version {version}")
                deadline = time.monotonic() + ABORT_GRACE_S
            if sender_error is not None and not isinstance(sender_error, ray.exceptions.RayTaskError):
                raise sender_error  # the trainer group's own failure (a rank lost), not the sender code's
            if deadline is not None and time.monotonic() > deadline:
                for ref in pending:  # still in the aborted collective: not to be trusted with weights
                    engine = calls[ref]
                    self.engine_pool.drop(engine, TimeoutError(
                        f"still in the aborted weight sync {ABORT_GRACE_S:.0f} s after it failed; killed"))
                    lost.append(engine)
                break
        try:
            sending.result(timeout=ABORT_GRACE_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"trainer rank 0 did not leave the aborted weight-sync group within "
                               f"{ABORT_GRACE_S:.0f} s") from None
        except ray.exceptions.RayTaskError:
            if not lost:  # the sender's own failure, not an engine's loss
                raise
        if lost:
            aborted = (f"; the receive failed on {len(failed)} of the others ({first_line(failed[0])})" if failed
                       else "")
            raise EnginesLostInSync(f"{len(lost)} rollout engine(s) lost during the weight sync of version "
                                    f"{version}{aborted}")
        if failed:
            raise failed[0]
        return SyncStats(version, min(min(r) for r in received), time.perf_counter() - start)

    def close(self) -> None:
        self.leave_engines()
        self.trainer_group.execute(leave_sync_group, self.key)

    def leave_engines(self) -> None:
        self.engine_pool.each("rpc", "kuberl_leave_group")


def sync_backend(spec) -> str:
    """NCCL between GPU trainers and engines, gloo on CPU. Colocated with trainer.lora, gloo too:
    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), and trainer
    rank 0 shares its GPU with an engine; the adapters are small enough to go through host memory."""
    if spec.trainer.gpus_per_replica == 0 or (spec.rollout.colocate and spec.trainer.lora is not None):
        return "gloo"
    return "nccl"


def first_line(err: BaseException) -> str:
    """The innermost cause's first line (a Ray task error wraps the remote one in its traceback)."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


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

    Two bucket buffers alternate, so packing bucket i overlaps the broadcast of bucket i-1. If the
    sync group fails (a member lost, the abort flag up), rank 0 stops sending but goes on through
    the gathers, which the other ranks are in too, and then raises ``SyncAborted``.
    """
    group = _GROUPS.get(key)
    if worker.rank == 0 and group is None:
        raise RuntimeError(f"weight sync group {key} was not set up on trainer rank 0")
    device = torch.device(worker.device) if group is not None and group.backend == "nccl" else torch.device("cpu")
    buckets = plan_buckets(meta_list, bucket_bytes)
    slots = [torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=device)
             for _ in range(min(2, len(buckets)))] if worker.rank == 0 else []
    pending: list = [None] * len(slots)
    sent, failure = 0, None
    for i, (bucket, tensors) in enumerate(iter_buckets(worker.model, buckets, device)):
        if worker.rank != 0 or failure is not None:
            continue
        slot = i % len(slots)
        try:
            if pending[slot] is not None:
                group.wait(pending[slot])  # the broadcast that last read this buffer is done
            group.check()  # no bucket into a group a member has given up on
            buf = slots[slot][:bucket.nbytes]
            pending[slot] = group.broadcast_async(pack(bucket, tensors, buf), root=0)
        except RuntimeError as err:  # SyncAborted, or the backend's own error (the flag is up then)
            failure = f"bucket {i} of {len(buckets)}: {str(err).splitlines()[0]}"
            continue
        sent += sum(meta.nbytes for meta in bucket.metas)
    if failure is None:
        try:
            for work in pending:
                if work is not None:
                    group.wait(work)
        except RuntimeError as err:
            failure = f"the last buckets: {str(err).splitlines()[0]}"
    if failure is not None:
        raise SyncAborted(f"trainer rank 0 stopped sending the weights at {failure}")
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

    def kuberl_receive_adapter(self, metas: list, bucket_bytes: int, options: dict, directory: str) -> int:
        """trainer.lora: receive the adapters and write them into ``directory`` in peft's format,
        for the engine to load (every tensor-parallel worker receives; the first one writes)."""
        group: SyncGroup = self._kuberl_group
        device = self._kuberl_device() if group.backend == "nccl" else torch.device("cpu")
        tensors = {name: t.to("cpu", copy=True)
                   for name, t in _received(group, plan_buckets(from_wire(metas), bucket_bytes), device)}
        if int(getattr(self, "rank", 0)) == 0:
            save_adapter(directory, tensors, lora_config(**options))
        return sum(t.numel() * t.element_size() for t in tensors.values())

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
            yield from _finish(group, *pending)
        pending = (bucket, buf, work)
    if pending is not None:
        yield from _finish(group, *pending)


def _finish(group: SyncGroup, bucket, buf: torch.Tensor, work) -> list[tuple[str, torch.Tensor]]:
    group.wait(work)
    return unpack(bucket, buf)

