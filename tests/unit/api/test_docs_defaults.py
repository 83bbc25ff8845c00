"""docs/api.md and the defaults a job actually gets are one source: every documented default is
the value an omitted field takes, nested defaults (``spec.head.resources``) included."""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel

from kuberl.api.docs import DOC_PATH
from kuberl.api.types import RLTrainingJobSpec

ROW = re.compile(r"^\| `(?P<field>[^`]+)` \| [^|]*(?:\\\|[^|]*)* \| (?:yes)? \| (?P<default>`[^`]*`)? \|")


def _documented() -> dict[str, str]:
    out = {}
    for line in DOC_PATH.read_text().splitlines():
        match = ROW.match(line)
        if match and match["default"]:
            out[match["field"]] = match["default"].strip("`")
    return out


def _model(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _effective(model: type[BaseModel], instance: BaseModel | None, path: str) -> dict[str, object]:
    """Leaf defaults as a job gets them: a nested object's defaults come from its parent's
    default instance when there is one (that is where the head's 2 CPUs live)."""
    out = {}
    for name, field in model.model_fields.items():
        where = f"{path}.{field.alias or name}"
        sub = _model(field.annotation)
        if sub is not None:
            value = getattr(instance, name) if instance is not None else (
                field.get_default(call_default_factory=True) if not field.is_required() else None)
            out.update(_effective(sub, value if isinstance(value, BaseModel) else None, where))
        elif not field.is_required():
            value = getattr(instance, name) if instance is not None else field.get_default(call_default_factory=True)
            if value is not None and not isinstance(value, (dict, list)):
                out[where] = value
    return out


def test_every_documented_default_is_the_effective_default():
    documented = _documented()
    effective = _effective(RLTrainingJobSpec, None, "spec")
    assert documented["spec.head.resources.cpu"] == '"2"' and documented["spec.head.resources.memory"] == '"8Gi"'
    mismatched = {f: (documented[f], json.dumps(v)) for f, v in effective.items()
                  if f in documented and documented[f] != json.dumps(v)}
    assert not mismatched, mismatched
    assert set(effective) <= set(documented), set(effective) - set(documented)
