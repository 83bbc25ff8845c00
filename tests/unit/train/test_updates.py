"""Mini-batch policy updates (``kuberl.driver.updates``) on a real one-rank FSDP2 trainer: the
behaviour policy's log-probs are taken once, before the first update, so from the second update on
the importance ratio leaves 1 and the PPO clip binds; with one update it cannot."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kuberl.api.types import AlgorithmSpec
from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import Sample, SampleError, TrainBatch
from kuberl.driver.tiny import make_model
from kuberl.driver.updates import merge_update_metrics, mini_batches, policy_updates


def _batch(prompts=4, group_size=4, seed=0) -> TrainBatch:
    rng = random.Random(seed)
    samples = []
    for group in range(prompts):
        prompt = [rng.randrange(4, 100) for _ in range(5)]
        for _ in range(group_size):
            samples.append(Sample(prompt_ids=prompt, response_ids=[rng.randrange(4, 100) for _ in range(8)],
                                  advantage=rng.choice([-1.0, 1.0]), group=group))
    return TrainBatch(samples)


def test_mini_batches_keep_groups_whole_and_in_order():
    batch = _batch(prompts=4, group_size=3)
    batch.old_logprobs = [[float(i)] for i in range(12)]
    parts = mini_batches(batch, 2)
    assert [[s.group for s in p.samples] for p in parts] == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]]
    assert parts[1].old_logprobs == [[float(i)] for i in range(6, 12)] and parts[1].ref_logprobs is None
    with pytest.raises(ValueError, match="4 prompts do not split into mini-batches of 3"):
        mini_batches(batch, 3)


def test_merged_metrics_weight_updates_by_their_tokens():
    base = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "aux_loss": 0.0, "lr": 1e-6,
            "tis_ratio": 1.0, "tis_truncated_frac": 0.0,
            "skipped": 0.0, "skipped_total": 0.0, "optimizer_steps": 1.0, "checkpoint_wait": 0.0}
    merged = merge_update_metrics([{**base, "clip_frac": 0.0, "tokens": 30.0, "grad_norm": 1.0},
                                   {**base, "clip_frac": 0.4, "tokens": 10.0, "grad_norm": 3.0, "optimizer_steps": 2.0}])
    assert merged["clip_frac"] == pytest.approx(0.1)
    assert (merged["grad_norm"], merged["grad_norm_max"], merged["updates"], merged["optimizer_steps"]) == (2.0, 3.0, 2.0, 2.0)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from kuberl.train.worker import ModelOptions, TrainerConfig, TrainerWorker

    model = make_model(tmp_path_factory.mktemp("updates") / "model", moe=False, seed=3)
    port = unclaimed_port()
    config = TrainerConfig(lr=2e-2, weight_decay=0.0, micro_batch_size=4, clip_low=0.2, clip_high=0.2,
                           model=ModelOptions(gradient_checkpointing=False, param_dtype=torch.float32))
    w = TrainerWorker(str(model), config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                      device=torch.device("cpu"))
    yield w
    w.shutdown()


@pytest.mark.parametrize("mini_batch_size,updates,clipped", [(4, 1, False), (1, 4, True)])
def test_clip_binds_only_from_the_second_update(worker, mini_batch_size, updates, clipped):
    algorithm = AlgorithmSpec(promptsPerStep=4, groupSize=4, microBatchSize=4, miniBatchSize=mini_batch_size)
    batch = _batch(seed=updates)
    batch.old_logprobs = worker.log_probs(batch)
    before = worker.optimizer_steps
    metrics = policy_updates(worker, batch, algorithm)
    assert metrics["updates"] == updates and worker.optimizer_steps - before == updates
    if clipped:
        assert metrics["clip_frac"] > 0
    else:
        assert metrics["clip_frac"] == 0.0


def test_update_epochs_repeat_the_pass(worker):
    algorithm = AlgorithmSpec(promptsPerStep=4, groupSize=4, microBatchSize=4, miniBatchSize=2, updateEpochs=2)
    batch = _batch(seed=9)
    batch.old_logprobs = worker.log_probs(batch)
    assert policy_updates(worker, batch, algorithm)["updates"] == 4
    with pytest.raises(ValueError, match="behaviour policy"):
        policy_updates(worker, _batch(), algorithm)


@pytest.mark.parametrize("micro_batch_tokens", [0, 64], ids=["padded", "packed"])
def test_truncated_importance_sampling_weighs_each_token_against_the_engines_logprobs(worker, micro_batch_tokens):
    batch = _batch(seed=5)
    batch.old_logprobs = worker.log_probs(batch)
    for sample, old in zip(batch.samples, batch.old_logprobs):
        # The engines' probability: the trainer's on even response tokens, a quarter of it on odd
        # ones, so pi_old / mu is 1 on half the tokens and 4 (above the cap of 2) on the other half.
        sample.response_logprobs = [lp - (math.log(4) if i % 2 else 0.0) for i, lp in enumerate(old)]
    algorithm = AlgorithmSpec(promptsPerStep=4, groupSize=4, microBatchSize=4, tis={"cap": 2.0})
    config = worker.config
    worker.config = dataclasses.replace(config, tis_cap=algorithm.tis.cap, micro_batch_tokens=micro_batch_tokens)
    try:
        metrics = policy_updates(worker, batch, algorithm)
        assert metrics["tis_truncated_frac"] == pytest.approx(0.5)
        assert metrics["tis_ratio"] == pytest.approx((1 + 4) / 2, rel=1e-5)
        batch.samples[3].response_logprobs = None  # e.g. an agent harness that returned none
        with pytest.raises(SampleError, match=r"algorithm.tis: samples \[3\] .* without the engines' log-probs"):
            policy_updates(worker, batch, algorithm)
    finally:
        worker.config = config


def test_k3_kl_is_clamped_per_token():
    from kuberl.train.loss import kl_penalty

    logprobs = torch.tensor([[-20.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0]])  # token 0: exp(19) - 19 - 1, far above the clamp
    mask = torch.ones(1, 2)
    assert kl_penalty(logprobs, ref, mask, clamp=10.0).item() == pytest.approx(5.0)
    assert kl_penalty(logprobs, ref, mask).item() > 1e7
