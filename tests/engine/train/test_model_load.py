"""Meta-device build + rank-0 load + bucketed broadcast gives every rank the checkpoint's model:
two gloo ranks (torch.multiprocessing), buckets far smaller than the model so that many are sent,
tied embeddings and the rotary buffers (non-persistent, left empty by the meta build) included."""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from kuberl.common.ports import unclaimed_port
from kuberl.driver.tiny import make_model


def _rank(rank: int, world: int, port: int, model_path: str, moe: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from kuberl.train.model import ModelOptions, load_sharded_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    options = ModelOptions(gradient_checkpointing=False, broadcast_bucket_bytes=64 << 10)
    model = load_sharded_model(model_path, init_device_mesh("cpu", (world,)), torch.device("cpu"), options)
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # Tied: the LM head and the embeddings are still one parameter after sharding and loading.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dist.destroy_process_group()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bucketed_broadcast_load_matches_from_pretrained(tmp_path, moe):
    model_path = str(make_model(tmp_path / "model", moe=moe, seed=7))
    port = unclaimed_port()
    mp.start_processes(_rank, args=(2, port, model_path, moe), nprocs=2, join=True, start_method="spawn")
