"""The receiving side of weight sync, inside each vLLM worker process.

vLLM mixes this class into its workers (``worker_extension_cls``); the engine actor reaches the
methods through ``collective_rpc``. Every method streams (name, tensor) pairs into vLLM's in-place
``reload_weights``, which maps Hugging Face names onto vLLM's fused and tensor-parallel-sharded
parameters and redoes the post-load processing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kuberl.sync.ipc import IpcReceiver
from kuberl.sync.nccl import NcclReceiver
from kuberl.sync.snapshot import SnapshotReceiver


class WeightReceiver(NcclReceiver, SnapshotReceiver, IpcReceiver):
    """Methods added to vLLM's worker class; ``self`` is the worker. Each transport's receiving
    methods come from its own module; what they share is here."""

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
        if counted.error is not None:
            # The stream broke (a sync aborted): it ended early instead of raising inside vLLM's
            # reload, which then finished with what came (part new, part old weights, but a
            # model that reloads again; an exception midway left one that could not). Now raise.
            raise counted.error
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


class _Counted:
    """The weights stream, counted; an error in it ends the stream and is kept in ``error``."""

    def __init__(self, weights):
        self.weights, self.nbytes, self.error = weights, 0, None

    def __iter__(self):
        try:
            for name, tensor in self.weights:
                self.nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
        except Exception as err:  # noqa: BLE001 - raised by _kuberl_load once vLLM's reload is done
            self.error = err
