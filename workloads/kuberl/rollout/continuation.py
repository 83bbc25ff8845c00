"""Token-exact continuation of a conversation: the next turn's prompt without re-tokenizing.

An agent episode's second request carries the whole chat so far as text (the model's reply
included). Rendering and tokenizing it again need not reproduce the tokens the model produced:
special or unused tokens vanish from the decoded text, a stop string is cut from the text but not
from the ids, and BPE may merge differently across a turn boundary. The trainer needs one sample
whose every turn extends the one before, so a recorded episode's next prompt is built from ids:

    previous prompt + previous response + closing + the new messages' tokens

``closing`` is what the chat template puts after an assistant message (ChatML: ``<|im_end|>\\n``),
without the end-of-sequence token when the response already ends with it. The new messages'
tokens are the difference between the template rendered with and without them, around a
placeholder exchange, so the template's own turn markers are used, whatever the model family.
"""

from __future__ import annotations

from typing import Any, Sequence

_USER = "kuberl-placeholder-question"
_REPLY = "kuberl-placeholder-reply"


class ContinuationError(ValueError):
    """The chat template cannot be continued token by token."""


def continuation_ids(tokenizer: Any, new_messages: Sequence[dict[str, str]], response_ids: Sequence[int]) -> list[int]:
    """Tokens that follow ``response_ids`` (the model's last turn) when ``new_messages`` come
    after it, ending with the template's generation prompt (the next assistant turn's header)."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}]
    base_text = tokenizer.apply_chat_template(base, tokenize=False)
    full_text = tokenizer.apply_chat_template(base + list(new_messages), tokenize=False, add_generation_prompt=True)
    if not full_text.startswith(base_text):
        raise ContinuationError("the model's chat template renders an assistant turn differently once more "
                                "messages follow it, so an episode cannot continue token by token")
    closing = base_text[base_text.rindex(_REPLY) + len(_REPLY):]
    ids = list(tokenizer.encode(closing + full_text[len(base_text):], add_special_tokens=False))
    eos = tokenizer.eos_token_id
    if response_ids and response_ids[-1] == eos and ids and ids[0] == eos:
        ids = ids[1:]  # the model closed its turn itself
    return ids
