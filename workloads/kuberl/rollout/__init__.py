"""kuberl.rollout: vLLM rollout engines as Ray actors, their pool, and the HTTP endpoint."""
