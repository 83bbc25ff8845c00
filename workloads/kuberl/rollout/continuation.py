"""Token-exact continuation of a conversation: the next turn's prompt without re-tokenizing.

An agent episode's second request carries the whole chat so far as text (the model's reply
included). Rendering and tokenizing it again need not reproduce the tokens the model produced:
special or unused tokens vanish from the decoded text, a stop string is cut from the text but not
from the ids, BPE may merge differently across a turn boundary, and some templates rewrite an
earlier reply (Qwen3's drop its reasoning). The trainer needs one sample whose every turn extends
the one before, so a recorded episode's next prompt is built from ids:

    previous prompt + previous response + the tokens the template puts after that reply

The last part, the rest of the reply's turn (ChatML: ``<|im_end|>\n``), the new messages and the
next assistant turn's header, is read off the template itself, around a placeholder question and
reply. Rendered with the new messages after the reply, the chat is either the question with its
generation prompt, the reply, then that part (most templates, Qwen3's with thinking on), or else
the question and reply as the template closes a final reply, then the new messages (templates whose
generation prompt differs from how they render a past reply's header, Qwen3's with thinking off).
When the model ended its turn with the template's end-of-turn token itself, the template's copy is
left out.
"""

from __future__ import annotations

from typing import Any, Sequence

_USER = "kuberl-placeholder-question"
_REPLY = "kuberl-placeholder-reply"


class ContinuationError(ValueError):
    """The chat template cannot be continued token by token."""


def _after_reply(tokenizer: Any, new_messages: Sequence[dict], tools: list[dict] | None) -> str:
    """The text the template puts after an assistant reply when ``new_messages`` follow it."""
    question = [{"role": "user", "content": _USER}]
    answered = [*question, {"role": "assistant", "content": _REPLY}]
    full = tokenizer.apply_chat_template([*answered, *new_messages], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    asked = tokenizer.apply_chat_template(question, tools=tools, tokenize=False, add_generation_prompt=True)
    if full.startswith(asked + _REPLY):
        return full[len(asked) + len(_REPLY):]
    closed = tokenizer.apply_chat_template(answered, tools=tools, tokenize=False)
    if full.startswith(closed) and _REPLY in closed:
        return closed[closed.rindex(_REPLY) + len(_REPLY):] + full[len(closed):]
    raise ContinuationError("the model's chat template renders an earlier assistant reply differently once "
                            "more messages follow, so an episode cannot continue token by token")


def continuation_ids(tokenizer: Any, new_messages: Sequence[dict], context: Sequence[int],
                     tools: list[dict] | None = None) -> list[int]:
    """Tokens that follow ``context`` (a turn's prompt and response ids) when ``new_messages``
    come after its reply, ending with the template's generation prompt (the next assistant turn's
    header). ``tools``: the request's tool schemas, as the template takes them."""
    ids = list(tokenizer.encode(_after_reply(tokenizer, new_messages, tools), add_special_tokens=False))
    if context and ids and ids[0] == context[-1] and not tokenizer.decode(ids[:1], skip_special_tokens=True):
        ids = ids[1:]  # the model closed its turn itself
    return ids
