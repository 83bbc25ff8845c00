"""Generates docs/api.md, the RLTrainingJob field reference, from the API types.

`python -m kuberl.api.docs --write`; a test fails when docs/api.md is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kuberl.api.crd import REPO_ROOT, openapi_schema

DOC_PATH = REPO_ROOT / "docs" / "api.md"


def _type(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if node.get("type") == "array":
        return f"list of {_type(node['items'])}"
    if node.get("type") == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    return node.get("type", "")


def _limits(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"{'<' if node.get('exclusiveMaximum') else '<='} {node['maximum']}")
    if "pattern" in node and len(node["pattern"]) < 40:
        parts.append(f"pattern `{node['pattern']}`")
    return ", ".join(parts)


def _rows(node: dict[str, Any], path: str, required: set[str], inherited: dict[str, Any] | None = None) -> list[str]:
    """``inherited``: the parent object's default, whose values are what an omitted field gets
    (``reward`` defaults to ``{builtin: gsm8k_strict}`` though ``builtin`` alone has none)."""
    rows = []
    for name, sub in node.get("properties", {}).items():
        field = f"{path}.{name}"
        default = (inherited or {}).get(name, sub.get("default"))
        shown_default = "" if default is None or isinstance(default, dict) else f"`{json.dumps(default)}`"
        req = "yes" if name in required else ""
        desc = " ".join(str(sub.get("description", "")).split()).replace("|", "\\|")
        limits = _limits(sub)
        rows.append(f"| `{field}` | {_type(sub)} | {req} | {shown_default} | {desc}{' (' + limits + ')' if limits else ''} |")
        if "properties" in sub:
            rows += _rows(sub, field, set(sub.get("required", [])), default if isinstance(default, dict) else None)
        elif sub.get("type") == "array" and "properties" in sub.get("items", {}):
            rows += _rows(sub["items"], f"{field}[]", set(sub["items"].get("required", [])))
    return rows


def _rules(node: dict[str, Any], path: str) -> list[str]:
    out = [f"- `{path or 'metadata'}`: {r['message']}" for r in node.get("x-kubernetes-validations", [])]
    for name, sub in node.get("properties", {}).items():
        out += _rules(sub, f"{path}.{name}" if path else name)
    return out


def render_docs() -> str:
    schema = openapi_schema()
    spec, status = schema["properties"]["spec"], schema["properties"]["status"]
    lines = [
        "# RLTrainingJob API reference",
        "",
        "`apiVersion: kuberl.dev/v1alpha1`, `kind: RLTrainingJob`, short name `rltj`, namespaced.",
        "Generated from `workloads/kuberl/api/types.py` by `python -m kuberl.api.docs --write`; do not edit.",
        "",
        "## spec",
        "",
        "| field | type | required | default | description |",
        "| --- | --- | --- | --- | --- |",
        *_rows(spec, "spec", set(spec.get("required", []))),
        "",
        "## Cross-field rules",
        "",
        "Checked by the API server (CEL) and by `kuberl render` / `kuberl train` alike:",
        "",
        *_rules(schema, ""),
        "",
        "## status",
        "",
        "Written by the operator (phase, conditions, names, restarts) and by the workload through its",
        "per-job ServiceAccount (progress, lastCheckpoint).",
        "",
        "| field | type | required | default | description |",
        "| --- | --- | --- | --- | --- |",
        *_rows(status, "status", set()),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberl.api.docs", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    text = render_docs()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH.relative_to(REPO_ROOT)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
