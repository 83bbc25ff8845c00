"""A one-rank trainer keeps a plain module (no FSDP2, ``ModelOptions.shard_single_rank``), two
ranks shard it: the DCP checkpoint of either restores into the other. Real gloo ranks in spawned
processes, a tiny Qwen3 with tied embeddings, CPU."""

from __future__ import annotations


import torch
import torch.multiprocessing as mp

from kuberl.common.ports import unclaimed_port
from tests.engine.train.full_state import full_state

LR = 1e-2


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48, tie_word_embeddings=True)


def _batch():
    from kuberl.common.samples import Sample, TrainBatch

    g = torch.Generator().manual_seed(0)
    return TrainBatch([Sample(prompt_ids=torch.randint(96, (5,), generator=g).tolist(),
                              response_ids=torch.randint(96, (7,), generator=g).tolist(), advantage=a, group=i)
                       for i, a in enumerate((1.0, -0.5, 0.25, -1.0))])


def _phase(rank: int, world: int, port: int, load_from: str | None, save_to: str, out: str, extra: dict | None):
    """One trainer of ``world`` ranks: train a step (or restore ``load_from``), save to ``save_to``;
    rank 0 writes the full state to ``out``. Returns the rank's checkpoint extra."""
    import torch.distributed.checkpoint as dcp

    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    config = TrainerConfig(lr=LR, micro_batch_size=2, model=ModelOptions(gradient_checkpointing=False))
    worker = TrainerWorker(None, config, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                           device=torch.device("cpu"), random_init_config=_config())
    sharded = hasattr(next(worker.model.parameters()), "full_tensor")
    if load_from is None:
        worker.train_step(_batch())
    else:
        worker.restore_state(lambda state: dcp.load(state, checkpoint_id=load_from), extra)
    state, extra = worker.checkpoint_state()
    dcp.save(state, checkpoint_id=save_to)
    full = full_state(worker)
    if rank == 0:
        torch.save({"sharded": sharded, "state": full}, out)
    worker.shutdown()
    return extra


def _ranks(rank: int, ports: list[int], root: str, barrier):
    """Two processes: rank 0 alone as a one-rank trainer, both as two ranks, rank 0 alone again."""
    if rank == 0:
        torch.save(_phase(0, 1, ports[0], None, f"{root}/one", f"{root}/one.pt", None), f"{root}/extra.pt")
    barrier.wait()
    # Every rank resumes the one rank's scheduler, counters and RNG (a group refuses a
    # checkpoint of another world size for those: here only the DCP state is in question).
    extra = torch.load(f"{root}/extra.pt", weights_only=False)
    extra = _phase(rank, 2, ports[1], f"{root}/one", f"{root}/two", f"{root}/two.pt", extra)
    if rank == 0:
        _phase(0, 1, ports[2], f"{root}/two", f"{root}/back", f"{root}/back.pt", extra)


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(unclaimed_port())
    return sorted(ports)


def test_one_rank_checkpoint_restores_into_two_sharded_ranks_and_back(tmp_path):
    barrier = mp.get_context("spawn").Barrier(2)
    mp.start_processes(_ranks, args=(_free_ports(3), str(tmp_path), barrier), nprocs=2, start_method="spawn")
    one, two, back = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("one", "two", "back"))
    assert (one["sharded"], two["sharded"], back["sharded"]) == (False, True, False)
    # Trained state: AdamW holds moments for the parameters.
    assert any(k.endswith(".exp_avg") for k in one["state"])
    for restored in (two["state"], back["state"]):
        assert restored.keys() == one["state"].keys()
        for key, value in one["state"].items():
            assert torch.equal(restored[key], value), key
