"""The pinned Go components of the test control plane and how each is built.

One Kubernetes release for every k8s binary; each component is built from
its Go module through a throwaway go.mod (so that upstream `replace`
directives, which `go install pkg@version` refuses, do not matter).

KubeRay is pinned to v1.6.2: the Go module proxy answers `403 Forbidden: This
module version is not available.` for github.com/ray-project/kuberay/ray-operator
@v1.7.0 (and for its list), so v1.7.0 cannot be built here. The RayCluster,
RayJob and RayService CRDs the tests install and validate rendered manifests
against come from the same module, so CRDs and the running operator are one
version.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

GO_MIN_VERSION = (1, 26)

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KUBERAY_VERSION = "v1.6.2"
KWOK_VERSION = "v0.8.0"
# Kueue 0.17.0: built against KubeRay v1.6.0's RayJob API and client-go 0.35 (one minor behind the
# API server, inside client-go's skew). It is the only version the Go module proxy lists here.
KUEUE_VERSION = "v0.17.0"
HELM_VERSION = "v3.22.0"
COREDNS_VERSION = "v1.15.0"
# Prometheus 3.16.0: its Go module numbers 3.x releases v0.3xx.y. Debian's package is built without
# Kubernetes service discovery, which the documented scrape config of the pods needs.
PROMETHEUS_VERSION = "v0.316.0"
# Of all its service discoveries, only Kubernetes' (its build tags): the others pull in cloud SDKs.
PROMETHEUS_TAGS = ("remove_all_sd", "enable_kubernetes_sd")

# CoreDNS with only the plugins cluster DNS needs: its stock main links every plugin (cloud DNS
# SDKs included), several minutes more of cold build for code the test cluster never runs.
# The directives keep CoreDNS's own order (plugin.cfg); a Corefile may use only these.
COREDNS_MAIN = """package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"ready", "health", "errors", "log", "cache", "kubernetes"}
}

