"""Expert parallelism beside FSDP2 (spec.trainer.parallelism.expert), on real gloo ranks in spawned
processes and a tiny Qwen3-MoE (8 experts, top-2), CPU, through the trainer's own step
(TrainerWorker.train_step): 4 ranks at EP 2 x DP 2 against one process on the same batch, and a
checkpoint saved at EP 2 restored at EP 1, 4 and 2.

Tolerances: both sides compute in fp32 and differ only in summation order (per-rank micro-batches
and FSDP2's reduce-scatter, the all-to-all's regrouped expert rows, against one process's
accumulation), i.e. a few fp32 ulps (~1e-7 relative) per reduction; AdamW's first update moves
each weight by about lr * g / |g|, so the weights and moments agree to rtol 1e-4 / atol 1e-6 (the
loss and grad norm to 1e-5). A gradient off by a factor (e.g. expert gradients divided by the
wrong degree) moves the grad norm by percent and the moments by that factor."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard

from kuberl.common.ports import unclaimed_port
from tests.engine.train.full_state import full_state

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


def _phase(rank: int, world: int, ep: int, port: int, model_path: str, out: str) -> None:
    from kuberl.sync.buckets import plan_buckets
    from kuberl.sync.params import iter_buckets, param_metas
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
    full = full_state(worker)
    # What a weight sync sends the engines (kuberl.sync.params): full tensors gathered bucket by
    # bucket, small buckets so the experts' gathers interleave with the dense ones.
    buckets = plan_buckets(param_metas(worker.model, torch.float32), bucket_bytes=16 << 10)
    synced = {meta.name: t for bucket, tensors in iter_buckets(worker.model, buckets, torch.device("cpu"))
              for meta, t in zip(bucket.metas, tensors)}
    # The Hugging Face export gathers full experts to rank 0.
    worker.export_hf(out.removesuffix(".pt") + "-hf")
    if rank == 0:
        torch.save({"metrics": metrics, "state": full, "layout": layout, "synced": synced,
                    "buckets": len(buckets)}, out)
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


@pytest.mark.timeout(300)
def test_ep2_dp2_matches_one_process(tmp_path):
    from safetensors.torch import load_file
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
    for key in ("loss", "pg_loss", "grad_norm", "tokens"):
        assert ep2["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert ep2["state"].keys() == one["state"].keys()
    for key, value in one["state"].items():
        torch.testing.assert_close(ep2["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    # A weight sync from the EP trainer gathers the same weights the one process sends.
    assert ep2["buckets"] > 1 and ep2["synced"].keys() == one["synced"].keys()
    for name, value in one["synced"].items():
        torch.testing.assert_close(ep2["synced"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    # So does the Hugging Face export: the same tensors, full experts included.
    exported = {name: load_file(next((tmp_path / f"{name}-hf").glob("*.safetensors"))) for name in ("one", "ep2")}
    assert exported["ep2"].keys() == exported["one"].keys()
    experts = [name for name in exported["one"] if ".experts." in name]
    assert experts and sum(exported["ep2"][name].numel() for name in experts) == sum(
        exported["one"][name].numel() for name in experts)
    for name, value in exported["one"].items():
        torch.testing.assert_close(exported["ep2"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def _worker(rank: int, ep: int, port: int, model_path: str):
    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    # The load-balancing loss on: the router is a dense weight and each rank routes its own tokens,
    # so the loss is the same at every EP degree.
    config = TrainerConfig(lr=LR, micro_batch_size=2, router_aux_loss_coef=0.01,
                           model=ModelOptions(gradient_checkpointing=False, expert_parallel=ep))
    return TrainerWorker(model_path, config, rank=rank, world_size=4, master_addr="127.0.0.1",
                         master_port=port, device=torch.device("cpu"))


def _resharding_ranks(rank: int, ports: list[int], model_path: str, root: str) -> None:
    """EP 2 trains a step, saves (DCP), trains another; EP 1, EP 4 and EP 2 each restore the
    checkpoint and train that second step. Rank 0 writes every full state and the metrics."""
    import torch.distributed.checkpoint as dcp

    out: dict = {}
    worker = _worker(rank, 2, ports[0], model_path)
    worker.train_step(_batch())
    state, extra = worker.checkpoint_state()
    dcp.save(state, checkpoint_id=f"{root}/ckpt")
    out["saved"] = full_state(worker)
    out["ep2"] = worker.train_step(_batch()), full_state(worker)
    worker.shutdown()
    for ep, port in zip((1, 4, 2), ports[1:]):
        worker = _worker(rank, ep, port, model_path)
        worker.restore_state(lambda state: dcp.load(state, checkpoint_id=f"{root}/ckpt"), extra)
        out[f"restored_ep{ep}"] = full_state(worker)
        out[f"resumed_ep{ep}"] = worker.train_step(_batch()), full_state(worker)
        worker.shutdown()
    if rank == 0:
        torch.save(out, f"{root}/out.pt")


@pytest.mark.timeout(300)
def test_checkpoint_saved_at_ep2_restores_at_ep1_and_ep4(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path / "model")
    mp.start_processes(_resharding_ranks, args=(_free_ports(4), str(tmp_path / "model"), str(tmp_path)),
                       nprocs=4, start_method="spawn")
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    saved = out["saved"]
    assert any(k.endswith(".exp_avg") for k in saved)
    # DCP reshards exactly: every layout reads back the saved weights and AdamW moments bit for bit.
    for ep in (1, 4, 2):
        restored = out[f"restored_ep{ep}"]
        assert restored.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(restored[key], value), (ep, key)
    # At the saving layout, the resumed step is the uninterrupted one, bit for bit.
    metrics, state = out["ep2"]
    resumed_metrics, resumed = out["resumed_ep2"]
    assert resumed_metrics == metrics
    for key, value in state.items():
        assert torch.equal(resumed[key], value), key
    # At EP 1 and EP 4 the step sums the expert gradients in another order (all-to-all then one
    # matmul, or per-rank matmuls then reduce-scatter): equal within fp32 rounding, as in
    # test_ep2_dp2_matches_one_process; the load-balancing loss is the same at every degree.
    for ep in (1, 4):
        other_metrics, other = out[f"resumed_ep{ep}"]
        for key in ("loss", "aux_loss", "grad_norm", "tokens"):
            assert other_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (ep, key)
        for key, value in state.items():
            torch.testing.assert_close(other[key], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"EP {ep}: {key}: {m}")


def _frozen_router_ranks(rank: int, ports: list[int], model_path: str, root: str) -> None:
    """Two ranks train two steps at EP 1 and EP 2 with the router frozen, and at EP 2 without;
    the frozen EP 2 run's checkpoint is restored at EP 1."""
    import torch.distributed.checkpoint as dcp

    from kuberl.train.model import ModelOptions
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    def start(ep: int, freeze: bool, port: int) -> TrainerWorker:
        # The load-balancing loss on: its gradient reaches the router first of all.
        config = TrainerConfig(lr=LR, micro_batch_size=2, router_aux_loss_coef=0.01,
                               model=ModelOptions(gradient_checkpointing=False, expert_parallel=ep,
                                                  freeze_router=freeze))
        return TrainerWorker(model_path, config, rank=rank, world_size=2, master_addr="127.0.0.1",
                             master_port=port, device=torch.device("cpu"))

    out = {}
    for (ep, freeze), port in zip([(1, True), (2, True), (2, False)], ports):
        worker = start(ep, freeze, port)
        before = full_state(worker)
        for _ in range(2):
            worker.train_step(_batch())
        # Autograd gives no gradient to a parameter without requires_grad; the optimizer was
        # built from the trainable ones.
        optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        routers = {name: (p.requires_grad, id(p) in optimized)
                   for name, p in worker.model.named_parameters() if ".mlp.gate." in name}
        out[(ep, freeze)] = before, full_state(worker), routers
        if (ep, freeze) == (2, True):
            state, extra = worker.checkpoint_state()
            dcp.save(state, checkpoint_id=f"{root}/ckpt")
        worker.shutdown()
    worker = start(1, True, ports[3])
    worker.restore_state(lambda state: dcp.load(state, checkpoint_id=f"{root}/ckpt"), extra)
    out["restored_ep1"] = full_state(worker)
    worker.shutdown()
    if rank == 0:
        torch.save(out, f"{root}/frozen.pt")


