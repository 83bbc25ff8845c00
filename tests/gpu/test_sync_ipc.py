"""The ipc weight-sync plumbing on a real GPU, without vLLM (not installed on the GPU machine):
trainer-side ``share_bucket`` in this process, the vLLM worker's ``WeightReceiver.kuberl_load_ipc``
in a separate spawned process with a stand-in model, handles matched by GPU uuid."""

from __future__ import annotations

import pytest
import torch

from tests.unit.sync.test_transport import SHAPES, NamedParams, Runner


def _receive(handles, metas, bucket_bytes, results):
    from kuberl.sync.receiver import WeightReceiver

    model = NamedParams(SHAPES, seed=None).cuda()
    ext = WeightReceiver()
    ext.model_runner, ext.device = Runner(model), torch.device("cuda", 0)
    loaded = ext.kuberl_load_ipc(handles, metas, bucket_bytes)
    # numpy, not tensors: torch would share CPU tensors by file descriptor, which dies with this process.
    results.put((loaded, {name: p.float().cpu().numpy() for name, p in model.named_parameters()}))


def test_ipc_handles_load_the_trainers_weights_in_another_process():
    import torch.multiprocessing as mp

    from kuberl.sync import ipc
    from kuberl.sync.buckets import plan_buckets
    from kuberl.sync.params import param_metas

    class Worker:
        def __init__(self, model):
            self.model, self.rank, self.world_size, self.device = model, 0, 1, "cuda:0"

    model = NamedParams(SHAPES, seed=7).cuda()
    metas = param_metas(model, torch.bfloat16)
    bucket_bytes = 2048
    buckets = plan_buckets(metas, bucket_bytes)
    assert len(buckets) > 1
    handles, kept = [], []
    for i, bucket in enumerate(buckets):
        uuid, handle = ipc.share_bucket(Worker(model), f"k{i}", bucket)
        handles.append({uuid: handle})
        kept.append(ipc._SHARED[f"k{i}"])  # the engine holds handles to these
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(handles, metas, bucket_bytes, results))
    proc.start()
    loaded, got = results.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert loaded == sum(m.nbytes for m in metas)
    for name, want in model.named_parameters():
        assert torch.equal(want.to(torch.bfloat16).cpu().float(), torch.from_numpy(got[name])), name
    ipc.release_shared(None, "k")


def test_ipc_refuses_cpu_tensors():
    from kuberl.sync.ipc import share

    with pytest.raises(ValueError, match="ipc shares CUDA memory"):
        share(torch.zeros(4))
