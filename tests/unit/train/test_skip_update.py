"""A non-finite gradient norm skips the update without a host sync before the optimizer
(issue 36): ``TrainerWorker.train_step`` hands the skip decision to the fused AdamW kernels as
``found_inf``, the hook torch's GradScaler uses. The first test pins that hook in torch itself (it
fails if a torch release changes it); the second, a real one-rank trainer on CPU (a tiny Qwen3),
that a skipped step leaves parameters, moments, step count and LR bit-identical. Two ranks, the
non-finite sample on one of them: tests/engine/train/test_group.py."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import Sample, TrainBatch

from tests.unit.train.tiny_trainer import save_tiny_qwen3, tiny_batch


def _tensors(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    state = [t for p in params for _, t in sorted(optimizer.state[p].items())]
    return [t.detach().clone() for t in [*params, *state]]


def test_fused_adamw_found_inf_leaves_params_moments_and_step():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    before = _tensors(optimizer, params)
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    del optimizer.found_inf
    after = _tensors(optimizer, params)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # weight decay skipped too
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert optimizer.state[params[0]]["step"].item() == 2.0
    assert not torch.equal(params[0].detach(), before[0])


def _digest(worker) -> dict:
    h = hashlib.sha256()
    for name, value in sorted(worker.model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in worker.optimizer.state.values():
        for key, value in sorted(state.items()):
            h.update(key.encode())
            h.update(torch.as_tensor(value).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return {"digest": h.hexdigest(), "lr": worker.scheduler.get_last_lr()[0],
            "scheduler_epoch": worker.scheduler.last_epoch, "optimizer_steps": worker.optimizer_steps}


def test_single_rank_skips_non_finite_update_bit_exactly(tmp_path):
    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    config = TrainerConfig(lr=1e-3, weight_decay=0.1, micro_batch_size=2, entropy_coef=0.01, warmup_steps=3,
                           model=ModelOptions())
    worker = TrainerWorker(save_tiny_qwen3(tmp_path / "model"), config, rank=0, world_size=1,
                           master_addr="127.0.0.1", master_port=unclaimed_port(), device=torch.device("cpu"))
    try:
        first = worker.train_step(tiny_batch(0))
        assert first["skipped"] == 0.0 and math.isfinite(first["grad_norm"]) and first["optimizer_steps"] == 1.0
        before = _digest(worker)
        good = tiny_batch(1)
        bad = TrainBatch([*good.samples[:-1], Sample(**{**vars(good.samples[-1]), "advantage": float("nan")})])
        skipped = worker.train_step(bad)
        assert skipped["skipped"] == 1.0 and skipped["skipped_total"] == 1.0 and skipped["optimizer_steps"] == 1.0
        assert not math.isfinite(skipped["grad_norm"])
        assert _digest(worker) == before  # parameters, AdamW moments and step, LR schedule
        assert all(p.grad is None for p in worker.model.parameters())
        after = worker.train_step(good)  # and training goes on, at the LR the skipped step left
        assert after["skipped"] == 0.0 and after["lr"] == pytest.approx(first["lr"] * 2)
        assert _digest(worker)["digest"] != before["digest"]
    finally:
        worker.shutdown()
