"""kuberl.storage: staging models and checkpoints between object stores and local disks.

The library API the workers share:
- ``resolve(uri)``: a context manager yielding a local directory for a model URI;
- ``stage(src, dst)``: verified, parallel, resumable download (``kuberl stage``);
- ``upload_dir(local, uri)``; ``withdraw_from``, ``commit_records``, ``commit_checkpoint``, ``latest_checkpoint``, ``checkpoint_to_restore``, ``prune_checkpoints``;
- ``claim_epoch``, ``check_epoch``: the fence that keeps a replaced trainer group from writing checkpoints.
"""

from kuberl.storage.checkpoints import (StaleEpoch, check_epoch, checkpoint_dirname, checkpoint_to_restore,
                                        claim_epoch, commit_checkpoint, commit_records, latest_checkpoint,
                                        prune_checkpoints, step_uri, withdraw_from)
from kuberl.storage.errors import StorageError
from kuberl.storage.resolve import resolve
from kuberl.storage.staging import StageResult, stage, verify_checkpoint
from kuberl.storage.upload import upload_dir

__all__ = ["StageResult", "StaleEpoch", "StorageError", "check_epoch", "checkpoint_dirname", "checkpoint_to_restore",
           "claim_epoch", "commit_checkpoint",
           "commit_records", "latest_checkpoint", "prune_checkpoints", "resolve", "stage", "step_uri",
           "upload_dir", "verify_checkpoint", "withdraw_from"]
