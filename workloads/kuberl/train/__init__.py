"""kuberl.train: the training half of the data plane.

- ``loss``: GRPO/PPO policy loss, KL penalty, entropy and group advantages (plain tensor functions);
- ``moe``: the Mixture-of-Experts expert path that runs every expert every step (grouped GEMM);
- ``model``: loading a Hugging Face causal LM into FSDP2 (meta init, rank-0 load + broadcast);
- ``worker``: one trainer rank (torch only, no Ray: also driven by torchrun in ``bench/``);
- ``group``: ``TrainerGroup``, the Ray actors that form one torch.distributed group;
- ``driver`` (``python -m kuberl.driver``): the RL loop.

Importing this package is cheap; the heavy modules import torch themselves.
"""
