"""Agent episodes through the real rollout endpoint (Starlette + uvicorn on loopback, in process):
what it records per episode key, and the environment loop that trains on it. The engine behind it
is a scripted stand-in (tests/unit/agents/stand_in.py says why). Harnesses, programs of their own:
tests/engine/agents/test_harness_episodes.py."""

from __future__ import annotations

import re

import httpx
import pytest

from kuberl.common.prompts import Prompt
from kuberl.rollout.server import BackgroundServer, make_app
from kuberl.rollout.transitions import EpisodeSampling, episode_to_sample
from tests.unit.agents.stand_in import MODEL, UNUSED_TOKEN, Pool, ScriptedEngine, make_spec


def test_a_two_turn_anthropic_exchange_is_recorded_token_exactly(serve, tokenizer):
    import anthropic

    base_url, episodes, engine = serve(make_spec())
    key = episodes.open(EpisodeSampling(temperature=0.5, top_k=5, max_tokens=12, seed=100))
    client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
    question = {"role": "user", "content": "1+2? Use the calculator (=)."}
    first = client.messages.create(model=MODEL, max_tokens=40, messages=[question], extra_body={"temperature": 0.9})
    assert first.content[0].text == "=" and first.stop_reason == "end_turn"
    second = client.messages.create(model=MODEL, max_tokens=40, messages=[
        question, {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "calculator: 3"}])
    assert second.content[0].text == "33" and second.stop_reason == "max_tokens"
    # The episode's sampling, not the client's: a seed per turn, max_tokens capped.
    assert [(r["temperature"], r["top_k"], r["seed"], r["max_tokens"]) for r in engine.requests] == [
        (0.5, 5, 100, 12), (0.5, 5, 101, 12)]

    turns = episodes.close(key)
    assert len(turns) == 2
    call = first.model_extra["token_ids"]
    assert call[1] == UNUSED_TOKEN  # in the ids, not in the text the client sent back
    # Turn 2's prompt is turn 1's ids, then the tool message: never the re-tokenized text.
    assert turns[1].prompt_ids[:len(turns[0].prompt_ids) + len(call)] == turns[0].prompt_ids + call
    spliced = turns[1].prompt_ids[len(turns[0].prompt_ids) + len(call):]
    assert tokenizer.decode(spliced) == "\n<|im_start|>user\ncalculator: 3<|im_end|>\n<|im_start|>assistant\n"
    assert second.model_extra["prompt_token_ids"] == turns[1].prompt_ids
    assert turns[1].response_logprobs == [-0.25, -0.25]  # recorded although the client asked for none
    assert [t.metadata["weight_version"] for t in turns] == [3, 3]
    sample = episode_to_sample(turns)
    assert sample.loss_mask == [1] * len(call) + [0] * len(spliced) + [1, 1]


def test_requests_without_an_episode_key_are_served_but_not_recorded(serve):
    base_url, episodes, engine = serve(make_spec())
    key = episodes.open(EpisodeSampling(temperature=0.5))
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0.25, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": "sk-other"}).status_code == 200
    assert (engine.requests[-1]["max_tokens"], engine.requests[-1]["temperature"]) == (4, 0.25)
    assert episodes.close(key) == []


def test_openai_bearer_keys_record_too_and_one_choice_per_turn(serve):
    base_url, episodes, _ = serve(make_spec())
    key = episodes.open()
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ok = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert ok.status_code == 200
    bad = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "n": 2},
                     headers={"authorization": f"Bearer {key}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    # A raw prompt is no chat turn: refused, not served with the client's sampling and left unrecorded.
    raw = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "max_tokens": 4, "prompt": "hi"},
                     headers={"authorization": f"Bearer {key}"})
    assert raw.status_code == 400 and "/v1/messages" in raw.json()["error"]["message"]
    assert len(episodes.close(key)) == 1


def prompts() -> list[Prompt]:
    from kuberl.driver.tiny import calculator_rows

    rows = calculator_rows(2, seed=1)
    return [Prompt(row["prompt"], row["answer"], i, ({"role": "user", "content": row["prompt"]},),
                   extra_info=row["extra_info"]) for i, row in enumerate(rows)]


