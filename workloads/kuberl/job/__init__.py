"""kuberl.job: manifest -> run plan -> Kubernetes objects. The operator and ``kuberl render`` build
them; every process of a run reads its plan (``plan.load``)."""
