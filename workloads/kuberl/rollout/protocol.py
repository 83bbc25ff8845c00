"""Request bodies of the OpenAI and Anthropic APIs the rollout endpoint accepts (text only).

Validated with pydantic; the server turns validation failures into 400s naming the field.
Unknown fields are ignored, as both upstream APIs' clients send options we do not use.
"""

from __future__ import annotations

from typing import Literal

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
    seed: int | None = None
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
class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _empty_reply(cls, value):
        """An empty assistant reply (the model closed its turn at once) may be sent back as it came."""
        if isinstance(value, dict) and value.get("role") == "assistant" and value.get("content") == "":
            return {**value, "content": [{"type": "text", "text": ""}]}
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class AnthropicMetadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] = Field(default_factory=list, max_length=16)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # the API's top_k; -1 (absent) disables it
    metadata: AnthropicMetadata | None = None
    stream: bool = False

    _no_stream = field_validator("stream")(_reject_stream)

    def chat_messages(self) -> list[dict[str, str]]:
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        out.extend({"role": m.role, "content": m.text()} for m in self.messages)
        return out
