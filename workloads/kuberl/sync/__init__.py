"""kuberl.sync: trainer -> rollout engine weight transfer.

``make_weight_sync(spec, trainer_group, engine_pool)`` returns a ``WeightSync`` for
``spec.weightSync.method``; call ``setup()`` once, then ``sync(version)`` after each update.
One module per transport (``nccl``, ``snapshot``, ``ipc``), each with its driver, sender and
receiver parts; ``receiver.WeightReceiver`` gathers the receivers into vLLM's worker extension.
"""

from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.ipc import IpcWeightSync
from kuberl.sync.nccl import NcclWeightSync
from kuberl.sync.snapshot import SnapshotWeightSync

# weightSync.method -> transport. The API's "checkpoint" is the snapshot transport: a user-facing
# value, kept as it is (renaming it would break manifests).
METHODS = {"nccl": NcclWeightSync, "checkpoint": SnapshotWeightSync, "ipc": IpcWeightSync}


def make_weight_sync(spec, trainer_group, engine_pool) -> WeightSync:
    method = spec.weight_sync.method
    if method not in METHODS:
        raise ValueError(f"weightSync.method: unknown method {method!r}; use one of {sorted(METHODS)}")
    return METHODS[method](spec, trainer_group, engine_pool)


__all__ = ["IpcWeightSync", "NcclWeightSync", "SnapshotWeightSync", "SyncStats", "WeightSync",
           "make_weight_sync"]