def test_calculator_episodes_through_the_endpoint_train_on_the_model_tokens_only(serve, tokenizer):
    from kuberl.rollout.agents.episodes import AgentRollout

    spec = make_spec()
    base_url, episodes, engine = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    groups = rollout.generate(prompts(), group_size=2, seed=11)
    assert [[s.group for s in group] for group in groups] == [[0, 0], [1, 1]]
    for prompt, group in zip(prompts(), groups):
        for sample in group:
            assert sample.reward == pytest.approx(1.0)  # called the tool, then answered its digit
            assert sample.metadata["replies"] == 2 and not sample.metadata["truncated"]
            trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
            untrained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if not m]
            assert tokenizer.decode(trained) == "=<|im_end|>" + prompt.answer * 2
            assert UNUSED_TOKEN in trained
            assert tokenizer.decode(untrained) == (f"\n<|im_start|>user\ncalculator: {prompt.answer}<|im_end|>\n"
                                                   f"<|im_start|>assistant\n")
            assert sample.weight_version == 3 and len(sample.response_logprobs) == len(sample.response_ids)
    # Sampling as the spec says, a distinct seed per turn, the per-turn cap.
    assert {r["temperature"] for r in engine.requests} == {0.7}
    assert len({r["seed"] for r in engine.requests}) == len(engine.requests) == 8
    assert {r["max_tokens"] for r in engine.requests} == {12}


def test_an_episode_that_fills_the_context_ends_there(serve):
    from kuberl.rollout.agents.episodes import AgentRollout

    spec = make_spec(max_response_length=16)  # context 64: no room for the tool's reply
    base_url, episodes, _ = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    (group,) = rollout.generate(prompts()[:1], group_size=2, seed=0)
    for sample in group:
        assert sample.metadata == {**sample.metadata, "replies": 1, "truncated": True, "turns": 1}
        assert sample.reward == 0.0 and sample.loss_mask == [1, 1, 1]


def test_a_chat_the_template_refuses_is_a_400_naming_messages(tmp_path):
    """Real templates check the chat themselves (``raise_exception``, e.g. on the order of roles);
    that is the request's fault, not the endpoint's."""
    from kuberl.driver.tiny import make_tokenizer

    tokenizer = make_tokenizer(tmp_path)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must "
                               "start with a user message') }}{% endif %}" + tokenizer.chat_template)
    engine = ScriptedEngine(tokenizer)
    server = BackgroundServer(make_app(Pool(make_spec(), engine), tokenizer), "127.0.0.1", 0)
    server.start()
    try:
        resp = httpx.post(f"{server.url}/v1/messages", json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "assistant", "content": "hi"}]})
    finally:
        server.stop()
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"type": "invalid_request_error", "message": (
        "messages: the model's chat template refused this chat: Conversations must start with a user message")}
    assert engine.requests == []


@pytest.fixture
def release_hung_calls():
    """Ends, after the test, the environment calls it left hanging in their threads."""
    from tests.unit.agents.environments import RELEASE

    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("environment,call", [("HangsInReset", "reset()"), ("HangsInStep", "step() of turn 1")])
def test_an_environment_call_that_never_returns_fails_the_step_in_bounded_time(serve, release_hung_calls,
                                                                               environment, call):
    import time

    from kuberl.rollout.agents.environment import AgentError
    from kuberl.rollout.agents.episodes import AgentRollout

    spec = make_spec().model_copy(deep=True)
    spec.agent.environment = f"tests.unit.agents.environments:{environment}"
    base_url, episodes, _ = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    rollout.step_timeout_s = 0.2  # the field takes whole seconds; the bound itself any time
    started = time.monotonic()
    with pytest.raises(AgentError, match=re.escape(
            f"tests.unit.agents.environments:{environment} (prompt 0, episode 0): {call} did not return within 0.2 s "
            f"(spec.agent.stepTimeoutSeconds, the bound on each call of the environment's code)")):
        rollout.generate(prompts()[:1], group_size=2, seed=0)
    assert time.monotonic() - started < 10


def test_an_episode_reward_beyond_the_bound_is_an_error(serve):
    from kuberl.rollout.agents.environment import AgentError
    from kuberl.rollout.agents.episodes import AgentRollout

    spec = make_spec().model_copy(deep=True)
    spec.agent.environment = "tests.unit.agents.environments:LargeSum"
    base_url, episodes, _ = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    with pytest.raises(AgentError, match=re.escape("(prompt 0, episode 0): the episode's reward (the sum of its "
                                                   "steps') is 1.2e+06, beyond the bound |reward| <= 1e+06")):
        rollout.episode(prompts()[0], 0, 0, seed=0)
