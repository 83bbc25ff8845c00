"""The kuberl operator: reconciles RLTrainingJobs into KubeRay RayJobs with kopf.

Pure logic (what to create, what the status says, what to do next) lives in ``reconcile`` and
``status`` and is tested without a cluster; ``handlers`` wires it to kopf and ``kube`` talks to the
API server.
"""
