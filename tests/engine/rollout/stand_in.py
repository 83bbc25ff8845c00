"""A stand-in for one trainer rank: a plain (unsharded) Hugging Face model in a Ray actor.

It offers what the sync methods use of ``kuberl.train.group.TrainerGroup`` (``execute(fn, ...)``
running ``fn(worker, ...)`` on every rank; ``worker.model``, ``rank``, ``world_size``,
``device``), so the tests exercise the real transport, engine and vLLM loading without the FSDP2
trainer, which is tested with its own suite.
"""

from __future__ import annotations

import ray


class TrainerRank:
    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.rank, self.world_size, self.device = 0, 1, "cpu"

    def execute(self, fn, *args, **kwargs):
        return fn(self, *args, **kwargs)

    def perturb(self, seed: int, scale: float = 0.05) -> None:
        """Change every weight, as a training step would."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * scale)

    def log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token after the first, as the trainer computes it."""
        import torch

        out = []
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq])
                logits = self.model(input_ids=ids).logits.float()
                logp = torch.log_softmax(logits[0, :-1], dim=-1)
                out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out


class StandInTrainerGroup:
    def __init__(self, model_path: str):
        self.ranks = [ray.remote(TrainerRank).options(num_cpus=0).remote(model_path)]

    def execute(self, fn, *args, **kwargs) -> list:
        return ray.get([rank.execute.remote(fn, *args, **kwargs) for rank in self.ranks])

    def perturb(self, seed: int) -> None:
        ray.get([rank.perturb.remote(seed) for rank in self.ranks])

    def log_probs(self, sequences):
        return ray.get(self.ranks[0].log_probs.remote(sequences))
