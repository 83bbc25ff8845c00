"""Request bodies of the OpenAI and Anthropic APIs the rollout endpoint accepts (text, and
Anthropic's tool use).

Validated with pydantic; the server turns validation failures into 400s naming the field.
Unknown fields are ignored, as both upstream APIs' clients send options we do not use.

Anthropic tools reach the model through its chat template in Hugging Face's conventions: the
request's ``tools`` as the template's ``tools`` (function schemas), a ``tool_use`` block as the
assistant message's ``tool_calls``, a ``tool_result`` block as a ``tool`` message. The model's
tool calls are read from its reply in the Hermes format Qwen and many open models write,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``reply_blocks``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


def _stop_list(value):
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _reject_stream(value):
    if value:
        raise ValueError("streaming is not supported by the kuberl rollout endpoint; set stream=false")
    return value


# --- OpenAI ---------------------------------------------------------------------------------
class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class _OpenAISampling(_Body):
    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    # vLLM takes a seed of 64 bits (a larger one fails in the engine, not as the request's error),
    # and a negative one as none at all (-1) or as another seed: refused rather than reinterpreted.
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = _stop_list(value)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    _no_stream = field_validator("stream")(_reject_stream)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=0)


# --- Anthropic ------------------------------------------------------------------------------
class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicTool(_Body):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    input_schema: dict[str, Any]


def assistant_message(blocks: list) -> dict[str, Any]:
    """An assistant turn's content blocks as a chat-template message: its text, and its tool
    calls as ``tool_calls``. The endpoint records a reply in this form, and a later request that
    sends the reply back gets the same form, so the two compare equal."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    return message


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def reply_blocks(text: str, tools: list[AnthropicTool]) -> list:
    """The model's reply as content blocks: its tool calls (Hermes format, naming a tool the
    request offered, arguments an object) as ``tool_use`` blocks, the rest as one text block.
    A call that does not parse stays text: the model wrote it, and its reward is the judge."""
    names = {tool.name for tool in tools}
    blocks: list = []
    rest, last = [], 0
    for match in _TOOL_CALL.finditer(text) if names else ():
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
            continue
        rest.append(text[last:match.start()])
        last = match.end()
        blocks.append(ToolUseBlock(type="tool_use", id=f"toolu_{uuid.uuid4().hex[:24]}", name=call["name"],
                                   input=call["arguments"]))
    if not blocks:
        return [TextBlock(type="text", text=text)]
    prose = "".join(rest) + text[last:]
    return ([TextBlock(type="text", text=prose.strip())] if prose.strip() else []) + blocks


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _empty_text(cls, value):
        """Empty text is a message all the same: a reply the model closed at once, sent back as it
        came, or a tool's empty output."""
        if isinstance(value, dict) and value.get("content") == "":
            return {**value, "content": [{"type": "text", "text": ""}]}
        return value

    @model_validator(mode="after")
    def _blocks_by_role(self):
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks belong to assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong to user messages")
        return self

    def chat(self) -> list[dict[str, Any]]:
        """This message as chat-template messages: tool results become ``tool`` messages, before
        the message's text, if any."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            return [assistant_message(self.content)]
        out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                                     for b in self.content if isinstance(b, ToolResultBlock)]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if text or not out:
            out.append({"role": "user", "content": text})
        return out


class AnthropicMetadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # the API's top_k; -1 (absent) disables it
    tools: list[AnthropicTool] = Field(default_factory=list, max_length=128)
    metadata: AnthropicMetadata | None = None
    stream: bool = False

    _no_stream = field_validator("stream")(_reject_stream)

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            out.extend(m.chat())
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (function schemas), or None without tools."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}} for t in self.tools] or None
