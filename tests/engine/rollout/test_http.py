"""The OpenAI and Anthropic endpoints over the real engine, driven by the official SDKs."""

from __future__ import annotations

import json

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


# --- bad input: a 4xx in the API's own shape, before it reaches an engine ------------------------
VOCAB = 128  # the tiny model's (kuberl.driver.tiny.VOCAB_SIZE); its tokenizer has 100 of them
CHAT = [{"role": "user", "content": "x"}]


def api_error(resp, path: str) -> dict:
    """The error object of an OpenAI or Anthropic error body (never Starlette's plain text)."""
    payload = resp.json()
    if path == "/v1/messages":
        assert payload["type"] == "error"
    return payload["error"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": [4, VOCAB]}, "prompt"),
    ("/v1/completions", {"prompt": [4, -1]}, "prompt"),
    ("/v1/completions", {"prompt": [4, 2**70]}, "prompt"),
    ("/v1/completions", {"prompt": "ab", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "ab", "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -2**63 - 1}, "seed"),
    ("/v1/messages", {"messages": CHAT, "top_k": 10**30}, "top_k"),
    ("/v1/messages", {"messages": CHAT, "top_k": VOCAB + 1}, "top_k"),
    ("/v1/messages", {"messages": CHAT, "stop_sequences": [""]}, "stop_sequences"),
])
def test_token_ids_seeds_top_k_and_stops_out_of_range_are_400_naming_the_field(base_url, path, body, field):
    resp = httpx.post(f"{base_url}{path}", json={"model": MODEL, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    error = api_error(resp, path)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field)


def test_the_edges_of_those_ranges_are_served(base_url):
    for path, body in [("/v1/completions", {"prompt": [4, VOCAB - 1]}),
                       ("/v1/completions", {"prompt": "ab", "seed": 2**64 - 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "seed": 0}),
                       ("/v1/messages", {"messages": CHAT, "top_k": VOCAB})]:
        resp = httpx.post(f"{base_url}{path}", json={"model": MODEL, "max_tokens": 2, **body})
        assert resp.status_code == 200, (path, body, resp.text)


class UncheckedPool:
    """The session's real engines, offered to a second endpoint as if the vocabulary were 2**100:
    its own token id and ``top_k`` checks then pass what vLLM must judge itself."""

    def __init__(self, pool):
        self.spec, self.engines, self.served_model_name = pool.spec, pool.engines, pool.served_model_name
        self.vocab_size = 2**100


@pytest.fixture(scope="module")
def unchecked_url(pool, tokenizer):
    from kuberl.rollout.server import BackgroundServer, make_app

    server = BackgroundServer(make_app(UncheckedPool(pool), tokenizer), "127.0.0.1", 0)
    server.start()
    yield server.url
    server.stop()


def test_what_vllm_refuses_is_a_400_and_an_engine_failure_a_500_in_the_apis_shape(pool, unchecked_url):
    import ray

    from kuberl.rollout.engine import RequestRefused

    # vLLM refuses an unknown token id with its VLLMValidationError, which is no ValueError.
    refused = httpx.post(f"{unchecked_url}/v1/completions", json={"model": MODEL, "prompt": [4, 10**6]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "prompt"
    assert "Token id 1000000 is out of vocabulary" in refused.json()["error"]["message"]
    # What SamplingParams refuses is the request's too.
    with pytest.raises(RequestRefused, match="sampling parameters: top_k must be 0"):
        ray.get(pool.engines[0].complete.remote([4, 5], top_k=-5))
    # A top_k beyond 64 bits fails in vLLM's engine client (EngineGenerateError, from an
    # OverflowError): not an input check, so a 500, in Anthropic's shape all the same.
    failed = httpx.post(f"{unchecked_url}/v1/messages",
                        json={"model": MODEL, "max_tokens": 2, "top_k": 10**30, "messages": CHAT})
    assert failed.status_code == 500, failed.text
    assert failed.json()["type"] == "error" and failed.json()["error"]["type"] == "api_error"
    assert "EngineGenerateError" in failed.json()["error"]["message"]
    # The engine lives on.
    assert httpx.post(f"{unchecked_url}/v1/messages",
                      json={"model": MODEL, "max_tokens": 2, "messages": CHAT}).status_code == 200


# --- the body cap -------------------------------------------------------------------------------
def test_a_body_declared_larger_than_the_cap_is_413_before_it_is_sent(base_url):
    """Only the headers go out: the endpoint answers without waiting for the 10 GB."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000000\r\n\r\n{")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    assert error["error"]["message"].startswith("body: 10000000000 bytes exceed the endpoint's limit")


def test_a_chunked_body_over_the_cap_is_413(base_url, pool):
    from kuberl.rollout.server import max_body_bytes

    rollout = pool.spec.rollout
    limit = max_body_bytes(rollout.context_length())
    sent = []

    def chunks():  # no Content-Length: httpx sends it chunked
        while sum(sent) <= limit:
            sent.append(65536)
            yield b" " * 65536

    resp = httpx.post(f"{base_url}/v1/chat/completions", content=chunks(),
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["param"] == "body"
    assert resp.json()["error"]["message"].startswith(f"body: it exceeds the endpoint's limit of {limit} bytes")


# --- tokenization off the event loop ------------------------------------------------------------
def test_a_huge_chat_does_not_stall_other_clients(base_url, pool, tokenizer):
    """A chat just under the body cap takes seconds to tokenize; meanwhile requests on other
    connections are answered in a fraction of that time."""
    import threading
    import time

    from kuberl.rollout.server import chat_ids, max_body_bytes

    rollout = pool.spec.rollout
    size = max_body_bytes(rollout.context_length()) - 1000
    chat = [{"role": "user", "content": "ab c" * (size // 4)}]
    start = time.perf_counter()
    chat_ids(tokenizer, chat)
    tokenize_s = time.perf_counter() - start

    big = {}

    def send_big():
        big["resp"] = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": chat},
                                 timeout=120)

    sender = threading.Thread(target=send_big)
    sender.start()
    latencies = []
    with httpx.Client(base_url=base_url, timeout=120) as other:
        while sender.is_alive():
            start = time.perf_counter()
            assert other.get("/v1/models").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    sender.join()
    # Tokenized in full, then refused for its length: the endpoint did the whole work.
    assert big["resp"].status_code == 400 and big["resp"].json()["error"]["param"] == "messages"
    assert len(latencies) >= 5, (latencies, tokenize_s)
    assert max(latencies) < tokenize_s / 4, (max(latencies), tokenize_s)


def test_the_text_the_endpoint_decodes_is_vllms(pool, tokenizer):
    """A request without stop strings is not detokenized step by step in the engine but decoded
    once by the endpoint (``decode_samples``): the same seeded samples, detokenized by vLLM,
    have the same text and the same per-token texts (the logprobs objects')."""
    import ray

    from kuberl.rollout.server import decode_samples

    engine = pool.engines[0]
    for i, text in enumerate(("abc", "Write the letter q.", "hi there, how are you")):
        ids = tokenizer.encode(text)
        request = dict(n=4, temperature=1.0, max_tokens=24, seed=10 + i, logprobs=True)
        by_vllm = ray.get(engine.complete.remote(ids, **request))
        here = ray.get(engine.complete.remote(ids, detokenize=False, **request))
        assert [s.response_ids for s in here] == [s.response_ids for s in by_vllm]
        assert all(s.response_text == "" and "tokens" not in s.metadata for s in here)
        decode_samples(tokenizer, here, token_text=True)
        assert [s.response_text for s in here] == [s.response_text for s in by_vllm]
        assert [s.metadata["tokens"] for s in here] == [s.metadata["tokens"] for s in by_vllm]
