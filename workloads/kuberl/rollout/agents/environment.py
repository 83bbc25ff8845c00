"""The Python environment form of ``spec.agent``: a class with ``reset`` and ``step``.

The shape is gymnasium's and skyrl-gym's, over text::

    class MyEnv:
        def reset(self, task: Task) -> list[dict]:      # the chat the episode starts from
            ...
        def step(self, action: str) -> Step:             # action: the model's reply
            return Step(observation="tool output", reward=0.0, done=False)

``step`` may also return gymnasium's tuple ``(observation, reward, terminated, truncated, info)``,
and ``reset`` gymnasium's ``(observation, info)``. The class is named by import path,
``module.path:Class`` like ``spec.reward.function``, and made with no arguments, once per episode.
An episode's reward is the sum of its steps' rewards; each step's reward, and the sum, is a number
as ``kuberl.common.reward_values.as_reward`` says (not a string or a bool, finite, bounded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kuberl.api.types import CodeSource
from kuberl.common.prompts import checked_chat
from kuberl.common.reward_values import as_reward
from kuberl.common.usercode import resolve


class AgentError(ValueError):
    """The environment cannot be loaded, or returned something an episode cannot use."""


@dataclass(frozen=True)
class Task:
    """One data row, as ``reset`` gets it."""

    messages: tuple[dict[str, str], ...]  # the row's chat (spec.data's template and system prompt applied)
    answer: Any                           # spec.data.answerField (None if absent)
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    seed: int = 0                          # for the environment's own randomness: repeats on resume


@dataclass(frozen=True)
class Step:
    observation: str | None = None  # the next user message (tool output, feedback); None when done
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    def reset(self, task: Task) -> Sequence[dict[str, str]]: ...

    def step(self, action: str) -> Step: ...


FIELD = "spec.agent.environment"


def load_environment(path: str, source: CodeSource | None = None, code_dir: str | None = None) -> type[Environment]:
    """The class ``module.path:Class`` names, from ``source``'s directory ``code_dir`` when the
    job names one (``spec.agent.source``); errors name the field and what to fix."""
    cls = resolve(path, FIELD, "class", AgentError, source=source, source_dir=code_dir)
    if not isinstance(cls, type):
        raise AgentError(f"{FIELD}: {path} is a {type(cls).__name__}, not a class; name the environment "
                         f"class after ':'")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise AgentError(f"{FIELD}: {path} has no {' or '.join(missing)} method; an environment class "
                         f"needs reset(task) and step(action) (docs/agents.md)")
    return cls


def first_chat(value: Any, where: str) -> list[dict[str, str]]:
    """``reset``'s result as a chat: a message list, a string (one user message), or gymnasium's
    ``(observation, info)``. It must end with a user message, which the model answers."""
    if isinstance(value, tuple) and len(value) == 2:
        value = value[0]
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise AgentError(f"{where}: reset() must return a chat (a non-empty list of {{role, content}}) or "
                         f"a string, got {type(value).__name__}")
    try:
        return checked_chat(list(value), "reset()")
    except ValueError as err:
        raise AgentError(f"{where}: {err}") from None


def as_step(value: Any, where: str) -> Step:
    """``step``'s result as a ``Step``: a ``Step`` or gymnasium's 5-tuple."""
    if isinstance(value, tuple) and len(value) == 5:
        observation, reward, terminated, truncated, _info = value
        value = Step(observation=observation, reward=reward, done=bool(terminated or truncated))
    if not isinstance(value, Step):
        raise AgentError(f"{where}: step() must return a Step or gymnasium's (observation, reward, "
                         f"terminated, truncated, info), got {type(value).__name__}")
    reward = as_reward(value.reward, f"{where}: step()'s reward", AgentError)
    if not value.done and not isinstance(value.observation, str):
        raise AgentError(f"{where}: step() returned done=False without a string observation for the "
                         f"model's next turn")
    return Step(observation=value.observation, reward=reward, done=value.done)
