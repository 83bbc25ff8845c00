"""Every bad manifest is rejected locally (schema + CEL via cel-python, then the renderer) with a
message naming the field; the same table runs against the real API server in tests/cluster."""

import typing

import pytest

from kuberl.api.types import AlgorithmName
from kuberl.api.uri import URIError
from kuberl.api.validate import ManifestError
from kuberl.job.render import render_manifest
from kuberl.api.uri import URIError
from tests.unit.api.bad_manifests import BAD_MANIFESTS, minimal_manifest


def test_the_table_is_large_enough():
    assert len(BAD_MANIFESTS) >= 25
    assert len({c.id for c in BAD_MANIFESTS}) == len(BAD_MANIFESTS)


def test_the_minimal_manifest_is_valid():
    objects = render_manifest(minimal_manifest())
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "RayJob"]


@pytest.mark.parametrize("case", BAD_MANIFESTS, ids=lambda c: c.id)
def test_bad_manifest_is_rejected_naming_the_field(case):
    with pytest.raises((ManifestError, URIError)) as info:
        render_manifest(case.manifest)
    assert case.message in str(info.value)


@pytest.mark.parametrize("name", typing.get_args(AlgorithmName))
def test_every_algorithm_name_renders(name):
    manifest = minimal_manifest(f"algo-{name}")
    manifest["spec"]["algorithm"] = {"name": name}
    if name == "dapo":
        manifest["spec"]["algorithm"].update(overlongBuffer=256, overlongPenalty=0.5, maxRefillRounds=2)
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]


def test_integer_clip_ratios_compare_with_the_algorithm_defaults():
    """YAML ``clipRatioHigh: 1`` is an integer; the CEL rule compares it with a double default."""
    manifest = minimal_manifest("algo-int-clip")
    manifest["spec"]["algorithm"] = {"name": "gspo", "clipRatioHigh": 1}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]


def test_async_rollout_renders_with_an_integer_top_p():
    """``topP: 1`` in YAML is an integer; the asyncRollout rule compares it as a double."""
    manifest = minimal_manifest("algo-async")
    manifest["spec"]["algorithm"] = {"asyncRollout": True, "topP": 1}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]


def test_max_staleness_without_async_rollout_renders():
    """maxStaleness alone sets the bound; 0 is synchronous and passes the topP and colocate rules."""
    manifest = minimal_manifest("algo-stale")
    manifest["spec"]["algorithm"] = {"maxStaleness": 4, "topP": 1}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]
    manifest["spec"]["algorithm"] = {"maxStaleness": 0, "topP": 0.9}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]


def test_an_agent_manifest_renders():
    manifest = minimal_manifest("agent")
    manifest["spec"]["agent"] = {"environment": "kuberl.rollout.agents.calculator:Calculator", "maxTurns": 2,
                                 "maxTokensPerTurn": 12}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]
    manifest["spec"]["agent"] = {"harness": {"command": ["python", "-m", "kuberl.rollout.agents.calculator"]}}
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]