func main() { coremain.Run() }
"""


def _k8s_version_ldflags() -> list[str]:
    """Stamp the release into the binaries; unstamped ones report v0.0.0-master."""
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return flags


@dataclass(frozen=True)
class Component:
    """A binary built from `package` of Go module `module` at `version`."""

    name: str
    module: str
    version: str
    package: str
    # Module graph shared by components of one release (one throwaway go.mod).
    group: str
    ldflags: list[str] = field(default_factory=list)
    # Files of the module source concatenated into `<name>-<version>.yaml`
    # beside the binary (upstream configuration the binary needs at run time).
    data_files: tuple[str, ...] = ()
    # A main package of our own (Go source) built instead of `package`, which then names the
    # package whose module it needs; for a smaller binary than upstream's main links.
    main_go: str | None = None
    # Go build tags.
    tags: tuple[str, ...] = ()
    # Built only when asked for by name (a fixture few tests use), not with the control plane.
    optional: bool = False

    @property
    def binary_name(self) -> str:
        if not self.tags:
            return f"{self.name}-{self.version}"
        # Keyed by the tags too: a binary built with other tags is not this one.
        return f"{self.name}-{self.version}-{hashlib.sha256(','.join(self.tags).encode()).hexdigest()[:8]}"

    @property
    def data_name(self) -> str:
        # Keyed by the file list too: a cache built with other files is not this one.
        digest = hashlib.sha256("\n".join(self.data_files).encode()).hexdigest()[:8]
        return f"{self.name}-{self.version}-{digest}.yaml"


def _k8s(name: str, package: str) -> Component:
    return Component(
        name=name,
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        package=package,
        group=f"kubernetes-{KUBERNETES_VERSION}",
        ldflags=_k8s_version_ldflags(),
    )


COMPONENTS: dict[str, Component] = {
    c.name: c
    for c in [
        Component(
            name="etcd",
            module="go.etcd.io/etcd/server/v3",
            version=ETCD_VERSION,
            package="go.etcd.io/etcd/server/v3",
            group=f"etcd-{ETCD_VERSION}",
        ),
        _k8s("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
        _k8s("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
        _k8s("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
        _k8s("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
        # The real nodes: kubelet and kube-proxy of the API server's release.
        _k8s("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
        _k8s("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
        Component(
            name="coredns",
            module="github.com/coredns/coredns",
            version=COREDNS_VERSION,
            package="github.com/coredns/coredns/coremain",
            group=f"coredns-{COREDNS_VERSION}",
            ldflags=[f"-X github.com/coredns/coredns/coremain.GitCommit={COREDNS_VERSION}"],
            main_go=COREDNS_MAIN,
        ),
        Component(
            name="kuberay-operator",
            module="github.com/ray-project/kuberay/ray-operator",
            version=KUBERAY_VERSION,
            package="github.com/ray-project/kuberay/ray-operator",
            group=f"kuberay-{KUBERAY_VERSION}",
            # Its CRDs, from the module it is built from: RayCluster and RayJob are what
            # kuberl renders; the operator's RayService controller waits for its CRD too.
            data_files=(
                "config/crd/bases/ray.io_rayclusters.yaml",
                "config/crd/bases/ray.io_rayjobs.yaml",
                "config/crd/bases/ray.io_rayservices.yaml",
            ),
        ),
        Component(
            name="kwok",
            module="sigs.k8s.io/kwok",
            version=KWOK_VERSION,
            package="sigs.k8s.io/kwok/cmd/kwok",
            group=f"kwok-{KWOK_VERSION}",
            # The standalone kwok binary ships no stages of its own (kwokctl
            # embeds these): node init + lease heartbeat, and the "fast" pod
            # stages that move a scheduled pod to Running at once.
            data_files=(
                "kustomize/stage/node/fast/node-initialize.yaml",
                "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                "kustomize/stage/pod/fast/pod-ready.yaml",
                "kustomize/stage/pod/fast/pod-complete.yaml",
                "kustomize/stage/pod/fast/pod-delete.yaml",
            ),
        ),
        Component(
            name="kueue",
            module="sigs.k8s.io/kueue",
            version=KUEUE_VERSION,
            package="sigs.k8s.io/kueue/cmd/kueue",
            group=f"kueue-{KUEUE_VERSION}",
            # Its cold build is the longest of all (every Kueue integration's API module): only
            # the tests of fixture `kueue` pay for it.
            optional=True,
            # Its CRDs and its webhook configurations (rewritten by the harness to call the
            # webhook server on loopback), from the module it is built from.
            data_files=tuple(
                f"config/components/crd/bases/kueue.x-k8s.io_{kind}.yaml"
                for kind in (
                    "admissionchecks", "clusterqueues", "cohorts", "localqueues", "multikueueclusters",
                    "multikueueconfigs", "provisioningrequestconfigs", "resourceflavors", "topologies",
                    "workloadpriorityclasses", "workloads",
                )
            )
            + ("config/components/webhook/manifests.yaml",),
        ),
        Component(
            name="prometheus",
            module="github.com/prometheus/prometheus",
            version=PROMETHEUS_VERSION,
            package="github.com/prometheus/prometheus/cmd/prometheus",
            group=f"prometheus-{PROMETHEUS_VERSION}",
            tags=PROMETHEUS_TAGS,
        ),
        Component(
            name="promtool",
            module="github.com/prometheus/prometheus",
            version=PROMETHEUS_VERSION,
            package="github.com/prometheus/prometheus/cmd/promtool",
            group=f"prometheus-{PROMETHEUS_VERSION}",
            tags=PROMETHEUS_TAGS,
        ),
        Component(
            name="helm",
            module="helm.sh/helm/v3",
            version=HELM_VERSION,
            package="helm.sh/helm/v3/cmd/helm",
            group=f"helm-{HELM_VERSION}",
            ldflags=[f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}"],
        ),
    ]
}


# What the control plane needs: every component but the optional ones.
REQUIRED = [name for name, component in COMPONENTS.items() if not component.optional]


def cache_dir() -> Path:
    """Root of the build cache: $KUBERL_CACHE (as for .ci/setup and `kuberl train`), else ~/.cache/kuberl."""
    override = os.environ.get("KUBERL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "kuberl"


def bin_dir() -> Path:
    return cache_dir() / "bin"


def binary_path(name: str) -> Path:
    return bin_dir() / COMPONENTS[name].binary_name


def data_path(name: str) -> Path:
    return bin_dir() / COMPONENTS[name].data_name


def is_built(name: str) -> bool:
    component = COMPONENTS[name]
    return binary_path(name).exists() and (not component.data_files or data_path(name).exists())
