"""A LoRA adapter on disk, in peft's format: what the trainer exports and what the engines load.

``adapter_config.json`` (peft's ``LoraConfig``, saved by peft) and ``adapter_model.safetensors``
with peft's saved keys, ``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``.
peft, transformers and vLLM all load it; vLLM reads it from a directory
(``LoRARequest(lora_path=...)``), so every sync method with ``trainer.lora`` ends in such a
directory next to the engine (kuberl.rollout.engine). Both ends of the weight sync use it: the
trainer writes it, the engine workers (nccl) write what they received.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where a LoRA job's Hugging Face export keeps its adapter, beside the merged model if any.
ADAPTER_EXPORT_DIR = "adapter"
# PeftModel.save_pretrained names the tensors after the wrapped model (PeftModel.base_model.model);
# the trainer injects the adapters into the plain model (peft.inject_adapter_in_model), whose names
# lack it.
ADAPTER_PREFIX = "base_model.model."


def is_adapter_name(name: str) -> bool:
    """An adapter's parameter, under the trainer's name (``...q_proj.lora_A.default.weight``) or
    the saved one (``...q_proj.lora_A.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_config(*, rank: int, alpha: int, dropout: float, target_modules: list[str]):
    """peft's LoraConfig for the adapters kuberl trains: plain LoRA (no bias, no DoRA, no rsLoRA,
    no modules_to_save), which is all vLLM's loader accepts."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(target_modules),
                      bias="none", task_type="CAUSAL_LM")


def spec_adapter_options(spec) -> dict | None:
    """``spec.trainer.lora`` as ``lora_config``'s keyword arguments, or None without LoRA (the sync
    sends full weights). A dict, not the LoraConfig: vLLM's collective_rpc serialises a dataclass
    argument into a plain dict on its way to the workers."""
    lora = spec.trainer.lora
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules)}


def saved_adapter(model: torch.nn.Module, state: dict) -> dict:
    """The adapter's entries of ``state`` (the trainer model's names: its parameters, or a state
    dict of it) under peft's saved names, as PeftModel.save_pretrained writes them."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: embeddings are never targeted (LORA_TARGET_MODULES), and "auto"
    # would look the base model up on the Hub.
    return {ADAPTER_PREFIX + name: value for name, value in
            get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False).items()}


def save_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], config) -> int:
    """Write ``tensors`` (saved names) and ``config`` (a LoraConfig) into ``directory`` as
    PeftModel.save_pretrained does; the weights file is renamed into place complete, the config
    written last (a reader that finds the config finds the weights). Returns the weights' bytes."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / ADAPTER_WEIGHTS
    partial = weights.with_suffix(".partial")
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(partial),
              metadata={"format": "pt"})
    os.replace(partial, weights)
    config.save_pretrained(str(out))
    return weights.stat().st_size
