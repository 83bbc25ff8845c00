"""The trainer's AdamW: torch's fused AdamW (its state, its state dict, its found_inf skip) whose
step takes the gradient clipping's coefficient, and on a GPU runs as one Triton launch per
parameter group (``kuberl.train.adamw_kernel``: the clipping's pass over the gradients folded in;
in a dense-preset step on an H200 the launch took 13.6 ms, 4.1 TB/s, where torch's clipping and
fused AdamW took ~22 ms: docs/benchmarks.md).

Where the kernel does not apply (CPU tensors, as in offload and the unit tests; a dtype other than
fp32; amsgrad, maximize, capturable, a tensor learning rate), the gradients are multiplied by the
coefficient as ``torch.nn.utils.clip_grads_with_norm_`` does and torch's fused step runs:
bit for bit what the trainer did before.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

# Elements and warps per program of the update kernel: the fastest of bench/adamw_speed.py's six
# on an H200 (15.59 ms a call against 15.63-16.21 ms for 1024-8192 elements on 4-16 warps). An
# in-place update cannot use Triton's autotuner, whose timing runs would each apply it again.
BLOCK = 2048
NUM_WARPS = 8


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def scale_grads_(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply every gradient by ``coefficient`` in place, as ``clip_grads_with_norm_`` does:
    one foreach multiply per device mesh (sharded gradients of several meshes, as with expert
    parallelism, cannot share one foreach call) and device."""
    groups: dict = defaultdict(list)
    for g in grads:
        groups[(g.device_mesh if isinstance(g, DTensor) else None, g.device)].append(g)
    for (_, device), group in groups.items():
        torch._foreach_mul_(group, coefficient.to(device))


