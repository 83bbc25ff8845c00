"""The trainer's AdamW (``kuberl.train.optim``): on CPU tensors torch's fused step after the
clipping's multiply, bit for bit what the trainer ran before; the GPU kernel
(``kuberl.train.adamw_kernel``) run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
set before Triton is imported, hence the subprocess) against AdamW in float64 and against torch's
fused AdamW. On a GPU: tests/gpu/test_optim_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kuberl.train.optim import AdamW
from tests.unit import triton_interpreter


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(40, 50, generator=g)), torch.nn.Parameter(torch.randn(50, generator=g))]


def _everything(optimizer: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    return [t.detach().clone() for p in params for t in (p, *optimizer.state[p].values())]


def test_on_cpu_it_is_torch_fused_adamw_after_clip_grads_with_norm_():
    ours, twins = _params(0), _params(0)
    mine = AdamW(ours, lr=1e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(twins, lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, q in zip(ours, twins):
            p.grad = torch.randn(p.shape, generator=g) * 10
            q.grad = p.grad.clone()
        norm = torch.nn.utils.get_total_norm([q.grad for q in twins])
        torch.nn.utils.clip_grads_with_norm_(twins, 1.0, norm)
        theirs.step()
        mine.step(found_inf=torch.zeros(()), grad_mul=torch.clamp(1.0 / (norm + 1e-6), max=1.0))
    assert all(torch.equal(a, b) for a, b in zip(_everything(mine, ours), _everything(theirs, twins)))
    assert mine.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()
    before = _everything(mine, ours)
    for p in ours:
        p.grad = torch.full_like(p, float("nan"))
    mine.step(found_inf=torch.ones(()), grad_mul=torch.tensor(float("nan")))
    assert all(torch.equal(a, b) for a, b in zip(_everything(mine, ours), before))  # step counts too


CHECK = r"""
import torch
from kuberl.train.optim import BLOCK, AdamW, _Plan

torch.manual_seed(0)


def kernel_step(opt, params, found_inf, grad_mul):
    # AdamW.step takes the kernel's path on a GPU only: on CPU tensors the state and the plan are
    # made here as AdamW._plan makes them there.
    for p in params:
        if not opt.state[p]:
            opt.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    plan = _Plan(params, [opt.state[p] for p in params], BLOCK)
    opt._kernel_step(opt.param_groups[0], plan, plan.grad_addresses(), found_inf, grad_mul)



def reference(p, g, m, v, step, lr, wd, b1, b2, eps, c):
    g = g * c
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr / (1 - b1 ** step) * m / (v.sqrt() / (1 - b2 ** step) ** 0.5 + eps), m, v


# 9000 elements: three programs of 4096, the last one masked; 13 and 1 make the sizes unaligned
# (the kernel's scalar path).
for sizes in [[(3, 3000), (64,), (16, 16)], [(3, 3000), (13,), (1,)]]:
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    opt = AdamW(params, lr=0.01, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6)
    ref = [(p.detach().double().clone(), torch.zeros(p.shape, dtype=torch.float64),
            torch.zeros(p.shape, dtype=torch.float64)) for p in params]
    for step in range(1, 4):
        c = torch.tensor(0.5 if step == 2 else 1.0)
        grads = []
        for p in params:
            p.grad = torch.randn_like(p)
            grads.append(p.grad.clone())
        kernel_step(opt, params, torch.zeros(()), c)
        for i, p in enumerate(params):
            assert torch.equal(p.grad, grads[i])  # the coefficient is applied in registers only
            ref[i] = reference(ref[i][0], grads[i].double(), ref[i][1], ref[i][2], step, 0.01, 0.1, 0.9, 0.99,
                               1e-6, c.double())
            for got, want in zip((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), ref[i]):
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < 1e-6, (sizes, step, i, err)
            assert opt.state[p]["step"].item() == step and opt.state[p]["step"].dtype == torch.float32
    before = [t.clone() for p in params for t in (p.detach(), *opt.state[p].values())]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    kernel_step(opt, params, torch.ones(()), torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, [t for p in params for t in (p.detach(), *opt.state[p].values())]))

params = [torch.nn.Parameter(torch.randn(40, 50)), torch.nn.Parameter(torch.randn(50))]
twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
ours = AdamW(params, lr=1e-3, weight_decay=0.01)
theirs = torch.optim.AdamW(twins, lr=1e-3, weight_decay=0.01, fused=True)
for step in range(3):
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    norm = torch.nn.utils.get_total_norm([q.grad for q in twins])
    torch.nn.utils.clip_grads_with_norm_(twins, 1.0, norm)
    theirs.step()
    kernel_step(ours, params, None, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
for p, q in zip(params, twins):
    assert ((p - q).norm() / q.norm()).item() < 1e-6
    a, b = ours.state[p], theirs.state[q]
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    assert torch.equal(a["step"], b["step"])
print("ok")
"""


@pytest.mark.triton_interpreter(CHECK)
def test_kernel_in_the_interpreter_is_adamw():
    pytest.importorskip("triton")
    triton_interpreter.result(CHECK)
