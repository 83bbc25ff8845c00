"""The receiving side of weight sync, inside each vLLM worker process.

vLLM mixes this class into its workers (``worker_extension_cls``); the engine actor reaches the
methods through ``collective_rpc``. Every method streams (name, tensor) pairs into vLLM's in-place
``reload_weights``, which maps Hugging Face names onto vLLM's fused and tensor-parallel-sharded
parameters and redoes the post-load processing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kuberl.sync.buckets import from_wire, plan_buckets, unpack
from kuberl.sync.group import SyncGroup


class WeightReceiver:
    """Methods added to vLLM's worker class; ``self`` is the worker."""

    def _kuberl_device(self) -> torch.device:
        return self.device if isinstance(getattr(self, "device", None), torch.device) else torch.device("cpu")

    def _kuberl_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Load a stream of (HF name, tensor) pairs through vLLM's in-place reload.

        ``reload_weights`` restores each layer's checkpoint-format parameters, feeds them to the
        model's ``load_weights`` and re-runs ``process_weights_after_loading`` once a layer is
        complete: plain ``load_weights`` on a live model fails wherever loading repacked the
        weights (vLLM's CPU kernels do). One call for the whole model, so a layer whose tensors
        arrive in different buckets is processed once, complete.
        """
        counted = _Counted(weights)
        self.model_runner.reload_weights(weights_iterator=iter(counted), is_checkpoint_format=True)
        self._kuberl_refresh_cpu_kernels()
        return counted.nbytes

    def _kuberl_refresh_cpu_kernels(self) -> None:
        """vLLM on CPU runs linear layers through kernels prepacked from the weights. A layer that
        keeps its weight (the LM head tied to the embeddings) loads nothing itself during the
        reload, so its prepacked copy would stay stale: rebuild it from the reloaded weight.
        (Only vLLM's CPU layers have ``cpu_linear``; elsewhere this finds nothing to do.)"""
        for module in self.model_runner.get_model().modules():
            if hasattr(module, "cpu_linear") and module.weight.numel() > 0:
                module.quant_method.process_weights_after_loading(module)

    def kuberl_model_dtype(self) -> str:
        return str(self.model_config.dtype).removeprefix("torch.")

    def kuberl_device_uuid(self) -> str:
        device = self._kuberl_device()
        return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"

    # --- nccl (gloo on CPU): broadcast from trainer rank 0 -------------------------------------
    def kuberl_join_group(self, host: str, port: int, first_rank: int, world_size: int,
                          backend: str) -> int:
        # vLLM's worker rank inside its engine (0 .. tp-1) offsets the engine's first sync rank.
        rank = first_rank + int(getattr(self, "rank", 0))
        self._kuberl_group = SyncGroup(host, port, rank, world_size, backend)
        return rank

    def kuberl_receive(self, metas: list, bucket_bytes: int) -> int:
        group: SyncGroup = self._kuberl_group
        device = self._kuberl_device() if group.backend == "nccl" else torch.device("cpu")
        return self._kuberl_load(_received(group, plan_buckets(from_wire(metas), bucket_bytes), device))

    def kuberl_leave_group(self) -> None:
        group = getattr(self, "_kuberl_group", None)
        if group is not None:
            group.close()
            self._kuberl_group = None

    # --- checkpoint: safetensors files written by the trainer ---------------------------------
    def kuberl_load_files(self, paths: list[str]) -> int:
        return self._kuberl_load(_from_files(paths))

    # --- ipc: CUDA IPC handles of buffers on this worker's own GPU ----------------------------
    def kuberl_load_ipc(self, handles: list[dict[str, bytes]], metas: list, bucket_bytes: int) -> int:
        """``handles[i]`` maps GPU uuid -> handle of bucket i gathered on that GPU."""
        uuid = self.kuberl_device_uuid()
        missing = [i for i, per_gpu in enumerate(handles) if uuid not in per_gpu]
        if missing:
            raise RuntimeError(f"no trainer rank shares GPU {uuid} with this engine worker "
                               f"(trainer GPUs: {sorted(handles[missing[0]])}); ipc needs rollout.colocate")
        buckets = plan_buckets(from_wire(metas), bucket_bytes)
        return self._kuberl_load(_from_ipc(buckets, [h[uuid] for h in handles], self._kuberl_device()))


class _Counted:
    def __init__(self, weights):
        self.weights, self.nbytes = weights, 0

    def __iter__(self):
        for name, tensor in self.weights:
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def _received(group: SyncGroup, buckets, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of each bucket as it arrives; bucket i+1 is already in flight while the loader
    consumes bucket i. A fresh buffer per bucket (cheap with the caching allocator): the loader
    may hold views until a layer's last tensor arrives, so buffers are never reused under it."""
    pending = None
    for bucket in buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        work = group.broadcast_async(buf, root=0)
        if pending is not None:
            yield from _finish(*pending)
        pending = (bucket, buf, work)
    if pending is not None:
        yield from _finish(*pending)


def _finish(bucket, buf: torch.Tensor, work) -> list[tuple[str, torch.Tensor]]:
    work.wait()
    return unpack(bucket, buf)


def _from_files(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _from_ipc(buckets, handles: list[bytes], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from kuberl.sync.ipc import open_handle

    for bucket, handle in zip(buckets, handles):
        yield from unpack(bucket, open_handle(handle, device))
