"""The sync transport without vLLM: bucket plans, packing, and the real sender/receiver code over a
real gloo group (two ranks in threads of this process)."""

from __future__ import annotations

import threading

import pytest
import torch

from kuberl.sync import nccl
from kuberl.sync.buckets import ParamMeta, pack, plan_buckets, unpack
from kuberl.sync.group import SyncGroup, open_store
from kuberl.sync.params import hf_name, param_metas
from kuberl.sync.receiver import WeightReceiver


class NamedParams(torch.nn.Module):
    """Parameters with Hugging Face-style dotted names and a ``load_weights`` like vLLM's."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype=torch.float32, seed: int | None = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.inner = torch.nn.ParameterDict()
        self.names = list(shapes)
        for i, (name, shape) in enumerate(shapes.items()):
            data = torch.randn(shape, generator=gen, dtype=torch.float32) if gen else torch.zeros(shape)
            self.inner[f"p{i}"] = torch.nn.Parameter(data.to(dtype), requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        for i, name in enumerate(self.names):
            yield name, self.inner[f"p{i}"]

    def load_weights(self, weights):
        index = {name: i for i, name in enumerate(self.names)}
        for name, tensor in weights:
            self.inner[f"p{index[name]}"].data.copy_(tensor)


SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
          "model.layers.0.self_attn.q_proj.bias": (16,), "model.layers.0.mlp.down_proj.weight": (16, 40),
          "model.norm.weight": (16,), "lm_head.weight": (64, 16)}


def test_plan_respects_the_bound_and_keeps_order():
    metas = [ParamMeta(n, s, "float32") for n, s in SHAPES.items()]
    buckets = plan_buckets(metas, 4096)
    assert [m.name for b in buckets for m in b.metas] == list(SHAPES)
    assert all(b.nbytes <= 4096 for b in buckets if len(b.metas) > 1)
    assert all(off % 16 == 0 for b in buckets for off in b.offsets)
    with pytest.raises(ValueError, match="bucketSizeMB"):
        plan_buckets(metas, 0)


def test_pack_unpack_round_trip_mixed_dtypes():
    metas = [ParamMeta("a", (3,), "float32"), ParamMeta("b", (2, 3), "bfloat16"), ParamMeta("c", (5,), "float16")]
    (bucket,) = plan_buckets(metas, 1 << 20)
    tensors = [torch.randn(m.shape).to(m.torch_dtype) for m in metas]
    buf = pack(bucket, tensors, torch.empty(bucket.nbytes, dtype=torch.uint8))
    for (name, got), meta, want in zip(unpack(bucket, buf), metas, tensors):
        assert name == meta.name and torch.equal(got, want)
    with pytest.raises(ValueError, match="b: expected"):
        pack(bucket, [tensors[0], tensors[0], tensors[2]], buf)


def test_wire_format_survives_vllms_rpc_serializer():
    from kuberl.sync.buckets import from_wire, to_wire

    metas = [ParamMeta("a", (3, 2), "bfloat16")]
    assert from_wire(to_wire(metas)) == metas
    assert from_wire([{"name": "a", "shape": [3, 2], "dtype": "bfloat16"}]) == metas  # msgspec's dataclass form


def test_wrapper_segments_are_stripped_from_names():
    assert hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"


class Worker:
    def __init__(self, model):
        self.model, self.rank, self.world_size, self.device = model, 0, 1, "cpu"


class Runner:
    """Stand-in for vLLM's model runner: ``reload_weights`` consumes the stream into the model."""

    def __init__(self, model):
        self.model = model

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        self.model.load_weights(weights_iterator)

    def get_model(self):
        return self.model


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
def test_broadcast_from_trainer_rank0_loads_every_tensor_under_its_own_name(bucket_bytes):
    sender_model = NamedParams(SHAPES, seed=1)
    receivers = [NamedParams(SHAPES, seed=None) for _ in range(2)]
    metas = param_metas(sender_model, torch.float32)
    store = open_store("127.0.0.1")
    key = f"test-{bucket_bytes}"
    results: dict[int, int] = {}

    def receive(rank: int, model) -> None:
        ext = WeightReceiver()
        ext.model_runner, ext.rank = Runner(model), 0
        ext.kuberl_join_group("127.0.0.1", store.port, rank, 3, "gloo")
        results[rank] = ext.kuberl_receive(metas, bucket_bytes)
        ext.kuberl_leave_group()

    threads = [threading.Thread(target=receive, args=(r + 1, m)) for r, m in enumerate(receivers)]
    for t in threads:
        t.start()
    nccl._STORES[key] = store
    nccl.join_sync_group(Worker(sender_model), key, "127.0.0.1", store.port, 3, "gloo")
    sent = nccl.broadcast_weights(Worker(sender_model), key, metas, bucket_bytes)
    for t in threads:
        t.join(timeout=60)
    nccl.leave_sync_group(Worker(sender_model), key)
    total = sum(m.nbytes for m in metas)
    assert sent == total and results == {1: total, 2: total}
    for model in receivers:
        for (name, want), (_, got) in zip(sender_model.named_parameters(), model.named_parameters()):
            assert torch.equal(want, got), name


def test_casts_to_the_engine_dtype():
    model = NamedParams(SHAPES, seed=3)
    metas = param_metas(model, torch.bfloat16)
    assert {m.dtype for m in metas} == {"bfloat16"}
    (bucket,) = plan_buckets(metas, 1 << 20)
    from kuberl.sync.params import full_bucket

    tensors = full_bucket(model, bucket, torch.device("cpu"))
    assert all(t.dtype == torch.bfloat16 for t in tensors)


