"""The trainer's update runs the configured algorithm's loss (``TrainerConfig.algorithm``, from
``spec.algorithm.name``), on padded and on packed micro-batches, on a real one-rank FSDP2 trainer.

At the behaviour policy every ratio is 1 and nothing clips, so each loss reduces to its
aggregation of ``-A``, worked out by hand below for four samples with advantages 1, -0.5, 2, -1.5
and 3, 5, 2, 6 response tokens (sum of A * tokens: 3 - 2.5 + 4 - 9 = -4.5; sum of A: 1)."""

from __future__ import annotations


import pytest
import torch

from kuberl.api.types import RLTrainingJobSpec
from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import Sample, TrainBatch

ADVANTAGES = [1.0, -0.5, 2.0, -1.5]
LENGTHS = [3, 5, 2, 6]
MAX_RESPONSE_TOKENS = 8
EXPECTED_PG_LOSS = {
    "grpo": 4.5 / 16,                       # token mean: -sum(A n) / sum(n)
    "dapo": 4.5 / 16,                       # token-level, the same at ratio 1
    "rloo": 4.5 / 16,
    "dr-grpo": 4.5 / (4 * MAX_RESPONSE_TOKENS),  # token sum over G * L_max
    "gspo": -1.0 / 4,                       # sequence mean: -sum(A) / G
}


def _batch() -> TrainBatch:
    samples = [Sample(prompt_ids=[3 + i, 7, 9, 11], response_ids=[(5 * i + t) % 100 + 4 for t in range(n)],
                      advantage=a, group=i // 2)
               for i, (a, n) in enumerate(zip(ADVANTAGES, LENGTHS))]
    return TrainBatch(samples)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", sorted(EXPECTED_PG_LOSS))
def test_update_uses_the_algorithms_loss(name, packed):
    from transformers import Qwen3Config

    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    config = Qwen3Config(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64)
    clip = (3e-4, 4e-4) if name == "gspo" else (0.2, 0.2)
    trainer_config = TrainerConfig(algorithm=name, lr=1e-3, micro_batch_size=2, micro_batch_tokens=30 if packed else 0,
                                   clip_low=clip[0], clip_high=clip[1], max_response_tokens=MAX_RESPONSE_TOKENS,
                                   model=ModelOptions(gradient_checkpointing=False, param_dtype=torch.float32))
    worker = TrainerWorker(None, trainer_config, rank=0, world_size=1, master_addr="127.0.0.1",
                           master_port=unclaimed_port(), device=torch.device("cpu"), random_init_config=config)
    try:
        batch = _batch()
        batch.old_logprobs = worker.log_probs(batch)
        metrics = worker.train_step(batch)
        assert metrics["pg_loss"] == pytest.approx(EXPECTED_PG_LOSS[name], rel=1e-4, abs=1e-6)
        assert metrics["clip_frac"] == 0.0 and metrics["optimizer_steps"] == 1.0
    finally:
        worker.shutdown()


def test_trainer_config_takes_the_algorithm_and_its_defaults_from_the_spec():
    from kuberl.train.worker import TrainerConfig

    base = {"image": "img", "model": {"uri": "s3://models/x"}, "data": {"uri": "s3://data/x.jsonl"},
            "rollout": {"maxResponseLength": 512}}
    for name, clip in [("grpo", (0.2, 0.2)), ("dapo", (0.2, 0.28)), ("gspo", (3e-4, 4e-4))]:
        spec = RLTrainingJobSpec.model_validate({**base, "algorithm": {"name": name}})
        config = TrainerConfig.from_spec(spec, on_gpu=False)
        assert (config.algorithm, config.clip_low, config.clip_high, config.max_response_tokens) == (name, *clip, 512)
    spec = RLTrainingJobSpec.model_validate({**base, "algorithm": {"name": "gspo", "clipRatioHigh": 1e-3}})
    assert (TrainerConfig.from_spec(spec, on_gpu=False).clip_low, spec.algorithm.clip_range()[1]) == (3e-4, 1e-3)
