"""Hypothesis strategies for RLTrainingJob specs, read off the pydantic API types.

Each field of each model becomes a strategy from its annotation and constraints (bounds, lengths,
patterns, literals, nested models); a field that may be left out is left out or drawn, so the
specs cover absent optional fields as much as present ones. The types' field constraints are all
met; the cross-field CEL rules are not aimed at, so some specs are valid and some are not, and
the tests compare who refuses what (tests/unit/api/test_spec_properties.py without a cluster,
tests/cluster/api/test_kuberl_api.py against the real API server).
"""

from __future__ import annotations

import math
import sys
import types
import typing
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kuberl.api import types as t
from tests.unit.api.bad_manifests import minimal_manifest

# cel-python sets the recursion limit to 2500 each time it makes an environment (a rule's first
# use); set first here, hypothesis does not see it change during a test and warn.
sys.setrecursionlimit(max(sys.getrecursionlimit(), 2500))

# Constraints the types keep in CEL rules or validators rather than in a field's constraints:
# drawn mostly valid (so that many specs are), sometimes as any text (so that some are not).
_IMPORT_PATH = st.one_of(st.from_regex(t.IMPORT_PATH_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 512),
                         st.text(max_size=20))
OVERRIDES: dict[tuple[type[BaseModel], str], st.SearchStrategy] = {
    (t.RewardSpec, "function"): _IMPORT_PATH,
    (t.AgentSpec, "environment"): _IMPORT_PATH,
    (t.DataSpec, "promptTemplate"): st.one_of(st.builds("{}{{prompt}}{}".format, st.text(max_size=8),
                                                        st.text(max_size=8)), st.text(max_size=8)),
    (t.RolloutSpec, "env"): st.dictionaries(
        st.one_of(st.from_regex(t.ENV_NAME_PATTERN, fullmatch=True), st.text(max_size=8)), st.text(max_size=8),
        max_size=3),
}
# Lists and maps get a few items: their bounds (64) are checked by the bad-manifest table.
MAX_ITEMS = 3
# Text without a length bound, drawn short: its size is not what these tests are about.
MAX_TEXT = 24


def _constraints(metadata: list[Any]) -> dict[str, Any]:
    """ge/gt/le/lt, min_length/max_length and pattern from a field's or an Annotated's metadata."""
    out: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):
            out.update(_constraints(item.metadata))
            continue
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(item, name, None) is not None:
                out[name] = getattr(item, name)
    return out


def _strip(annotation: Any) -> tuple[Any, list[Any]]:
    """``X | None`` -> X, and ``Annotated[X, ...]`` -> (X, its metadata)."""
    metadata: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        elif origin is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            metadata += extra
        else:
            return annotation, metadata


def _numbers(kind: type, c: dict[str, Any]) -> st.SearchStrategy:
    low = c.get("ge", c.get("gt"))
    high = c.get("le", c.get("lt"))
    if kind is int:
        return st.integers(min_value=None if low is None else low + ("gt" in c),
                           max_value=None if high is None else high - ("lt" in c))
    floats = st.floats(min_value=low, max_value=high, exclude_min="gt" in c, exclude_max="lt" in c,
                       allow_nan=False, allow_infinity=False)
    # YAML writes 1 for 1.0: whole numbers reach a number field as integers too.
    whole_low = None if low is None else math.ceil(low) + (low == math.ceil(low) and "gt" in c)
    whole_high = None if high is None else math.floor(high) - (high == math.floor(high) and "lt" in c)
    if whole_low is not None and whole_high is not None and whole_low > whole_high:
        return floats
    return st.one_of(floats, st.integers(min_value=whole_low, max_value=whole_high))


def _text(c: dict[str, Any]) -> st.SearchStrategy:
    low, high = c.get("min_length", 0), c.get("max_length")
    if "pattern" in c:
        return st.from_regex(c["pattern"], fullmatch=True).filter(
            lambda s: low <= len(s) and (high is None or len(s) <= high))
    return st.text(min_size=low, max_size=min(high or MAX_TEXT, max(low, MAX_TEXT)))


def for_annotation(annotation: Any, metadata: list[Any]) -> st.SearchStrategy:
    annotation, extra = _strip(annotation)
    c = _constraints([*metadata, *extra])
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        return _numbers(annotation, c)
    if annotation is str:
        return _text(c)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return for_model(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return st.lists(for_annotation(item, []), min_size=c.get("min_length", 0),
                        max_size=min(c.get("max_length", MAX_ITEMS), MAX_ITEMS))
    if origin is dict:
        key, value = typing.get_args(annotation)
        return st.dictionaries(for_annotation(key, []), for_annotation(value, []),
                               max_size=min(c.get("max_length", MAX_ITEMS), MAX_ITEMS))
    raise TypeError(f"no strategy for {annotation!r}: teach tests/unit/api/spec_strategies.py the new type")


def for_model(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """The model as the API server receives it: camelCase keys; an optional field absent or drawn."""
    required, optional = {}, {}
    for name, field in model.model_fields.items():
        strategy = OVERRIDES.get((model, field.alias or name))
        if strategy is None:
            strategy = for_annotation(field.annotation, field.metadata)
        (required if field.is_required() else optional)[field.alias or name] = strategy
    return st.fixed_dictionaries(required, optional=optional)


def manifests() -> st.SearchStrategy[dict[str, Any]]:
    """Whole RLTrainingJob manifests whose spec is drawn from ``RLTrainingJobSpec``."""
    def manifest(spec: dict[str, Any]) -> dict[str, Any]:
        m = minimal_manifest("property")
        m["spec"] = spec
        return m

    return for_model(t.RLTrainingJobSpec).map(manifest)


def local_verdict(manifest: dict[str, Any]) -> str | None:
    """None when ``kuberl render`` accepts the manifest, else its error (anything other than the
    renderer's own errors propagates: a crash is a finding too)."""
    from kuberl.api.uri import URIError
    from kuberl.api.validate import ManifestError
    from kuberl.job.render import render_manifest
    from kuberl.api.uri import URIError

    try:
        render_manifest(manifest)
    except (ManifestError, URIError) as exc:
        return str(exc)
    return None
