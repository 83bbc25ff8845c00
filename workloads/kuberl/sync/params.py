"""The trainer's parameters as the engines need them: full (unsharded) tensors under HF names;
with trainer.lora the adapters' alone, under the names of peft's saved format (kuberl.sync.adapter)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from kuberl.sync.adapter import saved_adapter
from kuberl.sync.buckets import Bucket, ParamMeta, dtype_name

# Wrappers (activation checkpointing, torch.compile, FSDP1) insert these into parameter names;
# the engines know the plain Hugging Face names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def sync_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends, under the name the engines know it by: every parameter; or, when the
    model trains LoRA adapters, only theirs (the engines hold the frozen base already)."""
    named = [(hf_name(name), p) for name, p in model.named_parameters()]
    if getattr(model, "peft_config", None) is None:
        return iter(named)
    return iter(saved_adapter(model, dict(named)).items())


def param_metas(model: torch.nn.Module, wire_dtype: torch.dtype) -> list[ParamMeta]:
    """Global shapes (a DTensor's ``shape`` is the unsharded one); no collective."""
    return [ParamMeta(name, tuple(p.shape), dtype_name(wire_dtype)) for name, p in sync_params(model)]


def full_bucket(model: torch.nn.Module, bucket: Bucket, device: torch.device) -> list[torch.Tensor]:
    """The bucket's parameters, unsharded and cast to the wire dtype, on ``device``.

    Gathering a DTensor is a collective: every trainer rank must call this for every bucket,
    in the same order, even the ranks that send nothing.
    """
    wanted = {meta.name: meta for meta in bucket.metas}
    found: dict[str, torch.Tensor] = {}
    for name, param in sync_params(model):
        if name not in wanted:
            continue
        if isinstance(param, DTensor):
            if param.device.type != param.device_mesh.device_type:
                # An offloaded shard (trainer.cpuOffload) lives on the host: gather it on the mesh's
                # device, over NCCL, instead of over gloo through host memory.
                param = param.to(param.device_mesh.device_type)
            tensor = param.full_tensor()
        else:
            tensor = param
        found[name] = tensor.detach().to(device=device, dtype=wanted[name].torch_dtype)
    missing = [meta.name for meta in bucket.metas if meta.name not in found]
    if missing:
        raise KeyError(f"trainer model has no parameters named {missing}")
    # Bucket order, looked up by name: a tensor can only ever be sent under its own name.
    return [found[meta.name] for meta in bucket.metas]


def iter_buckets(model: torch.nn.Module, buckets: list[Bucket],
                 device: torch.device) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
    for bucket in buckets:
        yield bucket, full_bucket(model, bucket, device)
