"""kuberl.rollout: generation. ``engine``: a vLLM engine, a Ray actor on the rollout pods (or the
trainer's, colocated). The driver's side of it, in the driver process: ``pool`` (the engines'
handles), ``server`` (the rollout endpoint on the head's loopback) and ``agents`` (episodes)."""
