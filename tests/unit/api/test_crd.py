"""The committed CRD (and the chart's copy) is exactly what the API types generate, and it is a
structural schema the API server accepts."""

import re
from pathlib import Path

import pytest
import yaml

from kuberl.api.crd import CRD_PATHS, generate_crd, render_crd_yaml

REGENERATE = "run `python -m kuberl.api.crd --write` and commit the result"


@pytest.mark.parametrize("path", CRD_PATHS, ids=lambda p: str(p.relative_to(p.parents[2])))
def test_committed_crd_matches_the_types(path: Path):
    assert path.exists(), f"{path} is missing: {REGENERATE}"
    assert path.read_text() == render_crd_yaml(), f"{path} is stale: {REGENERATE}"


def _walk(node, path="schema"):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title"):
            assert forbidden not in node, f"{path} has {forbidden}"
        if node.get("exclusiveMinimum") is not None:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_defaults_fill_a_minimal_spec_the_way_the_api_server_would():
    from kuberl.api.validate import _schema, apply_defaults

    spec = apply_defaults({"model": {"uri": "s3://b/m"}, "data": {"uri": "s3://b/d"}, "image": "i"},
                          _schema()["properties"]["spec"])
    assert spec["trainer"]["resources"] == {"cpu": "8", "memory": "64Gi", "cpuLimit": "request"}
    assert spec["head"]["resources"] == {"cpu": "2", "memory": "8Gi", "cpuLimit": "request"}
    assert spec["reward"] == {"builtin": "gsm8k_strict", "workers": 1, "cpusPerWorker": 1.0, "timeoutSeconds": 600}
    assert spec["checkpoint"]["resume"] == "auto"


def test_crd_names_and_printer_columns():
    crd = next(yaml.safe_load_all(render_crd_yaml()))
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("RLTrainingJob", "rltrainingjobs", ["rltj"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Step"] == ".status.progress.step"
    assert columns["Total"] == ".spec.algorithm.totalSteps"
    assert columns["Reward"] == ".status.progress.reward"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_api_reference_is_generated_from_the_types():
    from kuberl.api.docs import DOC_PATH, render_docs

    assert DOC_PATH.read_text() == render_docs(), "docs/api.md is stale: run `python -m kuberl.api.docs --write`"


_SELF_PATH = re.compile(r"\bself((?:\.[A-Za-z_][A-Za-z0-9_]*)+)(\()?")


def _fields_read(expr: str):
    """Each ``self.a.b`` a CEL expression reads, as ["a", "b"] (a trailing method call dropped)."""
    for match in _SELF_PATH.finditer(expr):
        parts = match.group(1).split(".")[1:]
        yield parts[:-1] if match.group(2) else parts


def _optional_prefixes(node: dict, parts: list[str]):
    """The prefixes of ``parts`` that may be absent after defaulting: neither required nor defaulted."""
    for i, part in enumerate(parts):
        sub = node.get("properties", {}).get(part)
        if sub is None:  # a map's key or a list's member: not a field of the schema
            return
        if part not in node.get("required", []) and "default" not in sub:
            yield parts[:i + 1]
        node = sub


def test_every_cel_rule_guards_the_optional_fields_it_reads():
    """The API server refuses an object whose rule reads an absent field ("no such key"), so a rule
    on an optional field must ask has() first: a scheduling block without nodeSelector was refused."""
    schema = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    unguarded = []
    for path, node in _walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            for parts in _fields_read(rule["rule"]):
                if path == "schema" and parts[0] == "metadata":
                    continue  # the API server sets metadata.name on every object (generateName too)
                for prefix in _optional_prefixes(node, parts):
                    if f"has(self.{'.'.join(prefix)})" not in rule["rule"]:
                        unguarded.append(f"{path}: {rule['rule']} reads self.{'.'.join(prefix)}")
    assert not unguarded, "guard these with has():\n" + "\n".join(unguarded)
