"""kuberl.train: the trainer rank, one FSDP2 process of one torch.distributed group.

- ``loss``: policy loss, KL penalty, entropy and group advantages (plain tensor functions);
- ``algorithms``: the RL algorithms (their losses for the rank, their shaping for the driver);
- ``moe``: the Mixture-of-Experts expert path that runs every expert every step (grouped GEMM);
- ``model``: loading a Hugging Face causal LM into FSDP2 (meta init, rank-0 load + broadcast);
- ``worker``: one trainer rank (torch only, no Ray: also driven by torchrun in ``bench/``);
- ``checkpoint``, ``dcp_read``, ``export``: the rank's checkpoint writes and reads, the HF export;
- ``group``: ``TrainerGroup``, the Ray actors that form one torch.distributed group.

Importing this package is cheap; the heavy modules import torch themselves.
"""
