"""A process group between trainer and engine processes that does not touch the global one.

The trainers already run torch.distributed for FSDP2, and vLLM workers run their own
tensor-parallel group: the sync group is a separate backend object built from its own TCPStore,
never the default group, so neither side's world is disturbed.

A member lost mid-sync (an engine's process or pod gone) leaves the others waiting in a collective:
gloo fails on the pairs that touched the dead process (the socket closes) but a rank waiting on a
live peer that itself waits goes on until the group's timeout, and NCCL never notices a dead peer.
So every member waits through ``SyncGroup.wait``, which also watches an abort flag in the group's
store: the first member (or the driver) that sees a failure raises the flag, and every member
aborts the group within ``ABORT_POLL_S``.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
# The store key that aborts a sync group, and how often a member waiting in it looks at it.
ABORT_KEY = "kuberl-sync-abort"
ABORT_POLL_S = 0.2
# How long the driver tries to reach the store to raise the flag: short, because a store that does
# not answer is gone with trainer rank 0, and the members see that themselves.
ABORT_CONNECT_TIMEOUT = datetime.timedelta(seconds=2)


# Aborted groups, kept rather than destroyed: gloo's destructor joins its threads, and an operation
# stuck on a live peer holds its thread until that peer's sockets close or the group's timeout
# passes, so destroying the group would block the caller (a rebuild waited on it for ever).
_ABORTED: list = []


class SyncAborted(RuntimeError):
    """A member of the weight-sync group failed or was lost: the group was aborted on this member."""


def raise_abort(host: str, port: int, cause: str) -> None:
    """From outside the group (the driver): every member waiting in it aborts. A store already gone
    (its host, trainer rank 0, left or died) aborts the members too: they fail to read the flag."""
    try:
        dist.TCPStore(host, port, None, False, timeout=ABORT_CONNECT_TIMEOUT).set(ABORT_KEY, cause)
    except (RuntimeError, OSError):  # the store's host is gone: the members fail to read it too
        pass


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
        self.aborted = False
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
        self.wait(self.broadcast_async(tensor, root))

    def wait(self, work) -> None:
        """``work.wait()``, unless the abort flag goes up first (or the store is gone): then the
        group is aborted here and ``SyncAborted`` raised. A failure of ``work`` itself (gloo: a
        peer's socket closed) raises the flag for the others before it propagates."""
        next_look = time.monotonic() + ABORT_POLL_S
        while not work.is_completed():
            if time.monotonic() >= next_look:
                self.check()
                next_look = time.monotonic() + ABORT_POLL_S
            time.sleep(0.001)
        try:
            work.wait()
        except RuntimeError as err:
            self.fail(f"rank {self.rank}: {str(err).splitlines()[0]}")
            raise

    def check(self) -> None:
        """If the abort flag is up (or the store is gone): abort the group here, raise ``SyncAborted``."""
        try:
            cause = self.store.get(ABORT_KEY).decode() if self.store.check([ABORT_KEY]) else None
        except (RuntimeError, OSError) as err:
            cause = f"the sync group's store is gone ({err})"
        if cause is not None:
            self.abort()
            raise SyncAborted(f"weight sync aborted: {cause}")

    def fail(self, cause: str) -> None:
        """This member failed in the group: raise the flag for the others, abort it here."""
        try:
            self.store.set(ABORT_KEY, cause)
        except (RuntimeError, OSError):  # the store's host is gone: the others fail to read it too
            pass
        self.abort()

    def abort(self) -> None:
        """End every operation and connection of the group here (gloo closes its sockets, NCCL
        aborts its communicator): peers waiting on this member fail at once."""
        if not self.aborted:
            self.aborted = True
            self.pg.abort()
            _ABORTED.append(self.pg)

    def close(self) -> None:
        if not self.aborted:
            self.pg.shutdown()
