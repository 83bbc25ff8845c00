"""spec.trainer.lora on the trainer: each targeted linear layer gets a low-rank adapter
``W x + (alpha / r) B A x``; the base stays frozen and only A and B train.

The adapter layer is kuberl's own, not peft's: peft is not in this project's environment
(pyproject.toml, uv.lock), and plain LoRA is one small module. It keeps peft's module layout
(``<proj>.base_layer``, ``<proj>.lora_A``, ``<proj>.lora_B``) and saves in peft's file format
(kuberl.sync.adapter), so peft, transformers and vLLM load what it exports.

The adapters are added to the meta-device model before ``fully_shard``: FSDP2 shards frozen and
trainable parameters of one layer together (its groups need not agree on ``requires_grad``), and
the optimizer gets the trainable ones alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kuberl.api.types import LORA_TARGET_MODULES
from kuberl.sync.adapter import adapter_config


@dataclass(frozen=True)
class LoraOptions:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    merge_on_export: bool = False
    # The adapters' initial A, drawn on rank 0 (spec.algorithm.seed): a rerun starts from the same.
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def config(self, base_model: str = "") -> dict:
        """The adapter's peft config (adapter_config.json)."""
        return adapter_config(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                              target_modules=list(self.target_modules), base_model=base_model)

    @classmethod
    def from_spec(cls, lora, seed: int) -> "LoraOptions | None":
        if lora is None:
            return None
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                   target_modules=tuple(lora.target_modules), merge_on_export=lora.merge_on_export, seed=seed)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus its adapter. B starts at zero: the wrapped model starts as the
    base model exactly."""

    def __init__(self, base: nn.Linear, options: LoraOptions):
        super().__init__()
        self.base_layer = base
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, options.rank, bias=False, **like)
        self.lora_B = nn.Linear(options.rank, base.out_features, bias=False, **like)
        self.lora_dropout = nn.Dropout(options.dropout) if options.dropout else nn.Identity()
        self.scaling = options.scaling
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def apply_lora(model: nn.Module, options: LoraOptions, *, seed: int | None = None) -> nn.Module:
    """Wrap every ``nn.Linear`` whose name's last segment is in ``options.target_modules``, freeze
    everything else. ``seed``: initialise A as peft does (Kaiming-uniform) and B to zero, from
    this seed (rank 0's source model, whose values every rank receives); None leaves them as
    built (a meta-device model, filled by that broadcast)."""
    found = {name: 0 for name in options.target_modules}
    targets = [(name, module) for name, module in model.named_modules()
               if name.rpartition(".")[2] in found and isinstance(module, nn.Linear)]
    for name, _ in targets:
        found[name.rpartition(".")[2]] += 1
    missing = [name for name, count in found.items() if not count]
    if missing:
        raise ValueError(f"spec.trainer.lora.targetModules: {missing} match no linear layer of "
                         f"{type(model).__name__} (Mixture-of-Experts experts are fused, not linear "
                         f"layers); list only modules the model has")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, base in targets:
        parent_name, _, child = name.rpartition(".")
        layer = LoraLinear(base, options)
        if generator is not None:
            with torch.no_grad():
                nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5), generator=generator)
                nn.init.zeros_(layer.lora_B.weight)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return model


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward: the reference policy of klCoef, without a second copy of it."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def merged_state_dict(state: dict[str, torch.Tensor], options: LoraOptions) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict of the adapted model as the base model's: ``W + scaling B A``
    under each layer's own name, the adapters gone (a plain Hugging Face checkpoint)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." not in name:
            out[name] = value
            continue
        layer, _, param = name.partition(".base_layer.")
        if param == "weight":
            a, b = state[f"{layer}.lora_A.weight"], state[f"{layer}.lora_B.weight"]
            value = (value.float() + options.scaling * (b.float() @ a.float())).to(value.dtype)
        out[f"{layer}.{param}"] = value
    return out
