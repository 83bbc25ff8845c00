"""A LoRA adapter on disk, in peft's format: what the trainer exports and what the engines load.

``adapter_config.json`` (peft's LoraConfig fields) and ``adapter_model.safetensors`` with the keys
``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``. peft, transformers and vLLM
all load it; vLLM reads it from a directory (``LoRARequest(lora_path=...)``), so every sync method
with ``trainer.lora`` ends in such a directory next to the engine (kuberl.rollout.engine).
Both ends of the weight sync use it: the trainer writes it, the engine workers (nccl) write what
they received.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where a LoRA job's Hugging Face export keeps its adapter, beside the merged model if any.
ADAPTER_EXPORT_DIR = "adapter"
# peft names a saved adapter's tensors after the wrapped model (PeftModel.base_model.model).
ADAPTER_PREFIX = "base_model.model."
# The adapter's own parameters, by the last segments of their names.
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_key(name: str) -> str:
    """The saved name of the adapter parameter ``name`` (a Hugging Face module path)."""
    return ADAPTER_PREFIX + name


def adapter_config(*, rank: int, alpha: int, dropout: float, target_modules: list[str],
                   base_model: str = "") -> dict:
    """peft's LoraConfig as saved, for the adapters kuberl trains: plain LoRA (no bias, no DoRA,
    no rsLoRA, no modules_to_save), which is all vLLM's loader accepts."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": sorted(target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "base_model_name_or_path": base_model}


def spec_adapter_config(spec) -> dict | None:
    """``spec.trainer.lora``'s adapter config, or None without LoRA (the sync sends full weights)."""
    lora = spec.trainer.lora
    if lora is None:
        return None
    return adapter_config(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                          target_modules=list(lora.target_modules))


def save_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """Write ``tensors`` (saved names) and ``config`` into ``directory``; the weights file is
    renamed into place complete, the config written last (a reader that finds the config finds
    the weights). Returns the bytes of the weights file."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / ADAPTER_WEIGHTS
    partial = weights.with_suffix(".partial")
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(partial))
    os.replace(partial, weights)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return weights.stat().st_size
