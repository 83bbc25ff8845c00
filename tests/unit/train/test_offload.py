"""trainer.cpuOffload (FSDP2's CPUOffloadPolicy) against no offload: the same losses and weights
after a few steps, and an offloaded trainer resumes from its checkpoint bit-exactly. One real gloo
rank, a tiny Qwen3, CPU (tests/gpu/test_offload_gpu.py checks the memory it saves on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from kuberl.common.ports import unclaimed_port

from tests.unit.train.tiny_trainer import save_tiny_qwen3, tiny_batch

STEPS = 3


def _worker(model_path: str, offload: bool, port: int):
    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    config = TrainerConfig(lr=1e-3, micro_batch_size=2, entropy_coef=0.01, warmup_steps=2,
                           model=ModelOptions(cpu_offload=offload))
    return TrainerWorker(model_path, config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                         device=torch.device("cpu"))


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.state_dict().items()}


def test_offload_trains_as_no_offload_and_resumes_exactly(tmp_path):
    port, model = unclaimed_port(), save_tiny_qwen3(tmp_path / "model")
    plain = _worker(model, False, port)
    # One rank without offload keeps a plain module; offload needs FSDP2 even there.
    assert not isinstance(next(plain.model.parameters()), DTensor)
    plain_losses = [plain.train_step(tiny_batch(step))["loss"] for step in range(STEPS)]
    plain_weights = _weights(plain)

    offloaded = _worker(model, True, port)
    params = list(offloaded.model.parameters())
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
    losses = []
    for step in range(STEPS):
        if step == 1:
            state, extra = offloaded.checkpoint_state()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")))
        metrics = offloaded.train_step(tiny_batch(step))
        losses.append(metrics["loss"])
    weights = _weights(offloaded)
    # The optimizer's moments stay with the offloaded shards, on the host.
    assert all(v.device.type == "cpu" for s in offloaded.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-7)
    assert weights.keys() == plain_weights.keys()
    for name, value in plain_weights.items():
        # lr 1e-3: Adam moves each weight by about lr per step, so a wrong update is ~1e-3 off.
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)

    # The export gathers the host shards into a Hugging Face checkpoint.
    offloaded.export_hf(str(tmp_path / "export"))
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported and all(torch.equal(value, weights[name]) for name, value in exported.items())

    # Resume after step 1 into a fresh offloaded trainer: steps 1 and 2 again, bit for bit.
    resumed = _worker(model, True, port)
    resumed.restore_state(lambda fresh: dcp.load(fresh, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt"))),
                          extra)
    assert [resumed.train_step(tiny_batch(step))["loss"] for step in range(1, STEPS)] == losses[1:]
    for name, value in _weights(resumed).items():
        assert torch.equal(value, weights[name]), name
    resumed.shutdown()


def test_spec_cpu_offload_reaches_the_model_options():
    from kuberl.api.types import RLTrainingJobSpec
    from kuberl.train.worker import TrainerConfig

    spec = RLTrainingJobSpec.model_validate({"image": "img", "model": {"uri": "s3://models/x"},
                                             "data": {"uri": "s3://data/x.jsonl"}, "trainer": {"cpuOffload": True}})
    assert TrainerConfig.from_spec(spec, on_gpu=True).model.cpu_offload
    spec.trainer.cpu_offload = False
    assert not TrainerConfig.from_spec(spec, on_gpu=True).model.cpu_offload
