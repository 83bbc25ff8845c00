"""Expert parallelism beside FSDP2 (spec.trainer.parallelism.expert), on real gloo ranks in spawned
processes and a tiny Qwen3-MoE (8 experts, top-2), CPU, through the trainer's own step
(TrainerWorker.train_step): 4 ranks at EP 2 x DP 2 against one process on the same batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard

from kuberl.common.ports import unclaimed_port

LR = 1e-3
SAMPLES = 8


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                          num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, tie_word_embeddings=False)


def _batch():
    from kuberl.common.samples import Sample, TrainBatch

    g = torch.Generator().manual_seed(0)
    return TrainBatch([Sample(prompt_ids=torch.randint(96, (5,), generator=g).tolist(),
                              response_ids=torch.randint(96, (7,), generator=g).tolist(),
                              advantage=float(torch.randn((), generator=g)), group=i)
                       for i in range(SAMPLES)])


def _full_state(worker) -> dict[str, torch.Tensor]:
    """Model and AdamW state as full tensors by name (a DTensor is gathered: collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        flat.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in flat.items()}


def _phase(rank: int, world: int, ep: int, port: int, model_path: str, out: str) -> None:
    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    config = TrainerConfig(lr=LR, micro_batch_size=2,
                           model=ModelOptions(gradient_checkpointing=False, expert_parallel=ep))
    worker = TrainerWorker(model_path, config, rank=rank, world_size=world, master_addr="127.0.0.1",
                           master_port=port, device=torch.device("cpu"))
    experts = worker.model.model.layers[0].mlp.experts.gate_up_proj
    layout = ((experts.device_mesh.mesh_dim_names, experts.placements, experts.to_local().shape[0])
              if hasattr(experts, "to_local") else None)
    metrics = worker.train_step(_batch())
    full = _full_state(worker)
    if rank == 0:
        torch.save({"metrics": metrics, "state": full, "layout": layout}, out)
    worker.shutdown()


def _ranks(rank: int, ports: list[int], model_path: str, root: str, barrier) -> None:
    if rank == 0:
        _phase(0, 1, 1, ports[0], model_path, f"{root}/one.pt")
    barrier.wait()
    _phase(rank, 4, 2, ports[1], model_path, f"{root}/ep2.pt")


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(unclaimed_port())
    return sorted(ports)


@pytest.mark.timeout(120)
def test_ep2_dp2_matches_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path / "model")
    barrier = mp.get_context("spawn").Barrier(4)
    mp.start_processes(_ranks, args=(_free_ports(2), str(tmp_path / "model"), str(tmp_path), barrier),
                       nprocs=4, start_method="spawn")
    one, ep2 = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("one", "ep2"))
    # Each rank's EP group member holds 4 of the 8 experts (Shard(0) over ep), FSDP2-sharded over
    # dp_shard: 2 each at rest.
    names, placements, local = ep2["layout"]
    assert (names, placements[1], local) == (("dp_shard", "ep"), Shard(0), 2)
    print(one["metrics"], ep2["metrics"])
    for key in ("loss", "pg_loss", "grad_norm", "tokens"):
        assert ep2["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert ep2["state"].keys() == one["state"].keys()
    for key, value in one["state"].items():
        torch.testing.assert_close(ep2["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)