@pytest.mark.timeout(300)
def test_frozen_router_stays_bit_identical_at_ep1_and_ep2(tmp_path):
    """spec.trainer.moe.freezeRouter: the routers get no gradient and no optimizer state and stay
    bit for bit what they were, the experts train, at EP 1 (plain FSDP2) and EP 2, and a checkpoint
    saved at EP 2 restores at EP 1; without it, the same steps move the routers (so the check has
    teeth)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path / "model")
    mp.start_processes(_frozen_router_ranks, args=(_free_ports(4), str(tmp_path / "model"), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    out = torch.load(tmp_path / "frozen.pt", weights_only=False)
    router = [k for k in out[(2, True)][0] if k.startswith("model.") and ".mlp.gate." in k]
    assert len(router) == 2  # one per layer
    for ep in (1, 2):
        before, after, routers = out[(ep, True)]
        for key in router:
            assert torch.equal(after[key], before[key]), (ep, key)
        # Not trainable (so no gradient), not in the optimizer, no AdamW moments under its name.
        assert len(routers) == 2 and set(routers.values()) == {(False, False)}, (ep, routers)
        assert not any(".mlp.gate." in k for k in after if k.startswith("optim.")), ep
        # The experts and the dense weights train.
        for part in (".experts.gate_up_proj", ".experts.down_proj", ".self_attn.q_proj.weight"):
            key = next(k for k in before if k.startswith("model.") and k.endswith(part))
            assert not torch.equal(after[key], before[key]), (ep, key)
    # A checkpoint of the frozen EP 2 run (no optimizer state for the routers) restores at EP 1 bit
    # for bit.
    saved, restored = out[(2, True)][1], out["restored_ep1"]
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key
    before, after, routers = out[(2, False)]
    assert set(routers.values()) == {(True, True)}
    for key in router:
        assert not torch.equal(after[key], before[key]), key
