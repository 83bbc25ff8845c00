"""kuberl.sync: trainer -> rollout engine weight transfer.

``make_weight_sync(spec, trainer_group, engine_pool)`` returns a ``WeightSync`` for
``spec.weightSync.method``; call ``setup()`` once, then ``sync(version)`` after each update.
"""

from kuberl.sync.base import SyncStats, WeightSync
from kuberl.sync.methods import (CheckpointWeightSync, IpcWeightSync, NcclWeightSync,
                                 make_weight_sync)

__all__ = ["CheckpointWeightSync", "IpcWeightSync", "NcclWeightSync", "SyncStats", "WeightSync",
           "make_weight_sync"]
