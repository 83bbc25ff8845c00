"""Validates an RLTrainingJob manifest the way the API server does, without an API server.

Order as in the API server: structural defaults from the generated schema, then the schema's
field rules (pydantic, the same types the schema came from), then the CEL rules
(``x-kubernetes-validations``) evaluated with cel-python. ``kuberl render``, the operator and the
driver call this, so a manifest is judged the same with and without Kubernetes.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import celpy
from pydantic import ValidationError

from kuberl.api.crd import openapi_schema
from kuberl.api.types import RLTrainingJob
from kuberl.api.uri import URIError, revision_problem


class ManifestError(ValueError):
    """A manifest is invalid; ``errors`` lists one "field: what is wrong" line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid RLTrainingJob:\n" + "\n".join(f"  - {e}" for e in errors))


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return openapi_schema()


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in schema defaults recursively, as the API server does for structural schemas."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def _field_errors(manifest: dict[str, Any]) -> list[str]:
    try:
        RLTrainingJob.model_validate(manifest)
    except ValidationError as exc:
        return [f"{_path(err['loc'])}: {_plain(err)}" for err in exc.errors()]
    return []


def _path(loc: tuple) -> str:
    """A pydantic error location as Kubernetes writes field paths: spec.items[0].name."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _plain(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field (check its spelling and indentation)"
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] == "value_error":  # a validator's own message, without pydantic's prefix
        return str(err["ctx"]["error"])
    return err["msg"]


_INT64 = range(-2**63, 2**63)


def _as_decoded(value: Any) -> Any:
    """``value`` as the API server's JSON decoder hands it to CEL: an integer beyond 64 bits is a
    double there (in a number field, which the schema allows; in an integer field the schema has
    already refused it). cel-python would overflow on it instead."""
    if isinstance(value, dict):
        return {k: _as_decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_decoded(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return float(value)
    return value


@lru_cache(maxsize=256)
def _program(expr: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(expr))


# Each rule's result on each value it was evaluated on: a rule is a pure function of ``self``, and
# cel-python's interpreter takes about 1 ms a rule (36 ms a manifest of the examples). What
# validates many manifests (`kuberl render` of a multi-document file, the driver at each restart,
# the tests: 545 validations in tests/unit) meets the same parts again. Emptied when full.
_RESULTS: dict[tuple[str, str], bool | str] = {}
RESULTS_KEPT = 20_000


def _rule_result(expr: str, value_key: str, cel_value: Any) -> bool | str:
    """True or False, or the evaluation error's message. ``value_key``: ``repr`` of the value,
    which keeps types apart (1 and 1.0, a date and its string)."""
    key = (expr, value_key)
    result = _RESULTS.get(key)
    if result is None:
        try:
            evaluated = _program(expr).evaluate({"self": cel_value})
        except celpy.CELEvalError as exc:
            evaluated = exc
        result = str(evaluated.args[0]) if isinstance(evaluated, Exception) else bool(evaluated)
        if len(_RESULTS) >= RESULTS_KEPT:
            _RESULTS.clear()
        _RESULTS[key] = result
    return result


def _cel_errors(value: Any, schema: dict[str, Any], path: str, cel_value: Any = None) -> list[str]:
    """The CEL rules' errors in ``value`` and below. ``cel_value`` is ``value`` already converted
    for CEL: the document is converted once, at the root, and each rule below reads its part of
    that (a conversion per rule cost half of the validation's time)."""
    if cel_value is None:
        cel_value = celpy.json_to_cel(_as_decoded(value))
    errors = []
    rules = [r for r in schema.get("x-kubernetes-validations", [])
             if "oldSelf" not in r["rule"]]  # a transition rule: only the API server sees an update
    value_key = repr(value) if rules else ""  # once per value, not once per rule
    for rule in rules:
        result = _rule_result(rule["rule"], value_key, cel_value)
        if isinstance(result, str):
            # The API server refuses the object too, with the evaluation error: so does this.
            errors.append(f"{path}: {rule['message']} (the rule could not be evaluated: {result})")
        elif not result:
            errors.append(f"{path + rule.get('fieldPath', '')}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += _cel_errors(value[name], sub, f"{path}.{name}" if path else name,
                                      cel_value[celpy.celtypes.StringType(name)])
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(item, schema["items"], f"{path}[{i}]", cel_value[i])
    return errors


def validate_manifest(manifest: dict[str, Any]) -> RLTrainingJob:
    """Default and validate ``manifest``; return the typed job or raise ManifestError."""
    if not isinstance(manifest, dict):
        raise ManifestError([f"the manifest must be a mapping, not {type(manifest).__name__}"])
    if manifest.get("kind") != "RLTrainingJob":
        raise ManifestError([f"kind: expected RLTrainingJob, got {manifest.get('kind')!r}"])
    defaulted = apply_defaults(copy.deepcopy(manifest), _schema())
    errors = _field_errors(defaulted)
    if errors:
        raise ManifestError(errors)
    errors = _cel_errors(defaulted, _schema(), "")
    if errors:
        raise ManifestError(errors)
    job = RLTrainingJob.model_validate(defaulted)
    errors = uri_errors(job)
    if errors:
        raise ManifestError(errors)
    return job


def uri_errors(job: RLTrainingJob) -> list[str]:
    """What the stager and the renderer refuse in the job's URIs and revision, field by field.

    The CRD's CEL rules say the same; the operator asks again for jobs stored before those rules
    (or under a CRD that lacks them), so that such a job fails with the field named instead of
    wedging its reconcile."""
    spec = job.spec
    named = [spec.model.uri, spec.data.uri, spec.checkpoint.uri, spec.validation.uri if spec.validation else None]
    if spec.checkpoint.resume not in ("auto", "never"):
        named.append(spec.checkpoint.resume)
    errors = []
    for uri in named:
        if uri is None:
            continue
        try:
            uri.parsed  # a SpecURI (kuberl.api.types.uri_type): parsed once, naming its field
        except URIError as exc:
            errors.append(str(exc))
    if spec.model.revision is not None and (problem := revision_problem(spec.model.revision)):
        errors.append(f"spec.model.revision: {spec.model.revision!r} {problem}")
    return errors


def pod_errors(job: RLTrainingJob) -> list[str]:
    """What the schema leaves to the renderer because a local ``kuberl train`` may do without it:
    in a pod, the Secret the spec names is the only way in (locally, ``wandb login`` is)."""
    wandb = job.spec.tracking.wandb
    if wandb is not None and wandb.mode == "online" and wandb.credentials is None:
        return ["spec.tracking.wandb.credentials: mode online needs a Secret with WANDB_API_KEY, which the head "
                "pod logs in with; set credentials: {name: <secret>}, or mode: offline to write the run for a "
                "later `wandb sync`"]
    return []