class _Plan:
    """What one parameter group's update needs that stays from step to step: the tensors' sizes,
    the table of which tensor and which block each program updates, the parameters' and moments'
    local tensors and addresses, and the step counts. Checking and gathering all of them for the
    dense preset's 267 tensors took 1.8 ms of Python a step (on a CPU machine; in an H200 profile
    the GPU, done with the backward, waited ~2.5 ms around the optimizer's launches:
    bench/gpu_gaps.py); a step now checks and reads the gradients alone."""

    def __init__(self, params: list[torch.Tensor], states: list[dict], block: int):
        self.params = params
        self.sharded = isinstance(params[0], DTensor)
        self.locals = [_local(p) for p in params]
        self.device = self.locals[0].device
        self.steps = [s["step"] for s in states]
        # Parameters, first moments, second moments: the rows of the kernel's address table but
        # the gradients'.
        self.fixed = [t.data_ptr() for t in self.locals] + [_local(s[k]).data_ptr() for k in ("exp_avg", "exp_avg_sq")
                                                            for s in states]
        numels = [t.numel() for t in self.locals]
        self.aligned = all(a % 16 == 0 for a in self.fixed) and all(n % 16 == 0 for n in numels)
        blocks = [-(-n // block) for n in numels]
        firsts = [0]
        for b in blocks[:-1]:
            firsts.append(firsts[-1] + b)
        self.block, self.n_blocks = block, sum(blocks)
        self.block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                                    torch.tensor(blocks)).to(self.device)
        self.first_block = torch.tensor(firsts, dtype=torch.int64, device=self.device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=self.device)

    def current(self, params: list[torch.Tensor], states: list[dict]) -> bool:
        """Still these tensors where they were (a loaded state dict or a parameter's ``.data``
        swapped makes a new plan)."""
        return (len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))
                and all(a is s["step"] for a, s in zip(self.steps, states))
                and [t.data_ptr() for t in self.locals] == self.fixed[:len(params)]
                and [_local(s[k]).data_ptr() for k in ("exp_avg", "exp_avg_sq") for s in states]
                == self.fixed[len(params):])

    def grad_addresses(self) -> list[int] | None:
        """The gradients' addresses, or None where one is not a dense fp32 tensor on the device."""
        out = []
        for p in self.params:
            g = p.grad.to_local() if self.sharded else p.grad
            if g.dtype != torch.float32 or g.device != self.device or not g.is_contiguous():
                return None
            out.append(g.data_ptr())
        return out


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(..., fused=True)`` whose ``step`` takes ``found_inf`` (1: skip this
    update, leaving parameters, moments and step counts as they were; the GradScaler hook torch's
    fused kernels honour) and ``grad_mul`` (the gradient clipping's coefficient), both scalar
    tensors on the parameters' device, so that neither needs a host sync."""

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self._plans: dict[int, _Plan] = {}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()  # new moment tensors

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None, grad_mul: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grouped = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        runs = []
        for index, (group, params) in enumerate(zip(self.param_groups, grouped)):
            if not params:
                continue
            plan = self._plan(index, group, params)
            addresses = plan.grad_addresses() if plan is not None else None
            if addresses is None:
                runs = None
                break
            runs.append((group, plan, addresses))
        if runs is not None:
            for group, plan, addresses in runs:
                self._kernel_step(group, plan, addresses, found_inf, grad_mul)
            return loss
        if grad_mul is not None:
            scale_grads_([p.grad for params in grouped for p in params], grad_mul)
        if found_inf is not None:
            self.found_inf = found_inf
        try:
            super().step()
        finally:
            if found_inf is not None:
                del self.found_inf
        return loss

    def _plan(self, index: int, group: dict, params: list[torch.Tensor]) -> _Plan | None:
        """This group's plan, made anew when its tensors changed; None where the kernel does not
        apply."""
        plan = self._plans.get(index)
        states = [self.state.get(p) or {} for p in params]
        if plan is not None and plan.block == BLOCK and all(states) and plan.current(params, states):
            return plan
        self._plans.pop(index, None)
        if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
                or not group.get("decoupled_weight_decay", True) or isinstance(group["lr"], torch.Tensor)):
            return None
        locals_ = [_local(p) for p in params]
        device = locals_[0].device
        if device.type != "cuda" or any(isinstance(p, DTensor) != isinstance(params[0], DTensor) for p in params):
            return None
        for local, state in zip(locals_, states):
            if local.device != device or local.dtype != torch.float32 or not local.is_contiguous():
                return None
            if state and (state["step"].device != device
                          or any(not _local(state[k]).is_contiguous() for k in ("exp_avg", "exp_avg_sq"))):
                return None
        for p, state in zip(params, states):
            if not state:  # torch's fused AdamW's state: an fp32 step on the device, two moments
                state = self.state[p]
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        plan = self._plans[index] = _Plan(params, [self.state[p] for p in params], BLOCK)
        return plan

    def _kernel_step(self, group: dict, plan: _Plan, grad_addresses: list[int], found_inf: torch.Tensor | None,
                     grad_mul: torch.Tensor | None) -> None:
        from kuberl.train import adamw_kernel  # Triton: only where there is a GPU

        device = plan.device
        found_inf = found_inf.to(device) if found_inf is not None else None
        grad_mul = grad_mul.to(device) if grad_mul is not None else None
        # As torch's fused path: every step count moves by one, and back where found_inf is 1.
        # A device tensor as foreach_add_'s scalar is read on the host (a sync that drained the
        # queue before every update, seen in tests/gpu/test_optim_gpu.py's sync check): as a list,
        # it is the tensor-list form, queued like any kernel.
        if found_inf is None:
            torch._foreach_add_(plan.steps, 1.0)
        else:
            torch._foreach_add_(plan.steps, [1.0 - found_inf] * len(plan.steps))
        beta1, beta2 = group["betas"]
        # The bias corrections per tensor in float64, rounded to fp32, as torch's kernel has them.
        t = torch.stack(plan.steps).double()
        step_size = (group["lr"] / (1.0 - torch.pow(beta1, t))).float()
        bias2_sqrt = (1.0 - torch.pow(beta2, t)).float().sqrt()
        n = len(plan.params)
        fixed = plan.fixed
        addresses = torch.tensor(fixed[:n] + grad_addresses + fixed[n:], dtype=torch.int64)
        # Pinned, so the copy is queued behind the backward instead of waiting for it (CPU tensors
        # come here only under Triton's interpreter, tests/unit/train/test_optim.py).
        if device.type == "cuda":
            addresses = addresses.pin_memory().to(device, non_blocking=True)
        aligned = plan.aligned and all(a % 16 == 0 for a in grad_addresses)
        adamw_kernel.launch(plan.n_blocks, plan.block_tensor, plan.first_block, plan.numels, addresses, n,
                            step_size, bias2_sqrt, grad_mul, found_inf, lr=group["lr"],
                            weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            aligned=aligned, block=plan.block, num_warps=NUM_WARPS)
