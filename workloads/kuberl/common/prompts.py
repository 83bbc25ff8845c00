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


def checked_chat(messages: list, label: str) -> list[dict[str, str]]:
    """``messages`` as a chat the model can answer: ``{role, content}`` messages with a role of
    ``ROLES`` (a message's ``name`` is allowed and dropped), the last one the user's. A data set's
    rows and an environment's ``reset()`` give chats alike; ``ValueError`` names ``label`` (the
    field or the call) and the message at fault."""
    chat = []
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or set(message) - {"role", "content", "name"}
                or message.get("role") not in ROLES or not isinstance(message.get("content"), str)):
            raise ValueError(f"{label}[{i}] must be {{role: {'|'.join(ROLES)}, content: string}}, got {message!r:.120}")
        chat.append({"role": message["role"], "content": message["content"]})
    if chat[-1]["role"] != "user":
        raise ValueError(f"{label}: the last message must be the user's (the model answers it), "
                         f"got {chat[-1]['role']!r}")
    return chat
