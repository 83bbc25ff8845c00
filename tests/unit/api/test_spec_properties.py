"""Specs drawn from the API types (tests/unit/api/spec_strategies.py) through the local validator and
the renderer, without a cluster: each is accepted or refused with a message, never a crash (a CEL
rule that reads an absent optional field crashed `kuberl render` before it was guarded). The
same specs go to the real API server in tests/cluster/api/test_kuberl_api.py."""

from hypothesis import HealthCheck, given, settings

from tests.unit.api.spec_strategies import local_verdict, manifests


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_every_spec_the_types_allow_is_rendered_or_refused_naming_a_field(manifest):
    verdict = local_verdict(manifest)
    assert verdict is None or "spec." in verdict or "metadata." in verdict, verdict
    # A rule that cannot be evaluated is the CRD's fault: a rule reads a field the spec may lack.
    assert "could not be evaluated" not in (verdict or ""), verdict
