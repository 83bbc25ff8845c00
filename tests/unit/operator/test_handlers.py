"""The kopf wiring's own rules: what the indices keep of owned objects, and that every handler
runs in the event loop (no API server: the handlers' effect is tested in tests/cluster/operator)."""

from __future__ import annotations

import copy
import inspect

import kopf

from kuberl_operator.handlers import pod_entry, ray_cluster_entry, ray_job_entry, register

META = {"name": "tiny", "namespace": "ns", "uid": "u1", "labels": {"kuberl.dev/job": "tiny"},
        "annotations": {"kuberl.dev/attempt": "0"}, "ownerReferences": [{"uid": "j1"}], "resourceVersion": "5"}


def test_every_index_and_event_handler_is_async():
    # A sync handler runs in kopf's thread pool: one thread hop per watch event and handler, which
    # cost more of the operator's CPU than the handlers' work (bench/operator_scale.py). kopf's
    # registries are private: this test fails, rather than passes silently, if they move.
    registry = kopf.OperatorRegistry()
    register(registry)
    handlers = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    assert len(handlers) == 6 + 5
    assert [h.id for h in handlers if not inspect.iscoroutinefunction(h.fn)] == []


def test_a_ray_jobs_entry_ignores_kuberays_copy_of_the_cluster_status_and_its_bookkeeping():
    status = {"jobDeploymentStatus": "Initializing", "rayClusterName": "tiny-abc", "startTime": "t0",
              "rayClusterStatus": {"desiredCPU": "3"}}
    entry = ray_job_entry(META, {"suspend": False, "entrypoint": "x"}, status)
    assert entry["status"] == {"jobDeploymentStatus": "Initializing", "rayClusterName": "tiny-abc", "startTime": "t0"}
    later = {**status, "rayClusterStatus": {"desiredCPU": "3", "readyWorkerReplicas": 2}}
    assert ray_job_entry({**META, "resourceVersion": "6", "finalizers": ["ray.io/rayjob"]},
                         {"suspend": False, "entrypoint": "y"}, later) == entry
    assert ray_job_entry(META, {"suspend": True}, status) != entry
    assert ray_job_entry(META, {}, {**status, "jobDeploymentStatus": "Running"}) != entry


def test_a_ray_clusters_entry_is_its_state_and_group_sizes():
    spec = {"workerGroupSpecs": [{"groupName": "rollout", "replicas": 2, "template": {}}]}
    entry = ray_cluster_entry(META, spec, {"state": "ready", "readyWorkerReplicas": 2})
    assert ray_cluster_entry(META, spec, {"state": "ready", "readyWorkerReplicas": 1, "endpoints": {}}) == entry
    assert ray_cluster_entry(META, spec, {"state": "suspended"}) != entry
    resized = copy.deepcopy(spec)
    resized["workerGroupSpecs"][0]["replicas"] = 1
    assert ray_cluster_entry(META, resized, {"state": "ready"}) != entry


def test_a_pods_entry_changes_with_its_phase_not_with_its_finalizers():
    spec = {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    status = {"phase": "Running", "startTime": "2026-01-01T00:00:00Z", "podIP": "10.0.0.1"}
    entry = pod_entry(META, spec, status)
    assert pod_entry({**META, "finalizers": ["x"]}, spec, {**status, "podIP": "10.0.0.2"}) == entry
    assert pod_entry(META, spec, {**status, "phase": "Succeeded"}) != entry
