"""kuberl.common: the vocabulary more than one process imports: samples (rollout -> training),
prompts and reward values (driver and agents), the job's own code by import path, and the pod's
metrics exporter. It imports nothing of kuberl but ``kuberl.api``.
"""
