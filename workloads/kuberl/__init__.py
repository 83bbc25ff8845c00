"""kuberl: Kubernetes-native reinforcement-learning post-training for language models.

What runs inside the Ray cluster (and on a laptop without Kubernetes): the API types, the renderer,
staging, training, rollout, weight sync, checkpoints, NUMA placement and metrics.
"""

__version__ = "0.1.0"
