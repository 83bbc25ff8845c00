"""The weight-sync interface shared by the transports (one module each: ``nccl``, ``snapshot``,
``ipc``, each holding its driver, sender and receiver parts)."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class EnginesLostInSync(RuntimeError):
    """Rollout engines died during a sync (already dropped from the pool); the engines left may
    hold part of the new weights (a collective's), so they need the whole version again."""


@dataclass
class SyncStats:
    version: int
    bytes: int  # payload bytes each engine worker received
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSync(abc.ABC):
    """Pushes the trainer's current weights into every rollout engine.

    ``trainer_group.execute(fn, *args)`` runs ``fn(worker, *args)`` on every trainer rank and
    returns the results in rank order; ``engine_pool.engines`` are the RolloutEngine actors.
    """

    def __init__(self, spec, trainer_group, engine_pool):
        self.spec = spec
        self.trainer_group = trainer_group
        self.engine_pool = engine_pool
        self.bucket_bytes = spec.weight_sync.bucket_size_mb * 1024 * 1024
        self.engine_info: EngineInfo | None = None
        self._metas: list | None = None
        self.members: tuple = ()  # the engines ``setup`` wired

    def rebuild(self) -> bool:
        """If the pool's live engines are not those ``setup`` wired (one lost, or one joined at a
        step boundary), tear down and set up again for the engines live now (nccl: a new process
        group); True if it did."""
        if self.members == self.engine_pool.members:
            return False
        self.close()
        self.setup()
        return True

    def replace_trainers(self) -> None:
        """The trainer group was replaced (a rank lost): the old sender side died with it, so the
        engines leave what they joined and everything is set up again with the new ranks."""
        self.leave_engines()
        self.setup()

    def leave_engines(self) -> None:
        """The engines' part of ``close`` (a transport whose engines join a group extends this)."""

    def setup(self) -> None:
        """One-time wiring; call before the first ``sync``. Every transport needs the engines'
        dtype (the wire dtype) and the parameters' metadata in it; a transport that needs more
        (nccl's process group) extends this."""
        self.members = self.engine_pool.members
        self.engine_info = EngineInfo(self.engine_pool)
        self._metas = self.trainer_group.execute(metas, self.engine_info.dtype)[0]

    @property
    def metas(self) -> list:
        """The parameters' metadata in the wire dtype, as ``setup`` collected it."""
        if self._metas is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before sync()")
        return self._metas

    def sync(self, version: int) -> SyncStats:
        """Send the weights; engines pause, load, reset their prefix cache, resume at ``version``.

        An engine lost during the sync is dropped from the pool (a replacement joins at a step
        boundary, ``EnginePool.replenish``) and the sync is rebuilt for the engines left, which
        get the whole version again. Bounded: every retry follows at least one engine dropped,
        and the pool raises ``EnginesLost`` once none is left."""
        while True:
            try:
                return self.send(version)
            except EnginesLostInSync as lost:
                logger.warning("%s; rebuilding the weight sync for the %d engines left and sending "
                               "version %d to them again", lost, len(self.engine_pool.engines), version)
                self.rebuild()

    @abc.abstractmethod
    def send(self, version: int) -> SyncStats:
        """One try of ``sync``; ``EnginesLostInSync`` if engines died and the rest need a resend."""

    def close(self) -> None:
        """Release what ``setup`` created."""


class EngineInfo:
    """What every transport asks the engines first: their model dtype (the wire dtype) and
    tensor-parallel sizes."""

    def __init__(self, engine_pool):
        infos = engine_pool.each("sync_info")
        dtypes = {info["dtype"] for info in infos}
        if len(dtypes) != 1:
            raise RuntimeError(f"rollout engines disagree on the model dtype: {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.tp_sizes = [info["tensor_parallel_size"] for info in infos]


def metas(worker, wire_dtype: str):
    """On every trainer rank: the parameters' metadata in the engines' dtype (no collective)."""
    import torch

    from kuberl.sync.params import param_metas

    return param_metas(worker.model, getattr(torch, wire_dtype))
