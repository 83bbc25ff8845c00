"""The job's own code, named by import path: ``spec.reward.function`` and ``spec.agent.environment``.

Both are ``module.path:name`` strings that ``pkgutil.resolve_name`` imports; ``resolve`` turns
every failure into the caller's error naming the field and the fix. The driver's reward loader and
the agents' environment loader both use it; ``kuberl.driver.preflight`` loads both before a run.
"""

from __future__ import annotations

import pkgutil
from typing import Any


def resolve(path: str, field: str, what: str, error: type[Exception]) -> Any:
    """The object ``path`` names; ``error`` naming ``field`` and the fix when there is none.

    Importing runs the module's code, so anything it raises is the job's own error too."""
    module, _, name = path.partition(":")
    try:
        return pkgutil.resolve_name(path)
    except ModuleNotFoundError as exc:
        raise error(f"{field}: cannot import {module!r} ({exc}); install the module in the worker image "
                    f"or fix the module path before ':'") from exc
    except AttributeError as exc:
        if exc.name != name:  # raised by the module's own code
            raise error(f"{field}: importing {module!r} failed: AttributeError: {exc}") from exc
        raise error(f"{field}: {module!r} has no {what} {name!r}; fix the name after ':'") from exc
    except Exception as exc:  # the module's own code failed while importing
        raise error(f"{field}: importing {module!r} failed: {type(exc).__name__}: {exc}") from exc
