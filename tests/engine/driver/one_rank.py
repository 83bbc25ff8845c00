"""One real trainer rank without Ray or a model download: a gloo world (of one, unless told
otherwise), a small stack of FSDP2-sharded Linear layers and AdamW after one step, held by the real
``TrainerWorker`` methods that checkpoints use (``checkpoint_state``, ``restore_state``). Shared by
the checkpoint tests and the subprocesses they start and kill."""

from __future__ import annotations


import torch
import torch.distributed as dist

from kuberl.common.ports import unclaimed_port
from kuberl.train.worker import TrainerConfig, TrainerWorker


class OneRank(TrainerWorker):
    def __init__(self, layers: int = 2, dim: int = 64, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 port: int | None = None, device: str = "cpu"):  # noqa: D107 - no super(): no model to load
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if device != "cpu":
            torch.cuda.set_device(device)  # before the process group: NCCL binds to it
        if not dist.is_initialized():
            if port is None:
                port = unclaimed_port()
            dist.init_process_group("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl",
                                    init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.config = TrainerConfig()  # the defaults: the whole model trains (no LoRA)
        torch.manual_seed(seed)
        mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to(self.device)
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.optimizer_steps = self.skipped_steps = 0
        self.before_update = lambda: 0.0
        self.step()

    def step(self, data_seed: int | None = None) -> float:
        """One optimizer step, guarded as ``TrainerWorker.train_step`` guards it; the loss, averaged
        over ranks. ``data_seed``: this step's batch from its own generator, else the global RNG."""
        dim = self.model[0].in_features
        gen = None if data_seed is None else torch.Generator().manual_seed(data_seed)
        loss = self.model(torch.randn(4, dim, generator=gen).to(self.device)).square().mean()
        loss.backward()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        self.before_update()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return float(reduced) / self.world_size

    def values(self) -> list[float]:
        out = []
        for p in self.model.parameters():
            out.append(float(p.detach().to_local().sum(dtype=torch.float64)))
            for key in ("exp_avg", "exp_avg_sq"):
                out.append(float(self.optimizer.state[p][key].to_local().sum(dtype=torch.float64)))
        return out
