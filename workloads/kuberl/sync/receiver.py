"""The receiving side of weight sync, inside each vLLM worker process.

vLLM mixes this class into its workers (``worker_extension_cls``); the engine actor reaches the
methods through ``collective_rpc``. Every method loads through the model's own ``load_weights``,
which maps Hugging Face names onto vLLM's fused and tensor-parallel-sharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kuberl.sync.buckets import ParamMeta, plan_buckets, unpack
from kuberl.sync.group import SyncGroup


class WeightReceiver:
    """Methods added to vLLM's worker class; ``self`` is the worker."""

    def _kuberl_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _kuberl_device(self) -> torch.device:
        return self.device if isinstance(getattr(self, "device", None), torch.device) else torch.device("cpu")

    def _kuberl_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        weights = list(weights)
        self._kuberl_model().load_weights(weights=weights)
        return sum(t.numel() * t.element_size() for _, t in weights)

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

    def kuberl_receive(self, metas: list[ParamMeta], bucket_bytes: int) -> int:
        """Receive bucket i while loading bucket i-1 (two alternating buffers)."""
        group: SyncGroup = self._kuberl_group
        device = self._kuberl_device() if group.backend == "nccl" else torch.device("cpu")
        buckets = plan_buckets(metas, bucket_bytes)
        if not buckets:
            return 0
        slots = [torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=device)
                 for _ in range(min(2, len(buckets)))]
        received = 0
        previous = None  # (bucket, buffer, work) received but not yet loaded
        for i, bucket in enumerate(buckets):
            buf = slots[i % len(slots)][:bucket.nbytes]
            # NCCL orders this receive after the earlier load from the same buffer (same stream
            # dependency it takes on the current stream); gloo loads synchronously before it.
            work = group.broadcast_async(buf, root=0)
            if previous is not None:
                received += self._kuberl_finish(*previous)
            previous = (bucket, buf, work)
        return received + self._kuberl_finish(*previous)

    def _kuberl_finish(self, bucket, buf: torch.Tensor, work) -> int:
        work.wait()
        return self._kuberl_load(unpack(bucket, buf))

    def kuberl_leave_group(self) -> None:
        group = getattr(self, "_kuberl_group", None)
        if group is not None:
            group.close()
            self._kuberl_group = None

    # --- checkpoint: safetensors files written by the trainer ---------------------------------
    def kuberl_load_files(self, paths: list[str]) -> int:
        from safetensors import safe_open

        loaded = 0
        for path in paths:
            with safe_open(path, framework="pt", device="cpu") as f:
                loaded += self._kuberl_load((name, f.get_tensor(name)) for name in f.keys())
        return loaded

    # --- ipc: CUDA IPC handles of buffers on this worker's own GPU ----------------------------
    def kuberl_load_ipc(self, handles: dict[str, tuple], metas: list[ParamMeta],
                        bucket_bytes: int, bucket_index: int) -> int:
        from kuberl.sync.ipc import open_handle

        uuid = self.kuberl_device_uuid()
        if uuid not in handles:
            raise RuntimeError(f"no trainer rank shares GPU {uuid} with this engine worker "
                               f"(trainer GPUs: {sorted(handles)}); ipc needs rollout.colocate")
        bucket = plan_buckets(metas, bucket_bytes)[bucket_index]
        buf = open_handle(handles[uuid], self._kuberl_device())
        return self._kuberl_load(unpack(bucket, buf))
