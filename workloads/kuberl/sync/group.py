"""A process group between trainer and engine processes that does not touch the global one.

The trainers already run torch.distributed for FSDP2, and vLLM workers run their own
tensor-parallel group: the sync group is a separate backend object built from its own TCPStore,
never the default group, so neither side's world is disturbed.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def node_ip() -> str:
    """This node's address as other Ray nodes see it (falls back to the hostname's address)."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: resolve the hostname instead
        return socket.gethostbyname(socket.gethostname())


def open_store(host: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """The rendezvous store, served by rank 0 on a free port (``store.port``)."""
    return dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)


class SyncGroup:
    """Broadcast-only communicator over gloo (CPU tensors) or NCCL (CUDA tensors)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str,
                 *, store: dist.TCPStore | None = None,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"sync group backend must be gloo or nccl, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"sync group rank {rank} outside world of {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        # Rank 0 passes the store it opened (so the port is known before the others connect).
        self.store = store or dist.TCPStore(host, port, None, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"kuberl-sync-{backend}", self.store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast; the returned work's ``wait()`` orders later use of ``tensor`` after
        it (NCCL: on the current CUDA stream, without blocking the host; gloo: blocks)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.broadcast_async(tensor, root).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
