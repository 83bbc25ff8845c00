"""trainer.lora on one real gloo rank wrapped in FSDP2 (frozen and trainable parameters in the same
groups), a tiny Qwen3 on CPU: only the adapters change, the reference policy is the base itself,
a weight sync sends the adapters alone (their bytes against a full sync's), checkpoints hold the
adapters and their optimizer state only and resume bit-exactly, and the export's adapter and merged
model reproduce the trained policy."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import TrainBatch
from kuberl.sync.adapter import ADAPTER_CONFIG, ADAPTER_EXPORT_DIR, ADAPTER_PREFIX, ADAPTER_WEIGHTS
from kuberl.sync.buckets import plan_buckets
from kuberl.sync.params import iter_buckets, param_metas
from kuberl.train.lora import LoraOptions, apply_lora

from tests.unit.train.tiny_trainer import save_tiny_qwen3, tiny_batch

STEPS = 3
LORA = LoraOptions(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _worker(model_path: str, port: int, lora: LoraOptions | None = LORA, *, fsdp: bool = True):
    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    # lr 1e-2: the adapters move visibly in 3 steps; klCoef > 0: the reference policy is used.
    config = TrainerConfig(lr=1e-2, micro_batch_size=2, entropy_coef=0.01, kl_coef=0.05,
                           model=ModelOptions(shard_single_rank=fsdp, lora=lora))
    return TrainerWorker(model_path, config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                         device=torch.device("cpu"))


def _saved(name: str) -> str:
    """peft's saved name of the trainer's adapter parameter ``name`` (its adapter name dropped)."""
    return ADAPTER_PREFIX + name.replace(".default.", ".")


def _params(worker) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.named_parameters()}


def _with_ref(worker, batch: TrainBatch) -> TrainBatch:
    batch.ref_logprobs = worker.ref_log_probs(batch)
    return batch


def test_lora_trains_only_the_adapters_syncs_them_and_resumes_exactly(tmp_path):
    port, model = unclaimed_port(), save_tiny_qwen3(tmp_path / "model")
    worker = _worker(model, port)
    params = list(worker.model.parameters())
    assert all(isinstance(p, DTensor) for p in params)  # FSDP2 even at one rank (shard_single_rank)
    trainable = {k for k, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in k or ".lora_B." in k for k in trainable)
    assert len(trainable) == 2 * len(LORA.target_modules) * 2  # A and B, per target, per layer
    assert worker.ref_model is None  # the base itself is the reference: no second copy
    before = _params(worker)

    # B starts at 0: the policy starts as the base model, which is also the reference.
    assert worker.log_probs(tiny_batch(0)) == worker.ref_log_probs(tiny_batch(0))

    losses = []
    for step in range(STEPS):
        if step == 1:
            state, extra = worker.checkpoint_state()
            # The checkpoint holds the adapters and their AdamW moments, nothing of the base.
            assert set(state["model"]) == trainable
            assert {k for k in state["optim"]["state"]} == trainable
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")))
        losses.append(worker.train_step(_with_ref(worker, tiny_batch(step)))["loss"])
    after = _params(worker)
    for name, value in before.items():
        if name in trainable:
            assert not torch.equal(after[name], value) or ".lora_A." in name, name
        else:
            assert torch.equal(after[name], value), f"frozen {name} changed"
    assert any(after[k].abs().sum() > 0 for k in trainable if ".lora_B." in k)
    assert worker.log_probs(tiny_batch(0)) != worker.ref_log_probs(tiny_batch(0))

    # The sync sends the adapters alone, under peft's saved names, as trained.
    metas = param_metas(worker.model, torch.float32)
    assert {m.name for m in metas} == {_saved(k) for k in trainable}
    sent = {m.name: t for bucket, tensors in iter_buckets(worker.model, plan_buckets(metas, 1 << 20),
                                                          torch.device("cpu"))
            for m, t in zip(bucket.metas, tensors)}
    for name in trainable:
        assert torch.equal(sent[_saved(name)], after[name])
    adapter_bytes = sum(m.nbytes for m in metas)
    full_bytes = sum(v.numel() * 4 for k, v in after.items() if k not in trainable)
    print(f"\nbytes per sync, fp32: LoRA r={LORA.rank} adapters {adapter_bytes} B, full model {full_bytes} B "
          f"({full_bytes / adapter_bytes:.1f}x)")
    assert adapter_bytes * 4 < full_bytes

    # A LoRA checkpoint restores only into a LoRA trainer of the same rank and modules, and a full
    # one only into a full trainer; refused before dcp.load, naming the field.
    from kuberl.train.checkpoint import lora_mismatch
    from kuberl.train.dcp_read import load_metadata

    saved = load_metadata((tmp_path / "ckpt" / ".metadata").read_bytes(), "ckpt").state_dict_metadata
    shapes = worker.adapter_shapes()
    assert len(shapes) == len(trainable)
    assert lora_mismatch(saved, shapes, "ckpt") is None
    assert "written with trainer.lora (it holds the adapters" in lora_mismatch(saved, {}, "ckpt")
    assert "remove trainer.lora to resume it" in lora_mismatch(
        {k: v for k, v in saved.items() if ".lora_" not in k}, shapes, "ckpt")
    other_rank = {k: tuple(8 if d == LORA.rank else d for d in v) for k, v in shapes.items()}
    assert f"written with trainer.lora.rank {LORA.rank}" in lora_mismatch(saved, other_rank, "ckpt")
    fewer = {k: v for k, v in shapes.items() if ".down_proj." not in k}
    assert "targetModules ['down_proj', 'q_proj', 'v_proj'], this run has ['q_proj', 'v_proj']" in \
        lora_mismatch(saved, fewer, "ckpt")

    # Resume after step 1 into a fresh trainer: steps 1 and 2 again, bit for bit.
    resumed = _worker(model, port)
    resumed.restore_state(lambda fresh: dcp.load(fresh, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt"))),
                          extra)
    assert [resumed.train_step(_with_ref(resumed, tiny_batch(step)))["loss"] for step in range(1, STEPS)] == losses[1:]
    for name, value in _params(resumed).items():
        assert torch.equal(value, after[name]), name

    # Export: the adapter in peft's format, and on request the merged model, which scores as the
    # trained policy does.
    resumed.export_hf(str(tmp_path / "export"))
    adapter = tmp_path / "export" / ADAPTER_EXPORT_DIR
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", LORA.rank, LORA.alpha)
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    saved = load_file(adapter / ADAPTER_WEIGHTS)
    assert saved.keys() == {_saved(k) for k in trainable}
    assert all(torch.equal(saved[_saved(k)], after[k]) for k in trainable)
    assert not (tmp_path / "export" / "model.safetensors").exists()

    resumed.config.model.lora = dataclasses.replace(LORA, merge_on_export=True)
    resumed.export_hf(str(tmp_path / "merged"))
    assert (tmp_path / "merged" / ADAPTER_EXPORT_DIR / ADAPTER_WEIGHTS).exists()
    merged = _worker(str(tmp_path / "merged"), port, lora=None)
    torch.testing.assert_close(torch.tensor(sum(merged.log_probs(tiny_batch(5)), [])),
                               torch.tensor(sum(resumed.log_probs(tiny_batch(5)), [])), rtol=0, atol=1e-5)
    merged.shutdown()


def test_lora_on_one_unsharded_rank_trains_the_adapters_alone(tmp_path):
    """One rank keeps a plain module (no FSDP2), as a one-GPU trainer does."""
    worker = _worker(save_tiny_qwen3(tmp_path / "model"), unclaimed_port(), fsdp=False)
    assert not isinstance(next(worker.model.parameters()), DTensor)
    before = _params(worker)
    worker.train_step(_with_ref(worker, tiny_batch(0)))
    changed = {k for k, v in _params(worker).items() if not torch.equal(v, before[k])}
    assert changed and all(".lora_B." in k for k in changed)  # A's gradient is 0 while B is
    worker.shutdown()


def test_the_merged_weights_compute_what_the_adapted_model_does():
    """peft's merge_and_unload, W + (alpha / r) B A under each layer's own name, biases kept
    (Qwen2's q/k/v projections have one): the plain model it gives scores as the adapted one."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kuberl.train.lora import merged_state_dict

    config = Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    options = LoraOptions(rank=2, alpha=6, target_modules=("q_proj", "down_proj"))
    apply_lora(model, options, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
    # The model's own state (its live tensors, as a one-rank trainer's gathered state is): the
    # merge must leave the model as it was, which the comparison below checks.
    merged = merged_state_dict(model, model.state_dict(), options, config)
    assert not any(".lora_" in k or ".base_layer." in k for k in merged)
    assert "model.layers.0.self_attn.q_proj.bias" in merged
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 64, (2, 7))
    torch.testing.assert_close(plain(tokens).logits, model(tokens).logits)


def test_a_target_the_model_lacks_is_refused_naming_the_field():
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"spec.trainer.lora.targetModules: \['v_proj'\] match no linear layer"):
        apply_lora(model, LoraOptions(rank=2, alpha=2, target_modules=("q_proj", "v_proj")))


def test_spec_lora_reaches_the_model_options():
    from kuberl.api.types import RLTrainingJobSpec
    from kuberl.train.worker import TrainerConfig

    spec = RLTrainingJobSpec.model_validate({"image": "img", "model": {"uri": "s3://models/x"},
                                             "data": {"uri": "s3://data/x.jsonl"},
                                             "trainer": {"lora": {"rank": 8, "targetModules": ["q_proj"]}}})
    lora = TrainerConfig.from_spec(spec, on_gpu=False).model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.seed) == (8, 32, ("q_proj",), spec.algorithm.seed)
    spec.trainer.lora = None
    assert TrainerConfig.from_spec(spec, on_gpu=False).model.lora is None
