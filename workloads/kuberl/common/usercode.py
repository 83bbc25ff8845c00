"""The job's own code, named by import path: ``spec.reward.function`` and ``spec.agent.environment``.

Both are ``module.path:name`` strings that ``pkgutil.resolve_name`` imports. ``check`` loads them
the way a run will, so that a missing module or name is reported before any engine or trainer
starts: in the head pod's check-data init container (the worker image, before Ray) and at the
start of ``kuberl train`` (before Ray, engines or trainers).
"""

from __future__ import annotations

import pkgutil
from typing import Any

from kuberl.api.types import RLTrainingJobSpec


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


def check(spec: RLTrainingJobSpec) -> None:
    """Load the code the job names as a run will; raise ``RewardError`` or ``AgentError`` naming
    the field and the fix. Only what a run uses: with ``spec.agent`` the episodes' rewards
    replace ``spec.reward``, and a harness is a program, not an import path."""
    # Here, not at the top: both modules use ``resolve``.
    from kuberl.rollout.agents.environment import load_environment
    from kuberl.driver.rewards import load_reward

    if spec.agent is None:
        load_reward(spec.reward)
    elif spec.agent.environment is not None:
        load_environment(spec.agent.environment)
