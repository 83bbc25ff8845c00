"""Reproduces the stock MoE failure under FSDP2 + non-reentrant activation checkpointing.

Two gloo ranks train a tiny Qwen3-MoE for one step. Rank 1's first router is wrapped so that the
recompute in backward routes tokens to other experts than the forward did: on GPUs this happens
when bf16 kernels are not bit-deterministic and two router logits are nearly tied. The stock
expert loop then saves a different number of tensors in the recompute: ``CheckpointError`` on
rank 1 while rank 0 waits in the next FSDP2 collective. The every-expert path saves the same
tensors whatever the routing, so both ranks finish.

    python -m tests.engine.train.moe_recompute_repro --experts stock|grouped MODEL_DIR
Exit status 0 when both ranks finished the step.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.multiprocessing as mp
from torch import nn

from kuberl.common.ports import unclaimed_port


class RoutingDriftRouter(nn.Module):
    """Test double for a non-deterministic router: the first call (forward) routes as the wrapped
    router does; later calls (the checkpoint recompute) spread tokens over all experts."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.calls = 0

    def forward(self, hidden_states):
        logits, scores, indices = self.router(hidden_states)
        self.calls += 1
        if self.calls > 1:
            num_experts = self.router.num_experts
            token = torch.arange(indices.shape[0], device=indices.device)[:, None]
            indices = (token + torch.arange(indices.shape[1], device=indices.device)) % num_experts
        return logits, scores, indices


def _rank(rank: int, world: int, port: int, model_path: str, experts: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kuberl.train.model import ModelOptions, load_sharded_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = load_sharded_model(model_path, mesh, torch.device("cpu"),
                               ModelOptions(gradient_checkpointing=True, moe_experts=experts))
    model.train()
    mlp = model.model.layers[0].mlp
    if rank == 1:
        mlp.gate = RoutingDriftRouter(mlp.gate)
        ids = torch.full((2, 12), 5)  # one token repeated: the forward hits only top_k experts
    else:
        ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    dist.barrier()
    print(f"rank {rank}: step done", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", choices=("stock", "grouped", "loop"), required=True)
    parser.add_argument("model")
    args = parser.parse_args(argv)
    port = unclaimed_port()
    mp.start_processes(_rank, args=(2, port, args.model, args.experts), nprocs=2, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
