"""The receiving side of weight sync, inside each vLLM worker process.

vLLM mixes this class into its workers (``worker_extension_cls``); the engine actor reaches the
methods through ``collective_rpc``. Every method streams (name, tensor) pairs into vLLM's in-place
``reload_weights``, which maps Hugging Face names onto vLLM's fused and tensor-parallel-sharded
parameters and redoes the post-load processing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kuberl.sync.ipc import IpcReceiver
from kuberl.sync.nccl import NcclReceiver
from kuberl.sync.snapshot import SnapshotReceiver

# Where vLLM 0.32 defines its CPU MoE experts (``CPUUnquantizedExperts``).
CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


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
        with _cpu_experts_prepacked_again(self.model_runner.get_model(), self._kuberl_device()):
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


@contextmanager
def _cpu_experts_prepacked_again(model: torch.nn.Module, device: torch.device):
    """Let a reload prepack vLLM's CPU MoE experts, as the first load did.

    vLLM 0.32's unquantized MoE method (``UnquantizedFusedMoEMethod._setup_kernel``) treats a
    layer whose kernel exists as a weight update: it copies the new weights in the checkpoint's
    layout into the existing parameters and skips the experts' own
    ``process_weights_after_loading``, which is where the CPU backend prepacks them
    (``CPUUnquantizedExperts``: ``cpu_prepack_moe_weight``). The CPU kernel then reads unpacked
    weights as packed ones: on the tiny MoE, a mean log-prob gap of 0.19 per token after one
    sync. Dropping the kernel for the reload sends each reloaded layer down the first load's path
    (kernel built, weights prepacked; the reload copies the result into the live parameters); a
    layer the reload did not fill keeps its kernel, restored here. On GPU (no prepack) nothing
    changes. tests/engine/rollout/test_sync_expert_parallel.py fails without it."""
    kernels = {}
    # A model holding vLLM's CPU experts has imported their module; any other model (a test's
    # plain torch module) must not pay vLLM's 7-second import to learn that it holds none.
    cpu_moe = sys.modules.get(CPU_MOE_MODULE) if device.type == "cpu" else None
    if cpu_moe is not None:
        CPUUnquantizedExperts = cpu_moe.CPUUnquantizedExperts
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                kernels[module] = method.moe_kernel
                method.moe_kernel = None
    try:
        yield
    finally:
        for module, kernel in kernels.items():
            if module.quant_method.moe_kernel is None:
                module.quant_method.moe_kernel = kernel


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
