"""Anthropic tool use through the rollout endpoint: ``tools`` in, ``tool_use`` blocks out,
``tool_result`` blocks back, and an episode that records it token-exactly (the endpoint in
process on loopback, over the scripted engine of tests/unit/agents/stand_in.py, which says why)."""

from __future__ import annotations

import json

import pytest

from kuberl.rollout.agents.calculator import evaluate
from kuberl.rollout.protocol import MessagesRequest, TextBlock, ToolUseBlock, assistant_message, reply_blocks
from kuberl.rollout.transitions import episode_to_sample
from tests.unit.agents.stand_in import MODEL, ScriptedEngine, make_spec

CALCULATOR = {"name": "calculator", "description": "Evaluates an integer expression of + - *.",
              "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'


class ToolCallingEngine(ScriptedEngine):
    """Calls the calculator in the Hermes format, then answers the tool's result twice."""

    def reply_ids(self, prompt_ids):
        text = self.tokenizer.decode(prompt_ids)
        if "<|im_start|>tool" in text:
            result = text.rsplit("<|im_start|>tool", 1)[1].strip()[0]
            return self.tokenizer.encode(result * 2, add_special_tokens=False)
        return self.tokenizer.encode(f"Let me compute. {CALL}", add_special_tokens=False) + [self.tokenizer.eos_token_id]


def tools():
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 1, "tools": [CALCULATOR],
                                           "messages": [{"role": "user", "content": "x"}]}).tools


def test_reply_blocks_read_hermes_tool_calls_and_keep_the_rest_as_text():
    text, use = reply_blocks(f"Let me compute. {CALL}", tools())
    assert text == TextBlock(type="text", text="Let me compute.")
    assert (use.name, use.input, use.id.startswith("toolu_")) == ("calculator", {"expression": "1+2"}, True)
    # Not a call: unknown tool, arguments not an object, broken JSON, or no tools offered.
    for reply in ['<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                  '<tool_call>{"name": "calculator", "arguments": "1+2"}</tool_call>', "<tool_call>{oops</tool_call>"]:
        assert reply_blocks(reply, tools()) == [TextBlock(type="text", text=reply)]
    assert reply_blocks(CALL, []) == [TextBlock(type="text", text=CALL)]


def test_tool_blocks_become_the_chat_templates_messages():
    use = ToolUseBlock(type="tool_use", id="toolu_1", name="calculator", input={"expression": "1+2"})
    request = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 4, "tools": [CALCULATOR], "messages": [
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me compute."}, use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                                         {"type": "text", "text": "Now answer."}]}]})
    assert request.chat_messages() == [
        {"role": "user", "content": "1+2?"},
        assistant_message([TextBlock(type="text", text="Let me compute."), use]),
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "user", "content": "Now answer."}]
    assert request.chat_messages()[1]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}]
    assert request.template_tools() == [{"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR["description"], "parameters": CALCULATOR["input_schema"]}}]


@pytest.mark.parametrize("message,error", [
    ({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "calculator", "input": {}}]},
     "tool_use blocks belong to assistant messages"),
    ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "3"}]},
     "tool_result blocks belong to user messages"),
])
def test_tool_blocks_in_the_wrong_role_are_refused(message, error):
    with pytest.raises(ValueError, match=error):
        MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": [message]})


def test_an_anthropic_tool_use_episode_is_recorded_token_exactly(serve, tokenizer):
    import anthropic

    spec = make_spec()
    spec.rollout.max_response_length = 256  # the Hermes call is long in characters
    base_url, episodes, engine = serve(spec, ToolCallingEngine)
    key = episodes.open()
    client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
    question = {"role": "user", "content": "1+2? Use the calculator."}
    first = client.messages.create(model=MODEL, max_tokens=128, tools=[CALCULATOR], messages=[question])
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"] and first.content[0].text == "Let me compute."
    use = first.content[1]
    assert (use.name, use.input) == ("calculator", {"expression": "1+2"})
    second = client.messages.create(model=MODEL, max_tokens=8, tools=[CALCULATOR], messages=[
        question, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": str(evaluate(use.input["expression"]))}]}])
    assert second.content[0].text == "33" and second.stop_reason == "max_tokens"

    turns = episodes.close(key)
    call = first.model_extra["token_ids"]
    assert turns[1].prompt_ids[:len(turns[0].prompt_ids) + len(call)] == turns[0].prompt_ids + call
    spliced = turns[1].prompt_ids[len(turns[0].prompt_ids) + len(call):]
    assert spliced == tokenizer.encode("\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    sample = episode_to_sample(turns)
    assert sample.loss_mask == [1] * len(call) + [0] * len(spliced) + [1, 1]
    # The model's call, exactly as it wrote it, is trained on.
    assert json.loads(tokenizer.decode(call, skip_special_tokens=True).split("<tool_call>")[1]
                      .split("</tool_call>")[0]) == {"name": "calculator", "arguments": {"expression": "1+2"}}


def test_a_misplaced_tool_block_is_a_400_naming_the_message(serve):
    import httpx

    base_url, _, _ = serve(make_spec())
    response = httpx.post(f"{base_url}/v1/messages", json={
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "calculator", "input": {}}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "messages.0: tool_use blocks belong to assistant messages"


def test_empty_text_is_a_message_all_the_same():
    request = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]})
    assert request.chat_messages() == [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                                       {"role": "user", "content": ""}]
