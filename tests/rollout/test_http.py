"""The OpenAI and Anthropic endpoints over the real engine, driven by the official SDKs."""

from __future__ import annotations

import httpx
import pytest

MODEL = "kuberl-tiny"


@pytest.fixture(scope="module")
def openai_client(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(base_url):
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_models_lists_the_served_name(openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]


def test_openai_chat_completion(openai_client):
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Write the letter a."}],
        max_tokens=6, n=2, seed=3, logprobs=True)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)
        tokens = choice.model_extra["token_ids"]
        assert len(choice.logprobs.content) == len(tokens) <= 6
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)
    assert resp.usage.prompt_tokens == len(resp.model_extra["prompt_token_ids"]) > 0


def test_openai_completion_from_text_and_token_ids(openai_client):
    text = openai_client.completions.create(model=MODEL, prompt="abc", max_tokens=5, seed=1, logprobs=0)
    assert len(text.choices[0].logprobs.token_logprobs) == len(text.choices[0].model_extra["token_ids"])
    # Each sampled token's text (vLLM's detokenizer's, kept for the logprobs object) spells the completion.
    assert "".join(text.choices[0].logprobs.tokens).startswith(text.choices[0].text)
    ids = openai_client.completions.create(model=MODEL, prompt=text.model_extra["prompt_token_ids"],
                                           max_tokens=5, seed=1)
    assert ids.choices[0].text == text.choices[0].text


def test_anthropic_messages_with_system_and_content_blocks(anthropic_client):
    msg = anthropic_client.messages.create(
        model=MODEL, max_tokens=4, system=[{"type": "text", "text": "You write letters."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Write "},
                                               {"type": "text", "text": "the letter b."}]}])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert msg.usage.output_tokens == len(msg.model_extra["token_ids"]) <= 4
    assert msg.usage.input_tokens > 0


def test_anthropic_stop_reasons(anthropic_client, base_url):
    # This SDK version has no temperature argument; the API field goes through extra_body.
    capped = anthropic_client.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 0.0},
                                              messages=[{"role": "user", "content": "hi"}])
    assert capped.stop_reason in ("max_tokens", "end_turn")
    if capped.stop_reason == "max_tokens":
        # The greedy first character, as a stop sequence, ends the next greedy response at once.
        first = capped.content[0].text
        if first.strip():
            stopped = anthropic_client.messages.create(
                model=MODEL, max_tokens=8, extra_body={"temperature": 0.0}, stop_sequences=[first],
                messages=[{"role": "user", "content": "hi"}])
            assert stopped.stop_reason == "stop_sequence"
            assert stopped.stop_sequence == first


def test_sticky_routing_header_is_accepted(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for _ in range(2):
        resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"x-session-id": "s1"})
        assert resp.status_code == 200


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
     "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 500},
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 100}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
])
def test_openai_bad_requests_are_400_naming_the_field(base_url, path, body, field):
    resp = httpx.post(f"{base_url}{path}", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert error["message"].startswith(field)


@pytest.mark.parametrize("body,field", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "max_tokens": 4,
      "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ({"model": MODEL, "max_tokens": 4, "temperature": 1.5,
      "messages": [{"role": "user", "content": "x"}]}, "temperature"),
])
def test_anthropic_bad_requests_are_400_naming_the_field(base_url, body, field):
    resp = httpx.post(f"{base_url}/v1/messages", json=body)
    assert resp.status_code == 400, resp.text
    payload = resp.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"].startswith(field)


def test_sdk_raises_bad_request_and_unknown_model_is_404(openai_client, anthropic_client, base_url):
    import anthropic
    import openai

    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="other", prompt="x", max_tokens=2)
    resp = httpx.post(f"{base_url}/v1/messages", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("body")
