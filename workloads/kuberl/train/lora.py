"""spec.trainer.lora on the trainer, with peft: each targeted linear layer becomes peft's LoRA
layer, ``W x + (alpha / r) B A x``; the base stays frozen and only A and B train.

peft injects the adapters into the plain Hugging Face model (``inject_adapter_in_model``, not
``get_peft_model``): the model keeps its own parameter names (plus peft's ``base_layer`` /
``lora_A.default`` / ``lora_B.default``), so FSDP2's per-layer sharding, checkpoints and the weight
sync see the same tree with and without LoRA. The adapters are injected into the meta-device model
before ``fully_shard``: FSDP2 shards frozen and trainable parameters of one layer together (its
groups need not agree on ``requires_grad``), and the optimizer gets the trainable ones alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from kuberl.api.types import LORA_TARGET_MODULES
from kuberl.sync.adapter import is_adapter_name, lora_config, saved_adapter


@dataclass(frozen=True)
class LoraOptions:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    merge_on_export: bool = False
    # The adapters' initial A, drawn on rank 0 (spec.algorithm.seed): a rerun starts from the same.
    seed: int = 0

    def config(self):
        """The adapter's peft LoraConfig (adapter_config.json)."""
        return lora_config(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                           target_modules=list(self.target_modules))

    @classmethod
    def from_spec(cls, lora, seed: int) -> "LoraOptions | None":
        if lora is None:
            return None
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                   target_modules=tuple(lora.target_modules), merge_on_export=lora.merge_on_export, seed=seed)


def apply_lora(model: nn.Module, options: LoraOptions, *, seed: int | None = None) -> nn.Module:
    """Inject peft's LoRA layers into every ``nn.Linear`` whose name's last segment is in
    ``options.target_modules``; everything else frozen. ``seed``: peft's initialisation (A
    Kaiming-uniform, B zero) drawn from this seed (rank 0's source model, whose values every rank
    receives); None on a meta-device model, filled by that broadcast."""
    from peft import inject_adapter_in_model

    present = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    # peft refuses only a list of which none matches; a job that names one module the model lacks
    # is as wrong.
    missing = [name for name in options.target_modules if name not in present]
    if missing:
        raise ValueError(f"spec.trainer.lora.targetModules: {missing} match no linear layer of "
                         f"{type(model).__name__} (Mixture-of-Experts experts are fused, not linear "
                         f"layers); list only modules the model has")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        inject_adapter_in_model(options.config(), model)
    return model


def adapters_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """The base model's forward: the reference policy of klCoef, without a second copy of it.
    peft's adapter scaling set to 0 (``W x + 0``, the base's values exactly), not its
    ``enable_adapters(False)/(True)``: that also flips ``requires_grad``, and under FSDP2 the
    adapters stayed frozen after one reference forward (none in the state dict, none trained by
    the next step: the flag set back after the forward lands on the unsharded parameters)."""
    from peft.helpers import rescale_adapter_scale

    return rescale_adapter_scale(model, 0)


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor], options: LoraOptions,
                      hf_config) -> dict[str, torch.Tensor]:
    """The gathered full state dict ``state`` of the adapted ``model`` as the base model's with the
    adapter merged in (``W + scaling B A`` under each layer's own name, peft's ``merge_and_unload``):
    a plain Hugging Face checkpoint. On rank 0."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    # merge_and_unload adds B A into the targeted weights in place; a one-rank trainer's gathered
    # state may be its live parameters, so those are copied first.
    base = {name.replace(".base_layer.", "."): value.clone() if ".base_layer." in name else value
            for name, value in state.items() if not is_adapter_name(name)}
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(hf_config)
    plain.load_state_dict(base, assign=True)
    peft_model = get_peft_model(plain, options.config())
    set_peft_model_state_dict(peft_model, saved_adapter(model, state))
    return peft_model.merge_and_unload().state_dict()
