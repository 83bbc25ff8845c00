"""Generates the RLTrainingJob CustomResourceDefinition from the pydantic types, and beside it
the ValidatingAdmissionPolicy that keeps a job's own workload identity to the status fields the
driver writes.

`python -m kuberl.api.crd --write` rewrites ``crds/`` and the Helm chart's copy; a test fails when
the committed files differ from what this module generates.

The API server needs a *structural* schema: every node typed, no ``$ref``, no bare ``anyOf``,
defaults inline. Pydantic emits JSON Schema 2020-12, so this module inlines references, turns
``Optional[X]`` into an optional ``X``, and converts the few keywords that differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kuberl.api import types as t
from kuberl.api.contract import WORKLOAD_IDENTITY_SUFFIX

CRD_NAME = f"{t.PLURAL}.{t.GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATHS = (REPO_ROOT / "crds" / CRD_FILE, REPO_ROOT / "charts" / "kuberl" / "crds" / CRD_FILE)

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Total", "type": "integer", "jsonPath": ".spec.algorithm.totalSteps"},
    {"name": "Reward", "type": "number", "format": "float", "jsonPath": ".status.progress.reward"},
    {"name": "Activity", "type": "string", "jsonPath": ".status.progress.activity",
     "description": "What the driver has been doing for 2 s or more: generate, train, sync, ..."},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step",
     "description": "Step of the last complete checkpoint"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {"name": "RayJob", "type": "string", "jsonPath": ".status.rayJobName", "priority": 1},
    {"name": "GPU-Hours", "type": "number", "format": "float", "jsonPath": ".status.cost.gpuHours", "priority": 1,
     "description": "GPU-hours of every pod the job ran (status.cost)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

ROOT_RULES = [
    t.rule(f"size(self.metadata.name) <= {t.MAX_NAME_LENGTH}",
           f"metadata.name must be at most {t.MAX_NAME_LENGTH} characters (KubeRay derives pod and "
           f"Service names from it)"),
]

_DROP = {"title", "additionalProperties", "discriminator", "$defs"}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = {**_structural(target, defs)}
        # A field's own description and rules win over the referenced model's.
        for key, value in node.items():
            if key == "x-kubernetes-validations":
                merged[key] = merged.get(key, []) + value
            elif key not in _DROP:
                merged[key] = value
        return merged
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unions other than Optional[X] have no structural schema: {options}")
        inner = _structural(options[0], defs)
        inner.update({k: v for k, v in node.items() if k not in _DROP and k != "default"})
        if node.get("default") is not None:
            inner["default"] = node["default"]
        return inner
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "exclusiveMinimum" in node:
        node["minimum"], node["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        node["maximum"], node["exclusiveMaximum"] = node["exclusiveMaximum"], True
    out: dict[str, Any] = {k: v for k, v in node.items() if k not in _DROP}
    if node.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        if "properties" in node:
            out["properties"] = {k: _structural(v, defs) for k, v in node["properties"].items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = _structural(extra, defs)
    if node.get("type") == "array":
        out["items"] = _structural(node["items"], defs)
    if out.get("format") == "date-time":
        out["type"] = "string"
    return out


def _object_defaults(model: type[BaseModel], schema: dict[str, Any]) -> None:
    """Give each defaulted nested object its default inline, so the API server fills it in.

    Pydantic leaves ``default_factory`` values out of the JSON schema; the API server applies
    defaults only where the schema has them, and then recurses into the object it defaulted.
    """
    for name, field in model.model_fields.items():
        prop = schema["properties"][field.alias or name]
        annotation = _model_type(field)
        if annotation is not None:
            _object_defaults(annotation, prop)
            if field.default_factory is not None:
                prop["default"] = _full_default(field)
        elif (item_model := _list_model(field)) is not None:
            _object_defaults(item_model, prop["items"])


def _full_default(field: FieldInfo) -> dict[str, Any]:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        # Complete, not just what differs: the API server checks a default against the CEL rules
        # of its schema without first applying the nested defaults.
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    return value


def _model_type(field: FieldInfo) -> type[BaseModel] | None:
    """The model type of a field typed ``Model`` or ``Model | None``."""
    if getattr(field.annotation, "__origin__", None) in (list, dict):  # a collection of models, not one
        return None
    for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _list_model(field: FieldInfo) -> type[BaseModel] | None:
    args = getattr(field.annotation, "__args__", ())
    if getattr(field.annotation, "__origin__", None) is list and args and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0]
    return None


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _structural(raw, raw.get("$defs", {}))
    _object_defaults(model, schema)
    return schema


def openapi_schema() -> dict[str, Any]:
    spec = model_schema(t.RLTrainingJobSpec)
    status = model_schema(t.RLTrainingJobStatus)
    status.pop("default", None)
    return {
        "type": "object",
        "description": "RLTrainingJob runs reinforcement-learning post-training of a language model "
                       "on a KubeRay cluster.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": ROOT_RULES,
    }


def generate_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/part-of": "kuberl"},
        },
        "spec": {
            "group": t.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": t.KIND,
                "listKind": f"{t.KIND}List",
                "plural": t.PLURAL,
                "singular": t.SINGULAR,
                "shortNames": list(t.SHORT_NAMES),
                "categories": ["kuberl", "all"],
            },
            "versions": [{
                "name": t.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


STATUS_POLICY_NAME = f"workload-status.{CRD_NAME}"


def _status_fields() -> dict[str, str]:
    """Each status field's wire name -> how the policy reads it: an absent field with a schema
    default (``restarts: 0``, ``conditions: []``) is its default, since the API server fills it
    in on the updated object but not in ``oldObject`` when the status was never written."""
    out = {}
    for name, f in t.RLTrainingJobStatus.model_fields.items():
        default = f.get_default(call_default_factory=True)
        wire = f.alias or name
        out[wire] = f".?{wire}" + ("" if default is None else f".orValue({json.dumps(default)})")
    return out


def status_policy() -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its binding: a status update by the job's own workload
    ServiceAccount (the identity its pods run as, whose Role may patch the job's status) may
    change only ``t.WORKLOAD_STATUS_FIELDS``. RBAC cannot limit a patch to some fields; without
    this, code in the job's pods (its reward function, say) could rewrite ``status.restarts``
    (the operator's restart budget), ``status.cost`` or ``status.phase``. Requests by anyone
    else (the operator, an admin) are not matched."""
    driver = ", ".join(f"status.{f}" for f in t.WORKLOAD_STATUS_FIELDS)
    validations = [{
        "expression": f"oldObject.?status{read} == object.?status{read}",
        "message": (f"status.{f} is the kuberl operator's; the job's workload identity may write only "
                    f"{driver}"),
        "reason": "Forbidden",
    } for f, read in _status_fields().items() if f not in t.WORKLOAD_STATUS_FIELDS]
    labels = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/part-of": "kuberl"}
    return [{
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": STATUS_POLICY_NAME, "labels": labels},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [t.GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
                "resources": [f"{t.PLURAL}/status"]}]},
            "matchConditions": [{
                "name": "the-jobs-own-workload-identity",
                "expression": ("request.userInfo.username == 'system:serviceaccount:' + object.metadata.namespace + "
                               f"':' + object.metadata.name + '{WORKLOAD_IDENTITY_SUFFIX}'"),
            }],
            "validations": validations,
        },
    }, {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": STATUS_POLICY_NAME, "labels": labels},
        "spec": {"policyName": STATUS_POLICY_NAME, "validationActions": ["Deny"]},
    }]


HEADER = "# Generated by `python -m kuberl.api.crd --write` from workloads/kuberl/api/types.py. Do not edit.\n"


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated sub-schemas out in full: kubectl and Helm users read this file."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd_yaml() -> str:
    """The CRD, then the status policy: one file, so every way of installing the CRD (kubectl,
    Helm's crds/) installs the policy with it."""
    return HEADER + yaml.dump_all([generate_crd(), *status_policy()], Dumper=_NoAliasDumper, sort_keys=False,
                                  width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberl.api.crd", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {', '.join(str(p) for p in CRD_PATHS)}")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    if not args.write:
        sys.stdout.write(text)
        return 0
    for path in CRD_PATHS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
