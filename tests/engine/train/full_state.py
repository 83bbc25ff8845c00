"""A trainer rank's model and optimizer state as full tensors by name, to compare runs across
layouts (one process, FSDP2 ranks, expert parallelism)."""

from __future__ import annotations

import torch


def full_state(worker) -> dict[str, torch.Tensor]:
    """Model and AdamW state as full tensors by name (a DTensor is gathered: collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        flat.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in flat.items()}
