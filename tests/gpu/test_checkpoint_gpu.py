"""A trainer rank's background checkpoint on a GPU (``kuberl.train.checkpoint.RankCheckpointer``):
the state is copied into pinned host memory on a stream of its own, the next update waits for
that copy alone, and what is written and restored is the state when ``save`` was called, not the
state the update made while the write ran. A real FSDP2 + AdamW rank on one GPU
(``tests.engine.driver.one_rank``), a local checkpoint root."""

from __future__ import annotations

import torch.distributed as dist

from kuberl.job.plan import Checkpoints
from kuberl.train.checkpoint import RankCheckpointer
from tests.engine.driver.one_rank import OneRank


def test_a_gpu_checkpoint_is_staged_and_holds_the_state_at_save(tmp_path):
    rank = OneRank(layers=8, dim=1024, device="cuda:0")  # 8.4M parameters: 101 MB with AdamW's moments
    root = str(tmp_path / "checkpoints")
    spec = Checkpoints(root=root, interval_steps=1, keep=2, format="dcp", export_hugging_face=False, export_uri=None)
    saver = RankCheckpointer(rank, spec, tmp_path / "scratch")
    assert saver._stager is not None, "on a GPU the write reads a host copy, not the live state"
    rank.before_update = saver.fence
    try:
        saved = {}
        for step in (2, 4):
            saved[step] = rank.values()
            saver.save(step)
            rank.step()  # the optimizer step waits (fence) for the copy, then changes the live state
            saver.commit(step, saver.uploaded(step), {"weight_version": step})
        assert rank.values() != saved[4]
        assert saver.load(f"{root}/step-000000004") == {"weight_version": 4, "step": 4}
        assert rank.values() == saved[4]  # the state when save was called, not after the step
        assert saver.load(f"{root}/step-000000002") == {"weight_version": 2, "step": 2}
        assert rank.values() == saved[2]
    finally:
        rank.before_update = lambda: 0.0
        saver.close()
        dist.destroy_process_group()  # the GPU tests after this one start their own