def test_sync_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gloo or nccl"):
        SyncGroup("127.0.0.1", 1, 0, 2, "mpi")
    with pytest.raises(ValueError, match="rank 2 outside"):
        SyncGroup("127.0.0.1", 1, 2, 2, "gloo")


def test_make_weight_sync_rejects_unknown_method():
    from types import SimpleNamespace

    from kuberl.sync import make_weight_sync

    spec = SimpleNamespace(weight_sync=SimpleNamespace(method="carrier-pigeon", bucket_size_mb=1))
    with pytest.raises(ValueError, match="weightSync.method"):
        make_weight_sync(spec, None, None)


def test_transports_share_one_setup_and_refuse_sync_before_it():
    """The snapshot and ipc transports add nothing to the shared setup (engine dtype, parameter
    metadata); nccl extends it. Before it ran, every transport's sync names the missing call."""
    from kuberl.api import RLTrainingJobSpec
    from kuberl.sync import METHODS, IpcWeightSync, SnapshotWeightSync, WeightSync

    spec = RLTrainingJobSpec.model_validate({
        "image": "kuberl/worker:test", "model": {"uri": "/models/m"}, "data": {"uri": "/data/p.jsonl"},
        "trainer": {"gpusPerReplica": 0}, "rollout": {"gpusPerReplica": 0}})
    assert SnapshotWeightSync.setup is WeightSync.setup and IpcWeightSync.setup is WeightSync.setup
    assert METHODS["checkpoint"] is SnapshotWeightSync  # the API's value, kept for users' manifests
    for transport in METHODS.values():
        with pytest.raises(RuntimeError, match=rf"{transport.__name__}\.setup\(\) must run before sync"):
            transport(spec, trainer_group=None, engine_pool=None).sync(1)


def test_a_colocated_lora_sync_goes_through_gloo():
    """NCCL refuses trainer rank 0 and the engine on its GPU in one communicator; adapters are small."""
    from kuberl.api import RLTrainingJobSpec
    from kuberl.sync.nccl import sync_backend

    def spec(**trainer):
        return RLTrainingJobSpec.model_validate({
            "image": "kuberl/worker:test", "model": {"uri": "/models/m"}, "data": {"uri": "/data/p.jsonl"},
            "trainer": {"gpusPerReplica": 1, **trainer}, "rollout": {"colocate": True}})

    assert sync_backend(spec(lora={})) == "gloo"
    assert sync_backend(spec()) == "nccl"
    separate = spec(lora={})
    separate.rollout.colocate = False
    assert sync_backend(separate) == "nccl"
    separate.trainer.gpus_per_replica = 0
    assert sync_backend(separate) == "gloo"


def test_lora_syncs_send_the_adapters_alone_as_a_peft_directory(tmp_path):
    """trainer.lora: the sender's metadata lists the adapters alone, under peft's names; nccl's
    receivers write what they received as a peft directory (the engine's first worker only), and
    the checkpoint method's trainer writes the same (kuberl.sync.adapter)."""
    import json

    from safetensors.torch import load_file

    from kuberl.sync.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from kuberl.sync.snapshot import write_adapter
    from kuberl.train.lora import LoraOptions, apply_lora

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(16, 16),
                                                            "v_proj": torch.nn.Linear(16, 8)}) for _ in range(2))
    options = LoraOptions(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    apply_lora(model, options, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    metas = param_metas(model, torch.float32)
    # peft's saved names: its adapter name ("default") dropped, PeftModel's prefix added.
    want = {"base_model.model." + n.replace(".default.", "."): p.detach()
            for n, p in model.named_parameters() if p.requires_grad}
    assert {m.name for m in metas} == set(want) and len(want) == 8
    config = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}

    store, key = open_store("127.0.0.1"), "test-lora"
    results: dict[int, int] = {}

    def receive(rank: int, tp_rank: int) -> None:
        ext = WeightReceiver()
        ext.rank = tp_rank
        ext.kuberl_join_group("127.0.0.1", store.port, rank - tp_rank, 3, "gloo")
        results[rank] = ext.kuberl_receive_adapter(metas, 256, config, str(tmp_path / f"engine-{rank}"))
        ext.kuberl_leave_group()

    threads = [threading.Thread(target=receive, args=(r, r - 1)) for r in (1, 2)]  # one engine, tp 2
    for t in threads:
        t.start()
    nccl._STORES[key] = store
    nccl.join_sync_group(Worker(model), key, "127.0.0.1", store.port, 3, "gloo")
    sent = nccl.broadcast_weights(Worker(model), key, metas, 256)
    for t in threads:
        t.join(timeout=60)
    nccl.leave_sync_group(Worker(model), key)
    total = sum(m.nbytes for m in metas)
    assert sent == total and results == {1: total, 2: total}
    assert not (tmp_path / "engine-2").exists()  # the second worker of the engine writes nothing

    write_adapter(Worker(model), str(tmp_path / "snapshot"), metas, 256, config)
    for directory in (tmp_path / "engine-1", tmp_path / "snapshot"):
        saved = load_file(directory / ADAPTER_WEIGHTS)
        assert saved.keys() == want.keys() and all(torch.equal(saved[k], v) for k, v in want.items())
        saved_config = json.loads((directory / ADAPTER_CONFIG).read_text())
        assert (saved_config["peft_type"], saved_config["r"], saved_config["lora_alpha"]) == ("LORA", 4, 8)
        assert sorted(saved_config["target_modules"]) == ["q_proj", "v_proj"]
