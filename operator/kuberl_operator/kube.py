"""The few API-server writes the operator makes, through the `kubernetes` client's transport.

Server-side apply (field manager ``kuberl-operator``) for the objects the operator owns outright,
create-and-adopt for RayJobs (a RayJob's spec is fixed at creation), JSON merge patches for the
RayJob's suspend flag and for the operator's own status fields, a JSON patch for the size of a
RayCluster's rollout group (a live resize). Reads come from kopf's watch
streams, never from here.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kuberl.api import types as t

FIELD_MANAGER = "kuberl-operator"

# kind -> (API path prefix, plural) for every kind the operator writes.
_RESOURCES = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "RayJob": ("/apis/ray.io/v1", "rayjobs"),
    "RayCluster": ("/apis/ray.io/v1", "rayclusters"),
    # A job with a Kueue queue is suspended and resumed through its Workload's spec.active.
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads"),
    t.KIND: (f"/apis/{t.API_VERSION}", t.PLURAL),
}
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def load_client(kubeconfig: str | None = None, pool_size: int = 16) -> kubernetes.client.ApiClient:
    """The given kubeconfig, else in-cluster credentials, else ``$KUBECONFIG``; ``pool_size``
    connections, one per reconcile thread (the default, 5 x CPUs, makes threads drop and redial)."""
    config = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    else:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
    config.connection_pool_maxsize = pool_size
    return kubernetes.client.ApiClient(config)


def _path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = _RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Kube:
    """Writes through one ApiClient (connection pool shared by the reconcile threads)."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client

    def _request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                 query: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        serialized = self.client.param_serialize(method, path, query_params=query, header_params=headers,
                                                 body=body, auth_settings=["BearerToken"])
        response = self.client.call_api(*serialized, _request_timeout=30)
        data = response.read()
        if response.status >= 400:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply; ``force`` takes over fields another manager set (we own these objects)."""
        meta = obj["metadata"]
        return self._request("PATCH", _path(obj["kind"], meta["namespace"], meta["name"]), obj, APPLY,
                             [("fieldManager", FIELD_MANAGER), ("force", "true")])

    def create(self, obj: dict[str, Any]) -> bool:
        """Create; an object of that name already there is adopted (False), never duplicated."""
        meta = obj["metadata"]
        try:
            self._request("POST", _path(obj["kind"], meta["namespace"]), obj, "application/json",
                          [("fieldManager", FIELD_MANAGER)])
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return self._request("PATCH", _path(kind, namespace, name, subresource), patch, MERGE,
                             [("fieldManager", FIELD_MANAGER)])

    def json_patch(self, kind: str, namespace: str, name: str, patch: list[dict[str, Any]]) -> dict[str, Any]:
        """An RFC 6902 patch: one element of a list (a RayCluster's worker group) without the rest."""
        return self._request("PATCH", _path(kind, namespace, name), patch, JSON_PATCH,
                             [("fieldManager", FIELD_MANAGER)])

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete in the background (the garbage collector removes dependents); gone already is fine."""
        try:
            self._request("DELETE", _path(kind, namespace, name), {"propagationPolicy": "Background"},
                          "application/json")
        except ApiException as err:
            if err.status != 404:
                raise
