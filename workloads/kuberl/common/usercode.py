"""The job's own code, named by import path: ``spec.reward.function`` and ``spec.agent.environment``.

Both are ``module.path:name`` strings that ``pkgutil.resolve_name`` imports; ``resolve`` turns
every failure into the caller's error naming the field and the fix. The driver's reward loader and
the agents' environment loader both use it; ``kuberl.driver.preflight`` loads both before a run.

The code is in the image, or in a source directory (``spec.reward.source``, ``spec.agent.source``:
a mounted ConfigMap or a staged, digest-checked URI) that goes first on ``sys.path``.
"""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path
from typing import Any

from kuberl.api.types import CodeSource


def resolve(path: str, field: str, what: str, error: type[Exception], *, source: CodeSource | None = None,
            source_dir: str | None = None) -> Any:
    """The object ``path`` names; ``error`` naming ``field`` and the fix when there is none.

    With a ``source``, its directory ``source_dir`` goes first on sys.path (once per process), so
    its modules shadow the image's. Importing runs the module's code, so anything it raises is the
    job's own error too."""
    module, _, name = path.partition(":")
    where = ""
    if source is not None:
        source_field = field.rsplit(".", 1)[0] + ".source"
        where = f" from {source_field} ({source.describe()}, at {source_dir})"
        _add_source(source, source_field, source_dir, error)
    try:
        return pkgutil.resolve_name(path)
    except ModuleNotFoundError as exc:
        fix = ("add the module to the source or fix the module path before ':'" if source is not None
               else "install the module in the worker image or fix the module path before ':'")
        raise error(f"{field}: cannot import {module!r}{where} ({exc}); {fix}") from exc
    except AttributeError as exc:
        if exc.name != name:  # raised by the module's own code
            raise error(f"{field}: importing {module!r}{where} failed: AttributeError: {exc}") from exc
        raise error(f"{field}: {module!r} has no {what} {name!r}; fix the name after ':'") from exc
    except Exception as exc:  # the module's own code failed while importing
        raise error(f"{field}: importing {module!r}{where} failed: {type(exc).__name__}: {exc}") from exc


def _add_source(source: CodeSource, field: str, source_dir: str | None, error: type[Exception]) -> None:
    """Put the source's directory first on sys.path, after checking it holds what the job says."""
    if source_dir is None or not Path(source_dir).is_dir():
        raise error(f"{field}: the code of {source.describe()} is not at {source_dir} (not mounted or "
                    f"staged; kuberl train needs source.uri, not a ConfigMap)")
    key = source.config_map.key if source.config_map is not None else None
    if key is not None and not (Path(source_dir) / key).is_file():
        present = sorted(p.name for p in Path(source_dir).iterdir() if not p.name.startswith("."))
        raise error(f"{field}.configMap.key: ConfigMap {source.config_map.name} has no key {key!r} "
                    f"(its keys: {', '.join(present) or 'none, or the ConfigMap does not exist'}); "
                    f"add the key or fix the name")
    if source_dir not in sys.path:
        sys.path.insert(0, source_dir)
