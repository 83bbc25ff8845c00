"""kuberl.api.validate keeps each CEL rule's result per value (a rule is a pure function of
``self``): what it meets again is not evaluated again, and what changed is."""

from __future__ import annotations

import pytest

from kuberl.api import validate
from tests.unit.api.bad_manifests import minimal_manifest


@pytest.fixture
def evaluated(monkeypatch) -> list[str]:
    """The rules cel-python evaluates from now on, in order, with no result kept from before."""
    calls: list[str] = []
    program = validate._program

    class Counted:
        def __init__(self, expr: str):
            self.expr, self.runner = expr, program(expr)

        def evaluate(self, activation):
            calls.append(self.expr)
            return self.runner.evaluate(activation)

    monkeypatch.setattr(validate, "_program", Counted)
    monkeypatch.setattr(validate, "_RESULTS", {})
    return calls


def test_a_rule_is_evaluated_again_only_on_a_value_it_has_not_seen(evaluated):
    validate.validate_manifest(minimal_manifest())
    first = len(evaluated)
    assert first > 0
    validate.validate_manifest(minimal_manifest())
    assert len(evaluated) == first
    changed = minimal_manifest()
    changed["spec"]["model"]["uri"] = "s3://models/other"
    validate.validate_manifest(changed)
    assert first < len(evaluated) < 2 * first  # the rules over the model and what holds it


def test_a_kept_refusal_names_the_field_as_the_first(evaluated):
    bad = minimal_manifest()
    bad["spec"]["model"] = {"uri": "hf://org/m", "revision": "a..b"}
    refusals = []
    for _ in range(2):
        with pytest.raises(validate.ManifestError) as refused:
            validate.validate_manifest(bad)
        refusals.append(refused.value.errors)
    assert refusals[0] == refusals[1] and any(e.startswith("spec.model.revision") for e in refusals[0])


def test_equal_looking_values_of_other_types_are_kept_apart():
    schema = {"x-kubernetes-validations": [{"rule": "self == 1", "message": "must be 1"}]}
    assert validate._cel_errors(1, schema, "f") == []
    assert validate._cel_errors("1", schema, "f") != []
