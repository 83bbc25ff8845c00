"""A training prompt, as the driver serves it and an agent episode starts from it.

``kuberl.driver.data`` makes them from the data set's rows; ``kuberl.rollout.agents`` plays
episodes from them: both import this module from below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    text: str  # the last user message, template applied: what reward functions see as the prompt
    answer: Any
    index: int  # position in the data set
    messages: tuple[dict[str, str], ...] = ()  # the chat the model is given (system prompt included)
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
